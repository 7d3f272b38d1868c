"""Does a compression setting keep the model as good as the uncompressed one? One command, offline.

    python eval/parity.py --baseline runs/study/base \
        --candidate runs/study/topk0.1 --candidate runs/study/topk0.1+ef@none --out eval/parity/topk

A candidate is CHECKPOINT[@SPEC]: a recipe run directory (or transformers folder) evaluated with
inference-time compression SPEC at the stage boundaries; without @SPEC, the compression it was trained
with (its `eval`, else its `act` spec). The baseline runs as given (default @none). Every model answers the
same local lm-eval tasks (eval/tasks.py), and the report (<out>.md, <out>.json) gives per task and metric:
the baseline, the candidate, the delta and its standard error, and a verdict.

Verdict. Documents are paired (the same ones for both models), so the standard error of the delta is that
of the per-document differences: SE = std(d) / sqrt(n). A candidate is at "parity" on a metric unless it
is worse than the baseline by more than 2 SE (one-sided, ~97.7% confidence) and by more than a
negligible --tolerance (relative, default 0.5%). The exit code is 1 if any candidate fails on any metric.
Per-document values: acc / acc_norm (0 or 1), lastword perplexity -> per-document log-likelihood, ppl ->
per-document bits per byte.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval.lm import PPCompressLM  # noqa: E402
from eval.tasks import DEFAULT_DIR, build  # noqa: E402

HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "ll": True, "bits_per_byte": False}


def trained_spec(checkpoint: Path) -> str:
    run = checkpoint / "run.json"
    if not run.exists():
        return "none"
    import pp_compress as ppc

    cfg = ppc.parse_spec(json.loads(run.read_text())["pp_compress"])
    return str(cfg.spec_for(0, "act", training=False))


def per_doc(task: str, samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-document values of the metrics the verdict uses, in document order."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    if task.endswith("_ppl"):
        return {"bits_per_byte": [-s["bits_per_byte"][0] / s["bits_per_byte"][1] / math.log(2) for s in rows]}
    if task.endswith("_lastword"):
        return {"acc": [float(s["acc"]) for s in rows], "ll": [float(s["perplexity"]) for s in rows]}
    return {m: [float(s[m]) for s in rows] for m in ("acc", "acc_norm")}


def evaluate(checkpoint: Path, spec: str, tasks: list[str], stages: int, limit: int | None) -> dict[str, dict[str, list[float]]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = PPCompressLM(checkpoint=str(checkpoint), compress=spec, stages=stages)
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(DEFAULT_DIR), include_defaults=False),
                                  limit=limit, bootstrap_iters=0, log_samples=True)
    return {t: per_doc(t, res["samples"][t]) for t in tasks}


def compare(base: list[float], cand: list[float], higher: bool, tol: float) -> dict[str, Any]:
    n = len(base)
    d = [c - b for b, c in zip(base, cand)]
    mean_b, mean_c, mean_d = sum(base) / n, sum(cand) / n, sum(d) / n
    se = math.sqrt(sum((x - mean_d) ** 2 for x in d) / max(n - 1, 1) / n)
    worse = -mean_d if higher else mean_d
    ok = worse <= 2 * se or worse <= tol * abs(mean_b)
    return {"n": n, "baseline": mean_b, "candidate": mean_c, "delta": mean_d, "se": se, "verdict": "parity" if ok else "worse"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="CHECKPOINT[@SPEC]")
    ap.add_argument("--candidate", action="append", required=True, help="CHECKPOINT[@SPEC], repeatable")
    ap.add_argument("--corpus", default="shakespeare")
    ap.add_argument("--stages", type=int, default=4, help="where the boundaries are (as in training)")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    ap.add_argument("--tolerance", type=float, default=0.005)
    ap.add_argument("--out", type=Path, required=True, help="report path without suffix")
    args = ap.parse_args()
    tasks = build(args.corpus, DEFAULT_DIR)

    def parse(arg: str, default: str | None) -> tuple[Path, str]:
        path, _, spec = arg.partition("@")
        return Path(path), spec or default or trained_spec(Path(path))

    base_path, base_spec = parse(args.baseline, "none")
    base = evaluate(base_path, base_spec, tasks, args.stages, args.limit)
    report: dict[str, Any] = {"baseline": {"checkpoint": str(base_path), "compress": base_spec}, "candidates": []}
    failed = False
    for arg in args.candidate:
        path, spec = parse(arg, None)
        cand = evaluate(path, spec, tasks, args.stages, args.limit)
        rows = {f"{t}/{m}": compare(base[t][m], cand[t][m], HIGHER_IS_BETTER[m], args.tolerance) for t in tasks for m in base[t]}
        failed |= any(r["verdict"] != "parity" for r in rows.values())
        report["candidates"].append({"checkpoint": str(path), "compress": spec, "metrics": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Parity report\n\nBaseline: `{base_path}` evaluated with `{base_spec}`. Verdict: parity unless worse "
             f"by > 2 SE of the paired per-document differences and by > {args.tolerance:.1%}.\n",
             "| candidate | compress | task/metric | n | baseline | candidate | delta | SE | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["candidates"]:
        for k, r in c["metrics"].items():
            lines.append(f"| `{c['checkpoint']}` | `{c['compress']}` | {k} | {r['n']} | {r['baseline']:.4f} | {r['candidate']:.4f} | "
                         f"{r['delta']:+.4f} | {r['se']:.4f} | {r['verdict']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
