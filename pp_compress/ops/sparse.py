"""Shared by topk and randk: groups for `per`, k from the ratio, scatter back."""
from __future__ import annotations

import torch
from torch import Tensor

SPARSE_PER = ("sample", "tensor", "row")


def check_sparse(name: str, ratio: float, per: str) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name} ratio={ratio!r}; accepted: a number in (0, 1], e.g. {name}:0.1")
    if per not in SPARSE_PER:
        raise ValueError(f"{name} per={per!r}; accepted: {', '.join(SPARSE_PER)}")


def sparse_groups(shape: tuple[int, ...], per: str) -> tuple[int, int]:
    """(groups, elements per group): per sample = dims 1.. flattened (the paper's choice)."""
    numel = 1
    for s in shape:
        numel *= s
    if per == "tensor" or len(shape) < 2:
        return (1 if numel else 0), numel
    size = shape[-1]
    if per == "sample":
        for d in shape[1:-1]:
            size *= d
    return (numel // size if size else 0), size


def keep_count(ratio: float, n: int) -> int:
    """How many of n elements a group keeps: round(ratio * n), at least 1 (0 for empty groups)."""
    return 0 if n == 0 else max(1, min(n, round(ratio * n)))


_INT16_SPAN = 1 << 16


def index_dtype(size: int) -> torch.dtype:
    """Dtype of positions in 0..size-1 on the wire: int16 (shifted into its range) up to 65536, else int32."""
    return torch.int16 if size <= _INT16_SPAN else torch.int32


def to_wire_index(index: Tensor, dtype: torch.dtype) -> Tensor:
    """Positions (int64) as `dtype`: int16 holds 0..65535 shifted by -32768."""
    return (index - _INT16_SPAN // 2 if dtype == torch.int16 else index).to(dtype)


def from_wire_index(where: Tensor) -> Tensor:
    """Inverse of `to_wire_index`: int64 positions."""
    return where.long() + (_INT16_SPAN // 2 if where.dtype == torch.int16 else 0)


def scatter(values: Tensor, index: Tensor, groups: int, size: int) -> Tensor:
    """Dense (groups, size) tensor with `values` (groups, k) at `index` (groups, k), zeros elsewhere."""
    return values.new_zeros(groups, size).scatter_(1, index, values)
