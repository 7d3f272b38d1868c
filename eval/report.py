"""eval/RESULTS.md and its plots from the study's runs (eval/study.py).

    python eval/report.py        # reads runs/study/*, copies each run's logs to eval/results/<name>/

The copies keep the measured data in the repository (runs/ is not tracked); the report can be rebuilt
from them alone with --from-results.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval.study import COMMON, SETTINGS  # noqa: E402

KEEP = ("metrics.jsonl", "run.json", "summary.json", "infer_none.json")
GROUPS = {
    "quantization": ["base", "int8", "act-int4_grad-int8", "act-int2"],
    "topk-both": ["base", "topk0.5", "topk0.3", "topk0.2", "topk0.1", "topk0.05"],
    "topk-act": ["base", "act-topk0.5", "act-topk0.3", "act-topk0.2", "act-topk0.1", "act-topk0.05"],
    "topk-grad": ["base", "grad-topk0.5", "grad-topk0.3", "grad-topk0.2", "grad-topk0.1", "grad-topk0.05"],
    "feedback": ["base", "topk0.1", "topk0.1+ef", "topk0.1+ef21", "topk0.1+aqsgd"],
    "matched-bytes": ["base", "topk0.1", "randk0.13", "lowrank10"],
}


def load(run: Path) -> dict | None:
    if not (run / "summary.json").exists():
        return None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    wire = sum(r["act_wire_bytes"] + r["grad_wire_bytes"] for r in train) / len(train)
    raw = sum(r["act_raw_bytes"] + r["grad_raw_bytes"] for r in train) / len(train)
    out = {"name": run.name, "spec": SETTINGS.get(run.name, "?"), "val_loss": evals[-1]["val_loss"], "evals": evals,
           "train": train, "wire": wire, "ratio": raw / wire}
    if (run / "infer_none.json").exists():
        out["val_loss_uncompressed_inference"] = math.log(json.loads((run / "infer_none.json").read_text())["val_ppl"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "study")
    ap.add_argument("--results", type=Path, default=ROOT / "eval" / "results")
    ap.add_argument("--from-results", action="store_true", help="rebuild from eval/results only")
    args = ap.parse_args()
    if not args.from_results:
        for run in sorted(args.runs.glob("*/")):
            if (run / "summary.json").exists():
                (args.results / run.name).mkdir(parents=True, exist_ok=True)
                for f in KEEP:
                    if (run / f).exists():
                        shutil.copy(run / f, args.results / run.name / f)
    runs = {r["name"]: r for r in (load(p) for p in sorted(args.results.glob("*/"))) if r}
    plots = args.results.parent / "plots"
    plots.mkdir(exist_ok=True)
    for group, names in GROUPS.items():
        present = [n for n in names if n in runs]
        if len(present) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, n in enumerate(present):
            ev = runs[n]["evals"]
            ax.plot([e["tokens"] for e in ev], [e["val_loss"] for e in ev], "o-", color=f"C{i}", label=f"{n} ({runs[n]['ratio']:.1f}x)")
        ax.set(xlabel="tokens", ylabel="validation loss", title=f"{group}: 4-stage pipeline, small GPT")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plots / f"{group}.png", dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, r in runs.items():
        ax.scatter(r["wire"] / 1e6, r["val_loss"])
        ax.annotate(n, (r["wire"] / 1e6, r["val_loss"]), fontsize=7)
    ax.set(xscale="log", xlabel="wire MB per step (all boundaries, both directions)", ylabel="final validation loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plots / "quality_vs_bytes.png", dpi=110)
    base = runs.get("base")
    lines = [f"Measured settings: {len(runs)} of {len(SETTINGS)}. Every run: `recipes/pretrain.py {' '.join(COMMON)}`"
             " (Shakespeare, 8192-token BPE, micro-batch 4 x seq 128, 4 micro-batches per step, fp32, 4 stages on CPU/gloo).", "",
             "| setting | --pp-compress | wire ratio | final val loss | delta vs base | val loss, inference uncompressed |",
             "|---|---|---|---|---|---|"]
    for n in SETTINGS:
        if n in runs:
            r = runs[n]
            delta = f"{r['val_loss'] - base['val_loss']:+.3f}" if base else ""
            unc = f"{r['val_loss_uncompressed_inference']:.3f}" if "val_loss_uncompressed_inference" in r else ""
            lines.append(f"| {n} | `{r['spec']}` | {r['ratio']:.2f}x | {r['val_loss']:.3f} | {delta} | {unc} |")
    (args.results / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
