"""Loss curves of several runs in one PNG: train loss (thin) and validation loss (markers) against tokens.

    python recipes/plot.py runs/demo/none runs/demo/topk0.1 runs/demo/topk0.1+ef --out runs/demo/loss.png

Each run directory holds the metrics.jsonl that pretrain.py / finetune.py write; the legend shows the
run's name and its pp_compress spec. Also prints a table: final validation loss, mean tokens/s, wire
bytes per step (activations / gradients) and the compression ratio.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(run: Path) -> tuple[list[dict], list[dict], str]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    spec = json.loads((run / "run.json").read_text()).get("pp_compress", "") if (run / "run.json").exists() else ""
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"], spec


def summary(run: Path) -> dict:
    train, evals, spec = load(run)
    steady = train[1:] or train  # the first log row includes start-up
    wire = sum(r["act_wire_bytes"] + r["grad_wire_bytes"] for r in steady) / len(steady)
    raw = sum(r["act_raw_bytes"] + r["grad_raw_bytes"] for r in steady) / len(steady)
    return {"run": run.name, "spec": spec, "final_val_loss": evals[-1]["val_loss"] if evals else float("nan"),
            "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady), "step_s": sum(r["step_s"] for r in steady) / len(steady),
            "act_wire_bytes": steady[-1]["act_wire_bytes"], "grad_wire_bytes": steady[-1]["grad_wire_bytes"],
            "ratio": raw / wire if wire else 1.0}


def markdown(rows: list[dict]) -> str:
    lines = ["| run | pp_compress | final val loss | tokens/s | step s | act wire B/step | grad wire B/step | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | `{r['spec']}` | {r['final_val_loss']:.4f} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | "
              f"{r['act_wire_bytes']:,.0f} | {r['grad_wire_bytes']:,.0f} | {r['ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG path")
    ap.add_argument("--title", default="validation loss (markers) and train loss (lines)")
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(args.runs):
        train, evals, spec = load(run)
        color = f"C{i}"
        ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], color=color, alpha=0.35, lw=1)
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", color=color, label=f"{run.name}: {spec}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(markdown([summary(r) for r in args.runs]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
