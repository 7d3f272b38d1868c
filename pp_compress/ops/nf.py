"""nf<b>: normal-float quantization (QLoRA's NF4, Dettmers et al. 2023, for any b in 2..8), codes bit-packed.

The 2**b levels sit at quantiles of N(0, 1) scaled so the outermost are -1 and +1, with an exact zero (QLoRA's
construction: 2**(b-1) positive levels, 2**(b-1) - 1 negative ones). Each group sends its absmax; a value x is
coded as the level nearest x / absmax. Levels are dense near zero, where most of a roughly Gaussian tensor lies
(residual streams without outlier channels, activation-gradients), so the error is below int<b>'s uniform levels
for the same bytes. `stoch` rounds to one of the two neighbouring levels with probability by distance instead:
unbiased, with a smaller variance than int<b>:stoch where values cluster near zero.
Wire: ceil(n * b / 8) bytes of codes + one scale per group.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .bits import pack_bits, packed_nbytes, unpack_bits
from .groups import PER_FORMS, SCALE_DTYPES, check_per, check_scale, from_groups, group_dims, round_scale, safe_scale, to_groups

NF_BITS = (2, 3, 4, 5, 6, 7, 8)


@functools.cache
def levels(bits: int) -> Tensor:
    """The 2**bits levels in increasing order, in [-1, 1], with an exact 0 (fp32, CPU; QLoRA's NF4 for bits=4)."""
    n = 2**bits
    offset = (1 - 1 / (2 * (n - 1)) + 1 - 1 / (2 * n)) / 2  # QLoRA: between the two halves' outermost quantiles
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])  # (n/2,) descending
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])  # (n/2 - 1,)
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos.flip(0)])  # (n,) ascending
    return (v / v.abs().max()).float()


@functools.cache
def _table(bits: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(levels, midpoints between neighbouring levels) on `device`, built once: encode runs every micro-batch."""
    lv = levels(bits).to(device)  # (2**bits,)
    return lv, (lv[1:] + lv[:-1]) / 2


@dataclass(frozen=True)
class NormalFloatConfig(OpConfig):
    """Normal-float quantization, e.g. `nf4`, `nf4:per=block32`, `nf3:stoch`."""

    NAME: ClassVar[str] = "nf"
    FORMS: ClassVar[str] = f"nf<b>[:per=P][:stoch][:scale=S], b in 2..8, P = {PER_FORMS}"
    EXAMPLES: ClassVar[tuple[str, ...]] = ("nf4", "nf4:per=block32", "nf3:stoch", "nf2:per=tensor", "nf8:scale=fp32",
                                           "nf4:per=channel:stoch", "nf5:scale=fp16", "nf2:stoch:per=block64")

    bits: int = 4
    """Bits per code, 2..8: 2**bits levels."""
    per: str = "row"
    """Scale granularity: tensor, row (last dim), channel (per feature over the batch dim), block<N>."""
    stoch: bool = False
    """Stochastic rounding between the two neighbouring levels (unbiased) instead of the nearest level."""
    scale: str = "bf16"
    """Dtype of the per-group absmax on the wire: bf16 (default: fp32 range), fp16 or fp32."""

    def __post_init__(self) -> None:
        if self.bits not in NF_BITS:
            raise ValueError(f"nf bits={self.bits}; accepted: {', '.join(map(str, NF_BITS))}")
        check_per(self.per)
        check_scale(self.scale)

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        m = re.fullmatch(r"nf(\d+)", name)
        if not m:
            return None
        if int(m.group(1)) not in NF_BITS:
            raise ValueError(f"unsupported bit width in {name!r}; accepted: nf2 .. nf8")
        return {"bits": int(m.group(1))}

    def spec_name(self) -> str:
        return f"nf{self.bits}"

    def build(self) -> "NormalFloat":
        return NormalFloat(self)


class NormalFloat(Compressor):
    config: NormalFloatConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "channel"

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        groups, _ = group_dims(tuple(shape), c.per)
        return [TensorSpec((packed_nbytes(TensorSpec(tuple(shape), dtype).numel, c.bits),), torch.uint8),
                TensorSpec((groups,), SCALE_DTYPES[c.scale])]

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        lv, mid = _table(c.bits, x.device)  # (2**bits,), (2**bits - 1,)
        g = to_groups(x, c.per).float()  # (groups, size)
        scale = round_scale(g.abs().amax(dim=1), SCALE_DTYPES[c.scale])  # (groups,), rounded up: |u| <= 1
        if not bool(torch.isfinite(scale).all()):
            raise FloatingPointError(f"{ctx.name}: {self.spec} absmax overflows scale={c.scale} at step {ctx.step} "
                                     f"(max |x| {float(x.abs().max()):.4g} in {x.dtype}); use scale=bf16 or scale=fp32")
        u = (g / safe_scale(scale)[:, None]).clamp_(-1, 1).contiguous()  # (groups, size); channel groups are a view
        if c.stoch:  # between lv[lo] and lv[lo + 1], up with probability (u - lv[lo]) / (lv[lo + 1] - lv[lo])
            lo = (torch.bucketize(u, lv, right=True) - 1).clamp_(0, len(lv) - 2)  # (groups, size)
            p_up = (u - lv[lo]) / (lv[lo + 1] - lv[lo])  # (groups, size), in [0, 1]
            noise = torch.rand(u.shape, generator=ctx.generator(x.device, "nf"), device=x.device)
            codes = lo + (noise < p_up)  # (groups, size)
        else:  # the nearest level: bucketize against the midpoints
            codes = torch.bucketize(u, mid)  # (groups, size), 0..2**bits - 1
        codes = from_groups(codes.to(torch.uint8), tuple(x.shape), c.per)  # x.shape
        return Payload((pack_bits(codes.reshape(-1), c.bits), scale), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        codes = unpack_bits(payload.tensors[0], c.bits, TensorSpec(shape, payload.dtype).numel).reshape(shape)
        lv, _ = _table(c.bits, codes.device)
        g = lv[to_groups(codes, c.per).long()] * payload.tensors[1].float()[:, None]  # (groups, size)
        return from_groups(g, shape, c.per).to(payload.dtype)
