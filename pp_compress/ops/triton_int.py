"""Device kernels for symmetric per-row `int<b>` (b in 2..8), nearest or stochastic, with or without the Hadamard
rotation: one Triton kernel for encode and one for decode, where the eager torch code takes 10-40 small kernels.

Each program takes one row of the last dim as a (P, N) tile in registers, N the rotation block (or, without
rotation, the largest power of two up to 256 that divides the row) and P the next power of two of row / N:
- encode: read x once, [x / sqrt(N) * signs, butterfly], absmax, scale (rounded up to the scale dtype), divide,
  round (to nearest even, or floor(q + u) with ops/noise.py's counter-based u), bit-pack, write codes and scale;
- decode: read codes and scale once, unpack, multiply, [x / sqrt(N), butterfly, * signs], write in the output dtype.

The operations are the eager reference's (ops/quant.py, ops/hadamard.py's butterfly, lowest bit first), in the same
order and with the same IEEE roundings (division `div_rn`; `enable_fp_fusion=False`, since a multiply-add contracted
into one rounding would differ), so codes, scales and outputs are the reference's bitwise.

The finiteness checks ride along: a row holding NaN/Inf gets a non-finite scale (so the encoder's input check reads
the scales, not x again), and the decoder raises a flag where an output is not finite in its dtype (so the receiver's
check reads one number, not the output again).

`TRITON_INTERPRET=1` (set before this module is imported) runs the kernels on CPU tensors: the test suite checks them
there against the eager reference. The operators call them on CUDA tensors only (`usable`).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
from torch import Tensor

from .groups import ROUND_UP

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


def tile(last: int, rot: int) -> tuple[int, int]:
    """(P, N): the row's tile, N the rotation block or the largest power of two <= AUTO_BLOCK dividing `last`."""
    n = rot
    if not n:
        n = 1
        while n < AUTO_BLOCK and last % (2 * n) == 0:
            n *= 2
    return 1 << max(0, math.ceil(math.log2(last // n))), n


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


def _warps(p: int, n: int) -> int:
    return max(1, min(16, p * n // 256))


@functools.cache
def _kernels() -> ModuleType:
    from . import _triton_int_kernels

    return _triton_int_kernels


def sym_encode(x: Tensor, bits: int, scale_dtype: torch.dtype, rot: int = 0, rot_key: int = 0,
               key: int | None = None, check: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Codes (ceil(numel * bits / 8),) uint8 and one scale per row (rows,) in `scale_dtype` of x (..., last), as
    ops/quant.py's per-row reference; `rot` the Hadamard block and `rot_key` its signs' key (ops/hadamard.py), `key`
    the stochastic rounding's noise key (None: round to nearest). With `check`, also a one-element int32 flag, 0 when
    every value of x is finite (checked in the same pass)."""
    last = x.shape[-1]
    rows = x.numel() // last
    p, n = tile(last, rot)
    x = x.contiguous()
    codes = torch.empty(x.numel() * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scale = torch.empty(rows, dtype=scale_dtype, device=x.device)  # (rows,)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device) if check else None
    _kernels().encode[(rows,)](x, codes, scale, flag if check else scale, rot_key, key or 0, last, p, n, bits,
                               bool(rot), key is not None, ROUND_UP[scale_dtype], 1 / math.sqrt(n),
                               n.bit_length() - 1, check, num_warps=_warps(p, n), enable_fp_fusion=False)
    return codes.view(torch.uint8), scale, flag


def sym_decode(codes: Tensor, scale: Tensor, shape: tuple[int, ...], dtype: torch.dtype, bits: int, rot: int = 0,
               rot_key: int = 0, check: bool = False) -> tuple[Tensor, Tensor | None]:
    """Inverse of sym_encode: the tensor of `shape` in `dtype` from codes and per-row scales; with `check`, also a
    one-element int32 flag, 0 when every output value is finite (checked in the same pass)."""
    last = shape[-1]
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    flag = torch.zeros(1, dtype=torch.int32, device=codes.device) if check else None
    rows = out.numel() // last
    p, n = tile(last, rot)
    _kernels().decode[(rows,)](codes.view(torch.int8) if bits == 8 else codes, scale, out, flag if check else out,
                               rot_key, last, p, n, bits, bool(rot), 1 / math.sqrt(n), n.bit_length() - 1, check,
                               num_warps=_warps(p, n), enable_fp_fusion=False)
    return out, flag
