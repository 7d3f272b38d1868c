"""identity, fp16 and bf16: send the tensor as it is, or cast to a 16-bit float."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec

CAST_DTYPES = {"identity": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CastConfig(OpConfig):
    """`identity` (alias `none`), `fp16` or `bf16`: 16 bits per element for the casts."""

    NAME: ClassVar[str] = "identity"
    FORMS: ClassVar[str] = "identity | none | fp16 | bf16"
    EXAMPLES: ClassVar[tuple[str, ...]] = ("identity", "fp16", "bf16")

    to: str = "identity"
    """Wire dtype: identity (the input's own), fp16 or bf16."""

    def __post_init__(self) -> None:
        if self.to not in CAST_DTYPES:
            raise ValueError(f"cast to={self.to!r}; accepted: {', '.join(CAST_DTYPES)}")

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        if name == "none":
            return {"to": "identity"}
        return {"to": name} if name in CAST_DTYPES else None

    def spec_name(self) -> str:
        return self.to

    def build(self) -> "Cast":
        return Cast(self)


class Cast(Compressor):
    config: CastConfig

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return CAST_DTYPES[self.config.to] or dtype

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        return Payload((x.to(self._wire_dtype(x.dtype)),), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        return payload.tensors[0].to(payload.dtype)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        return [TensorSpec(tuple(shape), self._wire_dtype(dtype))]
