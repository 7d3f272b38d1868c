"""Wire bytes per step and step time of the small GPT over a real DeepSpeed pipeline (2 and 4 stages).

    python benchmarks/pipeline_bytes.py                 # -> results/bench/pipeline_bytes.md
    python benchmarks/pipeline_bytes.py --stages 2 --steps 12 --spec none --spec topk:0.1

Runs recipes/pretrain.py (model "small", shakespeare, micro-batch 4 x seq 128, 4 micro-batches per step)
once per (stages, spec), all in this one invocation so the timings compare side by side on this machine,
and reads each run's metrics.jsonl. Bytes are what pp_compress handed to torch.distributed per optimizer
step, summed over all boundaries (sample ids included; DeepSpeed's one-off meta message excluded).
Step time is the mean over the steps after the first two (start-up). On CPU the stage processes share
the cores and gloo runs over loopback, so the step time shows compression's cost, not a link's benefit.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pp_lab.paths import ROOT
from pp_lab.launch import run_job

SPECS = ["none", "act=int8,grad=int8", "act=int8,grad=topk:0.3+ef", "topk:0.1", "act=topk:0.1,grad=topk:0.1+ef"]


def measure(stages: int, spec: str, steps: int, out: Path, model: str) -> dict:
    rc, log = run_job(ROOT / "recipes/pretrain.py", stages, "--stages", str(stages), "--model", model, "--steps", str(steps),
                      "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--pp-compress", spec, "--overwrite",
                      "--out", str(out), timeout=1800)
    if rc != 0:
        raise SystemExit(f"{stages} stages, {spec}: exit {rc}\n{log[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][2:]
    return {"stages": stages, "spec": spec, "step_s": sum(r["step_s"] for r in train) / len(train),
            "act": train[-1]["act_wire_bytes"], "grad": train[-1]["grad_wire_bytes"],
            "act_raw": train[-1]["act_raw_bytes"], "grad_raw": train[-1]["grad_raw_bytes"],
            "val_loss": [r for r in rows if r["kind"] == "eval"][-1]["val_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, action="append", default=None, help="default: 2 and 4")
    ap.add_argument("--spec", action="append", default=None, help=f"default: {SPECS}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="small")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "pipeline_bytes")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "pipeline_bytes.md")
    args = ap.parse_args()
    results = []
    for stages in args.stages or [2, 4]:
        for spec in args.spec or SPECS:
            t0 = time.perf_counter()
            r = measure(stages, spec, args.steps, args.work / f"s{stages}_{spec.replace('=', '-').replace(',', '_')}", args.model)
            results.append(r)
            print(f"{stages} stages  {spec:32s} act {r['act']:>11,.0f} B  grad {r['grad']:>11,.0f} B  "
                  f"step {r['step_s']:.3f} s  ({time.perf_counter() - t0:.0f} s)", flush=True)
    lines = [f"Small GPT (`{args.model}`), micro-batch 4 x seq 128, 4 micro-batches per step, fp32, CPU/gloo, "
             f"{args.steps} steps per run; bytes per optimizer step summed over all boundaries.", "",
             "| stages | pp_compress | act bytes/step | grad bytes/step | act ratio | grad ratio | step time (s) | vs none |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = next(b for b in results if b["stages"] == r["stages"] and b["spec"] == "none") if any(
            b["stages"] == r["stages"] and b["spec"] == "none" for b in results) else r
        lines.append(f"| {r['stages']} | `{r['spec']}` | {r['act']:,.0f} | {r['grad']:,.0f} | {r['act_raw'] / r['act']:.2f}x | "
                     f"{r['grad_raw'] / r['grad']:.2f}x | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
