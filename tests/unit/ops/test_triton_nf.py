"""The nf kernels (ops/triton_nf.py) give the eager reference's codes, scales and reconstructions bitwise, run by
Triton's interpreter on CPU tensors (on a GPU the same checks run compiled: tests/unit/ops/test_cuda.py)."""

import pytest
import torch

from tests.unit.ops.interpreted import (assert_matches_reference, compiles_for_hopper, errors, import_kernels,  # noqa: E402
                                        interpreter)  # noqa: F401 - the fixture applies here

import_kernels("_triton_nf_kernels")

import pp_compress as ppc  # noqa: E402
from pp_compress.ops import triton_nf  # noqa: E402

SPECS = ["nf4", "nf6", "nf8", "nf2:stoch", "nf3:stoch", "nf5:stoch:scale=fp32", "nf4:per=block32", "nf5:scale=fp16",
         "nf7:per=tensor", "nf6:stoch:per=block64"]
SHAPES = [(2, 3, 576), (4, 512), (3, 40), (1, 24)]


@pytest.fixture
def interpreted(monkeypatch):
    """The operator takes the device path for CPU tensors, where the interpreter runs the kernels."""
    monkeypatch.setattr(triton_nf, "usable", lambda like, numel, group, bits: numel > 0
                        and triton_nf.supports(numel, group, bits))


def sample(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3  # shape
    x[..., 0, 5 % shape[-1]] = 40.0  # an outlier channel in the first row
    x[..., -1, :] = 0.0  # an all-zero row: scale 0, every code the zero level's
    if x.shape[-2] > 2:  # a row whose absmax is 1: values on the outermost levels and on 0.5
        x[..., 1, :3] = torch.tensor([1.0, -1.0, 0.5])
        x[..., 1, 3:] = x[..., 1, 3:].clamp(-1, 1)
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_kernels_are_the_eager_reference_bitwise(spec, dtype, interpreted):
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    checked = 0
    for shape in SHAPES:
        if not op._device_group(torch.empty(0), shape):
            continue
        assert_matches_reference(op, eager, sample(shape, dtype), ppc.Context(step=3, micro_batch=1))
        checked += 1
    assert checked >= 2  # every spec meets at least two of the shapes


def test_which_groups_the_kernels_take():
    assert triton_nf.supports(4 * 576, 576, 4) and triton_nf.supports(40, 40, 8) and triton_nf.supports(64, 32, 3)
    assert not triton_nf.supports(36, 36, 4)  # 36 codes of 4 bits: no whole word of 8 codes
    assert not triton_nf.supports(100, 32, 4)  # blocks that do not tile the tensor (the reference pads the last)
    assert not triton_nf.supports(2 * triton_nf.MAX_TILE, 2 * triton_nf.MAX_TILE, 8)
    op = ppc.build("nf:40")  # not a power of two: base-40 packing, the reference's
    assert not op._device_group(torch.empty(0), (4, 64))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_non_finite_input_is_reported_like_the_reference(deferred, interpreted):
    x = sample((4, 64), torch.float32)
    x[1, 3] = float("inf")
    want, got = errors(("nf4:kernel=eager", "nf4"), lambda op, ctx: op.compress(x, ctx), deferred)
    # the kernel's verdict, not a scan of x: the same error without the reference's count of bad values
    assert want.startswith(got) and "input has NaN/Inf values at step 2" in got


@pytest.mark.parametrize("spec,x", [("nf4:scale=fp16", torch.full((2, 64), 1e5)),  # absmax 1e5: beyond fp16 scales
                                    ("nf4", torch.tensor([[1.0, float("nan")] * 32] * 2))])
def test_an_overflowing_scale_and_nan_under_allow_are_reported_like_the_reference(spec, x, interpreted):
    want, got = errors((f"{spec}:kernel=eager", spec), lambda op, ctx: op.compress(x, ctx), nonfinite="allow", step=6)
    assert want.startswith(got) and "absmax overflows" in got


def test_a_decoded_non_finite_value_is_reported_like_the_reference(interpreted):
    op, eager, ctx = ppc.build("nf4"), ppc.build("nf4:kernel=eager"), ppc.Context(step=4)
    p = op.compress(sample((4, 64), torch.float16), ctx)
    bad = ppc.ops.Payload((p.tensors[0], p.tensors[1].clone().index_fill_(0, torch.tensor([2]), float("inf"))),
                          p.shape, p.dtype)
    want, got = errors(("nf4:kernel=eager", "nf4"), lambda o, c: o.decompress(bad, c), step=4)
    assert want.startswith(got) and "decoded finite input to NaN/Inf at step 4" in got
    assert op.screens_output(p) and not eager.screens_output(p)


COMPILE = """
from pp_compress.ops import _triton_nf_kernels as K
from pp_compress.ops.triton_nf import _block, _warps
from tests.unit.ops.interpreted import hopper_ptx as build

for dtype, group, bits, stoch in [("fp32", 2048, 4, False), ("bf16", 576, 6, True), ("fp16", 32, 8, False)]:
    block = _block(group)
    enc = {"x_ptr": f"*{dtype}", "lv_ptr": "*fp32", "mid_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*bf16",
           "flag_in_ptr": "*i32", "flag_scale_ptr": "*i32", "key": "i64", "slot_in": "i32", "slot_scale": "i32"}
    build(K.encode, enc, {"G": group, "BLOCK": block, "BITS": bits, "BUMP": 2.0**-7, "STOCH": stoch, "FLAG_IN": True},
          _warps(block))
    dec = {"codes_ptr": "*u8", "lv_ptr": "*fp32", "scale_ptr": "*bf16", "out_ptr": f"*{dtype}", "flag_ptr": "*i32",
           "slot": "i32"}
    build(K.decode, dec, {"G": group, "BLOCK": block, "BITS": bits, "FLAG": True}, _warps(block))
print("compiled")
"""


def test_the_kernels_compile_for_a_hopper_gpu_without_contractions():
    """The kernels compile for sm_90, with no fused multiply-add and no approximate division in their code."""
    compiles_for_hopper(COMPILE)
