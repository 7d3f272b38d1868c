"""Bytes per step between the stages of a 2 PP x 2 TP pipeline (4 CPU processes, gloo), with DeepSpeed's partitioned
pipes and without, uncompressed and compressed.

    python benchmarks/tp_bytes.py [--specs none,int8,act=int4:rot,grad=int8] [--model small] [--steps 10]

Each run is `recipes/pretrain.py --stages 2 --tp 2` (Megatron-style TP blocks, [seq, batch, hidden] between stages);
the figures are the recipe's own per-step wire bytes (all ranks of data-parallel replica 0, both TP ranks, the last
logged step). Writes results/bench/tp_bytes.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from pp_lab.paths import ROOT
from pp_lab.launch import run_job

MODES = {"partitioned": {}, "full tensors": {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}}


def run(spec: str, mode: str, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{mode.replace(' ', '_')}-{abs(hash(spec))}"
    config = json.loads((ROOT / "deepspeed_configs" / "cpu_gloo.json").read_text()) | MODES[mode]
    (work / "ds.json").write_text(json.dumps(config))
    rc, log = run_job(ROOT / "recipes/pretrain.py", 4, "--model", args.model, "--stages", "2", "--tp", "2", "--steps",
                      str(args.steps), "--log-every", str(args.steps), "--eval-every", "0", "--eval-batches", "2",
                      "--pp-compress", spec, "--deepspeed_config", str(work / "ds.json"), "--out", str(out), timeout=1800)
    if rc:
        sys.exit(f"{mode}, {spec}: exit {rc}\n{log[-4000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default="none;int8;act=int4:rot,grad=int8", help="';'-separated pp_compress specs")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    specs = args.specs.split(";")
    lines = ["| mode | `--pp-compress` | act bytes/step (raw -> wire) | grad bytes/step (raw -> wire) | ratio act / grad | "
             "loss at the last step |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in tqdm(MODES, desc="modes"):
            for spec in tqdm(specs, desc=mode, leave=False):
                r = run(spec, mode, args, Path(tmp))
                lines.append(f"| {mode} | `{spec}` | {r['act_raw_bytes']:,.0f} -> {r['act_wire_bytes']:,.0f} | "
                             f"{r['grad_raw_bytes']:,.0f} -> {r['grad_wire_bytes']:,.0f} | {r['act_ratio']:.2f}x / "
                             f"{r['grad_ratio']:.2f}x | {r['loss']:.4f} |")
    table = "\n".join(lines)
    print(table)
    command = " ".join(["python", "benchmarks/tp_bytes.py", *sys.argv[1:]])
    text = (f"# Bytes per step, 2 PP x 2 TP (4 processes, gloo)\n\nCommand: `{command}`\n\n`recipes/pretrain.py --model "
            f"{args.model} --stages 2 --tp 2 --steps {args.steps}`: Megatron-style TP blocks, [seq, batch, hidden] = "
            f"(128, 4, 192) between the stages, micro-batch 4, 4 micro-batches per step. Bytes are summed over both TP "
            f"ranks, per step. 'partitioned' is DeepSpeed's default with TP > 1: each TP rank sends its half of the "
            f"tensor (plus a 72-byte meta tensor) and the receiver all-gathers; 'full tensors' "
            f"(pipeline.pipe_partitioned/grad_partitioned false): every TP rank sends the whole tensor.\n\n{table}\n")
    out = ROOT / "results" / "bench" / "tp_bytes.md"
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
