"""Operator throughput next to memcpy: compress and decompress time, GB/s of input, ratio, error.

    python benchmarks/ops.py                          # CPU: default shapes, fp32 and bf16
    python benchmarks/ops.py --device cuda --shape 8x2048x4096
    python benchmarks/ops.py --spec int8 --spec topk:0.1 --shape 4x1024x1024 --dtype bf16

For every (shape, dtype) the same run measures `x.clone()` (the memcpy reference the issue names: allocation +
copy, like an operator's output) and `dst.copy_(x)` into a preallocated tensor (memory bandwidth alone; on CPU
clone's time swings with page faults of fresh allocations, 1-17 GB/s for the same tensor here), and, for TopK specs,
`torch.topk` itself with the same k per sample, so ratios compare side by side. Times are medians over
--reps repetitions after warm-up (CUDA: events after synchronize). "codec GB/s" is input bytes divided by
compress + decompress time; "vs clone" / "vs copy" are that over clone's / copy_'s GB/s. Results: results/bench/ops_<device>.md
and .csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch

from pp_lab.bench import kernel_settings
from pp_lab.paths import ROOT
import pp_compress as ppc
from pp_compress.ops.deferred import Deferred
from pp_compress.timing import median_time

SPECS = ["identity", "bf16", "fp8", "int8", "int8:compile", "int8:per=channel", "int4", "int4:rot", "int4:per=block64",
         "int4:rot:per=block64", "int3:rot", "int2:per=block64",
         "topk:0.3", "topk:0.1", "topk:0.1>int8", "randk:0.1", "lowrank:8"]
SHAPES = ["1x512x768", "4x1024x1024", "8x1024x2048"]
# --presets: the preset operators, each fused (the default) next to its eager reference (issue 28)
PRESET_SPECS = ["int8", "int8:kernel=eager", "nf6", "nf6:kernel=eager", "int3:stoch", "int3:stoch:kernel=eager", "nf5",
                "nf5:kernel=eager",
                "nf2:stoch", "int4", "int4:kernel=eager", "int4:rot", "int4:rot:kernel=eager", "int8:rot",
                "int8:rot:kernel=eager", "tile:3.5", "tile:3.5:kernel=eager", "vq:2.5", "vq:2.5:kernel=eager", "vq:4",
                "vq:4:kernel=eager", "vq:3", "vq:3:kernel=eager"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timer(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn() over reps runs, after two warm-up runs (CUDA: events, from an idle device)."""
    return median_time(fn, device, reps, warmup=2)


def context(device: torch.device) -> ppc.Context:
    """An inference context as the engines make it: on an accelerator the non-finite checks are deferred (read once
    per step), so that a message never waits for the device."""
    return ppc.Context(training=False, deferred=Deferred() if device.type != "cpu" else None)


def bench(spec: str, x: torch.Tensor, reps: int, clone_s: float, copy_s: float) -> dict:
    op = ppc.build(spec)
    ctx = context(x.device)
    payload = op.compress(x, ctx)
    y = op.decompress(payload, ctx)
    enc = timer(x.device, lambda: op.compress(x, ctx), reps)
    dec = timer(x.device, lambda: op.decompress(payload, ctx), reps)
    if ctx.deferred is not None:
        ctx.deferred.raise_pending()
    nbytes = x.numel() * x.element_size()
    err = float((x.double() - y.double()).norm() / x.double().norm())
    # the link bandwidth below which sending the payload (plus the codec's time) beats sending x: nbytes / B =
    # payload / B + codec time
    breakeven = max(nbytes - payload.nbytes, 0) / (enc + dec) / 1e9
    row = {"spec": spec, "compress_ms": enc * 1e3, "decompress_ms": dec * 1e3, "codec_GBps": nbytes / (enc + dec) / 1e9,
           "breakeven_GBps": breakeven,
           "vs_clone": clone_s / (enc + dec), "vs_copy": copy_s / (enc + dec), "ratio": nbytes / payload.nbytes, "rel_error": err, "topk_ms": None}
    if spec.startswith("topk:"):
        ratio = float(spec.split(":")[1].split(">")[0])
        flat = x.reshape(x.shape[0], -1)
        k = max(1, round(ratio * flat.shape[1]))
        row["topk_ms"] = timer(x.device, lambda: torch.topk(flat.abs(), k, dim=1, sorted=False), reps) * 1e3
    return row


def _without_rot(spec: str) -> str:
    return ":".join(part for part in spec.split(":") if part != "rot" and not part.startswith("rot="))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=None)
    ap.add_argument("--shape", action="append", default=None, help="BxSxH, e.g. 4x1024x1024")
    ap.add_argument("--dtype", action="append", choices=list(DTYPES), default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--presets", action="store_true", help=f"the preset operators, fused next to eager: {' '.join(PRESET_SPECS)}")
    kernel_settings.add_arguments(ap)  # each spec once per value, side by side
    args = ap.parse_args()
    if args.presets:
        args.spec = (args.spec or []) + PRESET_SPECS
    device = torch.device(args.device)
    rows = []
    for shape_s in args.shape or SHAPES:
        shape = tuple(int(v) for v in shape_s.split("x"))
        for dname in args.dtype or list(DTYPES):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=DTYPES[dname])
            dst = torch.empty_like(x)
            clone_s, copy_s = timer(device, x.clone, args.reps), timer(device, lambda: dst.copy_(x), args.reps)
            nbytes = x.numel() * x.element_size()
            print(f"{shape_s} {dname}: clone {clone_s * 1e3:.2f} ms = {nbytes / clone_s / 1e9:.2f} GB/s, "
                  f"copy_ {copy_s * 1e3:.2f} ms = {nbytes / copy_s / 1e9:.2f} GB/s", flush=True)
            for spec, setting in [(s, k) for s in args.spec or SPECS for k in kernel_settings.settings(args)]:
                with kernel_settings.applied(setting):
                    r = {"shape": shape_s, "dtype": dname, "clone_GBps": nbytes / clone_s / 1e9,
                         "copy_GBps": nbytes / copy_s / 1e9, **bench(spec, x, args.reps, clone_s, copy_s)}
                r["spec"] = spec = spec + kernel_settings.label(setting)
                rows.append(r)
                print(f"  {spec:22s} enc {r['compress_ms']:8.3f} ms  dec {r['decompress_ms']:8.3f} ms  "
                      f"{r['codec_GBps']:6.2f} GB/s ({r['vs_clone']:.0%} of clone, {r['vs_copy']:.0%} of copy_)  ratio {r['ratio']:5.2f}x"
                      f"  break-even {r['breakeven_GBps']:.1f} GB/s"
                      + (f"  torch.topk {r['topk_ms']:.2f} ms" if r["topk_ms"] else ""), flush=True)
    out = args.out or ROOT / "results" / "bench" / f"ops_{device.type}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    command = " ".join(["python", "benchmarks/ops.py", *map(shlex.quote, sys.argv[1:])])
    lines = [f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} {command}`", "",
             f"Device: {device} ({torch.cuda.get_device_name(device) + ', ' if device.type == 'cuda' else ''}"
             f"{torch.get_num_threads()} threads), torch {torch.__version__}; medians of {args.reps} runs.", "",
             "Break-even: the link bandwidth below which compressing pays, (input bytes - payload bytes) / codec time.", "",
             "| shape | dtype | spec | clone GB/s | copy_ GB/s | compress ms | decompress ms | codec GB/s | vs clone | vs copy_ | break-even GB/s | torch.topk ms | ratio | rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        topk = f"{r['topk_ms']:.2f}" if r["topk_ms"] else ""
        lines.append(f"| {r['shape']} | {r['dtype']} | `{r['spec']}` | {r['clone_GBps']:.2f} | {r['copy_GBps']:.2f} | {r['compress_ms']:.3f} | "
                     f"{r['decompress_ms']:.3f} | {r['codec_GBps']:.2f} | {r['vs_clone']:.0%} | {r['vs_copy']:.0%} | "
                     f"{r['breakeven_GBps']:.1f} | {topk} | {r['ratio']:.2f}x | {r['rel_error']:.4f} |")
    lines += ["", "Targets (issue 6): int8 quantize + dequantize >= 25% of clone throughput; TopK (compress + decompress) "
              "within 3x of torch.topk itself.", "", "| shape | dtype | int8 vs clone | int8 vs copy_ | int8:compile vs clone | topk:0.1 / torch.topk |",
              "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
        got = {r["spec"]: r for r in rows if (r["shape"], r["dtype"]) == key}
        pct = lambda spec, ref="vs_clone": f"{got[spec][ref]:.0%}" if spec in got else ""  # noqa: E731
        tk = got.get("topk:0.1")
        over = f"{(tk['compress_ms'] + tk['decompress_ms']) / tk['topk_ms']:.2f}x" if tk else ""
        lines.append(f"| {key[0]} | {key[1]} | {pct('int8')} | {pct('int8', 'vs_copy')} | {pct('int8:compile')} | {over} |")
    lines += ["", "Rotation cost (issue 13): compress + decompress time of each `rot` spec over the same spec without "
              "`rot`, side by side in this run. Target: at most 1.30x for int4.", "",
              "| shape | dtype | spec | without rot ms | with rot ms | time ratio | rel. error without / with |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = next((p for p in rows if (p["shape"], p["dtype"]) == (r["shape"], r["dtype"])
                      and p["spec"] == _without_rot(r["spec"]) != r["spec"]), None)
        if plain:
            t0, t1 = plain["compress_ms"] + plain["decompress_ms"], r["compress_ms"] + r["decompress_ms"]
            lines.append(f"| {r['shape']} | {r['dtype']} | `{r['spec']}` | {t0:.2f} | {t1:.2f} | {t1 / t0:.2f}x | "
                         f"{plain['rel_error']:.4f} / {r['rel_error']:.4f} |")
    lines += fused_table(rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


def fused_table(rows: list[dict]) -> list[str]:
    """Each spec measured both fused (default) and `:kernel=eager` in this run: codec GB/s side by side."""
    out = ["", "Fused kernels (issue 28): the same spec on its default path and with `:kernel=eager` (the reference), side "
           "by side in this run. The default is the fused CPU kernel on CPU (bitwise the reference, "
           "tests/unit/ops/test_fused.py); on a GPU, the rotation as one matrix product per block and vq's pruned "
           "search (tests/unit/ops/test_cuda.py). Targets on one CPU thread, 4x1024x1024 fp32: int8 at least 50% of "
           "copy_, nf6 and int3:stoch at least 25%.", "",
           "| shape | dtype | spec | fused codec GB/s | eager codec GB/s | speedup | fused vs copy_ |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        eager = next((e for e in rows if (e["shape"], e["dtype"]) == (r["shape"], r["dtype"])
                      and e["spec"] == f"{r['spec']}:kernel=eager"), None)
        if eager:
            out.append(f"| {r['shape']} | {r['dtype']} | `{r['spec']}` | {r['codec_GBps']:.2f} | {eager['codec_GBps']:.2f} | "
                       f"{r['codec_GBps'] / eager['codec_GBps']:.1f}x | {r['vs_copy']:.0%} |")
    return out


if __name__ == "__main__":
    main()
