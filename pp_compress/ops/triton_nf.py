"""Device kernels for `nf<b>` (ops/nf.py), per row, per block or per tensor with 2**b levels, nearest or stochastic:
one Triton kernel to encode and one to decode, where the torch code launches 33 per round trip on an H100
(results/bench/h100/codec_profile_cuda_fp32.md).

Each program takes one group (G values, the row, the block or the tensor) in registers:
- encode: read x once; absmax; the scale rounded up to the scale dtype (groups.round_scale); u = x times the scale's
  fp32 reciprocal, clamped to [-1, 1]; the nearest level (a binary search over the midpoints, one gather per bit), or
  the lower of the two neighbouring levels and up with probability by distance (ops/noise.py's counter-based
  uniforms, so that any device draws the same); bit-pack; write codes and scale;
- decode: read codes and scale once; look the levels up; multiply; write in the output dtype.

The operations are the eager reference's (`nf<b>:kernel=eager`), in the same order and with the same IEEE roundings
(division `div_rn`, no contracted multiply-adds), so codes, scales and outputs are the reference's bitwise.

The finiteness checks ride along: the encoder sets one flag where a value of x is NaN/Inf (the compressor's input
check) and another where a group's scale is not finite (the reference's scale check, which a NaN in x also trips);
the decoder sets one where an output is not finite in its dtype.

`TRITON_INTERPRET=1` (set before the kernels' module is imported) runs the kernels on CPU tensors: the test suite
checks them there against the eager reference. The operator calls them on CUDA tensors only (`usable`).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
from torch import Tensor

from .deferred import Flag
from .groups import ROUND_UP
from .triton_int import MAX_TILE, available
from .triton_launch import launch


@functools.lru_cache(maxsize=256)
def supports(numel: int, group: int, bits: int) -> bool:
    """Whether groups of `group` values that tile `numel` take these kernels: whole bytes of 8 codes per group where
    codes are narrower than a byte, and a group's block within MAX_TILE."""
    return (group > 0 and numel % group == 0 and 2 <= bits <= 8 and (bits == 8 or group % 8 == 0)
            and _block(group) <= MAX_TILE)


def usable(like: Tensor, numel: int, group: int, bits: int) -> bool:
    """Whether these groups on `like`'s device take these kernels here (CUDA devices with Triton)."""
    return like.is_cuda and numel > 0 and supports(numel, group, bits) and available()


@functools.cache
def _kernels() -> ModuleType:
    from . import _triton_nf_kernels

    return _triton_nf_kernels


def _block(group: int) -> int:
    return max(8, 1 << math.ceil(math.log2(group)))


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def encode(x: Tensor, lv: Tensor, mid: Tensor, group: int, bits: int, scale_dtype: torch.dtype, key: int | None,
           flag_in: Flag | None, flag_scale: Flag) -> tuple[Tensor, Tensor]:
    """(packed codes, one scale per group in `scale_dtype`) of x as ops/nf.py's reference per group of `group`
    consecutive values; `key` the stochastic rounding's noise key (None: the nearest level). The kernel sets
    `flag_in` where a value of x is NaN/Inf, `flag_scale` where a scale is not finite."""
    x = x.contiguous()
    groups = x.numel() // group
    block = _block(group)
    codes = torch.empty(x.numel() * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(groups, dtype=scale_dtype, device=x.device)  # (groups,)
    launch(_kernels().encode, groups, (x, lv, mid, codes, scale, (flag_in or flag_scale).buf, flag_scale.buf),
           (key or 0, flag_in.index if flag_in else 0, flag_scale.index),
           (group, block, bits, ROUND_UP[scale_dtype], key is not None, flag_in is not None), _warps(block))
    return codes, scale


def decode(codes: Tensor, lv: Tensor, scale: Tensor, shape: tuple[int, ...], dtype: torch.dtype, group: int,
           bits: int, flag: Flag | None) -> Tensor:
    """Inverse of `encode`: the tensor of `shape` in `dtype`; with `flag`, the kernel also sets it where an output
    value is not finite (checked in the same pass)."""
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    block = _block(group)
    launch(_kernels().decode, out.numel() // group, (codes, lv, scale, out, flag.buf if flag else out),
           (flag.index if flag else 0,), (group, block, bits, flag is not None), _warps(block))
    return out
