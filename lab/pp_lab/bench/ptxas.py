"""Registers and spills of the device kernels, as compiled for a Hopper GPU, without one.

    python benchmarks/ptxas.py --spec int8:rot --spec vq:4 --dtype fp32 --dtype bf16 --shape 8x1024x2048 --shape 16x576
    PYTHONPATH=/path/to/triton-3.6 python benchmarks/ptxas.py ...   # another Triton (the one a GPU machine has)

A kernel that spills keeps part of its working set in local memory (the GPU's DRAM, through L1), which can make it
many times slower than its memory traffic says. Whether it spills is decided at compile time, so it can be checked
here: each operator's compress and decompress run on CPU tensors with its device path forced on and Triton's launches
recorded instead of run (the launch code the GPU runs, so the same constexprs and warp counts); each recorded kernel
is compiled for sm_90 with that Triton, and its PTX goes through the ptxas Triton itself assembles sm_90 code with, `-v`. Printed per spec,
dtype, shape and kernel: warps, registers per thread, spill stores and loads, the stack frame (bytes), and from the
machine code (cuobjdump -sass, which Triton bundles too) the instructions per thread, with its barriers, warp shuffles
and shared-memory loads and stores. The kernels have no loops over data (their loops unroll), so the static count is
what each thread runs: where a kernel is bound by its instructions rather than its memory traffic, fewer is faster,
but only a GPU's clock says by how much (latency and occupancy count too). The kernel settings of
`pp_lab.bench.kernel_settings` (`--rows-per-program`, `--sign-table-rows`) compile each value in turn.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

import pp_compress as ppc
from pp_compress.ops import triton_int, triton_nf, triton_vq
from pp_compress.ops.triton_launch import int_type
from pp_lab.bench import kernel_settings
from pp_lab.bench.ops import DTYPES
from pp_lab.paths import ROOT

MODULES = (triton_int, triton_nf, triton_vq)
"""The modules whose kernels the operators launch (each imports `launch` and defines `usable`)."""
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
                torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


@contextlib.contextmanager
def recorded() -> Iterator[list[tuple[Any, tuple, tuple, tuple, int]]]:
    """Within: the operators take their device path on CPU tensors, and each launch is recorded as (kernel, tensors,
    runtime ints, constexprs, warps) instead of run. The outputs are garbage; only the launches matter."""
    launches: list[tuple[Any, tuple, tuple, tuple, int]] = []

    def launch(kernel: Any, grid: int, tensors: tuple, ints: tuple, consts: tuple, num_warps: int) -> None:
        launches.append((kernel, tensors, ints, consts, num_warps))

    saved = [(m, name, getattr(m, name)) for m in MODULES for name in ("launch", "usable")]
    saved.append((triton_int, "screens", triton_int.screens))
    try:
        for m in MODULES:
            m.launch = launch
        triton_int.usable = lambda like, last, bits, rot: like.numel() > 0 and triton_int.supports(last, bits, rot)
        triton_nf.usable = lambda like, numel, group, bits: numel > 0 and triton_nf.supports(numel, group, bits)
        triton_vq.usable = lambda like, d, size, dim, bits: like.numel() > 0 and triton_vq.supports(d, size, dim, bits)
        triton_int.screens = lambda t: t.dtype in triton_int.EXPONENTS and t.is_contiguous()
        yield launches
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


def launches_of(spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, Any, dict, dict, int]]:
    """(encode|decode, kernel, runtime signature, constexprs, warps) of each launch of one compress + decompress."""
    op = ppc.build(spec)
    x = torch.randn(shape).to(dtype)
    out = []
    with recorded() as rec:
        payload = op.compress(x, ppc.Context(step=0))
        n = len(rec)
        op.decompress(payload, ppc.Context(step=0))
    for i, (kernel, tensors, ints, consts, warps) in enumerate(rec):
        names = kernel.arg_names
        sig = {names[j]: "*" + TRITON_TYPES[t.dtype] for j, t in enumerate(tensors)}
        sig.update({names[len(tensors) + j]: int_type(v) for j, v in enumerate(ints)})
        const = dict(zip(names[len(tensors) + len(ints):], consts))
        out.append(("encode" if i < n else "decode", kernel, sig, const, warps))
    return out


def ptxas_path() -> str:
    """The ptxas this Triton assembles sm_90 code with (its own choice among the ones it bundles)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def sm90_ptx(kernel: Any, sig: dict[str, str], const: dict, warps: int) -> str:
    """The PTX of `kernel` compiled for sm_90 (no GPU needed) for runtime arguments of Triton types `sig` (in the
    kernel's order; pointers 16-byte aligned, as torch's) and `const`, without contracted multiply-adds (as
    ops/triton_launch.py launches it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    src = ASTSource(kernel, {**sig, **{n: "constexpr" for n in const}}, const, aligned)
    return compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]


SASS_KINDS = {"barriers": ("BAR",), "shuffles": ("SHFL",), "shared": ("LDS", "STS", "LDSM", "STSM")}
"""Instruction kinds counted apart (by opcode, before its first dot): what moves data between a block's threads."""


def sass_counts(cubin: Path) -> dict[str, int]:
    """Instructions in the cubin's machine code (NOPs left out), and of each of SASS_KINDS."""
    tool = Path(ptxas_path()).with_name("cuobjdump")
    text = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    # "/*0120*/  @!P0 FADD.FTZ R1, R2, R3 ;": the opcode after the address and an optional predicate
    ops = [m[1].split(".")[0] for line in text.splitlines()
           if (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line))]
    out = {"instructions": sum(op != "NOP" for op in ops)}
    out.update({kind: sum(op in names for op in ops) for kind, names in SASS_KINDS.items()})
    return out


def resources(kernel: Any, sig: dict, const: dict, warps: int, ptxas: str) -> dict[str, int]:
    """Registers per thread, spill stores / loads and stack frame (bytes) of the kernel compiled for sm_90, and its
    machine code's counts (`sass_counts`)."""
    ptx = sm90_ptx(kernel, sig, const, warps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
        if log.returncode != 0:
            raise RuntimeError(f"ptxas failed on {kernel.__name__}: {log.stderr[-2000:]}")
        log = log.stdout + log.stderr
        counts = sass_counts(Path(tmp) / "k.cubin")

    def field(pattern: str) -> int:
        m = re.search(pattern, log)
        if m is None:
            raise RuntimeError(f"ptxas -v printed no {pattern!r}:\n{log}")
        return int(m[1])

    return {"registers": field(r"Used (\d+) registers"), "spill_stores": field(r"(\d+) bytes spill stores"),
            "spill_loads": field(r"(\d+) bytes spill loads"), "stack": field(r"(\d+) bytes stack frame"), **counts}


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}; accepted: sizes joined by x, e.g. 8x1024x2048") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", required=True, help="an operator spec (int8:rot, vq:4, nf4, ...)")
    ap.add_argument("--dtype", action="append", choices=list(DTYPES), default=None, help="default: fp32 and bf16")
    ap.add_argument("--shape", action="append", type=parse_shape, default=None, help="default: 8x1024x2048")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    kernel_settings.add_arguments(ap)
    args = ap.parse_args()
    import triton

    ptxas = ptxas_path()
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    head = [f"Command: `python benchmarks/ptxas.py {shlex.join(sys.argv[1:])}`", "",
            f"Triton {triton.__version__}, compiled for sm_90 (no GPU), `ptxas -arch=sm_90a -v` ({version}).", "",
            "| spec | dtype | shape | kernel | warps | registers | spill stores (B) | spill loads (B) | stack (B) | "
            "instructions per thread | barriers | shuffles | shared loads + stores |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(head), flush=True)
    rows = []
    for spec, setting, dt, shape in itertools.product(args.spec, kernel_settings.settings(args),
                                                      args.dtype or ["fp32", "bf16"], args.shape or [(8, 1024, 2048)]):
        with kernel_settings.applied(setting):
            found = launches_of(spec, shape, DTYPES[dt])
        if not found:
            raise SystemExit(f"{spec} on {dt} {'x'.join(map(str, shape))} launches no device kernel")
        for side, kernel, sig, const, warps in found:
            r = resources(kernel, sig, const, warps, ptxas)
            rows.append(f"| `{spec}`{kernel_settings.label(setting)} | {dt} | {'x'.join(map(str, shape))} | "
                        f"{side}: {kernel.__name__} | {warps} | {r['registers']} | {r['spill_stores']} | "
                        f"{r['spill_loads']} | {r['stack']} | {r['instructions']} | {r['barriers']} | "
                        f"{r['shuffles']} | {r['shared']} |")
            print(rows[-1], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join([*head, *rows, ""]))
        print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
