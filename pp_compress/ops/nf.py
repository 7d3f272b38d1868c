"""nf<b>, nf:<L>: normal-float quantization (QLoRA's NF4, Dettmers et al. 2023, for any b in 2..8 or any level
count L in 3..256), codes bit-packed.

The levels sit at quantiles of N(0, 1) scaled so the outermost are -1 and +1, with an exact zero (QLoRA's
construction for an even count L: L/2 positive levels, L/2 - 1 negative ones; an odd count is symmetric). A count
that is not a power of two packs k codes as one base-L number (bits.pack_levels): `nf:40` costs 5.33 bits per
element with less error than nf5, `nf:5` 2.33 bits. Each group sends its absmax; a value x is
coded as the level nearest x / absmax. Levels are dense near zero, where most of a roughly Gaussian tensor lies
(residual streams without outlier channels, activation-gradients), so the error is below int<b>'s uniform levels
for the same bytes. `stoch` rounds to one of the two neighbouring levels with probability by distance instead:
unbiased, with a smaller variance than int<b>:stoch where values cluster near zero.
Wire: ceil(n * b / 8) bytes of codes (bits.levels_nbytes for L levels) + one scale per group.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from .base import (Compressor, Context, Layout, OpConfig, Payload, TensorSpec, expect_finite, input_message,
                   new_flag, settle)
from .bits import MAX_LEVELS, levels_nbytes, pack_levels, unpack_levels
from . import fused, triton_nf
from .groups import (PER_FORMS, SCALE_CODES, SCALE_DTYPES, check_kernel, check_per, check_scale, from_groups,
                     group_dims, round_scale, safe_scale, to_groups)

NF_BITS = (2, 3, 4, 5, 6, 7, 8)


@functools.cache
def levels(n: int) -> Tensor:
    """The n levels in increasing order, in [-1, 1], with an exact 0 (fp32, CPU; QLoRA's NF4 for n=16)."""
    if n % 2:  # symmetric: (n - 1) / 2 levels a side, the outermost at the centre quantile of n equal-mass bins
        pos = torch.special.ndtri(torch.linspace(1 - 1 / (2 * n), 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
        v = torch.cat([-pos, torch.zeros(1, dtype=torch.float64), pos.flip(0)])  # (n,) ascending
        return (v / v.max()).float()
    offset = (1 - 1 / (2 * (n - 1)) + 1 - 1 / (2 * n)) / 2  # QLoRA: between the two halves' outermost quantiles
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])  # (n/2,) descending
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])  # (n/2 - 1,)
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos.flip(0)])  # (n,) ascending
    return (v / v.abs().max()).float()


@functools.cache
def _table(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(levels, midpoints between neighbouring levels) on `device`, built once: encode runs every micro-batch."""
    lv = levels(n).to(device)  # (n,)
    return lv, (lv[1:] + lv[:-1]) / 2


@functools.cache
def _search_table(n: int, device: torch.device) -> Tensor:
    """The midpoints after -inf ((n,) on `device`): the device encoder's binary search for the nearest level."""
    _, mid = _table(n, device)
    return torch.cat([mid.new_tensor([-float("inf")]), mid])


@dataclass(frozen=True)
class NormalFloatConfig(OpConfig):
    """Normal-float quantization, e.g. `nf4`, `nf4:per=block32`, `nf3:stoch`, `nf:40` (40 levels, 5.33 bits)."""

    NAME: ClassVar[str] = "nf"
    POSITIONAL: ClassVar[str | None] = "levels"
    FORMS: ClassVar[str] = (f"nf<b>[:per=P][:stoch][:scale=S][:kernel=fused|eager] (2**b levels, b in 2..8) or "
                            f"nf:<L>[...] (L levels, 3..{MAX_LEVELS}), P = {PER_FORMS}")
    EXAMPLES: ClassVar[tuple[str, ...]] = ("nf4", "nf4:per=block32", "nf3:stoch", "nf2:per=tensor", "nf8:scale=fp32",
                                           "nf4:per=channel:stoch", "nf5:scale=fp16", "nf2:stoch:per=block64",
                                           "nf:40", "nf:5:stoch", "nf:3:per=block32:stoch", "nf:100:per=channel",
                                           "nf6:kernel=eager", "nf4:per=block64:kernel=eager")

    levels: int = 16
    """Number of levels, 3..256 (nf<b> sets 2**b). A power of two packs b bits per code; any other count packs k codes
    as one base-L number of m bits (bits.level_packing), e.g. 40 levels at 16 bits per 3 codes."""
    per: str = "row"
    """Scale granularity: tensor, row (last dim), channel (per feature over the batch dim), block<N>."""
    stoch: bool = False
    """Stochastic rounding between the two neighbouring levels (unbiased) instead of the nearest level."""
    scale: str = "bf16"
    """Dtype of the per-group absmax on the wire: bf16 (default: fp32 range), fp16 or fp32."""
    kernel: str = "fused"
    """fused: the one-pass CPU kernel (ops/fused.py) where this configuration has one: nearest level, a power-of-two
    level count, per row or per block of a multiple of 8 values that tile the tensor; the codes are bitwise the
    reference's. eager: always the reference tensor code."""

    def __post_init__(self) -> None:
        if not 3 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"nf levels={self.levels}; accepted: 3 .. {MAX_LEVELS} (nf<b>: b in "
                             f"{', '.join(map(str, NF_BITS))})")
        check_per(self.per)
        check_scale(self.scale)
        check_kernel(self.kernel)

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        if name == cls.NAME:
            return {}
        m = re.fullmatch(r"nf(\d+)", name)
        if not m:
            return None
        if int(m.group(1)) not in NF_BITS:
            raise ValueError(f"unsupported bit width in {name!r}; accepted: nf2 .. nf8, or nf:<levels>")
        return {"levels": 2 ** int(m.group(1))}

    def spec_name(self) -> str:
        bits = self.levels.bit_length() - 1
        return f"nf{bits}" if self.levels == 2**bits else self.NAME

    def build(self) -> "NormalFloat":
        return NormalFloat(self)


class NormalFloat(Compressor):
    config: NormalFloatConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "channel"

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        groups, _ = group_dims(tuple(shape), c.per)
        return [TensorSpec((levels_nbytes(TensorSpec(tuple(shape), dtype).numel, c.levels),), torch.uint8),
                TensorSpec((groups,), SCALE_DTYPES[c.scale])]

    def _fused_size(self, shape: tuple[int, ...], like: Tensor) -> int:
        """The group size when the fused kernel takes this tensor (0 when the reference runs)."""
        c = self.config
        if c.kernel != "fused" or c.stoch or c.levels & (c.levels - 1) or c.per == "channel":
            return 0
        groups, size = group_dims(shape, c.per)
        return size if groups * size == TensorSpec(shape, like.dtype).numel and fused.usable(like, size) else 0

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        lv, mid = _table(c.levels, x.device)  # (levels,), (levels - 1,)
        if group := self._device_group(x, tuple(x.shape)):  # one kernel: scales, levels, packing, both checks
            flag_in = new_flag(ctx, x.device, FloatingPointError, input_message(ctx)) if (
                self.nonfinite == "raise") else None
            flag_scale = new_flag(ctx, x.device, FloatingPointError, self._scale_message(ctx))
            codes, scale = triton_nf.encode(x, lv, _search_table(c.levels, x.device), group, c.levels.bit_length() - 1,
                                            SCALE_DTYPES[c.scale], ctx.noise_key("nf") if c.stoch else None, flag_in,
                                            flag_scale)
            for f in (flag_in, flag_scale):
                if f is not None:
                    settle(f, ctx)
            return Payload((codes, scale), x.shape, x.dtype)
        size = self._fused_size(tuple(x.shape), x)
        if size:  # one pass per group: absmax, scale, nearest level, packing
            codes, scale = fused.kernels().nf_encode(x.reshape(-1, size).contiguous(), mid, c.levels.bit_length() - 1,
                                                     SCALE_CODES[c.scale])
            scale = scale.to(SCALE_DTYPES[c.scale])
            self._check_scale(scale, x, ctx)
            return Payload((codes, scale), x.shape, x.dtype)
        g = to_groups(x, c.per).float()  # (groups, size)
        scale = round_scale(g.abs().amax(dim=1), SCALE_DTYPES[c.scale])  # (groups,), rounded up: |u| <= 1
        self._check_scale(scale, x, ctx)
        # times the fp32 reciprocal of the scale, not divided by it: the fused kernel multiplies too (a division per
        # element is its slowest instruction), and both round the same two fp32 operations
        inv = 1.0 / safe_scale(scale)  # (groups,)
        u = (g * inv[:, None]).clamp_(-1, 1).contiguous()  # (groups, size); channel groups are a view
        if c.stoch:  # between lv[lo] and lv[lo + 1], up with probability (u - lv[lo]) / (lv[lo + 1] - lv[lo])
            lo = (torch.bucketize(u, lv, right=True) - 1).clamp_(0, len(lv) - 2)  # (groups, size)
            p_up = (u - lv[lo]) / (lv[lo + 1] - lv[lo])  # (groups, size), in [0, 1]
            noise = ctx.uniform(u.shape, x.device, "nf")  # (groups, size)
            codes = lo + (noise < p_up)  # (groups, size)
        else:  # the nearest level: bucketize against the midpoints
            codes = torch.bucketize(u, mid)  # (groups, size), 0..levels - 1
        codes = from_groups(codes.to(torch.uint8), tuple(x.shape), c.per)  # x.shape
        return Payload((pack_levels(codes.reshape(-1), c.levels), scale), x.shape, x.dtype)

    def _check_scale(self, scale: Tensor, x: Tensor, ctx: Context) -> None:
        expect_finite(scale, ctx, FloatingPointError, self._scale_message(ctx),
                      lambda: f" (max |x| {float(x.abs().max()):.4g} in {x.dtype})")

    def _scale_message(self, ctx: Context) -> Callable[[], str]:
        spec, name = self.spec, self.config.scale
        return lambda: (f"{ctx.name}: {spec} absmax overflows scale={name} at step {ctx.step}; use scale=bf16 or "
                        "scale=fp32")

    def screens_input(self, x: Tensor) -> bool:
        return bool(self._device_group(x, tuple(x.shape)))

    def screens_output(self, payload: Payload) -> bool:
        return bool(payload.tensors) and bool(self._device_group(payload.tensors[0], tuple(payload.shape)))

    def _device_group(self, like: Tensor, shape: tuple[int, ...]) -> int:
        """The group size when the device kernels (ops/triton_nf.py) take a tensor of `shape` (0 when not): a
        power-of-two level count, groups of consecutive values that tile it, on a CUDA device."""
        c = self.config
        if c.kernel != "fused" or c.levels & (c.levels - 1) or c.per == "channel":
            return 0
        numel = TensorSpec(shape, torch.float32).numel
        _, size = group_dims(shape, c.per)
        return size if triton_nf.usable(like, numel, size, c.levels.bit_length() - 1) else 0

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        if group := self._device_group(payload.tensors[0], shape):
            flag = (new_flag(ctx, payload.tensors[0].device, FloatingPointError,
                             self.output_message(ctx, payload.dtype)) if self.nonfinite == "raise" else None)
            lv, _ = _table(c.levels, payload.tensors[0].device)
            out = triton_nf.decode(payload.tensors[0], lv, payload.tensors[1], shape, payload.dtype, group,
                                   c.levels.bit_length() - 1, flag)
            if flag is not None:
                settle(flag, ctx)
            return out
        size = self._fused_size(shape, payload.tensors[0])
        if size:
            lv, _ = _table(c.levels, payload.tensors[0].device)
            like = payload.tensors[0].new_empty(0, dtype=payload.dtype)
            return fused.kernels().nf_decode(payload.tensors[0], payload.tensors[1].float(), lv,
                                             c.levels.bit_length() - 1, size, like).reshape(shape)
        codes = unpack_levels(payload.tensors[0], c.levels, TensorSpec(shape, payload.dtype).numel).reshape(shape)
        lv, _ = _table(c.levels, codes.device)
        g = lv[to_groups(codes, c.per).long()] * payload.tensors[1].float()[:, None]  # (groups, size)
        return from_groups(g, shape, c.per).to(payload.dtype)
