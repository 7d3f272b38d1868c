"""Device kernels for `vq` (ops/vq.py): two Triton kernels to encode and one to decode, where the torch code takes
over 150 small kernels and a host synchronization per round trip.

- `prepare`, one program per row of the last dim (or, with the rotation on a large tensor, triton_int's
  ROWS_PER_PROGRAM rows one after the other, sharing the rotation's signs), holding it as a (T, S) block in registers
  (S the tile size, T the next power of two of the row's tiles; rows are zero-padded to whole tiles, as the reference
  pads them): read x once; take out the row's pivots (the largest |values|, the lowest position first among equals);
  [x / sqrt(S) * signs, butterfly]; each tile's RMS scale (rounded to the scale dtype); divide; write scales, pivots
  and the divided tiles (fp32);
- `search`, one program per block of vectors: read them back flat, find each one's nearest codebook point, bit-pack,
  write the codes. The pruned search measures only the few points that can be nearest anywhere in the vector's grid
  cell (ops/vq.py's `search_grid`), and a block with a vector beyond the grid measures every point;
- `decode`, one program per row: read codes, scales and pivots once; look the points up; multiply; [x / sqrt(S),
  butterfly, * signs]; put the pivots back; write in the output dtype.

The search is a kernel of its own so that its block is a flat run of vectors: one simple register layout whatever
the input dtype and row length, and few registers per thread, with Triton 3.6 as with 3.9. The
round trip of the divided tiles through memory costs 8 bytes per value; the search's arithmetic is larger.

The operations are the eager reference's (`vq:...:kernel=eager`: ops/pivoted.py, ops/hadamard.py's butterfly,
ops/vq.py's `tree_sum` and `coord_distances`), in the same order and with the same IEEE roundings (division and
square root `_rn`, no contracted multiply-adds), so payloads and outputs are the reference's bitwise.

The finiteness checks ride along: the encoder sets one flag where a value of x is NaN/Inf (the compressor's input
check) and another where a tile's scale times the codebook's outermost point overflows (the reference's check); the
decoder sets one where an output is not finite in its dtype.

`TRITON_INTERPRET=1` (set before the kernels' module is imported) runs the kernels on CPU tensors: the test suite
checks them there against the eager reference. The operator calls them on CUDA tensors only (`usable`).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from . import triton_int
from .deferred import Flag
from .triton_int import MAX_TILE, available, rows_per_program, warps
from .triton_launch import launch
from .triton_pivoted import block, block_signs


@functools.lru_cache(maxsize=256)
def supports(d: int, size: int, dim: int, code_bits: int) -> bool:
    """Whether rows of d values take these kernels: tiles of a power of two (the register block's side), whole bytes
    of 8 codes per tile where codes are narrower than a byte, and a row's block within MAX_TILE."""
    if d < 1 or size & (size - 1) or size < dim:
        return False
    tiles = -(-d // size)
    return (code_bits == 8 or (size // dim) % 8 == 0) and (1 << math.ceil(math.log2(tiles))) * size <= MAX_TILE


def usable(like: Tensor, d: int, size: int, dim: int, code_bits: int) -> bool:
    """Whether rows of d values on `like`'s device take these kernels here (CUDA devices with Triton)."""
    return like.is_cuda and like.numel() > 0 and supports(d, size, dim, code_bits) and available()


@functools.cache
def _kernels() -> ModuleType:
    from . import _triton_vq_kernels

    return _triton_vq_kernels


SEARCH_BLOCK = 512
"""Vectors per program of the search: a block with one vector beyond the grid searches every point."""
SEARCH_WARPS = 4


class Grid(NamedTuple):
    """ops/vq.py's search grid as the encoder reads it."""

    candidates: Tensor
    """(cells**dim, k) uint8 point indices per cell, ascending, on the device."""
    lo: float
    inv_h: float
    cells: int


def encode(x: Tensor, cb: Tensor, cbmax: float, size: int, dim: int, code_bits: int, pivots: int, rot: bool,
           rot_key: int, scale_dtype: torch.dtype, flag_in: Flag | None, flag_ovf: Flag,
           grid: Grid | None) -> tuple[Tensor, ...]:
    """(packed codes, per-tile scales in `scale_dtype`, pivot values in x's dtype, int16 pivot positions) of x
    (..., d) as ops/vq.py's reference; cb the codebook (points, dim) fp32 on x's device and cbmax its largest
    |coordinate|. The search measures each vector's cell's candidates in `grid` (None: every point; the same
    codes). The kernel sets `flag_in` where a value of x is NaN/Inf, `flag_ovf` where a scale overflows."""
    d = x.shape[-1]
    rows = x.numel() // d
    tpr, t, logs = block(d, size)
    k = min(pivots, d)
    x = x.contiguous()
    v = torch.empty(rows * tpr * size, dtype=torch.float32, device=x.device)  # the tiles over their scales
    n = v.numel() // dim  # vectors
    codes = torch.empty(-(-n * code_bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows * tpr, dtype=scale_dtype, device=x.device)  # (tiles,)
    vals = torch.empty(rows * k, dtype=x.dtype, device=x.device)  # (rows * k,)
    pos = torch.empty(rows * k, dtype=torch.int16, device=x.device)
    r = rows_per_program(rows, size if rot else 0)
    signs = block_signs(rows, d, size, rot, rot_key, x)  # (T * size,) fp32, or None: hashed in the kernel
    launch(_kernels().prepare, -(-rows // r), (x, v, scale, vals, pos, (flag_in or flag_ovf).buf, flag_ovf.buf,
                                              v if signs is None else signs),
           (rot_key, flag_in.index if flag_in else 0, flag_ovf.index, rows),
           (d, tpr, t, size, logs, cbmax, k, rot, 1 / math.sqrt(size), flag_in is not None, r, signs is not None,
            triton_int.BUTTERFLY == "sum"), warps(t, size))
    searched = (grid.cells, grid.candidates.shape[1], grid.lo, grid.inv_h) if grid else (0, 0, 0.0, 0.0)
    launch(_kernels().search, -(-n // SEARCH_BLOCK), (v, cb, grid.candidates if grid else cb, codes), (n,),
           (SEARCH_BLOCK, dim, cb.shape[0], code_bits, *searched), SEARCH_WARPS)
    return codes, scale, vals, pos


def decode(codes: Tensor, cb: Tensor, scale: Tensor, vals: Tensor, pos: Tensor, shape: tuple[int, ...],
           dtype: torch.dtype, size: int, dim: int, code_bits: int, rot: bool, rot_key: int,
           flag: Flag | None) -> Tensor:
    """Inverse of `encode`: the tensor of `shape` in `dtype`; with `flag`, the kernel also sets it where an output
    value is not finite (checked in the same pass)."""
    d = shape[-1]
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    tpr, t, logs = block(d, size)
    k = vals.numel() * d // out.numel()  # pivots per row
    rows = out.numel() // d
    r = rows_per_program(rows, size if rot else 0)
    signs = block_signs(rows, d, size, rot, rot_key, out)
    launch(_kernels().decode, -(-rows // r), (codes, cb, scale, vals, pos, out, flag.buf if flag else out,
                                             out if signs is None else signs),
           (rot_key, flag.index if flag else 0, rows),
           (d, tpr, t, size, logs, dim, code_bits, k, rot, 1 / math.sqrt(size), flag is not None, r,
            signs is not None, triton_int.BUTTERFLY == "sum"), warps(t, size))
    return out
