"""Device kernels for symmetric per-row `int<b>` (b in 2..8), nearest or stochastic, with or without the Hadamard
rotation: one Triton kernel for encode and one for decode, where the eager torch code takes 10-40 small kernels.

Each program takes one row of the last dim (or, with the rotation on a large tensor, ROWS_PER_PROGRAM rows one after
the other, sharing the signs) as a (P, N) tile in registers, N the rotation block (or, without
rotation, the largest power of two up to 256 that divides the row) and P the next power of two of row / N:
- encode: read x once, [x / sqrt(N) * signs, butterfly], absmax, scale (rounded up to the scale dtype), divide,
  round (to nearest even, or floor(q + u) with ops/noise.py's counter-based u), bit-pack, write codes and scale;
- decode: read codes and scale once, unpack, multiply, [x / sqrt(N), butterfly, * signs], write in the output dtype.

The operations are the eager reference's (ops/quant.py, ops/hadamard.py's butterfly, lowest bit first), in the same
order and with the same IEEE roundings (division `div_rn`; `enable_fp_fusion=False`, since a multiply-add contracted
into one rounding would differ), so codes, scales and outputs are the reference's bitwise.

The finiteness checks ride along: the encoder sets a flag (a slot of ops/deferred.py's `Flag`) where a value of x is NaN/Inf
and gives that row a NaN scale, as the reference does; the decoder sets one where an output is not finite in its dtype.
Neither side reads x or the output again for the check. `screen` is the same check alone, for the operators without
kernels of their own: one pass, where torch.isfinite(t).all() takes five kernels.

The kernels launch through ops/triton_launch.py, which calls each compiled kernel directly after its first launch.

`TRITON_INTERPRET=1` (set before this module is imported) runs the kernels on CPU tensors: the test suite checks them
there against the eager reference. The operators call them on CUDA tensors only (`usable`).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from .deferred import Flag
from .groups import ROUND_UP
from .triton_launch import launch

MAX_TILE = 1 << 15
"""Largest row (elements) a program holds in registers; longer rows run the eager reference."""
AUTO_BLOCK = 256


@functools.cache
def available() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=256)  # asked several times per message, for a handful of row lengths
def tile(last: int, rot: int) -> tuple[int, int]:
    """(P, N): the row's tile, N the rotation block or the largest power of two <= AUTO_BLOCK dividing `last`."""
    n = rot
    if not n:
        n = 1
        while n < AUTO_BLOCK and last % (2 * n) == 0:
            n *= 2
    return 1 << max(0, math.ceil(math.log2(last // n))), n


@functools.lru_cache(maxsize=256)
def supports(last: int, bits: int, rot: int) -> bool:
    """Whether rows of `last` values take these kernels: packed widths need whole bytes of 8 codes per row and tile
    columns, and the tile must fit MAX_TILE."""
    if last < 1:
        return False
    p, n = tile(last, rot)
    return 2 <= bits <= 8 and p * n <= MAX_TILE and (bits == 8 or (last % 8 == 0 and n % 8 == 0))


def usable(like: Tensor, last: int, bits: int, rot: int) -> bool:
    """Whether rows of `last` values on `like`'s device take these kernels here (CUDA devices with Triton)."""
    return like.is_cuda and like.numel() > 0 and supports(last, bits, rot) and available()


@functools.lru_cache(maxsize=256)
def warps(p: int, n: int) -> int:
    """Warps for a program holding a (p, n) block: one per 256 values, 1..16."""
    return max(1, min(16, p * n // 256))


@functools.cache
def _kernels() -> ModuleType:
    from . import _triton_int_kernels

    return _triton_int_kernels


ROWS_PER_PROGRAM = 1
"""Rows one program of the int kernels and of vq's `prepare` and `decode` (ops/triton_vq.py) takes with the rotation,
when the tensor has at least SHARED_SIGNS_ROWS rows: the rotation's
signs are the same for every row (one counter-based hash per position, three 64-bit multiplies), so a program that
takes several rows computes them once, at the cost of more registers per thread (sm_90: 64 instead of 32 at 4 rows of
2048, results/bench/ptxas/). 1 until a GPU measures more rows faster: `benchmarks/ops.py --rows-per-program 1
--rows-per-program 4` times both in one run."""
SHARED_SIGNS_ROWS = 4096
"""Fewer rows than this keep one row per program: a grid of rows / 4 programs would leave SMs idle."""


@functools.lru_cache(maxsize=1024)
def rows_per_program(rows: int, rot: int) -> int:
    """How many rows each program of the encode and decode kernels takes."""
    return ROWS_PER_PROGRAM if rot and rows >= SHARED_SIGNS_ROWS else 1


SIGN_TABLE_ROWS: int | None = 8192
"""Rotated tensors with at least this many rows have their rotation's signs computed once per message, as a table
of the block's positions that one small kernel writes (`sign_table`) and every program of the int, vq and `tile`
kernels reads, instead of each program hashing every position of its row: the hash (three 64-bit multiplies per
value) is a large share of a rotated kernel's instructions, and a decoder computes it twice, in the register layouts
of its load and of its store (results/bench/ptxas/README.md). The table costs one more launch per message, which
small messages feel most: up to 2048 rows the launch costs more than the hash saves, from 8192 rows the kernels
are shorter with the table (results/bench/h200/2026-12-04/README.md). None: every program hashes."""
SIGN_BLOCK = 1024
"""Positions per program of `sign_table`."""
BUTTERFLY: Literal["split", "sum"] = "split"
"""How the rotating kernels (int, vq, `tile`) spell each level of the rotation's butterfly: the same arithmetic and
the same bits (`_triton_int_kernels.butterfly`), laid out differently by Triton. "split": the pair's axis moved last and
split, whose layout conversions go through shared memory, with a barrier each; "sum": sums over the pair's axis where
it lies, which take warp shuffles instead: far fewer barriers in most kernels, and fewer registers in vq's `prepare`,
but more instructions or shared-memory traffic in some (results/bench/ptxas/README.md). "split": with "sum", an H200
ran `int4:rot`'s decoder and vq's about 2x and 10x slower (results/bench/h200/2026-12-04/README.md)."""


def sign_table(rows: int, length: int, rot_key: int, like: Tensor) -> Tensor | None:
    """The rotation's signs at positions 0 .. length - 1 of a row (length,) fp32 on `like`'s device, for the kernels to
    read (one launch), or None where they hash them themselves (fewer rows than SIGN_TABLE_ROWS)."""
    if SIGN_TABLE_ROWS is None or rows < SIGN_TABLE_ROWS:
        return None
    out = torch.empty(length, dtype=torch.float32, device=like.device)  # (length,)
    launch(_kernels().sign_table, -(-length // SIGN_BLOCK), (out,), (rot_key, length), (SIGN_BLOCK,), 4)
    return out


@functools.lru_cache(maxsize=1024)
def _encode_plan(last: int, bits: int, scale_dtype: torch.dtype, rot: int, stoch: bool, check: bool,
                 r: int, gather: bool, table: bool, butterfly: str) -> tuple[tuple, int]:
    """(the encode kernel's constexprs, its warps): the same few per boundary, worked out once."""
    p, n = tile(last, rot)
    return (last, p, n, bits, bool(rot), stoch, ROUND_UP[scale_dtype], 1 / math.sqrt(n), n.bit_length() - 1,
            check, r, gather, table, butterfly == "sum"), warps(p, n)


@functools.lru_cache(maxsize=1024)
def _decode_plan(last: int, bits: int, rot: int, check: bool, r: int, scatter: bool,
                 table: bool, butterfly: str) -> tuple[tuple, int]:
    """(the decode kernel's constexprs, its warps)."""
    p, n = tile(last, rot)
    return (last, p, n, bits, bool(rot), 1 / math.sqrt(n), n.bit_length() - 1, check, r, scatter,
            table, butterfly == "sum"), warps(p, n)


def _signs(rows: int, last: int, rot: int, rot_key: int, like: Tensor) -> Tensor | None:
    """`sign_table` for the int kernels' (P, N) block of rows of `last` values, where they rotate."""
    if not rot:
        return None
    p, n = tile(last, rot)
    return sign_table(rows, p * n, rot_key, like)


def sym_encode(x: Tensor, bits: int, scale_dtype: torch.dtype, rot: int = 0, rot_key: int = 0,
               key: int | None = None, flag: Flag | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes (ceil(numel * bits / 8),) uint8 and one scale per row (rows,) in `scale_dtype` of x (..., last), as
    ops/quant.py's per-row reference; `rot` the Hadamard block and `rot_key` its signs' key (ops/hadamard.py), `key`
    the stochastic rounding's noise key (None: round to nearest). With `flag`, the kernel also sets it where a value
    of x is not finite (checked in the same pass). With `rows` (int64 indices of x's rows), those rows in that order:
    the codes of x[rows] without the gathered copy."""
    last = x.shape[-1]
    n_rows = x.numel() // last if rows is None else rows.numel()
    r = rows_per_program(n_rows, rot)
    signs = _signs(n_rows, last, rot, rot_key, x)
    consts, warps_ = _encode_plan(last, bits, scale_dtype, rot, key is not None, flag is not None, r, rows is not None,
                                  signs is not None, BUTTERFLY)
    x = x.contiguous()
    codes = torch.empty(n_rows * last * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scale = torch.empty(n_rows, dtype=scale_dtype, device=x.device)  # (rows,)
    tensors = (x, x if rows is None else rows, codes, scale, flag.buf if flag else scale,
               scale if signs is None else signs)
    ints = (rot_key, key or 0, flag.index if flag else 0, n_rows)
    launch(_kernels().encode, -(-n_rows // r), tensors, ints, consts, warps_)
    return codes.view(torch.uint8), scale


def sym_decode(codes: Tensor, scale: Tensor, shape: tuple[int, ...], dtype: torch.dtype, bits: int, rot: int = 0,
               rot_key: int = 0, flag: Flag | None = None, into: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Inverse of sym_encode: the tensor of `shape` in `dtype` from codes and per-row scales; with `flag`, the kernel
    also sets it where an output value is not finite (checked in the same pass). With `into` = (out, rows), the
    decoded rows are written to out[rows] instead (out (..., shape[-1]) of `dtype`, rows int64 indices), and out is
    returned."""
    if into is None:
        out, rows = torch.empty(shape, dtype=dtype, device=codes.device), None
    else:
        out, rows = into
    n_rows = math.prod(shape[:-1])  # per message: no TensorSpec on the hot path
    r = rows_per_program(n_rows, rot)
    signs = _signs(n_rows, shape[-1], rot, rot_key, out)
    consts, warps_ = _decode_plan(shape[-1], bits, rot, flag is not None, r, rows is not None, signs is not None,
                                  BUTTERFLY)
    launch(_kernels().decode, -(-n_rows // r), (codes.view(torch.int8) if bits == 8 else codes, scale,
                                                out if rows is None else rows, out, flag.buf if flag else out,
                                                out if signs is None else signs),
           (rot_key, flag.index if flag else 0, n_rows), consts, warps_)
    return out


SCREEN_BLOCK = 4096
EXPONENTS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
             torch.float16: (torch.int16, 0x7C00)}
"""Per dtype: the integers of its width, and its exponent mask (all ones: NaN or Inf)."""


def screens(t: Tensor) -> bool:
    """Whether `screen` takes this tensor here: a contiguous CUDA tensor of a dtype in EXPONENTS, with Triton."""
    return t.is_cuda and t.dtype in EXPONENTS and t.is_contiguous() and available()


def screen(t: Tensor, flag: Flag) -> None:
    """Set `flag` where a value of `t` is NaN/Inf: one kernel reading t once (torch.isfinite(t).all() is 5)."""
    idt, exp = EXPONENTS[t.dtype]
    n = t.numel()
    launch(_kernels().screen, -(-n // SCREEN_BLOCK), (t.view(idt), flag.buf), (n, flag.index), (SCREEN_BLOCK, exp), 4)


def sums(x: Tensor, y: Tensor) -> bool:
    """Whether `error_sums` takes this pair here: contiguous CUDA float tensors of one size, with Triton."""
    return x.numel() == y.numel() and screens(x) and screens(y)


def error_sums(x: Tensor, y: Tensor, acc: Tensor) -> None:
    """acc (2,) fp64 += (||x - y||^2, ||x||^2): one kernel reading x and y once (the statistics' relative error)."""
    n = x.numel()
    launch(_kernels().error_sums, -(-n // SCREEN_BLOCK), (x, y, acc), (n,), (SCREEN_BLOCK,), 4)
