"""Where along training each bottleneck row's gap to the uncompressed run opens or closes.

    python benchmarks/bottleneck_gap.py --out results/bench/bottleneck_gap_smollm2
    python benchmarks/bottleneck_gap.py --protocol long --out results/bench/bottleneck_gap_long

SmolLM2 (the default): the bottleneck rows are evaluated before their first step (--eval-at-start); the uncompressed
baseline was not. This evaluates the pretrained model once on the same validation batches (the study's own arguments,
one step, no compression; kept as <out>.start.jsonl, so that a later call reuses it), then writes <out>.md: for every
committed bottleneck row, its validation loss minus the baseline's at steps 0, 25, 50, 100 and 200, and the share of
the gap at step 0 that training closed by the end.

The long protocol (the small GPT from scratch): every committed row of the long-bottleneck study (the bottleneck rows,
the other optimizers' baselines, the codec alone at the same bytes) and subspace model (`subspace*`, the fixed-basis
control) at steps 50, 100, 300, 600 and 1000; there is no pretrained start to close a
gap from. For each other optimizer whose baseline is committed (the frontier's `Testbed.optimizers`: Muon's
`muon-base`), a second table gives the rows trained with it against that baseline, the gap that counts for them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from pp_lab.eval.frontier import TESTBEDS, optimizer_of, steps_to_target, tolerance
from pp_lab.eval.study import BOTTLENECK_LONG_ORDER, EXTRA, SM_COMMON
from pp_lab.launch import run_job
from pp_lab.paths import RESULTS, ROOT

STEPS = (0, 25, 50, 100, 200)
LONG_STEPS = (50, 100, 300, 600, 1000)


def evals(metrics: Path) -> dict[int, float]:
    """step -> validation loss of one run's metrics.jsonl."""
    rows = (json.loads(line) for line in metrics.read_text().splitlines())
    return {r["step"]: r["val_loss"] for r in rows if r["kind"] == "eval"}


def measure_start(dest: Path) -> None:
    """The pretrained model's validation loss before any step, on the study's batches -> dest (its metrics.jsonl)."""
    with tempfile.TemporaryDirectory() as tmp:
        rc, log = run_job(ROOT / "recipes/finetune.py", 4, *SM_COMMON, "--seed", "0", "--steps", "1",
                          "--eval-at-start", "--pp-compress", "none", "--out", str(Path(tmp) / "run"), "--overwrite",
                          timeout=3600)
        if rc != 0:
            raise SystemExit(f"the baseline's start evaluation failed (exit {rc}):\n{log[-3000:]}")
        shutil.copy(Path(tmp) / "run" / "metrics.jsonl", dest)


def table(base: dict[int, float], rows: dict[str, dict[int, float]], steps: tuple[int, ...] = STEPS) -> list[str]:
    """Markdown rows: each run's gap to `base` at `steps`, and, where they start at step 0, the share of its step-0
    gap closed at its last step."""
    share = steps[0] == 0
    out = ["| setting | " + " | ".join(f"gap at step {s}" for s in steps)
           + (" | share of the start's gap closed |" if share else " |"), "|---|" + "---|" * (len(steps) + share)]
    for name, ev in sorted(rows.items()):
        gaps = {s: ev[s] - base[s] for s in steps if s in ev and s in base}
        cells = [f"{gaps[s]:+.3f}" if s in gaps else "" for s in steps]
        if share:
            closed = 1 - gaps[max(gaps)] / gaps[0] if gaps[0] > 0 else float("nan")
            cells.append(f"{closed:.0%}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def long_rows(results: Path) -> tuple[dict[int, float], dict[str, dict[int, float]], str]:
    """The long protocol's baseline, the long-bottleneck study's rows and the subspace rows of the baseline's length,
    and their caption."""
    base = evals(results / "base" / "metrics.jsonl")
    # the study's order holds the other optimizers' baselines and their second seeds too
    rows = {p.parent.name: evals(p) for pattern in ("subspace*", *BOTTLENECK_LONG_ORDER)
            for p in results.glob(f"{pattern}/metrics.jsonl")}
    rows = {name: ev for name, ev in rows.items() if ev and max(ev) == max(base)}
    if not rows:
        raise SystemExit(f"{results}: no bottleneck or subspace row of {max(base)} steps")
    return base, rows, (f"Validation loss minus the uncompressed baseline's (`{results.relative_to(ROOT)}/base`), same "
                        "batches; the small GPT trained from scratch. A positive gap is worse than the baseline.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.md (and <out>.start.jsonl once)")
    ap.add_argument("--protocol", choices=("smollm2", "long"), default="smollm2", help="the study whose rows to read")
    ap.add_argument("--results", type=Path, default=None,
                    help="the study's committed rows (default results/eval/smollm2 or results/eval/long)")
    args = ap.parse_args()
    args.results = args.results or RESULTS / args.protocol
    command = "python benchmarks/bottleneck_gap.py " + shlex.join(sys.argv[1:])
    lines = [f"Command: `{command}`", "", *(long_table(args.results) if args.protocol == "long"
                                            else smollm2_table(args.results, args.out))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def long_table(results: Path) -> list[str]:
    """The long protocol's caption and table (nothing is evaluated: there is no pretrained start)."""
    base, rows, caption = long_rows(results)
    out = [caption, "", *table(base, rows, LONG_STEPS)]
    final = max(base)
    for optimizer, base_name, seed1 in TESTBEDS["long"].optimizers:
        own = {name: ev for name, ev in rows.items()
               if optimizer_of(EXTRA.get(name, [])) == optimizer and name not in (base_name, seed1)}
        if base_name not in rows or not own:
            continue
        seed = rows.get(seed1, {}).get(final)
        tol = "" if seed is None else (f" Its tolerance is {tolerance(abs(seed - rows[base_name][final])):.3f} "
                                       f"(twice its seed-to-seed gap, `{seed1}`, and at least the frontier's "
                                       "minimum, as the loss rule's).")
        title = optimizer.capitalize()  # Muon
        out += ["", f"Against the {title} baseline (`{results.relative_to(ROOT)}/{base_name}`, the same command "
                f"with `--optimizer {optimizer}`), the rows trained with {title}.{tol}", "",
                *table(rows[base_name], own, LONG_STEPS),
                "", f"Where the rows trained with {title} reach the AdamW baseline's final loss "
                f"({base[final]:.3f}):", ""]
        for name, ev in sorted({base_name: rows[base_name], **own}.items()):
            at = steps_to_target(sorted(ev.items()), base[final])
            out.append(f"- {name}: " + ("never" if at is None else f"step {at:.0f}"))
    return out


def smollm2_table(results: Path, out: Path) -> list[str]:
    """SmolLM2's caption and table, the pretrained start evaluated once into <out>.start.jsonl."""
    start = out.with_suffix(".start.jsonl")
    if not start.exists():
        start.parent.mkdir(parents=True, exist_ok=True)
        measure_start(start)
    base = {**evals(results / "sm-base" / "metrics.jsonl"), 0: evals(start)[0]}
    rows = {p.parent.name: evals(p) for p in results.glob("sm-bn*/metrics.jsonl")}
    rows = {name: ev for name, ev in rows.items() if 0 in ev and max(ev) == max(base)}  # same schedule, started
    if not rows:
        raise SystemExit(f"{results}: no bottleneck row with a step-0 evaluation and {max(base)} steps")
    return [f"Validation loss minus the uncompressed baseline's (`{results.relative_to(ROOT)}/sm-base`), same "
            f"batches. The baseline at step 0 is the pretrained model, evaluated by this command "
            f"(`{start.name}`: {base[0]:.4f}). A positive gap is worse than the baseline.", "",
            *table(base, rows)]


if __name__ == "__main__":
    main()
