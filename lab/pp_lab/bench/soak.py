"""Soak and fault benchmark: long runs of the pretraining recipe with the plugin on and error feedback, killed with
SIGKILL at random steps and resumed, against the same run uninterrupted.

    python benchmarks/soak.py                                   # all three engines, about 30 minutes on 2 cores
    python benchmarks/soak.py --engine torch --steps 200 --kills 1 --out /tmp/soak   # a quick look

For each engine (DeepSpeed's PipelineEngine, torch.distributed.pipelining's 1F1B, DeepSpeed's DualPipeV) it runs
`recipes/pretrain.py` twice with the same arguments: once uninterrupted, once killed --kills times, each time one rank
chosen at random gets SIGKILL at a random moment after a random step, and the job is started again with --resume
from its last checkpoint. Both runs end with a sha256 of every rank's weights, optimizer, LR schedule and compression
state (`--digest`); a kill and resume must end bitwise where the uninterrupted run ends. Resident memory (the largest
rank's) and step time are logged every --log-every steps; the table gives their change from step 200 to the end,
the figure their course.

Resumable: runs and kill plans live under --runs; a finished run is not run again, an interrupted one continues from
its checkpoint. Results: <out>/soak.md, soak.png, and each run's metrics (<engine>_<ref|fault>.jsonl), from which
`--report` redraws them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pp_lab.launch import kill_job, rank_pids, start_job
from pp_lab.paths import ROOT

SPEC = "act=int8:rot+ef21,grad=int4:rot+ef"
"""Error feedback both ways (EF21 on activations, EF on gradients): state that must survive a kill bitwise."""
SINCE = 200
"""The step from which memory and step time must stay flat (the start-up's allocations are over by then); a run
shorter than 5 x SINCE steps is measured from a fifth of its length."""
TINY = ["--corpus", "fixture", "--model", "tiny", "--tokenizer", "bpe512", "--seq-len", "32", "--micro-batch", "2",
        "--grad-accum", "4", "--eval-every", "0", "--eval-batches", "2", "--untied", "--digest"]


@dataclass(frozen=True)
class Engine:
    name: str
    ranks: int
    args: tuple[str, ...]
    """pretrain.py's options that choose the engine and its stages."""


ENGINES = {"deepspeed": Engine("deepspeed", 4, ("--stages", "4")),
           "torch": Engine("torch", 4, ("--stages", "4", "--engine", "torch")),
           "dualpipev": Engine("dualpipev", 2, ("--stages", "2", "--dualpipev"))}


def last_step(run: Path) -> int:
    """The last training step logged in run/metrics.jsonl (0 before the first)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if '"kind": "train"' in x]
    return steps[-1] if steps else 0


def finished(run: Path, steps: int) -> dict | None:
    """The run's summary if it ran to `steps` with a digest, else None."""
    path = run / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("steps") == steps and summary.get("digest") else None


def launch(engine: Engine, run: Path, steps: int, save_every: int, log_every: int, resume: bool) -> tuple:
    args = [*TINY, *engine.args, "--steps", str(steps), "--save-every", str(save_every), "--log-every", str(log_every),
            "--keep-checkpoints", "2", "--pp-compress", SPEC, "--out", str(run), "--resume" if resume else "--overwrite"]
    run.mkdir(parents=True, exist_ok=True)
    log = open(run / "job.log", "a")
    log.write(f"\n=== {time.strftime('%H:%M:%S')} pretrain.py {shlex.join(args)}\n")
    log.flush()
    proc, tag = start_job(ROOT / "recipes" / "pretrain.py", engine.ranks, *args, log=log)
    return proc, tag, log


def wait(proc: subprocess.Popen, tag: str, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the job did not finish in {timeout:.0f} s") from None
    finally:
        kill_job(tag)


def run_plain(engine: Engine, run: Path, steps: int, save_every: int, log_every: int, timeout: float) -> dict:
    """The uninterrupted run (continued from its checkpoint if this benchmark itself was interrupted)."""
    while (summary := finished(run, steps)) is None:
        proc, tag, log = launch(engine, run, steps, save_every, log_every, resume=(run / "ckpt" / "latest").exists())
        rc = wait(proc, tag, timeout)
        log.close()
        if rc != 0 and finished(run, steps) is None:
            raise RuntimeError(f"{engine.name}: the uninterrupted run failed (exit {rc}); see {run / 'job.log'}")
    return summary


def run_faulted(engine: Engine, run: Path, steps: int, save_every: int, log_every: int, kills: int, seed: int,
                timeout: float) -> tuple[dict, list[dict]]:
    """The run killed `kills` times: after each planned step, one random rank gets SIGKILL a random 0-3 s later, and
    the job restarts from its last checkpoint. Returns its summary and the kills (the step logged last before each,
    the rank, the checkpoint it resumed from, the launcher's exit code)."""
    plan_path = run / "kills.json"
    rng = random.Random(seed)
    plan = sorted(rng.sample(range(save_every + log_every, steps - save_every, log_every), kills))
    events = json.loads(plan_path.read_text()) if plan_path.exists() else []
    while (summary := finished(run, steps)) is None:
        resume = (run / "ckpt" / "latest").exists()
        proc, tag, log = launch(engine, run, steps, save_every, log_every, resume)
        t_start = time.perf_counter()
        target = plan[len(events)] if len(events) < len(plan) else None
        if target is None:
            rc = wait(proc, tag, timeout)
            log.close()
            if rc != 0 and finished(run, steps) is None:
                raise RuntimeError(f"{engine.name}: the faulted run failed after its kills (exit {rc}); see "
                                   f"{run / 'job.log'}")
            continue
        while last_step(run) < target:
            if proc.poll() is not None:
                raise RuntimeError(f"{engine.name}: the job ended (exit {proc.returncode}) before step {target}")
            if time.perf_counter() - t_start > timeout:
                kill_job(tag)
                raise TimeoutError(f"{engine.name}: step {target} not reached in {timeout:.0f} s")
            time.sleep(0.2)
        time.sleep(rng.uniform(0, 3))
        pids = rank_pids(tag)
        if proc.poll() is not None or not pids:
            raise RuntimeError(f"{engine.name}: the job ended before its planned kill after step {target}; give the "
                               "run more steps")
        rank = rng.choice(sorted(pids))
        logged = last_step(run)
        os.kill(pids[rank], signal.SIGKILL)
        rc = wait(proc, tag, 120)
        log.close()
        latest = (run / "ckpt" / "latest").read_text().strip() if (run / "ckpt" / "latest").exists() else "none"
        events.append({"after_step": logged, "rank": rank, "resumes_from": latest, "exit": rc})
        print(f"{engine.name}: killed rank {rank} after step {logged} (exit {rc}); resuming from {latest}", flush=True)
        plan_path.write_text(json.dumps(events, indent=1))
    return summary, events


def rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def drift(metrics: list[dict], key: str, since: int) -> tuple[float, float, float]:
    """(value at the first logged step >= since, at the end, relative change)."""
    later = [r for r in metrics if r["step"] >= since]
    a, b = later[0][key], later[-1][key]
    return a, b, b / a - 1


def step_time(metrics: list[dict], since: int) -> tuple[float, float]:
    """Median step time of the first and the last half of the logged rows from `since` on."""
    later = [r["step_s"] for r in metrics if r["step"] > since]
    half = len(later) // 2
    return statistics.median(later[:half]), statistics.median(later[half:])


def report(out: Path, results: dict[str, dict], command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Command: `{command}`", "", f"Spec `{SPEC}`; `recipes/pretrain.py` with {' '.join(TINY)}.", "",
             "| engine | ranks | steps | kills (rank after step, resumed from) | bitwise equal to uninterrupted | "
             "from step | RSS MiB, then -> end | RSS growth | step ms, first half -> last half |",
             "|---|---|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ref = r["ref_metrics"]
        since = min(SINCE, r["steps"] // 5)
        a, b, growth = drift(ref, "rss_mb", since)
        t1, t2 = step_time(ref, since)
        kills = "; ".join(f"{e['rank']} after {e['after_step']}, from {e['resumes_from']}" for e in r["kills"])
        lines.append(f"| {name} | {r['ranks']} | {r['steps']} | {kills} | {'yes' if r['equal'] else 'NO'} | {since} | "
                     f"{a:.1f} -> {b:.1f} | {growth:+.2%} | {t1 * 1e3:.1f} -> {t2 * 1e3:.1f} |")
        for which, style in (("ref_metrics", "-"), ("fault_metrics", ":")):
            m = r[which]
            label = f"{name} {'uninterrupted' if which == 'ref_metrics' else 'killed and resumed'}"
            axes[0].plot([x["step"] for x in m], [x["rss_mb"] for x in m], style, label=label)
            axes[1].plot([x["step"] for x in m], [x["step_s"] * 1e3 for x in m], style, label=label)
    axes[0].set(xlabel="step", ylabel="largest rank's resident memory (MiB)")
    axes[1].set(xlabel="step", ylabel="step time (ms, mean over the logging period)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=120)
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", choices=list(ENGINES), help="default: all three")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--dualpipev-steps", type=int, default=400, help="DualPipeV's run length")
    ap.add_argument("--kills", type=int, default=3, help="kills per run (DualPipeV: 1)")
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one job may run")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "soak")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "soak")
    ap.add_argument("--report", action="store_true", help="only redraw the table and figure from --out's metrics")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/soak.py {shlex.join(sys.argv[1:])}".strip()
    if args.report and (args.out / "soak.md").exists():  # redrawn: the command that measured it
        command = (args.out / "soak.md").read_text().split("`", 2)[1]
    results: dict[str, dict] = {}
    for name in args.engine or list(ENGINES):
        engine = ENGINES[name]
        steps = args.dualpipev_steps if name == "dualpipev" else args.steps
        kills = 1 if name == "dualpipev" else args.kills
        save_every = min(args.save_every, steps // 4)
        saved = args.out / f"{name}.json"
        if args.report:
            if saved.exists():
                results[name] = json.loads(saved.read_text())
            continue
        ref = run_plain(engine, args.runs / name / "ref", steps, save_every, args.log_every, args.timeout)
        fault, events = run_faulted(engine, args.runs / name / "fault", steps, save_every, args.log_every, kills,
                                    args.seed, args.timeout)
        results[name] = {"ranks": engine.ranks, "steps": steps, "kills": events, "equal": ref["digest"] == fault["digest"],
                         "ref_digest": ref["digest"], "fault_digest": fault["digest"],
                         "ref_metrics": rows(args.runs / name / "ref"), "fault_metrics": rows(args.runs / name / "fault")}
        saved.write_text(json.dumps(results[name], indent=1))
        print(f"{name}: {'bitwise equal' if results[name]['equal'] else 'DIFFERENT'} after {len(events)} kills", flush=True)
    report(args.out, results, command)


if __name__ == "__main__":
    main()
