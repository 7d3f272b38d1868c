"""Deferred non-finite checks: with a Deferred in the Context the per-message path makes no host-blocking tensor call
(what waits for an accelerator), and a failure is still raised, naming the boundary and the step, when the engine
reads the verdicts."""
import math

import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import TensorSpec
from pp_compress.ops.deferred import Deferred
from pp_compress.pipe import StageCompression
from pp_compress.policy import Where

BLOCKING = ("__bool__", "item", "tolist", "cpu", "numpy", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every host-blocking tensor call while `on[0]` is set."""
    calls: list[str] = []
    on = [False]
    for name in BLOCKING:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, __name=name, __original=original, **k):
            if on[0]:
                calls.append(__name)
            return __original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls, on


@pytest.mark.parametrize("spec", ["int8", "safe", "aggressive", "int4:rot", "nf6", "int3:stoch", "act=int8:rot+ef21",
                                  "tile:3.5", "tile:3:lo=2:hi=4:asym:stoch", "int1"])
def test_a_preset_message_makes_no_host_read_in_steady_state(spec, host_reads):
    calls, on = host_reads
    cfg = ppc.parse_spec(spec)
    for direction in ("act", "grad"):
        op = cfg.spec_for(0, direction).build()
        deferred = Deferred()
        for step in range(3):  # steps 0-1 warm up (kernels built, codebooks and tables cached)
            x = torch.randn(4, 64, 576)
            ctx = ppc.Context(direction=direction, step=step, deferred=deferred)
            on[0] = step == 2
            op.decompress(op.compress(x, ctx), ctx)
            on[0] = False
        assert calls == [], (spec, direction, calls)
        assert len(deferred) > 0
        deferred.raise_pending()  # all fine


@pytest.mark.parametrize("mode", ["greedy", "greedy_weighted", "weighted_greedy", "stochastic"])
def test_mdtopk_learns_and_sends_without_a_host_read(mode, host_reads):
    """mdtopk's sender also learns from the gradient that comes back (`observe`): that too stays on the device."""
    calls, on = host_reads
    op, deferred = ppc.build(f"mdtopk:0.1:mode={mode}"), Deferred()
    for step in range(3):
        x, g = torch.randn(4, 64, 576), torch.randn(4, 64, 576)
        ctx = ppc.Context(step=step, deferred=deferred)
        on[0] = step == 2
        op.decompress(op.compress(x, ctx), ctx)
        op.observe(g if step else torch.zeros_like(g), ctx)  # a zero gradient once: w must stay without a read
        on[0] = False
    assert calls == [], (mode, calls)
    deferred.raise_pending()


def test_a_deferred_failure_is_raised_when_read_and_names_the_boundary_and_step():
    op, deferred = ppc.build("int8"), Deferred()
    x = torch.randn(4, 64)
    x[1, 3] = math.nan
    ctx = ppc.Context(name="boundary2.act", boundary=2, step=5, deferred=deferred)
    op.decompress(op.compress(x, ctx), ctx)  # nothing raised mid-message
    with pytest.raises(FloatingPointError, match=r"boundary2\.act: input has NaN/Inf values at step 5"):
        deferred.raise_pending()
    deferred.raise_pending()  # read once: nothing is left
    with pytest.raises(FloatingPointError, match=r"boundary2\.act: input has NaN/Inf values at step 5; .*; 1 of them$"):
        op.compress(x, ctx.replace(deferred=None))  # without a Deferred the check reads its verdict at once


def test_a_stage_defers_its_checks_and_the_engine_reads_them_once_a_step():
    send = StageCompression(ppc.parse_spec("int8"), 0, 2, defer_on_cpu=True)
    recv = StageCompression(ppc.parse_spec("int8"), 1, 2, defer_on_cpu=True)
    x = torch.randn(2, 8, 64)
    x[0, 0, 0] = math.inf
    where = Where(0, "act", 7, 0, True)
    buffers = send.encode([x], where)
    out = recv.decode([TensorSpec((2, 8, 64), torch.float32)], where, [None], buffers)
    assert out[0].shape == x.shape
    with pytest.raises(FloatingPointError, match=r"boundary0\.act: input has NaN/Inf values at step 7"):
        send.raise_pending()
    with pytest.raises(FloatingPointError, match=r"boundary0\.act: int8 decoded finite input to NaN/Inf at step 7"):
        recv.raise_pending()
    for stage in (send, recv):
        stage.raise_pending()  # read: nothing is left


def test_poll_raises_a_failed_verdict_once_it_is_on_the_host_and_only_once():
    deferred = Deferred()
    deferred.expect(torch.tensor(True), FloatingPointError, lambda: "fine")
    deferred.poll()  # CPU verdicts are on the host at once: read, nothing failed
    assert len(deferred) == 0
    deferred.expect(torch.tensor(False), FloatingPointError, lambda: "boundary1.grad: bad at step 3")
    with pytest.raises(FloatingPointError, match="boundary1.grad: bad at step 3"):
        deferred.poll()
    deferred.poll()
    deferred.raise_pending()  # read once: nothing is left


def test_kernel_flags_take_slots_that_are_read_with_the_other_verdicts_and_zeroed(monkeypatch):
    monkeypatch.setattr(Deferred, "SLOTS", 3)  # a step's flags fill more than one buffer
    deferred, cpu = Deferred(), torch.device("cpu")
    flags = [deferred.flag(cpu, FloatingPointError, lambda i=i: f"flag {i}") for i in range(7)]
    deferred.expect(torch.tensor(True), FloatingPointError, lambda: "verdict")
    assert [f.index for f in flags] == [0, 1, 2, 0, 1, 2, 0] and len({id(f.buf) for f in flags}) == 3
    assert len(deferred) == 8
    flags[4].buf[flags[4].index] = 1  # as a kernel sets its slot
    with pytest.raises(FloatingPointError, match="^flag 4$"):
        deferred.raise_pending()
    assert all(int(f.buf.abs().sum()) == 0 for f in flags)  # read and zeroed
    again = deferred.flag(cpu, FloatingPointError, lambda: "next step")
    assert again.index == 0 and again.buf is flags[6].buf  # the current buffer is reused from its first slot
    deferred.raise_pending()  # all fine


def test_a_flag_without_a_deferred_is_its_own_slot_and_settles_at_once():
    from pp_compress.ops.base import new_flag, settle

    flag = new_flag(ppc.Context(), torch.device("cpu"), ValueError, lambda: "corrupt")
    settle(flag, ppc.Context())
    flag.buf[flag.index] = 1
    with pytest.raises(ValueError, match="^corrupt$"):
        settle(flag, ppc.Context())
    deferred = Deferred()
    settle(flag, ppc.Context(deferred=deferred))  # deferred: read with the step's verdicts, not here
