"""Wire format: Payload <-> one flat uint8 buffer (bit packing itself is in ops/bits.py).

A payload is a few tensors of different dtypes. `to_buffer` lays them into one contiguous uint8
buffer (largest item size first, so every tensor starts aligned and `from_buffer` returns zero-copy
views); a receiver that knows the layout allocates exactly `layout_nbytes(layout)` bytes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops.base import Layout, Payload, TensorSpec, layout_nbytes
from .ops.bits import pack_bits, packed_nbytes, unpack_bits

__all__ = ["from_buffer", "pack_bits", "packed_nbytes", "to_buffer", "unpack_bits"]

def _order(layout: Layout) -> list[int]:
    """Largest item size first (stable): every tensor then starts at an aligned offset."""
    return sorted(range(len(layout)), key=lambda i: -layout[i].dtype.itemsize)


def to_buffer(payload: Payload, out: Tensor | None = None) -> Tensor:
    """Copy the payload's tensors into one flat uint8 buffer (into `out` when given)."""
    layout = payload.layout
    total = layout_nbytes(layout)
    device = payload.tensors[0].device if payload.tensors else torch.device("cpu")
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.numel() != total or out.dtype != torch.uint8:
        raise ValueError(f"buffer has {out.numel()} x {out.dtype}, payload needs {total} x torch.uint8")
    offset = 0
    for i in _order(layout):
        t = payload.tensors[i]
        nbytes = layout[i].nbytes
        if nbytes:
            out[offset : offset + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        offset += nbytes
    return out


def from_buffer(buffer: Tensor, layout: Layout, shape: torch.Size, dtype: torch.dtype) -> Payload:
    """Views into `buffer` shaped as `layout` (the inverse of `to_buffer`)."""
    total = layout_nbytes(layout)
    if buffer.numel() != total:
        raise ValueError(f"buffer has {buffer.numel()} bytes, layout needs {total}")
    tensors: list[Tensor | None] = [None] * len(layout)
    offset = 0
    for i in _order(layout):
        spec: TensorSpec = layout[i]
        chunk = buffer[offset : offset + spec.nbytes]
        tensors[i] = chunk.view(spec.dtype).view(spec.shape)
        offset += spec.nbytes
    return Payload(tuple(tensors), torch.Size(shape), dtype)  # type: ignore[arg-type]
