"""The paper's six findings (../shared/RESEARCH.md), each judged from the study's runs by an explicit rule.

eval/report.py writes the verdicts into eval/RESULTS.md: the 120-step study's next to the 1,000-step study's.
"""
from __future__ import annotations

import math

from eval import frontier
from eval.study import FINETUNE

# The TopK levels of the study's settings (eval/study.py: topk<r>, act-topk<r>, grad-topk<r>)
LEVELS = ("0.5", "0.3", "0.2", "0.1", "0.05")


class Findings:
    """The paper's six findings (../shared/RESEARCH.md), each judged from the runs by an explicit rule."""

    def __init__(self, runs: dict[str, dict]) -> None:
        self.runs = runs
        base, other = runs.get("base"), runs.get("base-seed1")
        self.base = base["val_loss"] if base else math.nan
        # Seed-to-seed spread of the baseline; "no loss" = frontier.tolerance (twice that, at least 0.02 nats)
        self.seed_gap = abs(other["val_loss"] - self.base) if base and other else math.nan
        self.tol = frontier.tolerance(self.seed_gap) if not math.isnan(self.seed_gap) else 0.05

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
        """Delta vs base of the run's checkpoint evaluated with no compression (NaN where not measured)."""
        r = self.runs.get(name, {})
        return r["val_loss_plain_inference"] - self.base if "val_loss_plain_inference" in r else math.nan

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
        gap = r["val_loss_plain_inference"] - r["val_loss"]
        text = (f"topk:0.1 (no error feedback): validation loss {r['val_loss']:.3f} with TopK at inference, "
                f"{r['val_loss_plain_inference']:.3f} without ({gap:+.3f}).")
        return ("holds" if gap > self.tol else "does not hold here"), text + self.ft_plain(("ft-topk0.1",))

    def ft_plain(self, names: tuple[str, ...]) -> str:
        """The finetuning runs' side of findings 3-4: val loss with TopK at inference, and without."""
        base = self.runs.get("ft-base")
        rows = [(n, self.runs[n]) for n in names if n in self.runs and "val_loss_plain_inference" in self.runs[n]]
        if not base or not rows:
            return ""
        return " Finetuning SmolLM2-135M: " + ", ".join(
            f"{r['spec']} training {r['val_loss'] - base['val_loss']:+.3f} vs uncompressed finetuning, validation "
            f"{r['val_loss']:.3f} with TopK at inference and {r['val_loss_plain_inference']:.3f} without "
            f"({r['val_loss_plain_inference'] - r['val_loss']:+.3f})" for n, r in rows) + "."

    def f4(self) -> tuple[str, str]:
        rows = []
        for n in ("topk0.1", "topk0.1+ef", "topk0.1+ef21"):
            r = self.runs.get(n)
            if r and "val_loss_plain_inference" in r:
                rows.append((n, self.d(n), r["val_loss_plain_inference"] - r["val_loss"]))
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
        return verdict, "Pretraining, " + text + self.ft_plain(("ft-topk0.1", "ft-topk0.1+ef"))

    def f5(self) -> tuple[str, str]:
        if "topk0.1+aqsgd" not in self.runs or "topk0.1" not in self.runs:
            return "not measured", ""
        r = self.runs["topk0.1+aqsgd"]
        gain = self.d("topk0.1") - self.d("topk0.1+aqsgd")
        text = f"{self.fmt('topk0.1+aqsgd')} vs {self.fmt('topk0.1')} (AQ-SGD gain {gain:+.3f}), wire ratio {r['ratio']:.2f}x."
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
        raw = (1 / r["ratio"] - 1 / self.runs["topk0.1"]["ratio"]) / (1 - 1 / self.runs["topk0.1"]["ratio"])
        text += (f" AQ-SGD sends a sample's first visit raw, so {raw:.0%} of its boundary traffic was not compressed at "
                 "all: a gain here mixes the deltas' effect with that of sending less through TopK.")
        return ("holds" if gain <= self.tol else "does not hold here: AQ-SGD helps"), text

    def f6(self) -> tuple[str, str]:
        ft = {n: r for n, r in self.runs.items() if n in FINETUNE}
        if "ft-base" in ft:
            levels = [(n.removeprefix("ft-topk"), ft[n]["val_loss"] - ft["ft-base"]["val_loss"]) for n in FINETUNE
                      if n.startswith("ft-topk") and "+" not in n and n in ft]
            seed = ft.get("ft-base-seed1")
            tol = max(2 * abs(seed["val_loss"] - ft["ft-base"]["val_loss"]), 0.02) if seed else 0.02
            verdict, first = self.rise(levels, tol)
            text = ("Finetuning SmolLM2-135M (below), TopK both directions, delta vs uncompressed finetuning: "
                    + ", ".join(f"{r}: {dl:+.3f}" for r, dl in levels) + f". First level worse by more than {tol:.3f} nats"
                    + (" (twice the finetuning seed-to-seed gap, at least 0.02)" if seed else "") + f": {first or 'none'}.")
            return verdict, text
        both = [(r, self.d(f"topk{r}")) for r in LEVELS if f"topk{r}" in self.runs]
        if not both:
            return "not measured", ""
        verdict, first = self.rise(both, self.tol)
        text = ("TopK both directions, pretraining: " + ", ".join(f"{r}: {dl:+.3f}" for r, dl in both) +
                f". First level beyond the tolerance: {first or 'none'}. This is pretraining from scratch, not "
                "finetuning, so the comparison is loose.")
        return verdict, text

    @staticmethod
    def rise(levels: list[tuple[str, float]], tol: float) -> tuple[str, str | None]:
        """(verdict, first level worse than `tol`) for "loss starts to rise from Top-20%": 0.2 is the first level
        beyond the tolerance, and 0.3, the level before it, was measured within it."""
        first = next((r for r, dl in levels if dl > tol), None)
        if first == "0.2" and "0.3" not in dict(levels):
            return "not measured (Top-30% not run)", first
        return ("holds" if first == "0.2" else "does not hold as stated"), first


def verdicts(old: Findings, new: Findings) -> list[str]:
    """The six findings' table: the 120-step verdict next to the 1,000-step one."""
    return ["| finding | 120 steps | 1,000 steps |", "|---|---|---|",
            *(f"| {title} | {fo()[0]} | {fn()[0]} |" for title, fo, fn in zip(Findings.TITLES, old.rules(), new.rules()))]


def findings_compared(old: Findings, new: Findings) -> list[str]:
    """The six findings: the verdicts' table, then the long study's evidence for each."""
    details = []
    for title, fn in zip(Findings.TITLES, new.rules()):
        verdict, text = fn()
        details += [f"**{title} (1,000 steps): {verdict}.** {text}", ""]
    return verdicts(old, new) + ["", new.lines()[0], "", *details]
