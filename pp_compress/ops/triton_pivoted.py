"""Device kernels for ops/pivoted.py's `split` and `merge` (what `tile` runs around its integer codes): one Triton
kernel each way, where the torch code takes two kernels per pivot and about four per level of the rotation's butterfly.

- `split`, one program per row of the last dim (or, with the rotation on a large tensor, triton_int's ROWS_PER_PROGRAM
  rows one after the other, sharing the rotation's signs), holding it as a (T, S) block in registers (S the tile size,
  T the next power of two of the row's tiles; rows are zero-padded to whole tiles, as the reference pads them): read x
  once; take out the row's pivots (the largest |values|, the lowest position first among equals); [x / sqrt(S) *
  signs, butterfly]; write the pivots and the tiles (fp32);
- `merge`, one program per row: read the tiles and the pivots once; [x / sqrt(S), butterfly, * signs]; put the pivots
  back; write the row in the output dtype.

The pivots are taken out and put back by the helpers that vq's kernels use too (ops/_triton_pivoted_kernels.py), in
the eager reference's order and with its IEEE roundings (no contracted multiply-adds), so tiles, pivots and outputs
are the reference's bitwise.

`TRITON_INTERPRET=1` (set before the kernels' module is imported) runs the kernels on CPU tensors: the test suite
checks them there against the eager reference. `pivoted.split` and `merge` call them on CUDA tensors only (`usable`).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
from torch import Tensor

from . import triton_int
from .triton_int import MAX_TILE, available, rows_per_program, sign_table, warps
from .triton_launch import launch


@functools.lru_cache(maxsize=256)
def supports(d: int, size: int) -> bool:
    """Whether rows of d values in tiles of `size` take these kernels: tiles of a power of two (the register block's
    side) and a row's block within MAX_TILE."""
    if d < 1 or size < 2 or size & (size - 1):
        return False
    return (1 << math.ceil(math.log2(-(-d // size)))) * size <= MAX_TILE


def usable(like: Tensor, d: int, size: int) -> bool:
    """Whether rows of d values on `like`'s device take these kernels here (CUDA devices with Triton)."""
    return like.is_cuda and like.numel() > 0 and supports(d, size) and available()


@functools.cache
def _kernels() -> ModuleType:
    from . import _triton_pivoted_kernels

    return _triton_pivoted_kernels


@functools.lru_cache(maxsize=256)
def block(d: int, size: int) -> tuple[int, int, int]:
    """(tiles per row, T, log2(size)) for rows of d values in tiles of `size` (vq's kernels hold the same blocks)."""
    tpr = -(-d // size)
    return tpr, 1 << math.ceil(math.log2(tpr)), size.bit_length() - 1


@functools.lru_cache(maxsize=256)
def _plan(d: int, size: int, k: int, rot: bool, r: int, table: bool, butterfly: str) -> tuple[tuple, int]:
    """(the kernels' constexprs, their warps) for rows of d values: the same few per boundary, worked out once."""
    tpr, t, logs = block(d, size)
    return (d, tpr, t, size, logs, k, rot, 1 / math.sqrt(size), r, table, butterfly == "sum"), warps(t, size)


def block_signs(rows: int, d: int, size: int, rot: bool, rot_key: int, like: Tensor) -> Tensor | None:
    """`sign_table` for the (T, size) block of rows of d values that these kernels and vq's hold, where they rotate."""
    return sign_table(rows, block(d, size)[1] * size, rot_key, like) if rot else None


def split(x: Tensor, k: int, size: int, rot: bool, rot_key: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tiles (rows * ceil(d / size), size) fp32 with the pivots zeroed and rotated if `rot`, pivot values (rows * k,)
    in x's dtype, their int16 positions) of x (..., d), as ops/pivoted.py's reference; `rot_key` the signs' key."""
    d = x.shape[-1]
    rows = x.numel() // d
    r = rows_per_program(rows, size if rot else 0)
    signs = block_signs(rows, d, size, rot, rot_key, x)
    consts, warps = _plan(d, size, k, rot, r, signs is not None, triton_int.BUTTERFLY)
    x = x.contiguous()
    t = torch.empty((rows * consts[1], size), dtype=torch.float32, device=x.device)  # (tiles, size)
    vals = torch.empty(rows * k, dtype=x.dtype, device=x.device)  # (rows * k,)
    pos = torch.empty(rows * k, dtype=torch.int16, device=x.device)
    launch(_kernels().split, -(-rows // r), (x, t, vals, pos, t if signs is None else signs), (rot_key, rows), consts,
           warps)
    return t, vals, pos


def merge(t: Tensor, vals: Tensor, pos: Tensor, shape: tuple[int, ...], dtype: torch.dtype, size: int, rot: bool,
          rot_key: int) -> Tensor:
    """Inverse of `split`: the tensor of `shape` in `dtype` from the tiles (fp32) and the pivots."""
    out = torch.empty(shape, dtype=dtype, device=t.device)
    d = shape[-1]
    rows = out.numel() // d
    r = rows_per_program(rows, size if rot else 0)
    signs = block_signs(rows, d, size, rot, rot_key, out)
    consts, warps = _plan(d, size, vals.numel() // rows, rot, r, signs is not None, triton_int.BUTTERFLY)
    launch(_kernels().merge, -(-rows // r), (t.contiguous(), vals, pos, out, out if signs is None else signs),
           (rot_key, rows), consts, warps)
    return out
