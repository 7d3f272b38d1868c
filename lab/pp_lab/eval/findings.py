"""The paper's six findings (../shared/RESEARCH.md), each judged from the study's runs by an explicit rule.

eval/report.py writes the verdicts into results/eval/RESULTS.md, one column per regime: pretraining the small GPT from scratch
(120 and 1,000 steps), finetuning SmolLM2-135M (the paper's regime: it finetuned a pretrained GPT-2-size model) and
continuing SmolLM2-135M's pretraining (eval/study.py --protocol smollm2).
"""
from __future__ import annotations

import math

from typing import Literal

from pp_lab.eval import frontier
from pp_lab.eval.study import FINETUNE, SMOLLM2

# The TopK levels of the study's settings (eval/study.py: topk<r>, act-topk<r>, grad-topk<r>)
LEVELS = ("0.5", "0.3", "0.2", "0.1", "0.05")


class Findings:
    """The paper's six findings (../shared/RESEARCH.md), each judged from the runs by an explicit rule."""

    def __init__(self, runs: dict[str, dict],
                 regime: Literal["pretraining", "finetuning", "continued pretraining"] = "pretraining",
                 aqsgd_runs: tuple[str, str, str] = ("base", "topk0.1", "topk0.1+aqsgd")) -> None:
        """`runs` by the pretraining study's names (`finetuning_runs` renames the finetuning ones); `aqsgd_runs`: the
        uncompressed run, the TopK run and its AQ-SGD twin that finding 5 compares (multi-epoch runs, with their own
        baseline, in the finetuning regime)."""
        self.runs, self.regime, self.aqsgd_runs = runs, regime, aqsgd_runs
        base, other = runs.get("base"), runs.get("base-seed1")
        self.base = base["val_loss"] if base else math.nan
        # Seed-to-seed spread of the baseline; "no loss" = frontier.tolerance (twice that, at least 0.02 nats)
        self.seed_gap = abs(other["val_loss"] - self.base) if base and other else math.nan
        self.tol = frontier.tolerance(self.seed_gap) if not math.isnan(self.seed_gap) else 0.05
        # What serving uncompressed reads off the baseline itself: 0 where it evaluates the validation batches again,
        # another figure where it reads another sample of the held-out text (the SmolLM2 study's served losses)
        served = base.get("val_loss_plain_inference") if base else None
        self.plain_offset = served - self.base if served is not None else 0.0

    def d(self, name: str) -> float:
        return self.runs[name]["val_loss"] - self.base if name in self.runs else math.nan

    def fmt(self, name: str) -> str:
        return f"{name} {self.d(name):+.3f}" if name in self.runs else f"{name} (not run)"

    TITLES = ("1. Gradients are more sensitive than activations",
              "2. TopK 10% is about the most aggressive level without severe harm (~10x less traffic)",
              "3. A model trained with TopK works well only with TopK at inference too",
              "4. EF / EF21 do not improve training quality, but allow inference without compression",
              "5. AQ-SGD + TopK does not help",
              "6. Loss starts to rise from Top-20% (GPT-2 finetuning in the paper)")

    def rules(self) -> tuple:
        return self.f1, self.f2, self.f3, self.f4, self.f5, self.f6

    def lines(self) -> list[str]:
        out = [f"Rule for \"no quality loss\": final validation loss within {self.tol:.3f} nats of the baseline "
               f"(twice the baseline's seed-to-seed gap of {self.seed_gap:.3f}, at least 0.02). Deltas are vs base "
               f"({self.base:.3f}); positive = worse.", ""]
        for title, fn in zip(self.TITLES, self.rules()):
            verdict, text = fn()
            out += [f"**{title}: {verdict}.** {text}", ""]
        return out

    def plain(self, name: str) -> float:
        """Delta of the run's checkpoint evaluated with no compression against the baseline evaluated the same way
        (NaN where not measured)."""
        r = self.runs.get(name, {})
        if "val_loss_plain_inference" not in r:
            return math.nan
        return r["val_loss_plain_inference"] - self.base - self.plain_offset

    def served_gap(self, r: dict) -> float:
        """How much worse the run is served uncompressed than through its own compression, net of the baseline's own
        difference between the two evaluations (`plain_offset`)."""
        return r["val_loss_plain_inference"] - r["val_loss"] - self.plain_offset

    def f1(self) -> tuple[str, str]:
        # An act-only run is also validated with TopK on its activations; grad-only runs are validated uncompressed.
        # Where the act-only checkpoint was re-evaluated uncompressed, that (the training effect alone) is compared.
        pairs = [(r, self.d(f"act-topk{r}"), self.plain(f"act-topk{r}"), self.d(f"grad-topk{r}")) for r in LEVELS
                 if f"act-topk{r}" in self.runs and f"grad-topk{r}" in self.runs]
        worse = [r for r, a, ap, g in pairs if g > (a if math.isnan(ap) else ap) + self.tol / 2]
        text = "TopK on one direction only, delta act-only (validated with TopK at inference; in brackets without " \
               "compression) / grad-only: " + ", ".join(
                   f"{r}: {a:+.3f}" + ("" if math.isnan(ap) else f" [{ap:+.3f}]") + f" / {g:+.3f}" for r, a, ap, g in pairs)
        q = f"; quantization: int8 both ways {self.fmt('int8')}, int4 act + int8 grad {self.fmt('act-int4_grad-int8')}, " \
            f"int2 act only {self.fmt('act-int2')}"
        if not pairs:
            return "not measured", text
        verdict = "holds" if len(worse) > len(pairs) / 2 else "does not hold here"
        return verdict, f"{text} (gradients clearly worse at {len(worse)} of {len(pairs)} levels){q}."

    def f2(self) -> tuple[str, str]:
        both = [(r, self.d(f"topk{r}")) for r in LEVELS if f"topk{r}" in self.runs]
        ok = [r for r, dl in both if dl <= self.tol]
        ratio = self.runs["topk0.1"]["ratio"] if "topk0.1" in self.runs else math.nan
        text = "TopK both directions: " + ", ".join(f"{r}: {dl:+.3f}" for r, dl in both) + \
               f"; topk:0.1 moves {ratio:.1f}x fewer bytes (fp32 values + positions)."
        if "topk0.1" not in self.runs:
            return "not measured", text
        if self.d("topk0.1") <= self.tol:
            return "holds", text
        least = min(ok, key=float) if ok else None
        return "does not hold here", text + (f" The most aggressive level within the tolerance is {least}." if least
                                             else " No TopK level both ways stays within the tolerance at this scale.")

    def f3(self) -> tuple[str, str]:
        r = self.runs.get("topk0.1")
        if not r or "val_loss_plain_inference" not in r:
            return "not measured", ""
        gap = self.served_gap(r)
        net = f", net of the baseline's own {self.plain_offset:+.3f} between the two evaluations" \
            if abs(self.plain_offset) > 1e-6 else ""
        text = (f"topk:0.1 (no error feedback): validation loss {r['val_loss']:.3f} with TopK at inference, "
                f"{r['val_loss_plain_inference']:.3f} without ({gap:+.3f}{net}).")
        return ("holds" if gap > self.tol else "does not hold here"), text

    def f4(self) -> tuple[str, str]:
        rows = []
        for n in ("topk0.1", "topk0.1+ef", "topk0.1+ef21"):
            r = self.runs.get(n)
            if r and "val_loss_plain_inference" in r:
                rows.append((n, self.d(n), self.served_gap(r)))
        if len(rows) < 2:
            return "not measured", ""
        text = "training quality (delta vs base, validated with compression) / inference without compression (delta " \
               "vs with; in brackets vs base): " + ", ".join(f"{n}: {dl:+.3f} / {gap:+.3f} [{dl + gap:+.3f}]" for n, dl, gap in rows) + \
               ". Error feedback keeps state from one batch to the next, so validating through it on other data " \
               "measures that state as well as the model; the bracketed deltas are the models alone."
        plain = rows[0][1]
        no_gain = all(dl >= plain - self.tol for n, dl, _ in rows[1:])
        small_drop = all(gap <= self.tol for n, _, gap in rows[1:])
        part1 = "no training gain" if no_gain else "a training gain"
        part2 = "small drop without compression" if small_drop else "a large drop without compression"
        verdict = "holds" if no_gain and small_drop else f"partly ({part1}, {part2})"
        return verdict, f"{self.regime.capitalize()}, {text}"

    def f5(self) -> tuple[str, str]:
        base, plain_topk, aqsgd = self.aqsgd_runs
        if aqsgd not in self.runs or plain_topk not in self.runs:
            return "not measured", ""
        r = self.runs[aqsgd]
        ref = self.runs[base]["val_loss"] if base in self.runs else self.base  # the pair's own protocol's baseline
        fmt = lambda n: f"{n} {self.runs[n]['val_loss'] - ref:+.3f}"  # noqa: E731
        gain = self.runs[plain_topk]["val_loss"] - r["val_loss"]
        text = f"{fmt(aqsgd)} vs {fmt(plain_topk)} (vs {base}; AQ-SGD gain {gain:+.3f}), wire ratio {r['ratio']:.2f}x."
        if r["ratio"] < 1.05:
            plain = r.get("val_loss_plain_inference", math.nan)
            return "not testable in one epoch", text + (
                f" The run draws {r.get('steps', 120)} steps x 16 training sequences and none of them twice, and "
                "AQ-SGD sends a sample's first visit uncompressed, so nothing was compressed in training: evaluated "
                f"without compression its loss is {plain:.3f} vs base {self.base:.3f}. Its delta above is only TopK "
                "applied at inference to a model trained without it. AQ-SGD needs repeated epochs (finetuning on "
                "small data) to compress at all.")
        # AQ-SGD sends first visits raw: the share of the traffic that TopK never touched, from the two wire ratios
        # (1 / ratio = raw + (1 - raw) / topk_ratio)
        raw = (1 / r["ratio"] - 1 / self.runs[plain_topk]["ratio"]) / (1 - 1 / self.runs[plain_topk]["ratio"])
        text += (f" AQ-SGD sends a sample's first visit raw, so {raw:.0%} of its boundary traffic was not compressed at "
                 "all: a gain here mixes the deltas' effect with that of sending less through TopK.")
        return ("holds" if gain <= self.tol else "does not hold here: AQ-SGD helps"), text

    def f6(self) -> tuple[str, str]:
        both = [(r, self.d(f"topk{r}")) for r in LEVELS if f"topk{r}" in self.runs]
        if not both:
            return "not measured", ""
        verdict, first = self.rise(both, self.tol)
        text = (f"TopK both directions, {self.regime}: " + ", ".join(f"{r}: {dl:+.3f}" for r, dl in both) +
                f". First level beyond the tolerance: {first or 'none'}." +
                {"pretraining": " This is pretraining from scratch, not finetuning, so the comparison is loose.",
                 "finetuning": " The paper's regime: finetuning a pretrained model.",
                 "continued pretraining": " Continued pretraining of a pretrained model on new text: close to the "
                                          "paper's finetuning regime."}[self.regime])
        return verdict, text

    @staticmethod
    def rise(levels: list[tuple[str, float]], tol: float) -> tuple[str, str | None]:
        """(verdict, first level worse than `tol`) for "loss starts to rise from Top-20%": 0.2 is the first level
        beyond the tolerance, and 0.3, the level before it, was measured within it."""
        first = next((r for r, dl in levels if dl > tol), None)
        if first == "0.2" and "0.3" not in dict(levels):
            return "not measured (Top-30% not run)", first
        return ("holds" if first == "0.2" else "does not hold as stated"), first


COLUMNS = ("small GPT pretraining, 120 steps", "small GPT pretraining, 1,000 steps",
           "SmolLM2-135M finetuning (the paper's regime)", "SmolLM2-135M continued pretraining")


def finetuning_runs(ft: dict[str, dict], ftep: dict[str, dict]) -> dict[str, dict]:
    """The SmolLM2 finetuning runs under the pretraining study's names, so the same rules judge them: the 40-step
    runs (`ft-<name>` is `<name>`) and, for finding 5, the multi-epoch TopK pair and its baseline as `ep-topk0.1`,
    `ep-topk0.1+aqsgd`, `ep-base` (AQ-SGD compresses only what a sample sends again)."""
    out = {n.removeprefix("ft-"): r for n, r in ft.items() if n in FINETUNE}
    out.update({n.removeprefix("ft-"): r for n, r in ftep.items() if n in ("ft-ep-base", "ft-ep-topk0.1", "ft-ep-topk0.1+aqsgd")})
    return out


def finetuning(ft: dict[str, dict], ftep: dict[str, dict]) -> Findings:
    return Findings(finetuning_runs(ft, ftep), "finetuning", ("ep-base", "ep-topk0.1", "ep-topk0.1+aqsgd"))


def continued(sm: dict[str, dict]) -> Findings:
    """The SmolLM2 continued-pretraining runs under the pretraining study's names (`sm-<name>` is `<name>`): its
    baseline's two seeds and its TopK levels both ways."""
    keep = {"sm-base", "sm-base-seed1", *(f"sm-topk{r}" for r in LEVELS)}
    runs = {n.removeprefix("sm-"): r for n, r in sm.items() if n in keep and n in SMOLLM2}
    return Findings(runs, "continued pretraining")


def verdicts(*columns: Findings) -> list[str]:
    """The six findings' table: one verdict per regime (`COLUMNS`, in order)."""
    return [f"| finding | {' | '.join(COLUMNS[:len(columns)])} |", "|---" * (len(columns) + 1) + "|",
            *(f"| {title} | {' | '.join(fn()[0] for fn in fns)} |"
              for title, *fns in zip(Findings.TITLES, *(c.rules() for c in columns)))]


def findings_compared(*columns: Findings) -> list[str]:
    """The six findings: the verdicts' table, then each later column's evidence for each."""
    details = []
    for name, col in zip(COLUMNS[1:len(columns)], columns[1:]):
        details += [f"#### {name}", "", col.lines()[0], ""]
        for title, fn in zip(Findings.TITLES, col.rules()):
            verdict, text = fn()
            details += [f"**{title}: {verdict}.** {text}", ""]
    return verdicts(*columns) + ["", *details]
