"""Composition `outer>inner`: inner compresses every floating-point tensor of outer's payload.

`topk:0.1>int8` sends TopK's indices as they are and its kept values as int8 codes + scales;
`lowrank:8>int8` quantizes both factors. The layout is the outer layout with each float tensor
replaced by the inner layout of that tensor.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import FLOAT_DTYPES, Compressor, Context, Layout, Payload


class Chain(Compressor):
    def __init__(self, outer: Compressor, inner: Compressor, nonfinite: str = "raise") -> None:
        super().__init__(f"{outer.spec}>{inner.spec}", nonfinite)
        self.outer, self.inner = outer, inner

    def _split(self, outer_layout: Layout, ctx: Context | None) -> list[Layout | None]:
        """Per outer tensor: the inner layout if it is compressed further, else None."""
        return [
            self.inner.wire_layout(s.shape, s.dtype, ctx) if s.dtype in FLOAT_DTYPES else None for s in outer_layout
        ]

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        out: Layout = []
        outer = self.outer.wire_layout(shape, dtype, ctx)
        for spec, inner in zip(outer, self._split(outer, ctx)):
            out.extend([spec] if inner is None else inner)
        return out

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        p = self.outer.encode(x, ctx)
        tensors: list[Tensor] = []
        for t in p.tensors:
            tensors.extend([t] if t.dtype not in FLOAT_DTYPES else self.inner.encode(t, ctx).tensors)
        return Payload(tuple(tensors), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        outer_layout = self.outer.wire_layout(tuple(payload.shape), payload.dtype, ctx)
        rest = list(payload.tensors)
        tensors: list[Tensor] = []
        for spec, inner in zip(outer_layout, self._split(outer_layout, ctx)):
            if inner is None:
                tensors.append(rest.pop(0))
            else:
                part, rest = rest[: len(inner)], rest[len(inner) :]
                tensors.append(self.inner.decode(Payload(tuple(part), torch.Size(spec.shape), spec.dtype), ctx))
        return self.outer.decode(Payload(tuple(tensors), payload.shape, payload.dtype), ctx)

    def batch_grouped(self) -> bool:
        return self.outer.batch_grouped()  # the inner operator sees the outer payload: no batch dim there

    def observe(self, grad: Tensor, ctx: Context) -> None:
        self.outer.observe(grad, ctx)  # the outer operator saw the tensor the gradient belongs to

    def state_dict(self) -> dict[str, Any]:
        state = {"outer": self.outer.state_dict(), "inner": self.inner.state_dict()}
        return {k: v for k, v in state.items() if v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state.get("outer", {}))
        self.inner.load_state_dict(state.get("inner", {}))

