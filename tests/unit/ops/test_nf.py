"""nf<b>: QLoRA's levels, nearest-level coding, unbiased stochastic rounding, less error than int<b> on Gaussians."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.nf import NF_BITS, NormalFloatConfig, levels

# QLoRA's NF4 table (bitsandbytes, functional.py: create_normal_map)
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def test_nf4_levels_are_qlora_s():
    assert levels(4).tolist() == pytest.approx(NF4, abs=1e-6)


@pytest.mark.parametrize("bits", NF_BITS)
def test_levels_ascending_with_exact_zero_and_unit_ends(bits):
    lv = levels(bits)
    assert lv.numel() == 2**bits and bool((lv[1:] > lv[:-1]).all())
    assert 0.0 in lv.tolist() and lv[0] == -1 and lv[-1] == 1


@pytest.mark.parametrize("spec", ["nf4", "nf3:per=block32", "nf2:per=tensor"])
def test_nearest_level(spec):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    op = ppc.build(spec)
    y, _ = op.roundtrip(x)
    cfg = op.config
    g = x.reshape(-1, 32) if cfg.per == "block32" else x.reshape(1, -1) if cfg.per == "tensor" else x
    scale = g.abs().amax(1, keepdim=True)  # (groups, 1)
    candidates = levels(cfg.bits)[None, None, :] * scale[:, :, None]  # (groups, 1, 2**bits)
    best = (g[:, :, None] - candidates).abs().amin(-1)  # (groups, size): the error of the nearest level
    err = (g - y.reshape(g.shape)).abs()
    assert bool((err <= best + 2**-6 * scale).all())  # the nearest level, up to the scale's rounding up to bf16


@pytest.mark.parametrize("spec", ["nf4:stoch", "nf2:stoch", "nf3:stoch:per=channel"])
def test_stochastic_rounding_is_unbiased(spec):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    op = ppc.build(spec)
    n = 3000
    mean = sum(op.roundtrip(x, ppc.Context(step=i))[0] for i in range(n)) / n
    spread = x.abs().amax()  # one draw's error is below the widest gap, at most the absmax
    assert (mean - x).abs().max() < 5 * spread / n**0.5
    assert (mean - x).abs().mean() < spread / n**0.5


@pytest.mark.parametrize("bits", [3, 4])
def test_less_error_than_uniform_levels_on_a_gaussian(bits):
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(3))
    err = {s: float((ppc.build(s).roundtrip(x)[0] - x).norm() / x.norm()) for s in (f"nf{bits}", f"int{bits}")}
    assert err[f"nf{bits}"] < 0.85 * err[f"int{bits}"]
    assert ppc.build(f"nf{bits}").wire_nbytes(x.shape, x.dtype) == ppc.build(f"int{bits}").wire_nbytes(x.shape, x.dtype)


def test_bad_bits_name_the_accepted_ones():
    with pytest.raises(ValueError, match="nf2 .. nf8"):
        ppc.build("nf1")
    with pytest.raises(ValueError, match="nf bits=9; accepted: 2, 3, 4, 5, 6, 7, 8"):
        NormalFloatConfig(bits=9)
    with pytest.raises(ValueError, match="per='rows'; accepted: tensor"):
        ppc.build("nf4:per=rows")
