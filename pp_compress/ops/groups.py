"""Shared by the quantizers: how a tensor is cut into scale groups, and scale rounding.

Granularity `per`:
  tensor     one scale for the whole tensor
  row        one scale per row of the last dim (per token for (batch, seq, hidden))
  channel    one scale per feature position, taken over the batch dim (AQ-SGD's "fixpoint")
  block<N>   one scale per block of N consecutive elements of the flattened tensor
"""
from __future__ import annotations

import re

import torch
from torch import Tensor

SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SCALE_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}
"""How the fused kernels (csrc/fused.cpp) name the scale dtypes."""
KERNELS = ("fused", "eager")
PER_FORMS = "tensor | row | channel | block<N> (e.g. block64)"
# Relative bump that makes a scale rounded to nearest in this dtype never smaller than the exact one.
ROUND_UP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 0.0}


def check_per(per: str, allowed: tuple[str, ...] = ("tensor", "row", "channel")) -> None:
    if per in allowed:
        return
    m = re.fullmatch(r"block(\d+)", per)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"per={per!r}; accepted: {PER_FORMS}")


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")


def check_scale(scale: str) -> None:
    if scale not in SCALE_DTYPES:
        raise ValueError(f"scale={scale!r}; accepted: {', '.join(SCALE_DTYPES)}")


def block_size(per: str) -> int:
    return int(per[5:]) if per.startswith("block") else 0


def group_dims(shape: tuple[int, ...], per: str) -> tuple[int, int]:
    """(number of groups, elements per group incl. padding) for a tensor of `shape`."""
    numel = 1
    for s in shape:
        numel *= s
    if per == "tensor":
        return 1, numel
    if per == "row":
        last = shape[-1] if shape else 1
        return (numel // last if last else 0), last
    if per == "channel":
        first = shape[0] if len(shape) > 1 else 1
        return (numel // first if first else 0), first
    n = block_size(per)
    return -(-numel // n), n


def to_groups(x: Tensor, per: str) -> Tensor:
    """View/copy `x` as (groups, group_size); block mode pads the tail by repeating the last value."""
    shape = tuple(x.shape)
    groups, size = group_dims(shape, per)
    if per == "channel":
        return x.reshape(size, groups).t()  # (positions, batch)
    flat = x.reshape(-1)
    pad = groups * size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(groups, size)


def from_groups(g: Tensor, shape: tuple[int, ...], per: str) -> Tensor:
    """Inverse of `to_groups` (drops the block padding)."""
    numel = 1
    for s in shape:
        numel *= s
    if per == "channel":
        return g.t().reshape(shape)
    return g.reshape(-1)[:numel].reshape(shape)


def div_exact(x: Tensor, k: float) -> Tensor:
    """x / k rounded once, as the CPU and the device kernels (ops/triton_*.py) divide. torch on CUDA multiplies by the
    rounded reciprocal where the divisor is a Python number (an ulp off at times, enough to move a scale across a
    rounding boundary of its dtype); a one-element tensor is divided by as a tensor."""
    return x / x.new_full((1,), k)


def round_scale(s: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast positive fp32 scales to `dtype`, rounding up so quantized values never clip."""
    return (s * (1.0 + ROUND_UP[dtype])).to(dtype)


def round_down(z: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast fp32 offsets to `dtype`, rounding towards -inf (asymmetric zero points)."""
    return (z - z.abs() * ROUND_UP[dtype]).to(dtype)


def safe_scale(scale: Tensor) -> Tensor:
    """fp32 scale with zeros replaced by one (an all-zero group quantizes to zero codes)."""
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))
