"""`auto`'s decision for one boundary and direction: the candidate with the lowest expected time per message.

expected time = encode + decode (measured on this device, on the real tensor) + wire bytes / bandwidth + latency
(measured on the real link). `none` costs no codec time and sends the dense bytes, so where no compression pays it
wins. The candidates are the presets up to a budget (`auto:max=safe`, `auto:max=aggressive`), each only where the
presets' recorded verdicts put it at parity by the loss rule on the model family in use (on every testbed measured,
when the family is not given): a setting measured worse is never a candidate. Settings that are no preset (`int8`:
8 bits like `safe`, with a cheaper codec and no rotation) are candidates only on a family named with `model=`, where
both rules put them at parity: a preset is validated for models of any family, they only for the ones measured.

This module holds the pure parts (the spec, the candidates, the cost model) and the measurements that need only an
exchange function and a clock: `measure_codec` and `fastest_trips`. Engines call them through the boundary policy.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch
from torch import Tensor

from .config import parse_spec
from .ops.base import Compressor, Context
from .presets import MODELS, PRESETS, verdicts
from .timing import elapsed, median_time

if TYPE_CHECKING:
    from .policy import BoundaryPolicy

Budget = Literal["safe", "aggressive"]
CANDIDATES: dict[str, tuple[str | None, str | None]] = {
    "none": (None, None), "int8": ("int8", "safe"), "safe": (PRESETS["safe"], "safe"),
    "aggressive": (PRESETS["aggressive"], "aggressive")}
"""name -> (its spec, the budget whose rung it is on), from the least to the most aggressive rung. A decision travels
as its index here, so both sides of a boundary must run the same version."""
LADDER: tuple[str, ...] = tuple(CANDIDATES)
RUNGS: tuple[str, ...] = ("none", "safe", "aggressive")
"""The budgets' order: a budget admits the candidates on its rung and below it."""


def model_name(text: str) -> str | None:
    """The family among MODELS that `text` names, compared without case and with '-' or '_' for spaces (so that a
    spec needs no quoting: `model=small-gpt`); None if it names none."""
    def key(t: str) -> str:
        return t.lower().replace("-", " ").replace("_", " ")

    return next((m for m in MODELS if key(m) == key(text)), None)


@dataclass(frozen=True)
class AutoConfig:
    """`auto[:max=safe|aggressive][:model=...]`."""

    max: Budget = "safe"
    """The most aggressive preset `auto` may pick."""
    model: str | None = None
    """The model family whose verdicts admit a candidate ('small GPT' or 'SmolLM2-135M'; `parse` also takes them
    without case and with '-' for spaces); None: a preset must be at parity by the loss rule on every testbed it was
    measured on, and no other candidate is admitted."""
    every: int = 20
    """Steps between decisions: the first is made at step 1 (on step 0's tensors), then at 1 + every, 1 + 2 every..."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"auto:every={self.every!r}; accepted: an integer >= 1")
        if self.max not in RUNGS[1:]:
            raise ValueError(f"auto:max={self.max!r}; accepted: {', '.join(RUNGS[1:])}")
        if self.model is not None and self.model not in MODELS:
            raise ValueError(f"auto:model={self.model!r}; accepted: {', '.join(MODELS)}")

    @classmethod
    def parse(cls, spec: str) -> "AutoConfig":
        """`auto`, `auto:max=aggressive`, `auto:model=SmolLM2-135M:max=safe:every=50`; an unknown key is an error."""
        head, *items = spec.split(":")
        if head != "auto":
            raise ValueError(f"{spec!r} is not an auto spec; accepted: auto[:max=safe|aggressive][:model=<family>]"
                             "[:every=N]")
        kwargs: dict[str, object] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in ("max", "model", "every") or key in kwargs:
                raise ValueError(f"auto: {item!r} in {spec!r}; accepted keys: max=safe|aggressive, model=<family> "
                                 f"({', '.join(MODELS)}), every=<steps>, each once")
            kwargs[key] = int(value) if key == "every" and value.isdigit() else value
        if "model" in kwargs:
            kwargs["model"] = model_name(str(kwargs["model"])) or kwargs["model"]
        return cls(**kwargs)  # type: ignore[arg-type]

    def candidates(self) -> list[str]:
        """The admitted candidates, least aggressive first, `none` always among them."""
        out = ["none"]
        for name, (spec, rung) in list(CANDIDATES.items())[1:]:
            if RUNGS.index(rung) > RUNGS.index(self.max):
                continue
            found = verdicts(spec, self.model)
            preset = PRESETS.get(name) == spec
            if found and all(v.loss_rule == "parity" and (preset or v.lm_eval == "parity") for v in found) \
                    and (preset or self.model is not None):
                out.append(name)
        return out


@dataclass(frozen=True)
class Link:
    """A measured link: bytes per second one way, and the latency of a message."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"Link(bandwidth={self.bandwidth}, latency={self.latency}): a positive bandwidth and a "
                             "latency >= 0")


@dataclass(frozen=True)
class Cost:
    """One candidate's measured codec time and message size on one boundary and direction."""

    encode_s: float
    decode_s: float
    wire_bytes: int
    rel_error: float = 0.0
    """||x - x_hat|| / ||x|| on the tensor it was measured on (the guard watches it)."""

    def expected(self, link: Link) -> float:
        """Seconds per message: the codec's time plus the transfer."""
        return self.encode_s + self.decode_s + self.wire_bytes / link.bandwidth + link.latency


@dataclass(frozen=True)
class Decision:
    """What `choose` picked, with what it expects against sending the tensor dense."""

    candidate: str
    expected_s: float
    dense_s: float

    @property
    def saving(self) -> float:
        """The share of the dense transfer's time saved (0 when `none` wins)."""
        return 1 - self.expected_s / self.dense_s if self.dense_s else 0.0


def describe(boundary: int, direction: str, link: Link, decision: Decision) -> str:
    """The log line of one boundary's decision: the measured link, the pick, and what it is expected to save."""
    spec = "" if decision.candidate == "none" else f" ({CANDIDATES[decision.candidate][0]})"
    return (f"pp_compress auto: boundary {boundary} {direction}: link {link.bandwidth / 1e9:.3g} GB/s, "
            f"{link.latency * 1e3:.3g} ms; {decision.candidate}{spec}: {decision.expected_s * 1e3:.3g} ms per message "
            f"expected against {decision.dense_s * 1e3:.3g} ms dense ({decision.saving:.0%} saved)")


def choose(link: Link, raw_bytes: int, costs: dict[str, Cost]) -> Decision:
    """The candidate with the lowest expected time; `none` (no codec, the dense bytes) is always one, and wins ties."""
    dense = Cost(0.0, 0.0, raw_bytes).expected(link)
    best, best_s = "none", dense
    for name, cost in costs.items():
        if name != "none" and cost.expected(link) < best_s:
            best, best_s = name, cost.expected(link)
    return Decision(best, best_s, dense)


def measure_codec(op: Compressor, x: Tensor, ctx: Context, reps: int = 5) -> Cost:
    """The operator's encode and decode time on x (a real boundary tensor) and its message size."""
    payload = op.compress(x, ctx)
    return Cost(median_time(lambda: op.compress(x, ctx), x.device, reps),
                median_time(lambda: op.decompress(payload, ctx), x.device, reps), payload.nbytes,
                relative_error(op, x, ctx))


GUARD_ELEMENTS = 1 << 16
"""The relative error is measured on about this many elements of a tensor: whole rows (the codecs work along the last
dimension), evenly spaced over it. The guard measures it on every round's tensor, on the sender, while the boundaries
after it wait in the round's chain; a message-sized round trip of the slowest candidate there cost a large share of
the round."""


def relative_error(op: Compressor, x: Tensor, ctx: Context) -> float:
    """||s - D(C(s))|| / ||s|| for s, about GUARD_ELEMENTS of x's rows (one round trip; reads the result on the
    host)."""
    rows = x.detach().reshape(-1, x.shape[-1])  # (N, d)
    s = rows[::max(1, rows.numel() // GUARD_ELEMENTS)].contiguous()  # (about GUARD_ELEMENTS / d, d)
    ref = s.double()
    return float((ref - op.decompress(op.compress(s, ctx), ctx).double()).norm() / ref.norm().clamp_min(1e-300))


def fastest_trips(round_trip: Callable[[int], float], nbytes: int, reps: int = 5) -> tuple[float, float]:
    """The fastest of `reps` timed round trips of 1 byte and of `nbytes`: `round_trip(n)` sends n bytes one way and
    one byte back and returns the seconds it took. The fastest, because a process descheduled or a peer still busy
    only ever adds time, and on a fast link one such trip among few would make it look slow."""
    return min(round_trip(1) for _ in range(reps)), min(round_trip(nbytes) for _ in range(reps))


def link_of(small: float, big: float, nbytes: int) -> Link:
    """The link whose fastest round trips took `small` seconds for 1 byte and `big` for `nbytes`: the latency is half
    the 1-byte trip; the bandwidth comes from the extra time of nbytes."""
    return Link(bandwidth=nbytes / max(big - small, 1e-9), latency=small / 2)


def candidate_op(name: str, boundary: int, direction: str, nonfinite: str = "raise") -> Compressor:
    """A fresh operator of candidate `name` for one boundary and direction ('act' or 'grad')."""
    spec = CANDIDATES[name][0]
    if spec is None:
        raise ValueError(f"candidate {name!r} has no operator; accepted: {', '.join(LADDER[1:])}")
    return parse_spec(spec).spec_for(boundary, direction).build(nonfinite)


def candidate_ops(cfg: AutoConfig, direction: str) -> dict[str, Compressor]:
    """The operator each admitted candidate runs in `direction` ('act' or 'grad'); `none` has none."""
    return {name: candidate_op(name, 0, direction) for name in cfg.candidates()[1:]}


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


def decide_round(policy: "BoundaryPolicy", stage: int, stages: int, device: torch.device,
                 exchange: Callable[[list[tuple[str, int, Tensor]]], None], step: int, reps: int = 2) -> list[str]:
    """One decision for every boundary and direction that touches `stage` (every stage calls it before the same
    step; boundaries in increasing order, so that a chain of blocking exchanges cannot deadlock). The sender of each
    direction times the candidates on the message it kept (`policy.samples`), picks with `choose` on its link, and
    tells the receiver; both switch at this step. The link is measured by round trips over the real link (`_probe`,
    through the adapter's p2p) only where it is not known yet, every REPROBE_ROUNDS rounds, or when this stage's step
    time drifted by more than DRIFT since the last round (a link that changed; the codec times are kept then);
    otherwise the sender's one message carries its pick. Returns the log lines of the changes, on the sender."""
    assert policy.auto is not None
    candidates = policy.auto.candidates()
    drifted = _drifted(policy, step)
    lines = []
    for b in range(stages - 1):
        if stage not in (b, b + 1):
            continue
        for d in ("act", "grad"):
            sender = b if d == "act" else b + 1
            peer = b + 1 if stage == b else b
            # [what follows, pick]: -1 nothing (no sample), 0 the pick is in this message, 1 a probe, then the pick
            head = torch.zeros(2, dtype=torch.int64, device=device)
            if stage != sender:
                exchange([("recv", peer, head)])
                if int(head[0]) == 1:
                    _probe(False, peer, 0, device, exchange, reps)
                    exchange([("recv", peer, head[1:])])
                if int(head[0]) >= 0:
                    policy.decide(b, d, LADDER[int(head[1])])
                continue
            x = policy.samples.pop((b, d), None)
            known = policy.links.get((b, d))
            due = known is None or policy.rounds - policy.probed.get((b, d), 0) >= REPROBE_ROUNDS
            probe = x is not None and (due or drifted)
            head[0] = -1 if x is None else 1 if probe else 0
            if x is not None and not probe:
                name, line = _pick(policy, b, d, x, known, candidates, step, reps, measure=False)
                head[1] = LADDER.index(name)
            exchange([("send", peer, head)])
            if x is None:
                continue
            if probe:
                known = policy.links[b, d] = _probe(True, peer, x.numel() * x.element_size(), device, exchange, reps,
                                                    known)
                if due:
                    policy.probed[b, d] = policy.rounds
                name, line = _pick(policy, b, d, x, known, candidates, step, reps, measure=due)
                head[1] = LADDER.index(name)
                exchange([("send", peer, head[1:])])
            first = (b, d) not in policy.decisions
            if policy.decide(b, d, name) or first:
                lines.append(f"step {step}: {line}" + (" (link measured now)" if probe else ""))
    policy.rounds += 1
    policy.last_round = (time.perf_counter(), step)
    return lines


def _drifted(policy: "BoundaryPolicy", step: int) -> bool:
    """Whether this stage's time per step since the last round differs by more than DRIFT from the window before
    (the rounds themselves excluded, and the first window, after the first round, which holds the engine's warm-up);
    updates the windows."""
    if policy.last_round is None:
        return False
    t, s = policy.last_round
    now = (time.perf_counter() - t) / max(step - s, 1)
    if policy.rounds < 2:  # the first window holds the engine's warm-up steps: no baseline for a drift
        return False
    before, policy.window = policy.window, now
    return before is not None and abs(now / before - 1) > DRIFT


def _probe(sending: bool, peer: int, nbytes: int, device: torch.device,
           exchange: Callable[[list[tuple[str, int, Tensor]]], None], reps: int, known: Link | None = None
           ) -> Link | None:
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


def _pick(policy: "BoundaryPolicy", b: int, d: str, x: Tensor, link: Link, candidates: list[str], step: int,
          reps: int, measure: bool) -> tuple[str, str]:
    """The sender's pick for boundary b, direction d, and its log line; applies the guard. The candidates' codec
    times are measured with the link (`measure`) or for a tensor of a new shape, and kept in between; the current
    candidate's error, which the guard watches, is measured on every round's tensor."""
    from .policy import Where  # imports this module

    ctx = policy.context(Where(b, d, step, 0))
    op = functools.partial(candidate_op, boundary=b, direction=d, nonfinite=policy.cfg.nonfinite)
    like = (tuple(x.shape), x.dtype)
    known = policy.costs.get((b, d))
    if measure or known is None or known[0] != like:
        known = policy.costs[b, d] = (like, {name: measure_codec(op(name), x, ctx, reps) for name in candidates[1:]})
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
    decision = choose(link, x.numel() * x.element_size(), allowed)
    keep = Cost(0.0, 0.0, x.numel() * x.element_size()) if current == "none" else allowed.get(current)
    if keep is not None and keep.expected(link) <= decision.expected_s * (1 + HYSTERESIS):
        decision = Decision(current, keep.expected(link), decision.dense_s)  # not worth a switch
    if decision.candidate != "none":
        policy.validated.setdefault((b, d, decision.candidate), costs[decision.candidate].rel_error)
    return decision.candidate, describe(b, d, link, decision) + "".join(f"; {n}" for n in notes)
