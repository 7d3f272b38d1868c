"""fp8: scaled cast to float8 e4m3 or e5m2, one scale per tensor, row or block.

The scale maps each group's absmax onto the format's largest finite value (448 for e4m3, 57344 for
e5m2), so nothing saturates. Wire: one byte per element + one scale per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .groups import SCALE_DTYPES, check_per, check_scale, from_groups, group_dims, round_scale, to_groups

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Fp8Config(OpConfig):
    """Scaled float8, e.g. `fp8`, `fp8:e5m2`, `fp8:e4m3:per=block128`."""

    NAME: ClassVar[str] = "fp8"
    POSITIONAL: ClassVar[str | None] = "fmt"
    FORMS: ClassVar[str] = "fp8[:e4m3|e5m2][:per=tensor|row|block<N>][:scale=S]"
    EXAMPLES: ClassVar[tuple[str, ...]] = ("fp8", "fp8:e5m2", "fp8:per=row", "fp8:per=block128:scale=bf16")

    fmt: str = "e4m3"
    """e4m3 (more mantissa, max 448) or e5m2 (more range, max 57344)."""
    per: str = "tensor"
    """Scale granularity: tensor, row (last dim) or block<N>."""
    scale: str = "fp32"
    """Dtype of the scales on the wire: fp32, bf16 or fp16."""

    def __post_init__(self) -> None:
        if self.fmt not in FP8_FORMATS:
            raise ValueError(f"fp8 format {self.fmt!r}; accepted: {', '.join(FP8_FORMATS)}")
        check_per(self.per, allowed=("tensor", "row"))
        check_scale(self.scale)

    def build(self) -> "Fp8":
        return Fp8(self)


class Fp8(Compressor):
    config: Fp8Config

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        spec = TensorSpec(tuple(shape), dtype)
        groups, _ = group_dims(tuple(shape), self.config.per)
        return [TensorSpec((spec.numel,), FP8_FORMATS[self.config.fmt]),
                TensorSpec((groups,), SCALE_DTYPES[self.config.scale])]

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        fdt = FP8_FORMATS[self.config.fmt]
        g = to_groups(x, self.config.per).float()  # (groups, size)
        scale = round_scale(g.abs().amax(dim=1) / torch.finfo(fdt).max, SCALE_DTYPES[self.config.scale])  # (groups,)
        s = scale.float()
        codes = (g / torch.where(s > 0, s, torch.ones_like(s))[:, None]).to(fdt)  # (groups, size)
        codes = from_groups(codes, tuple(x.shape), self.config.per).reshape(-1)  # (numel,)
        return Payload((codes, scale), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        shape = tuple(payload.shape)
        g = to_groups(payload.tensors[0].float().reshape(shape), self.config.per)  # (groups, size)
        return from_groups(g * payload.tensors[1].float()[:, None], shape, self.config.per).to(payload.dtype)
