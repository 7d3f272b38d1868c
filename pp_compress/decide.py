"""`auto`'s decision rounds: every `every` steps the stages measure their links and their candidates' codec times,
the sender of each boundary and direction picks (auto.choose), and tells the receiver; both switch at that step.

The cost model prices a message at its codec time plus the link's time for its bytes. What it cannot see is what the
bytes also cost while the stages compute: a host's copies into and out of the transport, cores that the stages share,
a device's memory traffic. So a close call, where sending dense is expected to be faster than the fastest compressing
candidate but by less than the dense message's own time, is settled by a trial: for one window of steps the two sides
of the call run on alternate steps (both stages of the boundary switch in step), and the challenger is kept only if
the stage's median step time under it is TRIAL_GAIN or more below the incumbent's. Alternate steps share the window's
drift (another job on the host, the data), which two windows one after the other do not. The outcome stands for
REPROBE_ROUNDS rounds, then the call is tried again.

The engine adapters call `begin_step` at the start of every training step: it times the step that ended (the rounds
themselves excluded) and runs a round where one is due.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch
from torch import Tensor

from .auto import (LADDER, Cost, Decision, Link, candidate_op, candidates, choose, describe, fastest_trips, link_of,
                   measure_codec, relative_error)
from .policy import BoundaryPolicy, Trial, Where
from .timing import elapsed


Exchange = Callable[[list[tuple[str, int, Tensor]]], None]
"""The adapter's blocking p2p outside the schedule: [("send" | "recv", peer stage, buffer)], run in order."""

PROBE_BYTES = 1 << 16
"""The first probe's size: a dense message's round trip would cost seconds on the slow links where the decision
matters most, and 64 KiB already takes tens of milliseconds there."""
MIN_PROBE_S = 2e-3
"""A probe's extra time over a 1-byte round trip must reach this for its bandwidth to count (a fast link's is
lost in the noise of a small probe), unless it is the whole message."""
REPROBE_ROUNDS = 10
"""A boundary's link and its candidates' codec times are measured again at least every this many rounds (the link
also when step times drift)."""
CONFIRM = 1.5
"""A probe that finds the link more than this many times slower for the message than it was known to be (or the first
probe of a link) is repeated at once, and the fastest trips of both count: on a host whose processes share cores, a
whole probe can be slowed by something else, and a fast link taken for a slow one makes every message pay a codec."""
DRIFT = 0.2
"""A change of the step time between two rounds' windows beyond this share re-measures every link of the stage."""
HYSTERESIS = 0.05
"""A boundary switches only to a candidate expected to be more than this much faster than its current one: link and
codec timings are noisy, and a switch restarts the new candidate's state."""
GUARD = 2.0
"""A candidate is stepped back from when its relative error on a boundary's tensor exceeds GUARD times the error it had
there when it was first chosen (new outlier channels, a learning-rate spike): the quality it was validated at no longer
holds for these tensors."""
TRIAL_SPAN = 1.0
"""A close call: sending dense is expected to be faster than the fastest compressing candidate (or slower by less than
HYSTERESIS), but by at most this many times the dense message's expected time. Such a call is tried (see above)."""
TRIAL_GAIN = 0.01
"""A trial's challenger is kept only if the stage's median step time on its steps is this share or more below the
median on the incumbent's steps: a small lean to what ran before, since a switch restarts the candidate's state."""


def close_call(link: Link, raw_bytes: int, costs: dict[str, Cost]) -> str | None:
    """The fastest compressing candidate when it and sending dense are a close call (TRIAL_SPAN), else None."""
    dense = Cost(0.0, 0.0, raw_bytes).expected(link)
    expected = {name: cost.expected(link) for name, cost in costs.items() if name != "none"}
    fastest = min(expected, key=expected.__getitem__, default=None)
    if fastest is None or not dense * (1 - HYSTERESIS) <= expected[fastest] <= dense * (1 + TRIAL_SPAN):
        return None
    return fastest


def settle(trial: Trial, steps: list[tuple[int, float]]) -> tuple[str, float, float] | None:
    """What a trial keeps, from the (step, seconds) of the stage's steps since it began: (the kept candidate, the
    median step time under the challenger, under the incumbent). None while either has no step timed (a run resumed
    from a checkpoint just before the round)."""
    ran: tuple[list[float], list[float]] = ([], [])
    for step, seconds in steps:
        if step >= trial.start:
            ran[(step - trial.start) % 2].append(seconds)
    if not ran[0] or not ran[1]:
        return None
    challenger, incumbent = statistics.median(ran[0]), statistics.median(ran[1])
    return (trial.challenger if challenger < incumbent * (1 - TRIAL_GAIN) else trial.incumbent), challenger, incumbent


def begin_step(policy: BoundaryPolicy, stage: int, stages: int, device: torch.device, exchange: Exchange,
               step: int) -> list[str]:
    """Call at the start of every training step, on every stage: records how long the step that ended took (from the
    end of the round before it, if any), and runs `decide_round` where one is due. Returns its log lines."""
    if policy.auto is None:
        return []
    now = time.perf_counter()
    if policy.tick is not None:
        policy.durations.append((step - 1, now - policy.tick))
    lines = decide_round(policy, stage, stages, device, exchange, step) if policy.auto_due(step) else []
    policy.tick = time.perf_counter()
    return lines


def decide_round(policy: BoundaryPolicy, stage: int, stages: int, device: torch.device, exchange: Exchange,
                 step: int, reps: int = 2) -> list[str]:
    """One decision for every boundary and direction that touches `stage` (every stage calls it before the same
    step; boundaries in increasing order, so that a chain of blocking exchanges cannot deadlock). The sender of each
    direction times the candidates on the message it kept (`policy.samples`), picks with `choose` on its link, and
    tells the receiver; both switch at this step. The link is measured by round trips over the real link (`_probe`,
    through the adapter's p2p) only where it is not known yet, every REPROBE_ROUNDS rounds, or when this stage's step
    time drifted by more than DRIFT since the last round (a link that changed; the codec times are kept then);
    otherwise the sender's one message carries its pick. Returns the log lines of the changes and trials, on the
    sender."""
    assert policy.auto is not None
    admitted = candidates(policy.auto)
    drifted = _drifted(policy)
    lines = []
    for b in range(stages - 1):
        if stage not in (b, b + 1):
            continue
        for d in ("act", "grad"):
            sender = b if d == "act" else b + 1
            peer = b + 1 if stage == b else b
            # [what follows, pick, the trial's incumbent]: what follows is -1 nothing (no sample), 0 the rest of this
            # message, 1 a probe, then the rest; the incumbent is -1 where no trial runs
            head = torch.full((3,), -1, dtype=torch.int64, device=device)
            if stage != sender:
                exchange([("recv", peer, head)])
                if int(head[0]) == 1:
                    _probe(False, peer, 0, device, exchange, reps)
                    exchange([("recv", peer, head[1:])])
                if int(head[0]) >= 0:
                    policy.decide(b, d, LADDER[int(head[1])])
                    policy.alternate_with(b, d, LADDER[int(head[2])] if int(head[2]) >= 0 else None, step)
                continue
            x = policy.samples.pop((b, d), None)
            known = policy.links.get((b, d))
            due = known is None or policy.rounds - policy.probed.get((b, d), 0) >= REPROBE_ROUNDS
            probe = x is not None and (due or drifted)
            head[0] = -1 if x is None else 1 if probe else 0
            if x is not None and not probe:
                name, line, noted = _pick(policy, b, d, x, known, admitted, step, reps, measure=False)
                other = _told(policy, b, d, name, head)
            exchange([("send", peer, head)])
            if x is None:
                continue
            if probe:
                known = policy.links[b, d] = _probe(True, peer, x.numel() * x.element_size(), device, exchange, reps,
                                                    known)
                if due:
                    policy.probed[b, d] = policy.rounds
                name, line, noted = _pick(policy, b, d, x, known, admitted, step, reps, measure=due)
                other = _told(policy, b, d, name, head)
                exchange([("send", peer, head[1:])])
            policy.alternate_with(b, d, other, step)
            first = (b, d) not in policy.decisions
            if policy.decide(b, d, name) or first or noted:
                lines.append(f"step {step}: {line}" + (" (link measured now)" if probe else ""))
    policy.rounds += 1
    return lines


def _told(policy: BoundaryPolicy, b: int, d: str, name: str, head: Tensor) -> str | None:
    """Writes the sender's pick and its trial's incumbent (-1: no trial) into head[1:], as the receiver reads them;
    returns the incumbent, which runs on the trial's odd steps (None: no trial)."""
    trial = policy.trials.get((b, d))
    head[1], head[2] = LADDER.index(name), LADDER.index(trial.incumbent) if trial else -1
    return trial.incumbent if trial else None


def _drifted(policy: BoundaryPolicy) -> bool:
    """Closes this stage's window of step times: they become `policy.window_steps` and their median `policy.window`.
    True when the median differs by more than DRIFT from the window before. The window before the first round (the
    engine's warm-up) is dropped."""
    policy.window_steps, policy.durations = policy.durations, []
    if not policy.window_steps:
        return False
    now = statistics.median(seconds for _, seconds in policy.window_steps)
    if policy.rounds < 1:
        return False
    before, policy.window = policy.window, now
    return before is not None and abs(now / before - 1) > DRIFT


def _probe(sending: bool, peer: int, nbytes: int, device: torch.device, exchange: Exchange, reps: int,
           known: Link | None = None) -> Link | None:
    """The link to `peer`, measured on the sending side from round trips (the other side answers them: None). The
    probe starts at PROBE_BYTES and grows 16x, up to the message's size, until its extra time over a 1-byte round trip
    is at least MIN_PROBE_S: small enough to be cheap on a slow link, large enough to be timed on a fast one. Its last
    size is measured again where the link is new or looks CONFIRM times slower for an `nbytes` message than `known`.
    The sender announces each size (0: done), so that both sides run the same exchanges."""
    one = torch.zeros(1, dtype=torch.uint8, device=device)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    if not sending:
        while True:
            exchange([("recv", peer, size)])
            if not int(size[0]):
                return None
            full = torch.zeros(int(size[0]), dtype=torch.uint8, device=device)
            for buf in [one] * reps + [full] * reps:
                exchange([("recv", peer, buf)])
                exchange([("send", peer, one)])

    def round_trip(n: int) -> float:
        buf = one if n == 1 else torch.zeros(n, dtype=torch.uint8, device=device)
        return elapsed(lambda: (exchange([("send", peer, buf)]), exchange([("recv", peer, one)])), device)

    def fastest(n: int) -> tuple[float, float]:  # announced, so that the other side answers the same trips
        size[0] = n
        exchange([("send", peer, size)])
        return fastest_trips(round_trip, n, reps)

    n = min(nbytes, PROBE_BYTES)
    while True:
        small, big = fastest(n)
        link = link_of(small, big, n)
        if n >= nbytes or n / link.bandwidth >= MIN_PROBE_S:
            break
        n = min(nbytes, n * 16)
    dense = Cost(0.0, 0.0, nbytes)  # the message sent as it is
    if known is None or dense.expected(link) > CONFIRM * dense.expected(known):
        again = fastest(n)
        link = link_of(min(small, again[0]), min(big, again[1]), n)
    size[0] = 0
    exchange([("send", peer, size)])
    return link


def _pick(policy: BoundaryPolicy, b: int, d: str, x: Tensor, link: Link, admitted: list[str], step: int,
          reps: int, measure: bool) -> tuple[str, str, bool]:
    """The sender's pick for boundary b, direction d, its log line, and whether the line has news besides the pick
    (the guard, a trial); applies the guard and the trials. The candidates' codec times are measured with the link
    (`measure`) or for a tensor of a new shape, and kept in between; the current candidate's error, which the guard
    watches, is measured on every round's tensor."""
    ctx = policy.context(Where(b, d, step, 0))
    op = functools.partial(candidate_op, boundary=b, direction=d, nonfinite=policy.cfg.nonfinite)
    like = (tuple(x.shape), x.dtype)
    known = policy.costs.get((b, d))
    if measure or known is None or known[0] != like:
        known = policy.costs[b, d] = (like, {name: measure_codec(op(name), x, ctx, reps) for name in admitted[1:]})
    costs = dict(known[1])
    current = policy.decisions.get((b, d), "none")
    notes = []
    if current != "none" and current in costs:
        error = relative_error(op(current), x, ctx)
        costs[current] = dataclasses.replace(costs[current], rel_error=error)
        level = policy.validated.get((b, d, current))
        if level is not None and error > GUARD * level:
            policy.barred.add((b, d, current))
            notes.append(f"stepped back from {current}: relative error {costs[current].rel_error:.3g} against "
                         f"{level:.3g} when chosen")
    allowed = {name: c for name, c in costs.items() if (b, d, name) not in policy.barred}
    raw = x.numel() * x.element_size()
    decision = choose(link, raw, allowed)
    keep = Cost(0.0, 0.0, raw) if current == "none" else allowed.get(current)
    if keep is not None and keep.expected(link) <= decision.expected_s * (1 + HYSTERESIS):
        decision = Decision(current, keep.expected(link), decision.dense_s)  # not worth a switch
    name = _tried(policy, b, d, close_call(link, raw, allowed), decision.candidate, current, notes, step)
    if name != decision.candidate:
        decision = Decision(name, (allowed[name] if name != "none" else Cost(0.0, 0.0, raw)).expected(link),
                            decision.dense_s)
    if name != "none":
        policy.validated.setdefault((b, d, name), costs[name].rel_error)
    return name, describe(b, d, link, decision) + "".join(f"; {n}" for n in notes), bool(notes)


def _tried(policy: BoundaryPolicy, b: int, d: str, contender: str | None, pick: str, current: str,
           notes: list[str], step: int) -> str:
    """The pick after the trials: a trial that ran in the window since the last round is settled; on a close call
    (`contender`: its fastest compressing candidate) a settled outcome younger than REPROBE_ROUNDS rounds stands,
    otherwise a trial of `current` against the other side of the call starts at `step`. Appends what happened to
    `notes`."""
    trial = policy.trials.pop((b, d), None)
    if trial is not None:
        outcome = settle(trial, policy.window_steps)
        if outcome is None:  # no step of one side was timed: the trial runs its window again from here
            policy.trials[b, d] = dataclasses.replace(trial, start=step)
            return trial.challenger
        kept, challenger, incumbent = outcome
        policy.settled[b, d] = (kept, policy.rounds)
        notes.append(f"tried {trial.challenger} on alternate steps: {challenger * 1e3:.4g} ms per step against "
                     f"{incumbent * 1e3:.4g} ms under {trial.incumbent}; keeps {kept}")
    if contender is None or pick not in ("none", contender):
        return pick
    settled = policy.settled.get((b, d))
    if settled is not None and settled[0] in ("none", contender) and policy.rounds - settled[1] < REPROBE_ROUNDS:
        return settled[0]
    if policy.window is None or current not in ("none", contender):
        return pick
    other = contender if current == "none" else "none"
    policy.trials[b, d] = Trial(current, other, step)
    notes.append(f"a close call: {other} and {current} run on alternate steps for a window")
    return other
