"""The package's device paths on a CUDA device (skipped without one): error-feedback state kept on the device and
bit-identical on both sides, payloads through the wire buffers on the device, and the in-process boundary forward
and backward (`identity` bitwise invisible on CUDA too: tests/unit/test_boundary.py). The operators themselves:
tests/unit/ops/test_cuda.py. On a GPU machine: `bash benchmarks/cuda_check.sh`."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.wire import from_buffer, to_buffer
from tests.unit.state import state_tensors
from tests.unit.test_boundary import _grads, _mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")


@pytest.mark.parametrize("spec", ["topk:0.1+ef", "int2:stoch+ef21", "topk:0.2+aqsgd", "int2+aqsgd:first=int8:rot",
                                  "vq:3+ef21"])
def test_feedback_state_stays_on_the_device_and_identical_on_both_sides(spec):
    sender, receiver = ppc.build(spec), ppc.build(spec)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(12, 6, 64, generator=g).to(DEV)  # (samples, s, h)
    for step in range(12):
        ids = torch.randperm(12, generator=g)[:4]  # (b,)
        x = base[ids.to(DEV)] + 0.1 * torch.randn(4, 6, 64, generator=g).to(DEV)  # (b, s, h)
        ctx = ppc.Context(step=step, sample_ids=ids, micro_batch=step % 2)
        p = sender.compress(x, ctx)
        buf = to_buffer(p)  # (nbytes,) uint8: what one P2P op sends
        assert buf.is_cuda and buf.numel() == p.nbytes
        layout = receiver.wire_layout(x.shape, x.dtype, ctx)
        y = receiver.decompress(from_buffer(buf.clone(), layout, x.shape, x.dtype), ctx)
        assert y.is_cuda and torch.equal(y, sender.estimate(p, ctx)) and torch.equal(y, sender.decompress(p, ctx))
    s, r = list(state_tensors(sender.state_dict()["send"])), list(state_tensors(receiver.state_dict()["recv"]))
    assert s and all(t.is_cuda for t in s + r) and all(torch.equal(a, b) for a, b in zip(s, r))


@pytest.mark.parametrize("cfg", ["safe", "aggressive", "act=topk:0.2+ef,grad=int3:stoch"])
def test_boundary_trains_on_cuda(cfg):
    model = _mlp(cfg, width=64, device=DEV)
    x = torch.randn(8, 64, device=DEV)
    grads = _grads(model, x)
    assert all(t.is_cuda and bool(torch.isfinite(t).all()) for t in grads)
    (b,) = [m for m in model.modules() if isinstance(m, ppc.CompressionBoundary)]
    assert b.stats["act"].ratio > 1.9 and b.stats["grad"].ratio > 1.9
    assert all(t.is_cuda for t in state_tensors(b.state_dict()["_extra_state"]))


@pytest.mark.parametrize("cfg", ["safe", "aggressive"])
def test_boundary_steps_never_wait_for_the_device_and_still_report_non_finite_input(cfg):
    """Steady-state training steps through a boundary make no host synchronization (sync debug mode 'error' raises at
    any); a NaN sent through it is reported by a later poll, or by check()."""
    model = _mlp(cfg, width=64, device=DEV)
    x = torch.randn(8, 64, device=DEV)
    (b,) = [m for m in model.modules() if isinstance(m, ppc.CompressionBoundary)]
    for step in range(4):
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else 0)
        try:
            model(x).square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    b.check()
    assert b.stats["act"].as_dict()["compress_s"] > 0  # timed by CUDA events, read here
    model(torch.full_like(x, float("nan"))).sum().backward()
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        b.check()
