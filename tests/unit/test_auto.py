"""auto's pure parts (pp_compress/auto.py): the spec, the admitted candidates, the cost model, the measurements."""
import time

import pytest
import torch

import pp_compress as ppc
from pp_compress.auto import (AutoConfig, Cost, Link, candidate_op, candidate_ops, choose, describe, fastest_trips,
                              link_of, measure_codec)

MB = 1 << 20


def test_the_spec_and_its_errors():
    assert AutoConfig.parse("auto") == AutoConfig()
    assert AutoConfig.parse("auto:max=aggressive:model=SmolLM2-135M") == AutoConfig("aggressive", "SmolLM2-135M")
    assert AutoConfig.parse("auto:model=small-gpt") == AutoConfig.parse("auto:model=Small_GPT") == AutoConfig("safe", "small GPT")
    for bad, words in [("auto:max=fast", "max='fast'; accepted: safe, aggressive"), ("auto:speed=1", "accepted keys"),
                       ("auto:model=GPT-9", "accepted: small GPT, SmolLM2-135M"), ("auto:max=safe:max=safe", "each once"),
                       ("safe", "is not an auto spec")]:
        with pytest.raises(ValueError, match=words):
            AutoConfig.parse(bad)


def test_the_candidates_stop_at_the_budget_and_are_never_measured_worse():
    assert AutoConfig().candidates() == ["none", "safe"]
    assert AutoConfig("aggressive", "SmolLM2-135M").candidates() == ["none", "safe", "aggressive"]
    assert AutoConfig("aggressive").candidates() == ["none", "safe", "aggressive"]  # parity by the loss rule on both
    for name in AutoConfig("aggressive").candidates()[1:]:
        assert all(v.loss_rule == "parity" for v in ppc.presets.verdicts(ppc.PRESETS[name]))
    ops = candidate_ops(AutoConfig("aggressive"), "grad")
    assert [op.spec for op in ops.values()] == ["int8:rot", "vq:3"]


def test_a_setting_that_is_no_preset_is_a_candidate_only_on_a_family_where_both_rules_put_it_at_parity():
    """int8 (no rotation) is at parity on both rules on the small GPT, and worse by lm-eval on SmolLM2 (outlier
    channels): a candidate there only, and never for a family not named."""
    assert AutoConfig("aggressive", "small GPT").candidates() == ["none", "int8", "safe", "aggressive"]
    assert AutoConfig("safe", "small GPT").candidates() == ["none", "int8", "safe"]
    assert "int8" not in AutoConfig("aggressive", "SmolLM2-135M").candidates()
    assert "int8" not in AutoConfig("aggressive").candidates()
    assert [v.lm_eval for v in ppc.presets.verdicts("int8", "SmolLM2-135M")] == ["worse"]
    assert candidate_ops(AutoConfig("safe", "small GPT"), "act")["int8"].spec == "int8"
    with pytest.raises(ValueError, match="has no operator"):
        candidate_op("none", 0, "act")


def test_the_cost_model_sends_dense_on_a_fast_link_and_compresses_on_a_slow_one():
    raw = 8 * MB
    costs = {"safe": Cost(0.3e-3, 0.3e-3, raw // 4), "aggressive": Cost(4e-3, 1e-3, raw // 8)}
    nvlink = choose(Link(400e9, 5e-6), raw, costs)
    assert nvlink.candidate == "none" and nvlink.saving == 0.0
    ib = choose(Link(50e9 / 8 * 8, 5e-6), raw, costs)  # 50 GB/s: 0.17 ms dense, 0.64 ms through safe
    assert ib.candidate == "none"
    ethernet = choose(Link(1.25e9, 50e-6), raw, costs)  # 10 Gbit/s: 6.7 ms dense, 2.3 ms safe, 5.9 ms aggressive
    assert ethernet.candidate == "safe" and 0.6 < ethernet.saving < 0.7
    internet = choose(Link(5e6 / 8, 20e-3), raw, costs)  # 5 Mbit/s: the fewest bytes win
    assert internet.candidate == "aggressive"
    assert choose(Link(1e9, 0.0), raw, {}).candidate == "none"
    assert describe(1, "act", Link(1.25e9, 50e-6), ethernet) == (
        "pp_compress auto: boundary 1 act: link 1.25 GB/s, 0.05 ms; safe (int8:rot): 2.33 ms per message expected "
        "against 6.76 ms dense (66% saved)")


def test_a_codec_is_measured_on_the_real_tensor():
    x = torch.randn(4, 64, 576)
    op = ppc.build("int8:rot")
    cost = measure_codec(op, x, ppc.Context(), reps=3)
    assert cost.wire_bytes == op.wire_nbytes(tuple(x.shape), x.dtype) and cost.encode_s > 0 and cost.decode_s > 0


def test_the_guards_error_is_measured_on_spaced_rows_and_matches_the_whole_tensors():
    from pp_compress.auto import GUARD_ELEMENTS, relative_error

    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 10, 576)
    op = ppc.build("int8:rot")
    seen = []
    real = op.compress
    op.compress = lambda t, ctx: (seen.append(tuple(t.shape)), real(t, ctx))[1]
    sampled = relative_error(op, x, ppc.Context())
    assert seen == [(x.numel() // 576 // (x.numel() // GUARD_ELEMENTS), 576)]
    ref = x.double()
    whole = float((ref - op.decompress(real(x, ppc.Context()), ppc.Context()).double()).norm() / ref.norm())
    assert sampled == pytest.approx(whole, rel=0.05)


def test_a_link_is_measured_from_round_trips():
    def round_trip(n):  # a simulated 100 MB/s link with 2 ms each way
        t0 = time.perf_counter()
        time.sleep(0.004 + n / 100e6)
        return time.perf_counter() - t0
    link = link_of(*fastest_trips(round_trip, 2 * MB, reps=3), 2 * MB)
    assert 60e6 < link.bandwidth < 140e6 and 0.0015 < link.latency < 0.004
    with pytest.raises(ValueError, match="a positive bandwidth"):
        Link(0.0, 1e-3)


def test_a_trip_slowed_by_something_else_does_not_make_a_fast_link_look_slow():
    """One descheduled round trip of each size, among few: the link is still measured at its speed."""
    slow = iter([True, False, True, False])  # the first trip of each size waits 50 ms on something else
    link = link_of(*fastest_trips(lambda n: 1e-4 + n / 10e9 + (0.05 if next(slow) else 0.0), 2 * MB, reps=2), 2 * MB)
    assert link.bandwidth == pytest.approx(10e9, rel=1e-6) and link.latency == pytest.approx(5e-5)


# --- the decision round between two stages, over an in-memory link -----------------------------------------------

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

    from pp_compress import auto
    from pp_compress.auto import decide_round

    real, auto.elapsed = auto.elapsed, wire.elapsed

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
        auto.elapsed = real
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
    import time as clock

    assert pols[0].window is None  # the first window (the engine's warm-up) is no baseline
    pols[0].window = 1e-4
    pols[0].last_round = (clock.perf_counter() - 0.01, 2)
    remember(*pols, x, step=2)
    pols[0].decide(0, "act", "none")
    pols[1].decide(0, "act", "none")
    third = round_between(pols, wire, step=3)
    assert any("(link measured now)" in line for line in third[0])


def drift(sender, step: int) -> None:
    """Make the sender's next round see its step time drift: 100x the window before, after the warm-up's window."""
    sender.rounds = max(sender.rounds, 2)
    sender.window, sender.last_round = 1e-4, (time.perf_counter() - 0.01, step)


def test_a_probe_slowed_by_something_else_is_measured_again_and_a_fast_link_stays_uncompressed():
    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(3))
    pols = policies()
    remember(*pols, x)
    wire = BusyWire(rate=100_000 * MB, busy=2)  # the first probe's large trips (reps=2) wait 50 ms each
    lines = round_between(pols, wire)
    assert pols[0].decisions == pols[1].decisions == {(0, "act"): "none", (0, "grad"): "none"}, lines
    assert pols[0].links[0, "act"].bandwidth > 10_000 * MB  # the repeat's trips count
    # once known, a probe that finds the link as fast is not repeated; one that finds it much slower is
    drift(pols[0], step=1)  # measure the links again
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
    drift(pols[0], step=1)
    remember(*pols, x, step=1)
    lines = round_between(pols, wire, step=2)
    assert pols[0].decisions == pols[1].decisions == {(0, "act"): "safe", (0, "grad"): "none"}, lines
    assert "(link measured now)" in lines[0][0] and pols[0].links[0, "act"].bandwidth == pytest.approx(20 * MB, rel=1e-3)
    assert pols[0].costs[0, "act"] is costs  # a drift re-measures the link, not the codecs
