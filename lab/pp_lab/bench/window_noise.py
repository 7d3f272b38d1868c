"""How well a trial of `auto` can tell two settings apart on this machine: the spread of step-time comparisons between
runs of one fixed setting, where every true difference is zero.

    python benchmarks/window_noise.py runs/e2e_auto_trial_unl*/none_none_r* --window 20 --out results/bench/window_noise.md

From each run's `metrics.jsonl` (its per-step times), two ways of comparing, each as the relative difference of two
medians:
- adjacent windows: the median of one window of `--window` steps against the median of the window after it (what
  `auto`'s trials compare, pp_compress/decide.py);
- alternate steps: within one window, the median of its even steps against the median of its odd steps (what a
  trial that switched its two sides every step would compare: both see the same drift).
A comparison's spread here is what a trial mistakes for a difference between settings.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path


def step_times(run: Path) -> dict[int, float]:
    """{step: seconds} of a run directory's training steps."""
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["step_s"] for r in rows if r["kind"] == "train"}


def comparisons(times: dict[int, float], window: int, first: int) -> tuple[list[float], list[float]]:
    """(adjacent windows, alternate steps) relative differences over the run's whole windows from step `first`."""
    steps = sorted(s for s in times if s >= first)
    windows = [[times[s] for s in steps[i:i + window]] for i in range(0, len(steps) - window + 1, window)]
    adjacent = [statistics.median(b) / statistics.median(a) - 1 for a, b in zip(windows, windows[1:])]
    alternate = [statistics.median(w[0::2]) / statistics.median(w[1::2]) - 1 for w in windows]
    return adjacent, alternate


def summary(name: str, diffs: list[float], threshold: float) -> str:
    """A markdown row: how many comparisons, their spread, and how often one exceeds the threshold either way."""
    beyond = sum(abs(d) > threshold for d in diffs) / len(diffs)
    return (f"| {name} | {len(diffs)} | {statistics.pstdev(diffs):.1%} | {min(diffs):+.1%} .. {max(diffs):+.1%} | "
            f"{beyond:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, each of one fixed setting (with metrics.jsonl)")
    ap.add_argument("--window", type=int, default=20, help="steps per window (auto:every's default)")
    ap.add_argument("--first", type=int, default=3, help="the first step counted (the engine's warm-up before it)")
    ap.add_argument("--threshold", type=float, default=0.02, help="a trial's required gain (decide.TRIAL_GAIN)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.window < 2:
        raise SystemExit(f"--window {args.window}: accepted >= 2 (alternate steps need two)")
    adjacent, alternate = [], []
    for run in args.runs:
        if not (run / "metrics.jsonl").exists():
            raise SystemExit(f"{run}: no metrics.jsonl (accepted: run directories of the pretrain recipe)")
        a, b = comparisons(step_times(run), args.window, args.first)
        adjacent += a
        alternate += b
    if not adjacent:
        raise SystemExit(f"the runs have fewer than two windows of {args.window} steps from step {args.first}")
    lines = [f"Command: `python benchmarks/window_noise.py {shlex.join(sys.argv[1:])}`", "",
             f"{len(args.runs)} runs, each of one fixed setting, windows of {args.window} steps from step {args.first}: the "
             "relative difference of two medians where the true difference is zero.", "",
             f"| comparison | count | spread (SD) | range | beyond {args.threshold:.0%} |", "|---|---|---|---|---|",
             summary("adjacent windows (auto's trials)", adjacent, args.threshold),
             summary("alternate steps within a window", alternate, args.threshold)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
