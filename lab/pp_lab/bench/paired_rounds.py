"""One setting's step time against others', round by round, pooled over e2e runs, with a confidence interval.

    python benchmarks/paired_rounds.py results/bench/e2e_auto_alternate_unlimited*.csv \
        --spec auto:max=aggressive:model=small-gpt --out results/bench/auto_paired_unlimited

`benchmarks/e2e.py --rounds R` runs every spec of a link once per round, in turns, so the specs of one round share
that stretch of the machine's drift, while runs and rounds apart do not (on this 2-core machine one setting's step
time moves by 10-40% between rounds). So each round gives one ratio, --spec's step time over the other spec's in the
same round; the ratios of all the runs' rounds are pooled, and their mean comes with a Student-t interval
(scipy.stats) over the rounds. The table says whether the interval's upper end is within --margin (the issue's 5%).
"""
from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
from pathlib import Path

from scipy import stats


def rounds(path: Path, link: str) -> dict[str, list[float]]:
    """{spec: each round's step time in seconds} of one e2e CSV's rows on `link`."""
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["link"] == link]
    return {r["spec"]: [float(v) for v in r["rounds"].split()] for r in rows}


def ratios(runs: dict[str, dict[str, list[float]]], spec: str, other: str) -> list[float]:
    """spec's step time over other's, one per round of each run that has both (the rounds paired by position)."""
    out = []
    for name, by_spec in runs.items():
        if spec in by_spec and other in by_spec:
            a, b = by_spec[spec], by_spec[other]
            if len(a) != len(b):
                raise SystemExit(f"{name}: {spec} has {len(a)} rounds, {other} {len(b)}; accepted: the same number")
            out += [x / y for x, y in zip(a, b)]
    return out


def interval(r: list[float], confidence: float) -> tuple[float, float, float]:
    """The mean of ratios r minus 1, and the two ends of its Student-t confidence interval."""
    mean = statistics.fmean(r)
    half = stats.t.ppf(0.5 + confidence / 2, len(r) - 1) * statistics.stdev(r) / len(r) ** 0.5
    return mean - 1, mean - half - 1, mean + half - 1


def table(runs: dict[str, dict[str, list[float]]], spec: str, margin: float, confidence: float, command: str) -> str:
    """The markdown: per run, and pooled, spec against each other spec."""
    others = sorted({s for by_spec in runs.values() for s in by_spec if s != spec})
    lines = [f"# `{spec}` against each fixed setting, round by round", "", f"Command: `{command}`.", "",
             f"Each ratio is `{spec}`'s step time over the other setting's in the same round of the same run (they "
             f"ran in turns); the mean of the ratios minus 1, with its {confidence:.0%} Student-t interval over the "
             "rounds.", "", f"| against | rounds | mean | interval | upper end within {margin:.0%} |",
             "|---|---|---|---|---|"]
    for other in others:
        r = ratios(runs, spec, other)
        if len(r) < 2:
            continue
        mean, lo, hi = interval(r, confidence)
        within = "yes" if hi <= margin else "no"
        lines.append(f"| `{other}` | {len(r)} | {mean:+.1%} | {lo:+.1%} .. {hi:+.1%} | {within} |")
    lines += ["", "Per run (mean of its rounds' ratios):", "",
              "| run | " + " | ".join(f"`{o}`" for o in others) + " |", "|---" * (len(others) + 1) + "|"]
    for name, by_spec in runs.items():
        cells = []
        for other in others:
            r = ratios({name: by_spec}, spec, other)
            cells.append(f"{statistics.fmean(r) - 1:+.1%}" if r else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csvs", nargs="+", type=Path, help="e2e result CSVs (benchmarks/e2e.py --rounds R, R >= 2)")
    ap.add_argument("--spec", required=True, help="the setting compared with the others (e.g. an auto spec)")
    ap.add_argument("--link", default="none", help="the link whose rows are compared (the CSV's `link` column)")
    ap.add_argument("--margin", type=float, default=0.05, help="the goal: mean within this of each setting's")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=None, help="writes <out>.md")
    args = ap.parse_args()
    if not 0 < args.confidence < 1:
        ap.error(f"--confidence {args.confidence}; accepted: a number in (0, 1)")
    runs = {}
    for path in args.csvs:
        if not path.is_file():
            ap.error(f"{path}: no such file; accepted: e2e result CSVs")
        by_spec = rounds(path, args.link)
        if args.spec not in by_spec:
            ap.error(f"{path} has no row of --spec {args.spec!r} on link {args.link!r}; it has: "
                     f"{', '.join(sorted(by_spec)) or 'none on that link'}")
        runs[path.stem] = by_spec
    command = shlex.join(["python", "benchmarks/paired_rounds.py", *sys.argv[1:]])
    md = table(runs, args.spec, args.margin, args.confidence, command)
    if args.out:
        args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
