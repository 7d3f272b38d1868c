"""The codec's share of a training step: SmolLM2-135M trained on one device with in-process boundaries at the SmolLM2
study's three cuts (`insert_boundaries`), with and without each spec, side by side in one run.

    python benchmarks/train_step.py --device cuda --spec none --spec safe --spec aggressive --dtype bf16

Weights are randomly initialised in SmolLM2-135M's sizes (a step costs the same with trained weights), tokens are
random, AdamW updates every parameter. Every spec trains its own copy of the model from the same initialisation;
the specs take turns, one timed step each per round, so that a drift of the device's clocks spreads over all of them.
Step times are CUDA events (device time of a whole step, forward, backward and optimizer), medians over the rounds.
"Host ms" is the time the host takes to queue a step (until step() returns): where it is close to the step time, the
step is bound by its host, and a boundary's host µs add to the step one for one.
"Overhead" is a spec's median step time over the uncompressed one's, less one; its 95% interval is a bootstrap over
the rounds, resampled in pairs (a round's step of the spec with the same round's uncompressed step), so that it
says how far this run's noise leaves the figure open (scipy.stats.bootstrap, percentile). With `--sync-check`, one more step
per spec runs under `torch.cuda.set_sync_debug_mode("error")`, which raises at any host-device synchronization.
With the device kernels' settings (`--sign-table-rows`, `--butterfly`, pp_lab.bench.kernel_settings), every
compressing spec also takes a turn under each value given, as one more row.
Results: results/bench/<card>/train_step_<dtype>.md.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import pp_compress as ppc
from pp_compress.timing import elapsed
from pp_lab.bench import kernel_settings
from pp_lab.model import GPT, GPTConfig, lm_loss
from pp_lab.paths import BENCH

SMOLLM2_135M = GPTConfig(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536, norm_eps=1e-5,
                         rope_theta=100000.0, tie_embeddings=True)
"""SmolLM2-135M's sizes (its config.json, as GPTConfig.from_hf reads it)."""
CUTS = (8, 16, 23)
"""Layer indices (the embedding is layer 0) after which the SmolLM2 study's 4 stages end: stage_cuts(cfg, 4)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(spec: str, cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> tuple[GPT, list, torch.optim.Optimizer]:
    """The model from seed 0 on `device` in `dtype`, with boundaries after CUTS unless spec is `none`."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype).train()
    boundaries = [] if spec == "none" else ppc.insert_boundaries(model, after=list(CUTS), cfg=spec, blocks=model.layers)
    return model, boundaries, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def stepper(model: GPT, boundaries: list, opt: torch.optim.Optimizer, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def under(setting: kernel_settings.Setting, step: Callable[[], None]) -> Callable[[], None]:
    """step, run with the device kernels' `setting` (the library's defaults around it)."""
    def run() -> None:
        with kernel_settings.applied(setting):
            step()
    return run


def host_timed(step: Callable[[], None], host: list[float]) -> Callable[[], None]:
    """step, appending to `host` the seconds until it returns (on an accelerator: the time to queue its work)."""
    def run() -> None:
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    return run


def overhead(times: list[float], base: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median(times) / median(base) - 1, and its bootstrap interval's ends): rounds resampled in pairs."""
    import numpy as np
    from scipy import stats

    point = statistics.median(times) / statistics.median(base) - 1
    if len(times) < 3:
        return point, float("nan"), float("nan")
    res = stats.bootstrap((np.asarray(times), np.asarray(base)), lambda t, b, axis=-1:
                          np.median(t, axis=axis) / np.median(b, axis=axis) - 1, paired=True, vectorized=True,
                          confidence_level=confidence, n_resamples=2000, method="percentile",
                          random_state=np.random.default_rng(0))
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def sync_check(step: Callable[[], None]) -> str:
    """'none' if a step under sync debug mode 'error' synchronizes nowhere, else the first error's text."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def profile(spec: str, step: Callable[[], None], device: torch.device, top: int = 12) -> list[str]:
    """Markdown lines: the operators with the most device time and the most host time over 2 steps of `spec`."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    lines = ["", f"Profile of 2 steps of `{spec}` (self time per step, ms):", "", "| operator | calls | device ms | host ms |",
             "|---|---|---|---|"]
    for key in ("self_device_time_total", "self_cpu_time_total"):
        for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]:
            lines.append(f"| {e.key[:60]} | {e.count // 2} | {e.self_device_time_total / 2e3:.3f} | "
                         f"{e.self_cpu_time_total / 2e3:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=None, help="specs (default none, identity, int8, safe, aggressive)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30, help="timed steps per spec")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks (a quick check; the cuts must fit)")
    ap.add_argument("--sync-check", action="store_true", help="one more step per spec under sync debug mode 'error'")
    ap.add_argument("--profile", action="append", default=[], metavar="SPEC",
                    help="also profile 2 steps of SPEC: the operators with the most device and host time")
    ap.add_argument("--out", type=Path, default=None)
    kernel_settings.add_arguments(ap)  # each compressing spec once per value, side by side
    args = ap.parse_args()
    specs = args.spec or ["none", "identity", "int8", "safe", "aggressive"]
    if "none" not in specs:
        raise SystemExit(f"--spec none is the reference every overhead is measured against; got {specs}")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = SMOLLM2_135M if args.layers is None else GPTConfig(**{**SMOLLM2_135M.to_dict(), "n_layer": args.layers})
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    runs = {}
    for spec in specs:
        for setting in [()] if spec in ("none", "identity") else kernel_settings.settings(args):
            model, boundaries, opt = build(spec, cfg, device, dtype)
            step = under(setting, stepper(model, boundaries, opt, ids))
            for _ in range(args.warmup):
                step()
            runs[spec + kernel_settings.label(setting)] = (step, boundaries, [], [])
    for r in range(args.rounds):
        for spec, (step, _, times, host) in runs.items():
            times.append(elapsed(host_timed(step, host), device))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{s} {t[-1] * 1e3:.1f} ms" for s, (_, _, t, _) in runs.items()),
              flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    lines = [f"Command: `python benchmarks/train_step.py {' '.join(map(shlex.quote, sys.argv[1:]))}`", "",
             f"Device: {name}, torch {torch.__version__}; SmolLM2-135M sizes ({cfg.n_layer} blocks), random init, "
             f"{args.dtype}, batch {args.batch} x {args.seq} tokens, AdamW; boundaries after layers "
             f"{', '.join(map(str, CUTS))}; medians of {args.rounds} steps per spec, taken in turns, after "
             f"{args.warmup} warm-up steps.", "",
             "| spec | step ms | host ms | overhead | 95% interval | act wire bytes / raw | host syncs in a step |",
             "|---|---|---|---|---|---|---|"]
    for spec, (step, boundaries, times, host) in runs.items():
        t = statistics.median(times)
        point, low, high = overhead(times, runs["none"][2])
        syncs = sync_check(step) if args.sync_check and device.type == "cuda" else "not checked"
        for b in boundaries:
            b.check()
        raw = sum(b.stats["act"].raw_bytes for b in boundaries)
        ratio = f"{sum(b.stats['act'].wire_bytes for b in boundaries) / raw:.3f}" if raw else ""
        interval = "" if spec == "none" or low != low else f"{low:+.1%} .. {high:+.1%}"
        lines.append(f"| `{spec}` | {t * 1e3:.2f} | {statistics.median(host) * 1e3:.2f} | {point:+.1%} | {interval} | {ratio} | {syncs} |")
        print(lines[-1], flush=True)
    for spec in args.profile:
        if spec not in runs:
            raise SystemExit(f"--profile {spec}: not among the specs run ({', '.join(runs)})")
        lines += profile(spec, runs[spec][0], device)
    out = args.out or BENCH / f"train_step_{device.type}_{args.dtype}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
