"""No silent overflow: every operator and wrapper x {fp32, bf16, fp16} x extreme magnitudes gives a finite output
or a FloatingPointError that names the boundary, and the payload's bytes always equal the layout's."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import layout_nbytes
from tests.conftest import DTYPES, FEEDBACK_SPECS, OP_SPECS
from tests.unit.state import state_tensors

MAGNITUDES = {"tiny": 1e-30, "one": 1.0, "half-max": None, "zeros": 0.0}


def _input(dtype: torch.dtype, magnitude: str, step: int) -> torch.Tensor:
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    top = torch.finfo(dtype).max / 2 if MAGNITUDES[magnitude] is None else MAGNITUDES[magnitude]
    return (x / x.abs().max() * top).to(dtype)  # max |x| == top (0 for zeros; 1e-30 flushes to 0 in fp16)


@pytest.mark.parametrize("magnitude", list(MAGNITUDES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", OP_SPECS + FEEDBACK_SPECS)
def test_output_is_finite_or_a_named_error(spec, dtype, magnitude):
    op = ppc.build(spec)
    for step in range(3):  # wrappers carry state from step to step: residuals grow where compression drops a lot
        x = _input(dtype, magnitude, step)
        ctx = ppc.Context(name="boundary2.grad", step=step, sample_ids=torch.arange(4))
        try:
            layout = op.wire_layout(x.shape, x.dtype, ctx)
            p = op.compress(x, ctx)
            assert p.nbytes == layout_nbytes(layout) and p.layout == layout
            y = op.decompress(p, ctx)
        except FloatingPointError as e:
            assert "boundary2.grad" in str(e) and str(dtype).split(".")[-1] in str(e), str(e)
            return
        assert y.dtype == dtype and bool(torch.isfinite(y).all()), (spec, dtype, magnitude, step)
        if magnitude == "zeros":
            assert not bool(y.any())


@pytest.mark.parametrize("spec", ["int1+ef", "int4+ef", "topk:0.1+ef21", "int2+aqsgd"])
def test_feedback_state_is_fp32_for_half_inputs(spec):
    op = ppc.build(spec)
    for step in range(2):
        x = torch.randn(4, 8, 16, dtype=torch.float16)
        ctx = ppc.Context(step=step, sample_ids=torch.arange(4))
        op.decompress(op.compress(x, ctx), ctx)
    state = list(state_tensors(op.state_dict()))
    assert state and all(t.dtype == torch.float32 for t in state)


def test_the_fuzz_findings_of_the_issue():
    """int1+ef on fp16 with a value near 60000, and unbiased randk on fp16, used to return inf from finite input."""
    x = torch.randn(4, 64, dtype=torch.float16)
    x[0, 0] = 60000
    op = ppc.build("int1+ef")
    for step in range(4):
        ctx = ppc.Context(name="boundary0.act", step=step)
        y = op.decompress(op.compress(x, ctx), ctx)
        assert bool(torch.isfinite(y).all())
    assert op.saturated > 0  # the residual pushed x + e past fp16's max: clipped into the residual, counted
    big = torch.full((4, 64), 30000.0, dtype=torch.float16)
    with pytest.raises(FloatingPointError, match=r"boundary1\.grad.*float16"):
        ctx = ppc.Context(name="boundary1.grad")
        r = ppc.build("randk:0.2:unbiased")
        r.decompress(r.compress(big, ctx), ctx)
