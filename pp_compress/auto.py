"""`auto`'s decision for one boundary and direction: the candidate with the lowest expected time per message.

expected time = encode + decode (measured on this device, on the real tensor) + wire bytes / bandwidth + latency
(measured on the real link). `none` costs no codec time and sends the dense bytes, so where no compression pays it
wins. The candidates are the presets up to a budget (`auto:max=safe`, `auto:max=aggressive`), each only where the
presets' recorded verdicts put it at parity by the loss rule on the model family in use (on every testbed measured,
when the family is not given): a setting measured worse is never a candidate. Settings that are no preset (`int8`:
8 bits like `safe`, with a cheaper codec and no rotation) are candidates only on a family named with `model=`, where
both rules put them at parity: a preset is validated for models of any family, they only for the ones measured.

This module holds the pure parts (the spec, the candidates, the cost model) and the measurements that need only a
tensor or a timed exchange: `measure_codec` and `fastest_trips`. The rounds between stages that use them, the link
probes and the trials of close calls are in decide.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from .advice import verdicts
from .config import RUNGS, AutoConfig, parse_spec
from .ops.base import Compressor, Context
from .presets import PRESETS
from .timing import median_time

CANDIDATES: dict[str, tuple[str | None, str | None]] = {
    "none": (None, None), "int8": ("int8", "safe"), "safe": (PRESETS["safe"], "safe"),
    "aggressive": (PRESETS["aggressive"], "aggressive")}
"""name -> (its spec, the budget whose rung it is on), from the least to the most aggressive rung. A decision travels
as its index here, so both sides of a boundary must run the same version."""
LADDER: tuple[str, ...] = tuple(CANDIDATES)


def candidates(cfg: AutoConfig) -> list[str]:
    """The candidates `cfg` admits, least aggressive first, `none` always among them."""
    out = ["none"]
    for name, (spec, rung) in list(CANDIDATES.items())[1:]:
        if RUNGS.index(rung) > RUNGS.index(cfg.max):
            continue
        found = verdicts(spec, cfg.model)
        preset = PRESETS.get(name) == spec
        if found and all(v.loss_rule == "parity" and (preset or v.lm_eval == "parity") for v in found) \
                and (preset or cfg.model is not None):
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
            f"expected against {decision.dense_s * 1e3:.3g} ms dense ("
            + (f"{decision.saving:.0%} saved)" if decision.saving >= 0 else f"{-decision.saving:.0%} more)"))


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
    return {name: candidate_op(name, 0, direction) for name in candidates(cfg)[1:]}
