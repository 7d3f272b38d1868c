"""Where a codec's time goes on a device: torch.profiler over encode + decode rounds, per spec.

    python benchmarks/codec_profile.py --device cuda --spec int8 --spec int8:rot --shape 8x1024x2048 --dtype fp32

For each spec it prints and writes (results/bench/codec_profile_<device>.md) the wall time per round, the
device (kernel) time per round, the number of kernels launched and host-device synchronizations per round, and the
operators with the most device time. Wall time far above kernel time means the codec waits on launches and
synchronizations rather than on memory bandwidth. On an accelerator the non-finite checks are deferred, as the engines
defer them there.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pp_lab.paths import ROOT
import pp_compress as ppc
from pp_lab.bench import kernel_settings
from pp_lab.bench.ops import context, timer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_spec(spec: str, x: torch.Tensor, rounds: int, top: int, shapes: bool = False,
                 label: str = "") -> tuple[dict, list[str]]:
    """(summary row, markdown lines of the top operators by device time) for `rounds` encode + decode rounds;
    with `shapes`, an operator's calls are listed per input shape, to tell apart calls of one operator; `label` follows
    the spec in both (the kernel settings it ran under)."""
    op, ctx = ppc.build(spec), context(x.device)
    for _ in range(3):  # warm-up: codebooks, grids, compiled kernels
        op.decompress(op.compress(x, ctx), ctx)
    sync(x.device)
    cuda = x.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        t0 = time.perf_counter()
        for _ in range(rounds):
            op.decompress(op.compress(x, ctx), ctx)
        sync(x.device)
        wall = (time.perf_counter() - t0) / rounds
    if ctx.deferred is not None:
        ctx.deferred.raise_pending()
    events = prof.key_averages(group_by_input_shape=shapes)
    dev_us = lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total  # noqa: E731
    kernels = sum(e.count for e in events if cuda and e.device_type == torch.autograd.DeviceType.CUDA)
    # every .item() / bool() of a tensor: on a GPU the host waits there for the device
    syncs = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
    row = {"spec": spec + label, "wall_ms": wall * 1e3, "device_ms": sum(dev_us(e) for e in events if e.device_type ==
           (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU)) / rounds / 1e3,
           "kernels": kernels / rounds, "syncs": syncs / rounds}
    ops = sorted((e for e in events if e.key.startswith("aten::") and dev_us(e) > 0), key=dev_us, reverse=True)[:top]
    # the device kernels themselves (the Triton kernels have no aten operator above them), named `kernel <name>`
    ops += sorted((e for e in events if cuda and e.device_type == torch.autograd.DeviceType.CUDA and dev_us(e) > 0),
                  key=dev_us, reverse=True)[:top]
    shape = lambda e: f" {e.input_shapes}" if shapes else ""  # noqa: E731
    name = lambda e: e.key if e.key.startswith("aten::") else f"kernel {e.key[:60]}"  # noqa: E731 (torch's: long)
    lines = [f"| `{spec}{label}` | {name(e)}{shape(e)} | {e.count // rounds} | {dev_us(e) / rounds / 1e3:.3f} |"
             for e in ops]
    return row, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", required=True)
    ap.add_argument("--shape", default="8x1024x2048", help="BxSxH")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--top", type=int, default=6, help="operators listed per spec")
    ap.add_argument("--shapes", action="store_true", help="list each operator's calls per input shape")
    ap.add_argument("--out", type=Path, default=None)
    kernel_settings.add_arguments(ap)  # each spec once per value, side by side
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = tuple(int(v) for v in args.shape.split("x"))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=DTYPES[args.dtype])
    dst = torch.empty_like(x)
    copy_ms = timer(device, lambda: dst.copy_(x), args.rounds) * 1e3  # the median, as benchmarks/ops.py times it
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    lines = [f"Command: `python benchmarks/codec_profile.py {' '.join(map(shlex.quote, sys.argv[1:]))}`", "",
             f"Device: {name}, torch {torch.__version__}; {args.shape} {args.dtype}, {args.rounds} encode + decode "
             f"rounds after 3 warm-ups; `copy_` of the same tensor: {copy_ms:.3f} ms (median).", "",
             "| spec | wall ms per round | kernel ms per round | kernels per round | host syncs per round |",
             "|---|---|---|---|---|"]
    tops = ["", "Operators and device kernels with the most device time (self time, per round):", "",
            "| spec | operator or kernel | calls | ms |", "|---|---|---|---|"]
    for spec, setting in [(s, k) for s in args.spec for k in kernel_settings.settings(args)]:
        with kernel_settings.applied(setting):
            row, top = profile_spec(spec, x, args.rounds, args.top, args.shapes, kernel_settings.label(setting))
        print(f"{row['spec']:20s} wall {row['wall_ms']:.3f} ms  kernels {row['device_ms']:.3f} ms  "
              f"{row['kernels']:.0f} kernels  {row['syncs']:.0f} syncs", flush=True)
        lines.append(f"| `{row['spec']}` | {row['wall_ms']:.3f} | {row['device_ms']:.3f} | {row['kernels']:.0f} | "
                     f"{row['syncs']:.0f} |")
        tops += top
    out = args.out or ROOT / "results" / "bench" / f"codec_profile_{device.type}.md"
    out.write_text("\n".join(lines + tops) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
