"""randk:<ratio>: keep a random fraction of each group; indices never travel.

Sender and receiver draw the same indices from `ctx.generator` (seed, boundary, direction, step,
micro-batch): one random k-subset of positions, cyclically shifted by a random offset per group, so
every position is kept with probability exactly k/n. `unbiased` rescales by n/k on decode.
Wire: only the kept values, in the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .sparse import SPARSE_PER, check_sparse, keep_count, scatter, sparse_groups


@dataclass(frozen=True)
class RandKConfig(OpConfig):
    """Random-K sparsification, e.g. `randk:0.1`, `randk:0.1:unbiased`."""

    NAME: ClassVar[str] = "randk"
    POSITIONAL: ClassVar[str | None] = "ratio"
    FORMS: ClassVar[str] = f"randk:<ratio in (0,1]>[:per={'|'.join(SPARSE_PER)}][:unbiased]"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    EXAMPLES: ClassVar[tuple[str, ...]] = ("randk:0.1", "randk:0.2:unbiased:per=row")

    ratio: float = 0.1
    """Fraction of each group's elements that is kept."""
    per: str = "sample"
    """Group: sample (dims 1.. of each sample), row (last dim) or tensor."""
    unbiased: bool = False
    """Scale kept values by n/k so that E[decode(encode(x))] == x (higher variance)."""

    def __post_init__(self) -> None:
        check_sparse("randk", self.ratio, self.per)

    def build(self) -> "RandK":
        return RandK(self)


class RandK(Compressor):
    config: RandKConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "sample"

    def _index(self, shape: tuple[int, ...], device: torch.device, ctx: Context) -> tuple[Tensor, int, int]:
        groups, size = sparse_groups(shape, self.config.per)
        k = keep_count(self.config.ratio, size)
        gen = ctx.generator(device, "randk")
        subset = torch.randperm(size, generator=gen, device=device)[:k]  # (k,)
        shift = torch.randint(0, max(size, 1), (groups, 1), generator=gen, device=device)  # (groups, 1)
        return (subset + shift) % max(size, 1), groups, size  # (groups, k)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        groups, size = sparse_groups(tuple(shape), self.config.per)
        return [TensorSpec((groups, keep_count(self.config.ratio, size)), dtype)]

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        index, groups, size = self._index(tuple(x.shape), x.device, ctx)
        return Payload((x.reshape(groups, size).gather(1, index),), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        values = payload.tensors[0]  # (groups, k)
        index, groups, size = self._index(tuple(payload.shape), values.device, ctx)
        if self.config.unbiased and values.shape[1]:
            values = values * (size / values.shape[1])
        return scatter(values, index, groups, size).view(payload.shape).to(payload.dtype)
