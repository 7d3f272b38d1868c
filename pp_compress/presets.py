"""Named settings, and the validated verdicts that each carries.

`--pp-compress safe`, `"pp_compress": "safe"`, or `safe,warmup=100` with more keys after it. A preset is only a name
for a spec: `str(parse_spec("safe"))` is the spec it stands for, so logs and checkpoints record what actually ran.

`VERDICTS` holds what the quality studies measured for the presets and for the other settings users reach for
(`docs/choosing.md` explains the two rules; the logs are in results/eval/). It is data written here, not read from
results at run time; tests/unit/test_presets.py holds every row to the committed frontier (results/eval/frontier.json).
This module is data below the spec parser (config.py expands the names); advice.py reads the verdicts of a parsed
setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PRESETS: dict[str, str] = {
    # rotated int8 both ways: the fewest bits at parity on both rules on SmolLM2-135M (LLaMA family: outlier channels
    # and an attention sink, which per-row scales cannot fit without the rotation), with its loss within a tenth of
    # the tolerance
    "safe": "int8:rot",
    # vector quantization of rotated tiles: the fewest bits within the loss rule on SmolLM2 on both seeds, at the edge
    # of its tolerance; a setting for slow links (its codec is the slowest of the presets)
    "aggressive": "act=vq:4,grad=vq:3",
}

Rule = Literal["parity", "worse"]


@dataclass(frozen=True)
class Verdict:
    """One setting measured on one model: final validation loss against the uncompressed baseline (the loss rule)
    and lm-eval non-inferiority."""

    spec: str
    """The setting as typed (a spec string; presets are expanded before comparing)."""
    model: str
    """The testbed: 'small GPT' (4.2M parameters, 1,000 steps of pretraining) or 'SmolLM2-135M' (continued
    pretraining)."""
    bits: float
    """Bits per element on the wire, averaged over both directions (codes and scales against the dense tensor)."""
    delta: float
    """Final validation loss minus the uncompressed baseline's, in nats, through the setting's own compression."""
    tolerance: float
    """The loss rule's tolerance on that testbed (twice the baseline seeds' spread)."""
    loss_rule: Rule
    """'parity' when delta is within the tolerance."""
    lm_eval: Rule | None
    """lm-eval non-inferiority on every metric; None where it was not run (the loss rule already failed)."""
    evidence: str
    """Where the logs and reports are (relative to the repository)."""
    seed: int = 0
    """The training seed."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}; accepted: {', '.join(MODELS)}")
        if (abs(self.delta) <= self.tolerance) != (self.loss_rule == "parity"):
            raise ValueError(f"{self.spec} on {self.model}: delta {self.delta:+.3f} against tolerance "
                             f"{self.tolerance:.3f} is not '{self.loss_rule}'")

    def line(self) -> str:
        lm = {"parity": "lm-eval at parity", "worse": "lm-eval worse", None: "lm-eval not run"}[self.lm_eval]
        return (f"{self.model}{', seed 1' if self.seed else ''}: {self.bits:.2f} bits/element, final loss "
                f"{self.delta:+.3f} (tolerance {self.tolerance:.3f}), {lm}")


MODELS = ("small GPT", "SmolLM2-135M")
_SMALL, _SMOL = "results/eval/long", "results/eval/smollm2"
VERDICTS: tuple[Verdict, ...] = (
    Verdict("int8:rot", "small GPT", 8.08, -0.012, 0.063, "parity", "worse", _SMALL),
    Verdict("int8:rot", "SmolLM2-135M", 8.03, +0.001, 0.020, "parity", "parity", _SMOL),
    Verdict("act=vq:4,grad=vq:3", "small GPT", 4.00, +0.059, 0.063, "parity", "worse", _SMALL),
    Verdict("act=vq:4,grad=vq:3", "SmolLM2-135M", 3.83, +0.018, 0.020, "parity", "parity", _SMOL),
    Verdict("act=vq:4,grad=vq:3", "SmolLM2-135M", 3.83, +0.018, 0.020, "parity", "worse", _SMOL, seed=1),
    Verdict("int8", "small GPT", 8.08, -0.019, 0.063, "parity", "parity", _SMALL),
    Verdict("int8", "SmolLM2-135M", 8.03, +0.010, 0.020, "parity", "worse", _SMOL),
    Verdict("act=nf6,grad=int3:stoch", "small GPT", 4.58, -0.006, 0.063, "parity", "parity", _SMALL),
    Verdict("act=nf6,grad=int3:stoch", "SmolLM2-135M", 4.53, +0.025, 0.020, "worse", None, _SMOL),
    Verdict("act=nf5,grad=nf2:stoch", "small GPT", 3.58, +0.056, 0.063, "parity", "worse", _SMALL),
    Verdict("act=nf5,grad=nf2:stoch", "SmolLM2-135M", 3.53, +0.182, 0.020, "worse", None, _SMOL),
    Verdict("act=tile:3.5,grad=tile:3:stoch", "SmolLM2-135M", 3.59, +0.048, 0.020, "worse", "worse", _SMOL),
    Verdict("act=vq:2.5,grad=vq:2.5,eval=int8:rot", "SmolLM2-135M", 2.83, +0.034, 0.020, "worse", None, _SMOL),
    Verdict("topk:0.1", "small GPT", 4.20, +1.679, 0.063, "worse", None, _SMALL),
    Verdict("topk:0.1", "SmolLM2-135M", 4.20, +1.768, 0.020, "worse", None, _SMOL),
    Verdict("topk:0.2", "small GPT", 7.40, +1.979, 0.063, "worse", None, _SMALL),
    Verdict("topk:0.2", "SmolLM2-135M", 7.40, +0.603, 0.020, "worse", None, _SMOL),
    Verdict("topk:0.3", "small GPT", 10.60, +1.782, 0.063, "worse", None, _SMALL),
    Verdict("topk:0.3", "SmolLM2-135M", 10.60, +0.266, 0.020, "worse", None, _SMOL),
)


def expand(items: list[str]) -> list[str]:
    """Replace a leading preset name by its spec's items; other items pass through."""
    if items and items[0] in PRESETS:
        return [t.strip() for t in PRESETS[items[0]].split(",")] + items[1:]
    return items
