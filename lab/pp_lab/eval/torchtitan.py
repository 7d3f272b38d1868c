"""torchtitan's llama3 debug model trained through torchtitan's own trainer with pp_compress settings side by side, on
2 pipeline stages (one CPU process each, gloo), from one resumable command:

    .venv-torch-next/bin/python eval/torchtitan.py                   # torch 2.14.1, torchtitan 0.3.0 (make test)
    .venv-torch-next/bin/python eval/torchtitan.py --settings safe   # one setting

Every setting trains the same model from the same seed on the same Shakespeare batches (a 2,000-token BPE trained on
40 of its 42 works; the other 2 are held out), and torchtitan's validator measures the held-out loss. `none` is the
baseline (identity: stock torchtitan's numbers, bytes counted); `none-seed1` is the baseline from another seed, the
scale of seed noise. Each setting's run lives in runs/study_torchtitan/<setting>/ (torchtitan's checkpoints every 100
steps: a killed study resumes there); its results are copied to results/eval/torchtitan/<setting>/ as it lands
(steps.jsonl: loss and gradient norm per step; scalars.json: torchtitan's TensorBoard scalars: losses, held-out
loss and pp_compress's statistics), and `--report` (run after each setting) writes
results/eval/torchtitan/summary.json and the table in docs/engines.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from pp_lab.data import corpus_files
from pp_lab.docblock import update_readme
from pp_lab.launch import run_job
from pp_lab.paths import ROOT
from pp_lab.torchtitan_cpu import make_assets

RESULTS = ROOT / "results" / "eval" / "torchtitan"
RUNS = ROOT / "runs" / "study_torchtitan"
DOC = ROOT / "docs" / "engines.md"
SETTINGS = {"none": ("none", 42), "none-seed1": ("none", 43), "safe": ("safe", 42), "aggressive": ("aggressive", 42),
            "auto": ("auto", 42)}
"""setting -> (--pp_compress.compression, seed)."""
HELD_OUT = ("the_tempest.txt", "twelfth_night.txt")
STEPS = 600
ARGS = ["--config", "llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2",
        "--training.seq_len", "128", "--training.local_batch_size", "8", "--training.disable_cuda_graphs",
        "--lr_scheduler.warmup_steps", "20", "--metrics.log_freq", "10", "--metrics.enable_tensorboard",
        "--validator.enable", "--validator.freq", "100", "--validator.steps", "20",
        "--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.keep_latest_k", "2",
        "--comm.init_timeout_seconds", "600"]
"""The debug model (6 layers, width 256, 6.2M parameters) on 4 micro-batches of 2 x 128 tokens per step."""


def assets() -> list[str]:
    """The tokenizer and the two corpora (made once, under runs/)."""
    folder = RUNS / "assets"
    if not (folder / "tokenizer" / "tokenizer.json").exists():
        files = corpus_files("shakespeare")
        make_assets(folder, [f for f in files if f.name not in HELD_OUT], [f for f in files if f.name in HELD_OUT])
    return ["--hf_assets_path", str(folder / "tokenizer"), "--dataloader.dataset_path", str(folder / "c4_test"),
            "--validator.dataloader.dataset", "c4_test", "--validator.dataloader.dataset_path",
            str(folder / "held_out")]


def run(name: str, steps: int) -> None:
    """Train one setting to `steps` (resuming its checkpoint if a previous study was cut off), then copy its results."""
    spec, seed = SETTINGS[name]
    out = RUNS / name
    out.mkdir(parents=True, exist_ok=True)
    begin = time.time()
    rc, log = run_job(ROOT / "recipes" / "torchtitan_cpu.py", 2, "--module", "pp_compress.torchtitan", *ARGS,
                      *assets(), "--training.steps", str(steps), "--debug.seed", str(seed), "--dump_folder", str(out),
                      "--pp_compress.compression", spec, timeout=6 * 3600, env={"TT_METRICS": str(out / "steps")},
                      log_file=out / "log.txt")
    if rc != 0:
        raise SystemExit(f"{name}: torchtitan exited with {rc}; its log: {out / 'log.txt'}\n{log[-3000:]}")
    keep(name, out, steps, time.time() - begin)


def keep(name: str, out: Path, steps: int, seconds: float) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows: dict[int, dict[str, Any]] = {}
    for f in out.glob("steps.rank*.jsonl"):  # the last stage's rank logs the loss; a resumed run repeats some steps
        for line in f.read_text().splitlines():
            r = json.loads(line)
            rows[r["step"]] = r
    scalars: dict[str, list[list[float]]] = {}
    for events in {p.parent for p in out.rglob("events.out.tfevents.*")}:
        tb = EventAccumulator(str(events))
        tb.Reload()
        for tag in tb.Tags()["scalars"]:
            if tag.startswith(("pp_compress/", "validation_metrics/loss", "loss_metrics/")):
                scalars[tag] = [[e.step, e.value] for e in tb.Scalars(tag)]
    dest = RESULTS / name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "steps.jsonl").write_text("".join(json.dumps(rows[s]) + "\n" for s in sorted(rows)))
    (dest / "scalars.json").write_text(json.dumps(scalars, indent=1))
    (dest / "run.json").write_text(json.dumps({"setting": name, "compression": SETTINGS[name][0],
                                               "seed": SETTINGS[name][1], "steps": steps, "seconds": round(seconds),
                                               "args": ARGS}, indent=1))
    shutil.copy(out / "log.txt", dest / "log.txt")


def done(name: str, steps: int) -> bool:
    path = RESULTS / name / "run.json"
    return path.exists() and json.loads(path.read_text())["steps"] == steps


def summary() -> list[dict[str, Any]]:
    """One row per finished setting: held-out loss at the end, against the baseline, and the bytes that crossed."""
    rows = []
    for name in SETTINGS:
        if not (RESULTS / name / "scalars.json").exists():
            continue
        s = json.loads((RESULTS / name / "scalars.json").read_text())
        last = {tag: v[-1][1] for tag, v in s.items() if v}
        raw, wire = last["pp_compress/raw_MB"], last["pp_compress/wire_MB"]
        val = last["validation_metrics/loss"]
        rows.append({"setting": name, "compression": SETTINGS[name][0], "seed": SETTINGS[name][1], "val_loss": val,
                     "raw_MB": raw, "wire_MB": wire, "ratio": raw / wire, "bits": 16 * wire / raw,  # bf16 activations
                     **{tag.removeprefix("pp_compress/"): v for tag, v in last.items()
                        if tag.endswith(("/ratio", "/rel_error")) and ".act_eval" not in tag}})
    base = next((r for r in rows if r["setting"] == "none"), None)
    for r in rows:
        r["delta"] = r["val_loss"] - base["val_loss"] if base else None
    return rows


def report() -> None:
    rows = summary()
    (RESULTS / "summary.json").write_text(json.dumps(rows, indent=1))
    lines = ["| setting | compression | held-out loss | vs none | ratio | bits / element | MB sent (of) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | `{r['compression']}` | {r['val_loss']:.4f} | {r['delta']:+.4f} | "
                     f"{r['ratio']:.2f}x | {r['bits']:.2f} | {r['wire_MB']:.0f} ({r['raw_MB']:.0f}) |")
    update_readme(DOC, "torchtitan-study", lines, "eval/torchtitan.py")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--report", action="store_true", help="only write the summary and the docs table")
    args = ap.parse_args()
    names = args.settings.split(",")
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown settings {bad}; accepted: {', '.join(SETTINGS)}")
    if not args.report:
        for name in names:
            if done(name, args.steps):
                print(f"{name}: done ({RESULTS / name})", flush=True)
                continue
            print(f"{name}: training {args.steps} steps ({RUNS / name}/log.txt)", flush=True)
            run(name, args.steps)
            report()
    report()
