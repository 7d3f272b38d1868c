"""`auto`'s decision for one boundary and direction: the candidate with the lowest expected time per message.

expected time = encode + decode (measured on this device, on the real tensor) + wire bytes / bandwidth + latency
(measured on the real link). `none` costs no codec time and sends the dense bytes, so where no compression pays it
wins. The candidates are the presets up to a budget (`auto:max=safe`, `auto:max=aggressive`), each only where the
presets' recorded verdicts put it at parity by the loss rule on the model family in use (on every testbed measured,
when the family is not given): a setting measured worse is never a candidate.

This module holds the pure parts (the spec, the candidates, the cost model) and the measurements that need only an
exchange function and a clock: `measure_codec` and `measure_link`. Engines call them through the boundary policy.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Literal

from torch import Tensor

from .config import parse_spec
from .ops.base import Compressor, Context
from .presets import MODELS, PRESETS, verdicts
from .timing import median_time

Budget = Literal["safe", "aggressive"]
LADDER: tuple[str, ...] = ("none", "safe", "aggressive")
"""The candidates from the least to the most aggressive; a budget admits its rung and those below it."""


@dataclass(frozen=True)
class AutoConfig:
    """`auto[:max=safe|aggressive][:model=...]`."""

    max: Budget = "safe"
    """The most aggressive preset `auto` may pick."""
    model: str | None = None
    """The model family whose verdicts admit a candidate ('small GPT' or 'SmolLM2-135M'); None: a candidate must be at
    parity by the loss rule on every testbed it was measured on."""

    def __post_init__(self) -> None:
        if self.max not in LADDER[1:]:
            raise ValueError(f"auto:max={self.max!r}; accepted: {', '.join(LADDER[1:])}")
        if self.model is not None and self.model not in MODELS:
            raise ValueError(f"auto:model={self.model!r}; accepted: {', '.join(MODELS)}")

    @classmethod
    def parse(cls, spec: str) -> "AutoConfig":
        """`auto`, `auto:max=aggressive`, `auto:model=SmolLM2-135M:max=safe`; an unknown key is an error."""
        head, *items = spec.split(":")
        if head != "auto":
            raise ValueError(f"{spec!r} is not an auto spec; accepted: auto[:max=safe|aggressive][:model=<family>]")
        kwargs: dict[str, str] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in ("max", "model") or key in kwargs:
                raise ValueError(f"auto: {item!r} in {spec!r}; accepted keys: max=safe|aggressive, model=<family> "
                                 f"({', '.join(MODELS)}), each once")
            kwargs[key] = value
        return cls(**kwargs)  # type: ignore[arg-type]

    def candidates(self) -> list[str]:
        """The admitted presets, least aggressive first, `none` always among them."""
        out = ["none"]
        for name in LADDER[1:LADDER.index(self.max) + 1]:
            found = verdicts(PRESETS[name], self.model)
            if found and all(v.loss_rule == "parity" for v in found):
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
    spec = "" if decision.candidate == "none" else f" ({PRESETS[decision.candidate]})"
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
                median_time(lambda: op.decompress(payload, ctx), x.device, reps), payload.nbytes)


def measure_link(round_trip: Callable[[int], float], nbytes: int, reps: int = 5) -> Link:
    """A link from timed round trips: `round_trip(n)` sends n bytes one way and one byte back and returns the
    seconds it took. The latency is half a 1-byte round trip; the bandwidth comes from the extra time of n bytes."""
    small = statistics.median(round_trip(1) for _ in range(reps))
    big = statistics.median(round_trip(nbytes) for _ in range(reps))
    return Link(bandwidth=nbytes / max(big - small, 1e-9), latency=small / 2)


def candidate_ops(cfg: AutoConfig, direction: str) -> dict[str, Compressor]:
    """The operator each admitted candidate runs in `direction` ('act' or 'grad'); `none` has none."""
    return {name: parse_spec(PRESETS[name]).spec_for(0, direction, True).build() for name in cfg.candidates()[1:]}
