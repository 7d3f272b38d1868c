"""auto's decision rounds (pp_compress/decide.py) between two stages over an in-memory link: agreement, the guard,
checkpoints, re-probes on drift, and the trials of close calls."""
import time

import pytest
import torch

import pp_compress as ppc
from pp_compress.decide import TRIAL_GAIN, close_call, settle
from pp_compress.policy import Trial

MB = 1 << 20

class Wire:
    """Two stages' p2p over queues, in two threads. The link's time is modelled, not slept or clocked (a loaded test
    machine's thread switches would swamp it): a round trip timed by the sender takes 2 x latency + n / rate for the
    n bytes it sent (rate None: infinitely fast)."""

    def __init__(self, rate: float | None, latency: float = 0.0) -> None:
        import queue
        import threading

        self.rate, self.latency = rate, latency
        self.queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
        self.sent = threading.local()

    def exchange(self, stage: int):
        def run(ops):
            for kind, peer, buf in ops:
                if kind == "send":
                    self.sent.nbytes = buf.numel() * buf.element_size()
                    self.queues[stage, peer].put(buf.clone())
                else:
                    buf.copy_(self.queues[peer, stage].get(timeout=60))
        return run

    def elapsed(self, fn, device) -> float:
        fn()
        return 2 * self.latency + (self.sent.nbytes / self.rate if self.rate else 0.0)


class BusyWire(Wire):
    """A Wire on which the next `busy` timed round trips that carry more than a byte each take `by` seconds more: a
    whole probe slowed by something else on the sender's cores."""

    def __init__(self, rate: float | None, busy: int, by: float = 0.05) -> None:
        super().__init__(rate)
        self.busy, self.by = busy, by

    def elapsed(self, fn, device) -> float:
        t = super().elapsed(fn, device)
        if self.sent.nbytes > 1 and self.busy > 0:
            self.busy -= 1
            return t + self.by
        return t


def policies(spec: str = "auto:every=1,min_numel=0"):
    from pp_compress.policy import BoundaryPolicy

    cfg = ppc.parse_spec(spec)
    return BoundaryPolicy(cfg), BoundaryPolicy(cfg)


def remember(sender, receiver, x, step=0):
    from pp_compress.policy import Where

    sender.remember([x], Where(0, "act", step, 0))
    receiver.remember([x], Where(0, "grad", step, 0))  # stage 1 sends the gradient of boundary 0


def round_between(pols, wire, step=1):
    """decide_round on stage 0 and stage 1 of a 2-stage pipeline at once; (lines of stage 0, lines of stage 1)."""
    import threading

    from pp_compress import decide
    from pp_compress.decide import decide_round

    real, decide.elapsed = decide.elapsed, wire.elapsed

    out, errors = [None, None], []

    def run(stage):
        try:
            out[stage] = decide_round(pols[stage], stage, 2, torch.device("cpu"), wire.exchange(stage), step, reps=2)
        except Exception as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(120)
    finally:
        decide.elapsed = real
    assert not errors, errors
    return out


def test_both_sides_of_a_boundary_agree_compressing_on_a_slow_link_and_not_on_a_fast_one():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(0))  # 1.2 MB
    slow = policies()
    remember(*slow, x)
    lines = round_between(slow, Wire(rate=20 * MB, latency=1e-3))  # the message takes 60 ms dense
    assert slow[0].decisions == slow[1].decisions == {(0, "act"): "safe", (0, "grad"): "safe"}
    assert "boundary 0 act" in lines[0][0] and "safe (int8:rot)" in lines[0][0] and "boundary 0 grad" in lines[1][0]
    assert all(p.op(0, d, True).spec == "int8:rot" for p in slow for d in ("act", "grad"))
    fast = policies()
    remember(*fast, x)
    round_between(fast, Wire(rate=100_000 * MB))  # 12 us dense: no codec is that fast
    assert fast[0].decisions == fast[1].decisions == {(0, "act"): "none", (0, "grad"): "none"}
    assert fast[0].op(0, "act", True) is None and fast[0].samples == {}  # a sample is used once


def test_no_sample_no_decision_and_only_decision_steps_keep_one():
    pols = policies("auto:every=5,min_numel=0")
    assert [s for s in range(12) if pols[0].auto_due(s)] == [1, 6, 11]
    remember(*pols, torch.randn(4, 64), step=1)  # step 1 is not followed by a decision: nothing kept
    assert pols[0].samples == {} and round_between(pols, Wire(rate=None)) == [[], []]
    assert pols[0].decisions == pols[1].decisions == {}


def test_decisions_and_the_guard_survive_a_checkpoint_and_a_switch_starts_fresh():
    from pp_compress.policy import BoundaryPolicy

    sender, _ = policies()
    assert sender.decide(0, "act", "safe") and not sender.decide(0, "act", "safe")
    first = sender.op(0, "act", True)
    sender.validated[0, "act", "safe"] = 0.01
    sender.barred.add((0, "grad", "safe"))
    state = sender.state_dict()
    resumed = BoundaryPolicy(sender.cfg)
    resumed.load_state_dict(state)
    assert resumed.decisions == {(0, "act"): "safe"} and resumed.op(0, "act", True).spec == "int8:rot"
    assert resumed.validated == sender.validated and resumed.barred == sender.barred
    assert resumed.op(0, "act", False) is resumed.op(0, "act", True)  # inference follows the activations' decision
    sender.decide(0, "act", "none")
    sender.decide(0, "act", "safe")
    assert sender.op(0, "act", True) is not first  # switched back: a fresh operator, no state of the earlier one
    with pytest.raises(ValueError, match="accepted: none, int8, safe, aggressive"):
        sender.decide(0, "act", "int4")


def test_the_guard_steps_back_when_the_error_outgrows_its_validated_level():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(1))
    pols = policies()
    for p in pols:
        p.decide(0, "act", "safe")
        p.decide(0, "grad", "safe")
    pols[0].validated[0, "act", "safe"] = 1e-6  # far below what int8:rot makes on any tensor
    remember(*pols, x)
    lines = round_between(pols, Wire(rate=20 * MB))
    assert pols[0].decisions[0, "act"] == pols[1].decisions[0, "act"] == "none"  # safe barred: none is left
    assert (0, "act", "safe") in pols[0].barred and "stepped back from safe" in lines[0][0]
    assert pols[0].decisions[0, "grad"] == "safe"  # the other direction kept its pick


def test_auto_refuses_fixed_specs_and_the_in_process_boundary():
    with pytest.raises(ValueError, match="cannot be combined with act"):
        ppc.parse_spec("auto,act=int8")
    with pytest.raises(ValueError, match="an in-process boundary has no link"):
        ppc.CompressionBoundary("auto")
    cfg = ppc.parse_spec("auto:max=aggressive:every=10,warmup=5")
    assert str(cfg) == "auto:max=aggressive:every=10,warmup=5" and ppc.parse_spec(str(cfg)) == cfg
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


def test_a_known_link_is_not_probed_again_until_the_step_time_drifts():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(2))
    pols, wire = policies(), Wire(rate=20 * MB, latency=1e-3)
    remember(*pols, x)
    first = round_between(pols, wire, step=1)
    assert all("(link measured now)" in line for lines in first for line in lines)
    remember(*pols, x, step=1)
    pols[0].decide(0, "act", "none")  # so that the second round's pick is a change and logs a line
    pols[1].decide(0, "act", "none")
    second = round_between(pols, wire, step=2)
    assert second[0] and not any("(link measured now)" in line for line in second[0])  # the pick, from the known link
    assert pols[0].decisions == pols[1].decisions == {(0, "act"): "safe", (0, "grad"): "safe"}
    # the step time since the last round is 100x the window before it: the link may have changed, measure it again
    assert pols[0].window is None  # no step was timed: no window
    drift(pols[0])
    remember(*pols, x, step=2)
    pols[0].decide(0, "act", "none")
    pols[1].decide(0, "act", "none")
    third = round_between(pols, wire, step=3)
    assert any("(link measured now)" in line for line in third[0])


def drift(sender) -> None:
    """Make the sender's next round see its step time drift: 100x the window before, after the warm-up's window."""
    sender.rounds = max(sender.rounds, 1)
    sender.window, sender.durations = 1e-4, [(5, 0.01), (6, 0.01)]


def test_a_window_is_the_median_step_time_the_warm_up_is_dropped_and_a_drift_is_seen():
    from pp_compress.decide import _drifted

    pol, _ = policies()
    def timed(*seconds):
        return list(enumerate(seconds))

    pol.durations = timed(5.0, 0.1)  # before the first round: the engine's warm-up
    assert not _drifted(pol) and pol.window is None and pol.durations == [] and pol.window_steps == timed(5.0, 0.1)
    pol.rounds, pol.durations = 1, timed(0.1, 0.1, 3.0)  # one step held an evaluation or a checkpoint
    assert not _drifted(pol) and pol.window == pytest.approx(0.1)
    pol.durations = timed(0.11, 0.118, 0.1)
    assert not _drifted(pol) and pol.window == pytest.approx(0.11)
    pol.durations = timed(0.2, 0.2)
    assert _drifted(pol) and pol.window == pytest.approx(0.2)
    assert not _drifted(pol) and pol.window == pytest.approx(0.2)  # no step timed since: the window stands
    assert pol.window_steps == []


def test_begin_step_times_the_steps_without_the_rounds():
    from pp_compress import decide

    pol, _ = policies("auto:every=3,min_numel=0")
    rounds = []
    real, decide.decide_round = decide.decide_round, lambda *a: (rounds.append(a[-1]), time.sleep(0.2))[1] or []
    try:
        for step in range(5):
            assert decide.begin_step(pol, 0, 2, torch.device("cpu"), None, step) == []
            time.sleep(0.01)
    finally:
        decide.decide_round = real
    assert rounds == [1, 4] and [s for s, _ in pol.durations] == [0, 1, 2, 3]  # the steps that ended, in order
    assert all(0.01 <= t < 0.15 for _, t in pol.durations)
    assert decide.begin_step(policies("identity")[0], 0, 2, torch.device("cpu"), None, 1) == []


def test_a_probe_slowed_by_something_else_is_measured_again_and_a_fast_link_stays_uncompressed():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(3))
    pols = policies()
    remember(*pols, x)
    wire = BusyWire(rate=100_000 * MB, busy=2)  # the first probe's large trips (reps=2) wait 50 ms each
    lines = round_between(pols, wire)
    assert pols[0].decisions == pols[1].decisions == {(0, "act"): "none", (0, "grad"): "none"}, lines
    assert pols[0].links[0, "act"].bandwidth > 10_000 * MB  # the repeat's trips count
    # once known, a probe that finds the link as fast is not repeated; one that finds it much slower is
    drift(pols[0])  # measure the links again
    remember(*pols, x, step=1)
    wire.busy = 2
    round_between(pols, wire, step=2)
    assert pols[0].decisions[0, "act"] == "none" and wire.busy == 0 and pols[0].links[0, "act"].bandwidth > 10_000 * MB


def test_a_link_that_really_slowed_is_confirmed_in_the_same_round_and_the_drift_keeps_the_codec_times():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(4))
    pols, wire = policies(), Wire(rate=100_000 * MB)
    remember(*pols, x)
    round_between(pols, wire)
    assert pols[0].decisions[0, "act"] == "none"
    costs = pols[0].costs[0, "act"]
    wire.rate, wire.latency = 20 * MB, 1e-3  # the link slowed: the step time drifts, and the probe finds it twice
    drift(pols[0])
    remember(*pols, x, step=1)
    lines = round_between(pols, wire, step=2)
    assert pols[0].decisions == pols[1].decisions == {(0, "act"): "safe", (0, "grad"): "none"}, lines
    assert "(link measured now)" in lines[0][0] and pols[0].links[0, "act"].bandwidth == pytest.approx(20 * MB, rel=1e-3)
    assert pols[0].costs[0, "act"] is costs  # a drift re-measures the link, not the codecs


# --- trials of close calls -------------------------------------------------------------------------------------------

def test_a_close_call_is_between_dense_and_twice_its_time_and_a_trial_keeps_only_a_clear_gain():
    from pp_compress.auto import Cost, Link

    link, raw = Link(bandwidth=1e9, latency=1e-3), 1_000_000  # dense: 2 ms
    def codec(ms):  # a quarter of the bytes: 1.25 ms of the link, plus `ms` of codec
        return {"safe": Cost(ms * 1e-3, 0.0, raw // 4)}
    assert close_call(link, raw, codec(1.0)) == "safe"  # 2.25 ms against 2 ms dense: close
    assert close_call(link, raw, codec(2.5)) == "safe"  # 3.75 ms
    assert close_call(link, raw, codec(3.0)) is None  # 4.25 ms: more than twice dense's time, not tried
    assert close_call(link, raw, codec(0.1)) is None  # 1.35 ms: compressing clearly wins, the model picks it
    assert close_call(link, raw, {}) is None
    trial = Trial("none", "safe", start=10)
    steps = [(9, 0.01), (10, 0.090), (11, 0.100), (12, 0.092), (13, 0.101), (14, 0.5)]  # step 9 ran before the trial
    assert settle(trial, steps) == ("safe", 0.092, 0.1005)
    assert settle(trial, [(10, 0.100 * (1 - TRIAL_GAIN) - 1e-6), (11, 0.100)])[0] == "safe"
    assert settle(trial, [(10, 0.100 * (1 - TRIAL_GAIN) + 1e-6), (11, 0.100)])[0] == "none"
    assert settle(trial, [(9, 0.1), (10, 0.1), (12, 0.1)]) is None  # the incumbent's side has no step timed


def close_round(pols, wire, x, step, steps=()):
    """A decision round after which the sender's measured costs make safe a close call (1 ms of codec on a link
    whose dense message takes 1 ms), with `steps` [(step, seconds)] as the stage's step times since the last round."""
    import dataclasses

    like, costs = pols[0].costs[0, "act"]
    pols[0].costs[0, "act"] = (like, {n: dataclasses.replace(c, encode_s=6e-4, decode_s=4e-4) for n, c in costs.items()})
    pols[0].rounds, pols[0].durations = max(pols[0].rounds, 1), list(steps)
    pols[0].window = 0.1 if steps else None  # the window before: no drift
    remember(*pols, x, step=step - 1)
    return round_between(pols, wire, step=step)


def ops_at(pol, step):
    """The candidate each direction of boundary 0 runs at `step` (by its operator's spec)."""
    from pp_compress.policy import Where

    return tuple(str(op.spec) if (op := pol.plan_op(Where(0, d, step))) is not None else "none"
                 for d in ("act", "grad"))


@pytest.mark.parametrize("under_safe,kept", [(0.090, "safe"), (0.0995, "none")])
def test_a_close_call_runs_both_sides_on_alternate_steps_and_is_settled_by_their_step_times(under_safe, kept):
    from pp_compress.presets import PRESETS

    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(5))
    pols, wire = policies(), Wire(rate=None, latency=1e-3)
    remember(*pols, x)
    round_between(pols, wire)  # round 0 measures the link (1 ms, no bandwidth term) and the codecs: none
    assert pols[0].decisions[0, "act"] == "none"
    lines = close_round(pols, wire, x, step=2, steps=[(1, 0.1)])
    assert "a close call: safe and none run on alternate steps for a window" in lines[0][0]
    assert pols[0].trials[0, "act"] == Trial("none", "safe", 2)
    for pol in pols:  # both sides of the boundary switch in step: safe at 2, 4, ..., none at 3, 5, ...
        assert pol.decisions[0, "act"] == "safe" and pol.alternate == {(0, "act"): ("none", 2)}
        assert [ops_at(pol, s)[0] for s in (2, 3, 4, 5)] == [PRESETS["safe"], "none"] * 2
        assert ops_at(pol, 3)[1] == "none"  # the gradient's call was not close: no trial
    window = [(s, under_safe if s % 2 == 0 else 0.100) for s in range(2, 8)]
    lines = close_round(pols, wire, x, step=8, steps=window)
    assert pols[0].decisions[0, "act"] == pols[1].decisions[0, "act"] == kept
    assert pols[0].alternate == pols[1].alternate == {}
    assert (f"tried safe on alternate steps: {under_safe * 1e3:.4g} ms per step against 100 ms under none; "
            f"keeps {kept}") in lines[0][0]
    assert pols[0].trials == {} and pols[0].settled[0, "act"] == (kept, pols[0].rounds - 1)
    lines = close_round(pols, wire, x, step=9, steps=[(8, 0.5)])  # the outcome stands until the link is measured again
    assert pols[0].decisions[0, "act"] == kept and lines[0] == [] and pols[0].trials == {}
    assert "(0, 'grad')" not in str(pols[0].trials)  # the gradient's sender is stage 1, whose costs are its own


def test_alternate_steps_keep_each_candidates_own_operator_and_state():
    sender, _ = policies("auto:max=aggressive:model=small-gpt:every=1,min_numel=0")
    sender.decide(0, "act", "aggressive")
    before = sender.op(0, "act", True)
    sender.decide(0, "act", "int8")
    sender.alternate_with(0, "act", "aggressive", 4)
    assert sender.op(0, "act", True, 5) is not sender.op(0, "act", True, 4)
    assert sender.op(0, "act", True, 5) is before  # not rebuilt: its state carries over between its steps
    assert sender.op(0, "act", False, 5) is sender.op(0, "act", True, 4)  # inference runs the decision
    with pytest.raises(ValueError, match="auto trial candidate 'int4'; accepted: none, int8"):
        sender.alternate_with(0, "act", "int4", 4)


def test_a_trial_settled_from_no_timed_steps_runs_its_window_again():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(6))
    pols, wire = policies(), Wire(rate=None, latency=1e-3)
    remember(*pols, x)
    round_between(pols, wire)
    close_round(pols, wire, x, step=2, steps=[(1, 0.1)])
    lines = close_round(pols, wire, x, step=3, steps=[])  # resumed from a checkpoint just before this round
    assert pols[0].trials[0, "act"] == Trial("none", "safe", 3) and lines[0] == []
    assert pols[0].alternate == pols[1].alternate == {(0, "act"): ("none", 3)}


def test_a_trial_and_its_outcome_survive_a_checkpoint():
    from pp_compress.policy import BoundaryPolicy

    sender, _ = policies()
    sender.decide(0, "act", "safe")
    sender.trials[0, "act"] = Trial("none", "safe", 40)
    sender.alternate_with(0, "act", "none", 40)
    sender.settled[0, "grad"] = ("safe", 7)
    resumed = BoundaryPolicy(sender.cfg)
    resumed.load_state_dict(sender.state_dict())
    assert resumed.trials == sender.trials and resumed.settled == {(0, "grad"): ("safe", 0)}
    assert resumed.decisions == {(0, "act"): "safe"} and resumed.alternate == {(0, "act"): ("none", 40)}
    state = sender.state_dict()
    state["auto_trials"]["0.act"][1] = "int4"
    with pytest.raises(ValueError, match="auto candidate 'int4' in the checkpoint's state; accepted: none, int8"):
        BoundaryPolicy(sender.cfg).load_state_dict(state)
    state = sender.state_dict()
    state["auto_alternate"]["0.act"][1] = 0.25
    with pytest.raises(ValueError, match="auto trial start 0.25 in the checkpoint's state; accepted: an integer step"):
        BoundaryPolicy(sender.cfg).load_state_dict(state)
