"""vq's device encoder with its two searches side by side: the pruned one (each vector's grid cell's few candidate
points) and the exhaustive one (every point). Both give the same codes (tests/unit/ops/test_triton_vq.py); this says
which is faster on this device, per codebook and message size.

    python benchmarks/vq_search.py --shape 8x1024x2048 --shape 16x576 --out results/bench/vq_search_cuda.md

Times are medians over CUDA events from an idle device, with `copy_` of the same tensor measured in the same run.
With --parts, a second table says where the encoder's time goes: the same kernel with parts of its work turned off
through its compile-time switches (a search of one point, no pivots, no rotation) or with other warp counts. Those
variants give wrong codes; they only time the parts.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

import pp_compress as ppc
from pp_compress.ops import triton_vq, vq
from pp_compress.ops.deferred import Flag
from pp_lab.bench.ops import DTYPES, timer
from pp_lab.paths import ROOT


def encoder(spec: str, x: torch.Tensor, pruned: bool):
    """A call of the device encoder for `spec`'s config on x, with the pruned or the exhaustive search."""
    c = ppc.build(spec).config
    cb = vq.codebook(c.dim, c.code_bits, x.device)
    flag = Flag(torch.zeros(1, dtype=torch.int32, device=x.device), 0, FloatingPointError, str)
    grid = vq.kernel_grid(c.dim, c.code_bits, x.device) if pruned else None
    return lambda: triton_vq.encode(x, cb, vq.max_coord(c.dim, c.code_bits), c.size, c.dim, c.code_bits, c.pivots,
                                    c.rot, 7, torch.bfloat16, None, flag, grid)


PARTS = {"as it is": ({}, None), "exhaustive search": ({"CELLS": 0}, None),  # constexprs of either kernel
         "no search": ({"CELLS": 0, "POINTS": 1}, None), "no search, no pivots": ({"CELLS": 0, "POINTS": 1, "K": 0}, None),
         "no search, no rotation": ({"CELLS": 0, "POINTS": 1, "ROT": False}, None),
         "no search, pivots or rotation": ({"CELLS": 0, "POINTS": 1, "K": 0, "ROT": False}, None),
         "4 warps": ({}, 4), "16 warps": ({}, 16)}
"""Variants of the encode kernel: constexprs replaced, and the warp count (None: the operator's)."""


def with_part(fn, change: dict, warps: int | None):
    """fn() with the encode kernel's launch changed as `change` and `warps` say (the operator's own otherwise)."""
    real = triton_vq.launch

    def launch(kernel, grid, tensors, ints, consts, num_warps):
        names = kernel.arg_names[len(tensors) + len(ints):]
        consts = tuple(change.get(n, v) for n, v in zip(names, consts))
        return real(kernel, grid, tensors, ints, consts, warps or num_warps)

    def call():
        triton_vq.launch = launch
        try:
            return fn()
        finally:
            triton_vq.launch = real
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", help="vq specs (default vq:4, vq:3, vq:2:dim=4)")
    ap.add_argument("--shape", action="append", help="e.g. 8x1024x2048 (default that and 16x576)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", action="store_true", help="also time the encoder with parts of its work turned off")
    ap.add_argument("--out", type=Path, default=ROOT / "results/bench/vq_search_cuda.md")
    args = ap.parse_args()
    device = torch.device("cuda")
    if not (torch.cuda.is_available() and triton_vq.available()):
        sys.exit("vq_search: needs a CUDA device and Triton")
    specs = args.spec or ["vq:4", "vq:3", "vq:2:dim=4"]
    lines = [f"Command: `python benchmarks/vq_search.py {shlex.join(sys.argv[1:])}`", "",
             f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}; medians of {args.reps} "
             "runs (CUDA events, from an idle device).", "",
             "| shape | spec | candidates per cell | pruned ms | exhaustive ms | speedup | encode vs copy_ |",
             "|---|---|---|---|---|---|---|"]
    for shape in args.shape or ["8x1024x2048", "16x576"]:
        dims = tuple(int(s) for s in shape.split("x"))
        x = torch.randn(dims, device=device).to(DTYPES[args.dtype])
        copy = timer(device, lambda: torch.empty_like(x).copy_(x), args.reps)
        for spec in specs:
            c = ppc.build(spec).config
            t = [timer(device, encoder(spec, x, pruned), args.reps) for pruned in (True, False)]
            k = vq.search_grid(c.dim, c.code_bits).candidates.shape[1]
            lines.append(f"| {shape} | `{spec}` | {k} of {2**c.code_bits} | {t[0] * 1e3:.3f} | {t[1] * 1e3:.3f} | "
                         f"{t[1] / t[0]:.1f}x | {copy / t[0]:.0%} |")
            print(lines[-1], flush=True)
            write(args.out, lines)
    if args.parts:
        lines += ["", "Where the encoder's time goes (ms; variants with parts turned off give wrong codes):", "",
                  "| shape | dtype | spec | " + " | ".join(PARTS) + " |", "|---|---|---|" + "---|" * len(PARTS)]
        for shape in args.shape or ["8x1024x2048", "16x576"]:
            for dname in ("fp32", "bf16"):
                x = torch.randn(tuple(int(s) for s in shape.split("x")), device=device).to(DTYPES[dname])
                for spec in specs:
                    t = [timer(device, with_part(encoder(spec, x, True), *PARTS[p]), args.reps) for p in PARTS]
                    lines.append(f"| {shape} | {dname} | `{spec}` | " + " | ".join(f"{v * 1e3:.3f}" for v in t) + " |")
                    print(lines[-1], flush=True)
                    write(args.out, lines)


def write(path: Path, lines: list[str]) -> None:
    """The table so far: a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
