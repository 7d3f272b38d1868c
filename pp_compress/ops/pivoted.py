"""Rows cut into tiles with their largest values taken out exactly and a Hadamard rotation inside each tile: the
preparation that the tile-adaptive (`tile`) and vector (`vq`) quantizers share.

A LLaMA model's attention-sink token carries one channel ~100x the others. Taken out (its value in the input
dtype and its position as int16 travel exactly) it no longer sets a tile's scale; the rotation then spreads what
outliers remain over the tile, so a tile's values look like a gaussian sample whatever the channel. A row whose
length is not a multiple of the tile size is padded with zeros (none for LLM widths).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import hadamard, triton_pivoted
from .base import Context, TensorSpec

MAX_PIVOTS = 8
MAX_ROW = 2**15
"""Positions travel as int16."""


class Dims(NamedTuple):
    rows: int
    """Rows of the last dim (tokens)."""
    d: int
    """Row length."""
    tiles: int
    """Tiles over the whole tensor: rows * ceil(d / size)."""
    pivots: int
    """Values per row sent exactly: min(k, d)."""


def check(op: str, size: int, pivots: int, rot: bool, multiple_of: int = 1) -> None:
    """ValueError naming `op` and the accepted values where the tiling options cannot work: a tile of at least 2
    channels that `multiple_of` divides, a power of two where the Hadamard rotation runs, 0..MAX_PIVOTS pivots."""
    if size < 2 or size % multiple_of or (rot and size & (size - 1)):
        by = f" that {multiple_of} divides" if multiple_of > 1 else ""
        raise ValueError(f"{op} size={size}; accepted: an integer >= 2{by}, a power of two with rotation")
    if not 0 <= pivots <= MAX_PIVOTS:
        raise ValueError(f"{op} pivots={pivots}; accepted: 0..{MAX_PIVOTS}")


def dims(shape: tuple[int, ...], size: int, pivots: int, where: str, spec: str) -> Dims:
    """The tiling of a tensor of `shape`; ValueError where its rows are too long for int16 positions."""
    d = shape[-1] if shape else 1
    if d >= MAX_ROW:
        raise ValueError(f"{where}: {spec} sends pivot positions as int16; rows of {d} values (shape {tuple(shape)}) "
                         "are too long")
    rows = TensorSpec(tuple(shape), torch.float32).numel // max(d, 1)
    return Dims(rows, d, rows * -(-d // size), min(pivots, d))


def pivot_layout(dm: Dims, dtype: torch.dtype) -> list[TensorSpec]:
    """The pivots' wire tensors: values in the input dtype, then int16 positions."""
    return [TensorSpec((dm.rows * dm.pivots,), dtype), TensorSpec((dm.rows * dm.pivots,), torch.int16)]


def split(x: Tensor, dm: Dims, size: int, rot: bool, ctx: Context, salt: str,
          fused: bool) -> tuple[Tensor, list[Tensor]]:
    """(tiles (dm.tiles, size) fp32 with the pivots zeroed and rotated if `rot`, [pivot values, int16 positions]).
    `fused`: on a CUDA device, one kernel (ops/triton_pivoted.py), the same bits."""
    rows, d, tiles, k = dm
    if fused and triton_pivoted.usable(x, d, size):
        t, vals, pos = triton_pivoted.split(x, k, size, rot, ctx.noise_key(salt) if rot else 0)
        return t, [vals, pos]
    width = tiles // rows * size
    if width == d:  # the rows fill their tiles: one converting copy, no zero fill
        flat = x.reshape(rows, d).to(torch.float32, copy=True)  # (rows, d)
    else:
        flat = x.new_zeros((rows, width), dtype=torch.float32)  # (rows, d padded), zeros beyond d
        flat[:, :d] = x.reshape(rows, d)
    a = flat[:, :d].abs()  # (rows, d)
    pos = a.new_empty((rows, k), dtype=torch.int64)
    for j in range(k):  # the largest first; of equals the lowest position (argmax's choice; topk's is unspecified)
        pos[:, j] = a.argmax(1)
        a.scatter_(1, pos[:, j:j + 1], -1.0)
    vals = x.reshape(rows, d).gather(1, pos)  # (rows, k), exact, in x.dtype
    flat.scatter_(1, pos, 0.0)
    if rot:
        flat = hadamard.rotate(flat, size, ctx.noise_key(salt), fused)  # (rows, d padded)
    return flat.reshape(tiles, size), [vals.reshape(-1), pos.to(torch.int16).reshape(-1)]


def merge(t: Tensor, pivots: list[Tensor], dm: Dims, shape: tuple[int, ...], dtype: torch.dtype, rot: bool,
          ctx: Context, salt: str, fused: bool) -> Tensor:
    """Inverse of `split`: tiles (dm.tiles, size) fp32 and the pivots -> a tensor of `shape` in `dtype`."""
    rows, d, _, k = dm
    if fused and triton_pivoted.usable(t, d, t.shape[1]):
        return triton_pivoted.merge(t, *pivots, shape, dtype, t.shape[1], rot, ctx.noise_key(salt) if rot else 0)
    flat = t.reshape(rows, -1)  # (rows, d padded)
    if rot:
        flat = hadamard.unrotate(flat, t.shape[1], ctx.noise_key(salt), fused=fused)  # fp32
    flat = flat[:, :d].contiguous()  # (rows, d)
    vals, pos = pivots
    flat.scatter_(1, pos.long().reshape(rows, k), vals.float().reshape(rows, k))
    return flat.reshape(shape).to(dtype)
