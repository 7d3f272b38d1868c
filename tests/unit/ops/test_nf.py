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
    assert levels(16).tolist() == pytest.approx(NF4, abs=1e-6)


@pytest.mark.parametrize("n", [2**b for b in NF_BITS] + [3, 5, 7, 40, 100])
def test_levels_ascending_with_exact_zero_and_unit_ends(n):
    lv = levels(n)
    assert lv.numel() == n and bool((lv[1:] > lv[:-1]).all())
    assert 0.0 in lv.tolist() and lv[0] == -1 and lv[-1] == 1
    if n % 2:  # an odd count is symmetric about 0
        assert torch.equal(lv, -lv.flip(0))


@pytest.mark.parametrize("spec", ["nf4", "nf3:per=block32", "nf2:per=tensor", "nf:40", "nf:5:per=block32"])
def test_nearest_level(spec):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    op = ppc.build(spec)
    y, _ = op.roundtrip(x)
    cfg = op.config
    g = x.reshape(-1, 32) if cfg.per == "block32" else x.reshape(1, -1) if cfg.per == "tensor" else x
    scale = g.abs().amax(1, keepdim=True)  # (groups, 1)
    candidates = levels(cfg.levels)[None, None, :] * scale[:, :, None]  # (groups, 1, levels)
    best = (g[:, :, None] - candidates).abs().amin(-1)  # (groups, size): the error of the nearest level
    err = (g - y.reshape(g.shape)).abs()
    assert bool((err <= best + 2**-6 * scale).all())  # the nearest level, up to the scale's rounding up to bf16


@pytest.mark.parametrize("spec", ["nf4:stoch", "nf2:stoch", "nf3:stoch:per=channel", "nf:5:stoch"])
def test_stochastic_rounding_is_unbiased(spec):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    op = ppc.build(spec)
    n = 3000
    # n copies in one message: each copy's rows (and channels) have x's scales, and every position draws its own noise
    copies = x.expand(n, 4, 64).contiguous()  # (n, 4, 64)
    mean = op.roundtrip(copies, ppc.Context(step=1))[0].mean(0)  # (4, 64)
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
    with pytest.raises(ValueError, match="nf2 .. nf8, or nf:<levels>"):
        ppc.build("nf1")
    with pytest.raises(ValueError, match=r"nf levels=2; accepted: 3 .. 256 \(nf<b>: b in 2, 3, 4, 5, 6, 7, 8\)"):
        ppc.build("nf:2")
    with pytest.raises(ValueError, match="nf levels=300; accepted: 3 .. 256"):
        NormalFloatConfig(levels=300)
    with pytest.raises(ValueError, match="unknown option 'levels' in 'nf4:levels=40'"):
        ppc.build("nf4:levels=40")
    with pytest.raises(ValueError, match="per='rows'; accepted: tensor"):
        ppc.build("nf4:per=rows")


def test_level_counts_between_powers_of_two_fill_in_bits_and_error():
    """nf:40 sends 16 bits per 3 codes: fewer bytes than nf6, less error than nf5."""
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(4))
    err = {s: float((ppc.build(s).roundtrip(x)[0] - x).norm() / x.norm()) for s in ("nf5", "nf:40", "nf6")}
    size = {s: ppc.build(s).wire_nbytes(x.shape, x.dtype) for s in err}
    assert err["nf6"] < err["nf:40"] < err["nf5"] and size["nf5"] < size["nf:40"] < size["nf6"]
    assert size["nf:40"] == 64 * 192 // 3 * 2 + 64 * 2  # 2 bytes per 3 codes, a bf16 scale per row


@pytest.mark.parametrize("spec,canonical", [("nf:16", "nf4"), ("nf:40", "nf:40"), ("nf:5:stoch", "nf:5:stoch"),
                                            ("nf:256:per=block32", "nf8:per=block32")])
def test_spec_names_a_power_of_two_by_its_bits(spec, canonical):
    assert str(ppc.CompressorSpec.parse(spec)) == canonical
