"""nat: natural compression (Horvath et al., "Natural compression for distributed deep learning").

Each value is rounded stochastically to one of its two neighbouring powers of two, 2^a <= |x| < 2^(a+1):
up with probability |x| / 2^a - 1, so E[C(x)] = x, and E[(C(x) - x)^2] <= x^2 / 8 (the paper's 9/8 second
moment). Only the sign and the exponent travel.

  nat         sign + the dtype's whole exponent field: 9 bits for fp32 and bf16, 6 for fp16, 12 for fp64. Code 0
              is zero; codes 1.. are the exponents from the smallest normal one up. Values below the smallest
              normal power p go to 0 or p (probability |x| / p): unbiased, no subnormal codes needed.
  nat:bits=b  sign + (b - 1) exponent bits: 2^(b-1) - 1 powers ending at each group's largest rounded-up
              exponent (sent once per group as int16), plus zero. Values below the lowest power p go to 0 or p
              (probability |x| / p), so it stays unbiased; their variance |x| (p - |x|) exceeds the x^2 / 8 bound,
              which is the price of the fewer bits.

The uniforms come from the context (`ctx.uniform`, salt "nat"); the receiver needs no random numbers. A value in
the dtype's top binade can round up to 2^(emax + 1), which the dtype cannot hold: the decoder then raises
FloatingPointError naming the boundary (as for any operator whose reconstruction overflows), never a silent inf.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .bits import pack_bits, packed_nbytes, unpack_bits
from .groups import PER_FORMS, check_per, from_groups, group_dims, to_groups

NAT_BITS = (2, 3, 4, 5, 6, 7, 8)


@dataclass(frozen=True)
class NatConfig(OpConfig):
    """Natural compression, e.g. `nat`, `nat:bits=4`, `nat:bits=3:per=block64`."""

    NAME: ClassVar[str] = "nat"
    FORMS: ClassVar[str] = f"nat[:bits=<b in 2..8>[:per=P]], P = {PER_FORMS}"
    EXAMPLES: ClassVar[tuple[str, ...]] = ("nat", "nat:bits=4", "nat:bits=3:per=block64", "nat:bits=2:per=tensor",
                                           "nat:bits=8:per=channel")

    bits: int = 0
    """0: sign + the dtype's whole exponent field; b in 2..8: sign + (b - 1) exponent bits below each group's largest
    exponent."""
    per: str = "row"
    """Group that shares one largest exponent (bits > 0 only): tensor, row (last dim), channel or block<N>."""

    def __post_init__(self) -> None:
        if self.bits != 0 and self.bits not in NAT_BITS:
            raise ValueError(f"nat bits={self.bits}; accepted: {', '.join(map(str, NAT_BITS))} (or none: the full "
                             "exponent range)")
        check_per(self.per)
        if self.bits == 0 and self.per != "row":
            raise ValueError(f"nat per={self.per!r} needs bits=<b>: the full-range form sends no per-group exponent")

    def build(self) -> "Nat":
        return Nat(self)


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def _exponent_bits(dtype: torch.dtype) -> int:
    """Width of the dtype's exponent field: 8 for fp32/bf16, 5 for fp16, 11 for fp64."""
    fi = torch.finfo(dtype)
    return fi.bits - 1 - round(-math.log2(fi.eps))


@functools.cache
def _emin(dtype: torch.dtype) -> int:
    """Exponent of the smallest normal power of two of the dtype."""
    return round(math.log2(torch.finfo(dtype).tiny))


class Nat(Compressor):
    config: NatConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "channel" and self.config.bits > 0

    def _code_bits(self, dtype: torch.dtype) -> int:
        return self.config.bits or 1 + _exponent_bits(dtype)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        numel = TensorSpec(tuple(shape), dtype).numel
        w = self._code_bits(dtype)
        layout = [TensorSpec((packed_nbytes(numel, min(w, 8)),), torch.uint8)]
        if w > 8:  # the bits above the low byte: a second packed stream (9 bits = 8 + 1)
            layout.append(TensorSpec((packed_nbytes(numel, w - 8),), torch.uint8))
        if self.config.bits:
            layout.append(TensorSpec((group_dims(tuple(shape), self.config.per)[0],), torch.int16))
        return layout

    def _range(self, top: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        """(exponent of code 1 per group, number of nonzero codes) from each group's top exponent."""
        emin = _emin(dtype)
        levels = 2 ** (self._code_bits(dtype) - 1) - 1
        return (top - (levels - 1)).clamp(min=emin), levels

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        per = c.per if c.bits else "tensor"
        g = to_groups(x, per).to(_work(x.dtype))  # (groups, size)
        y = g.abs()  # (groups, size)
        mant, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [0.5, 1) (0 for zeros)
        a = exp - 1  # floor(log2 y) where y > 0
        emin = _emin(x.dtype)
        if c.bits:  # the largest exponent any value of the group can round up to
            up = torch.where(y > 0, a + (mant > 0.5).int(), torch.full_like(a, emin))  # (groups, size)
            top = up.amax(dim=1).clamp(min=emin)  # (groups,)
        else:
            top = torch.full((g.shape[0],), emin + 2 ** _exponent_bits(x.dtype) - 2, dtype=a.dtype, device=x.device)
        lo, _ = self._range(top, x.dtype)  # (groups,)
        lo = lo[:, None]  # (groups, 1)
        u = ctx.uniform(g.shape, x.device, "nat")  # (groups, size)
        below = (a < lo) | (y == 0)  # (groups, size): |x| < 2^lo (frexp gives zeros exponent 0)
        # within range: exponent a, or a + 1 with probability 2 * mant - 1 = |x| / 2^a - 1
        level = a - lo + 1 + (u < 2 * mant - 1).int()  # (groups, size), 1..levels
        # below range: code 1 (the power 2^lo) with probability |x| / 2^lo, else 0
        small = (u < torch.ldexp(y, -lo)).int()  # (groups, size)
        code = torch.where(below, small, level)  # (groups, size)
        code = code | ((g < 0) & (code > 0)).int() << (self._code_bits(x.dtype) - 1)  # sign bit on top
        codes = from_groups(code, tuple(x.shape), per).reshape(-1)  # (numel,), int32
        out = _pack(codes, self._code_bits(x.dtype))
        if c.bits:
            out.append(top.to(torch.int16))
        return Payload(tuple(out), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        per = c.per if c.bits else "tensor"
        shape, dtype = tuple(payload.shape), payload.dtype
        w = self._code_bits(dtype)
        numel = TensorSpec(shape, dtype).numel
        codes = _unpack(list(payload.tensors[: 2 if w > 8 else 1]), w, numel).reshape(shape)
        g = to_groups(codes, per)  # (groups, size), int32
        if c.bits:
            top = payload.tensors[-1].to(torch.int32)  # (groups,)
        else:
            top = torch.full((g.shape[0],), _emin(dtype) + 2 ** _exponent_bits(dtype) - 2, dtype=torch.int32,
                             device=codes.device)
        lo, _ = self._range(top, dtype)
        level = g & ((1 << (w - 1)) - 1)  # (groups, size)
        mag = torch.ldexp(torch.ones(level.shape, dtype=_work(dtype), device=codes.device), level + lo[:, None] - 1)
        val = torch.where(level > 0, torch.where(g >> (w - 1) > 0, -mag, mag), torch.zeros_like(mag))
        return from_groups(val, shape, per).to(dtype)


def _pack(codes: Tensor, w: int) -> list[Tensor]:
    """Codes of w <= 16 bits as one packed stream (w <= 8) or a low byte stream plus a packed high stream."""
    if w <= 8:
        return [pack_bits(codes.to(torch.uint8), w)]
    return [pack_bits((codes & 0xFF).to(torch.uint8), 8), pack_bits((codes >> 8).to(torch.uint8), w - 8)]


def _unpack(parts: list[Tensor], w: int, n: int) -> Tensor:
    low = unpack_bits(parts[0], min(w, 8), n).to(torch.int32)  # (n,)
    if w <= 8:
        return low
    return low | unpack_bits(parts[1], w - 8, n).to(torch.int32) << 8
