"""int<b>: uniform b-bit quantization (b in 1, 2, 4, 8), codes bit-packed on the wire.

Symmetric (default): levels -L..L with L = 2**(b-1) - 1 and scale = absmax / L per group; for b = 1
the code is the sign and the scale is mean|x| (or absmax with stochastic rounding, which is then
unbiased). Asymmetric (`asym`): 2**b levels from the group's min (zero point) to its max.
Stochastic rounding (`stoch`) draws from the context's generator and is unbiased.
Wire: ceil(n * b / 8) bytes of codes + one scale per group (+ one zero point if asym).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .bits import pack_bits, packed_nbytes, unpack_bits
from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .groups import (PER_FORMS, SCALE_DTYPES, check_per, check_scale, from_groups, group_dims, round_down,
                     round_scale, to_groups)

INT_BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class IntQuantConfig(OpConfig):
    """Uniform integer quantization, e.g. `int8`, `int4:per=block64`, `int2:asym:stoch:scale=fp32`."""

    NAME: ClassVar[str] = "int"
    FORMS: ClassVar[str] = f"int<b>[:per=P][:asym][:stoch][:scale=S], b in {INT_BITS}, P = {PER_FORMS}"

    bits: int = 8
    """Bits per code: 1, 2, 4 or 8."""
    per: str = "row"
    """Scale granularity: tensor, row (last dim), channel (per feature over the batch dim), block<N>."""
    asym: bool = False
    """Asymmetric min/max quantization (scale + zero point per group) instead of symmetric absmax."""
    stoch: bool = False
    """Stochastic rounding (unbiased) instead of round-to-nearest."""
    scale: str = "bf16"
    """Dtype of scales and zero points on the wire: bf16 (default: fp32 range, so tiny gradients
    never underflow), fp16 (underflows below ~6e-8: avoid for gradients) or fp32."""

    def __post_init__(self) -> None:
        if self.bits not in INT_BITS:
            raise ValueError(f"int bits={self.bits}; accepted: {', '.join(map(str, INT_BITS))}")
        check_per(self.per)
        check_scale(self.scale)

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        m = re.fullmatch(r"int(\d+)", name)
        if not m:
            return None
        bits = int(m.group(1))
        if bits not in INT_BITS:
            raise ValueError(f"unsupported bit width in {name!r}; accepted: int1, int2, int4, int8")
        return {"bits": bits}

    def spec_name(self) -> str:
        return f"int{self.bits}"

    def build(self) -> "IntQuant":
        return IntQuant(self)


class IntQuant(Compressor):
    config: IntQuantConfig

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        numel = TensorSpec(tuple(shape), dtype).numel
        groups, _ = group_dims(tuple(shape), c.per)
        sdt = SCALE_DTYPES[c.scale]
        layout = [TensorSpec((packed_nbytes(numel, c.bits),), torch.uint8), TensorSpec((groups,), sdt)]
        if c.asym:
            layout.append(TensorSpec((groups,), sdt))
        return layout

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        sdt = SCALE_DTYPES[c.scale]
        g = to_groups(x, c.per).float()  # (groups, size)
        noise = None
        if c.stoch:
            noise = torch.rand(g.shape, generator=ctx.generator(x.device, "int"), device=x.device)  # (groups, size)
        if c.asym:
            top = 2**c.bits - 1
            zero = round_down(g.amin(dim=1), sdt)  # (groups,)
            scale = round_scale((g.amax(dim=1) - zero.float()) / top, sdt)  # (groups,)
            q = (g - zero.float()[:, None]) / _safe(scale)[:, None]
            codes = _round(q, noise).clamp_(0, top)
            extra: tuple[Tensor, ...] = (scale, zero)
        elif c.bits == 1:
            amag = g.abs()
            scale = round_scale(amag.amax(dim=1) if c.stoch else amag.mean(dim=1), sdt)  # (groups,)
            if noise is None:
                codes = (g >= 0).float()
            else:  # P(+1) = (x / absmax + 1) / 2: unbiased
                codes = (noise < (g / _safe(scale)[:, None] + 1) / 2).float()
            extra = (scale,)
        else:
            top = 2 ** (c.bits - 1) - 1
            scale = round_scale(g.abs().amax(dim=1) / top, sdt)  # (groups,)
            codes = _round(g / _safe(scale)[:, None], noise).clamp_(-top, top) + top
            extra = (scale,)
        codes = from_groups(codes, tuple(x.shape), c.per).to(torch.uint8)  # x.shape
        return Payload((pack_bits(codes, c.bits),) + extra, x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        numel = TensorSpec(shape, payload.dtype).numel
        codes = unpack_bits(payload.tensors[0], c.bits, numel).reshape(shape)
        q = to_groups(codes, c.per).float()  # (groups, size)
        scale = payload.tensors[1].float()[:, None]  # (groups, 1)
        if c.asym:
            g = q * scale + payload.tensors[2].float()[:, None]
        elif c.bits == 1:
            g = (q * 2 - 1) * scale
        else:
            g = (q - (2 ** (c.bits - 1) - 1)) * scale
        return from_groups(g, shape, c.per).to(payload.dtype)


def _safe(scale: Tensor) -> Tensor:
    """fp32 scale with zeros replaced by one (an all-zero group quantizes to zero codes)."""
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _round(q: Tensor, noise: Tensor | None) -> Tensor:
    return torch.round(q) if noise is None else torch.floor(q + noise)
