"""topk:<ratio>: keep the largest-|x| fraction of each group (sample, row or whole tensor).

Wire: the kept values in the input dtype (compose `topk:0.1>bf16` or `>int8` for cheaper values),
plus their positions either as indices (int16 when a group has <= 65536 elements, else int32) or as
a bitmap of one bit per element, whichever is smaller (`index=auto`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .bits import pack_bits, packed_nbytes, unpack_bits
from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .sparse import (SPARSE_PER, check_sparse, from_wire_index, index_dtype, keep_count, scatter, sparse_groups,
                     to_wire_index)

INDEX_MODES = ("auto", "index", "bitmap")


@dataclass(frozen=True)
class TopKConfig(OpConfig):
    """Top-K sparsification, e.g. `topk:0.1`, `topk:0.05:per=row`, `topk:0.3:index=bitmap`."""

    NAME: ClassVar[str] = "topk"
    POSITIONAL: ClassVar[str | None] = "ratio"
    FORMS: ClassVar[str] = f"topk:<ratio in (0,1]>[:per={'|'.join(SPARSE_PER)}][:index={'|'.join(INDEX_MODES)}]"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    EXAMPLES: ClassVar[tuple[str, ...]] = ("topk:0.1", "topk:0.3:per=row", "topk:0.05:per=tensor",
                                           "topk:0.5:index=bitmap", "topk:0.01:index=index")

    ratio: float = 0.1
    """Fraction of each group's elements that is kept."""
    per: str = "sample"
    """Group: sample (dims 1.. of each sample, as in the paper), row (last dim) or tensor."""
    index: str = "auto"
    """Position encoding: index (int16/int32 per kept value), bitmap (1 bit per element) or auto."""

    def __post_init__(self) -> None:
        check_sparse("topk", self.ratio, self.per)
        if self.index not in INDEX_MODES:
            raise ValueError(f"topk index={self.index!r}; accepted: {', '.join(INDEX_MODES)}")

    def build(self) -> "TopK":
        return TopK(self)


class TopK(Compressor):
    config: TopKConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "sample"

    def _plan(self, shape: tuple[int, ...]) -> tuple[int, int, int, torch.dtype | None]:
        """(groups, size, k, index dtype or None for a bitmap) — the same on both sides."""
        groups, size = sparse_groups(shape, self.config.per)
        k = keep_count(self.config.ratio, size)
        idx_dtype = index_dtype(size)
        mode = self.config.index
        if mode == "auto":
            index_bytes = groups * k * idx_dtype.itemsize
            mode = "bitmap" if packed_nbytes(groups * size, 1) < index_bytes else "index"
        return groups, size, k, (idx_dtype if mode == "index" else None)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        groups, size, k, idx_dtype = self._plan(tuple(shape))
        where = (TensorSpec((packed_nbytes(groups * size, 1),), torch.uint8) if idx_dtype is None
                 else TensorSpec((groups, k), idx_dtype))
        return [TensorSpec((groups, k), dtype), where]

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        groups, size, k, _ = self._plan(tuple(x.shape))
        index = torch.topk(x.reshape(groups, size).abs(), k, dim=1, sorted=False).indices  # (groups, k)
        return self.encode_at(x, index)

    def encode_at(self, x: Tensor, index: Tensor) -> Payload:
        """TopK's payload for positions chosen elsewhere: `index` (groups, k) of each group (see `_plan`), distinct
        per group. mdtopk's importance-weighted choice travels this way."""
        groups, size, k, idx_dtype = self._plan(tuple(x.shape))
        g = x.reshape(groups, size)  # (groups, size)
        if idx_dtype is None:
            mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, index, True)  # (groups, size)
            values = g.gather(1, index.sort(dim=1).values)  # (groups, k), in position order (a mask's count is
            # known here, but indexing by it would read it back from the device)
            return Payload((values, pack_bits(mask.view(-1), 1)), x.shape, x.dtype)
        values = g.gather(1, index)  # (groups, k)
        return Payload((values, to_wire_index(index, idx_dtype)), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        groups, size, k, idx_dtype = self._plan(tuple(payload.shape))
        values, where = payload.tensors
        if idx_dtype is None:
            mask = unpack_bits(where, 1, groups * size).bool()  # (groups * size,)
            out = values.new_zeros(groups * size).masked_scatter_(mask, values.reshape(-1))  # positions in order
            return out.view(payload.shape).to(payload.dtype)
        return scatter(values, from_wire_index(where), groups, size).view(payload.shape).to(payload.dtype)
