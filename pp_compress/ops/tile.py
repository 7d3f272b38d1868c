"""tile:<avg bits>: tile-adaptive, rotated integer quantization (the TAH-Quant class, arXiv 2506.01352).

A row of the last dim (a token's hidden state) is cut into tiles of `size` channels, each with its own scale. Three
parts, each for a property of real LLM hidden states:
- **Pivots** (`pivots=k`): each row's k largest-magnitude values travel exactly (input dtype) with their positions,
  and are zeroed before the rest is quantized. A LLaMA model's attention-sink token carries one channel ~100x the
  others; inside a tile of 64 it would set the scale for 63 small values. TAH-Quant swaps such pivots before its
  Hadamard transform; here they are taken out, which costs k * (value + int16 position) per row.
- **Rotation** (`rot`, on by default): a randomized Hadamard transform within each tile spreads the remaining
  outlier channels over the tile (ops/hadamard.py; the signs come from the context's generator, nothing travels).
- **Tiles**: a row whose length is not a multiple of `size` is padded with zeros to the next multiple.
- **Adaptive bits**: each tile gets `hi` or `lo` bits. A fixed share of the tiles, (avg - lo) / (hi - lo) rounded
  to a whole tile, gets `hi`: those whose error would shrink most, i.e. with the largest range squared (the
  MSE-optimal pick between two widths). So the wire size depends only on the shape, the dtype and the config; the
  choice travels as one bit per tile.
Symmetric absmax scales by default, `asym` for min/max with a zero point; `stoch` rounds stochastically: exact
pivots, a linear rotation and unbiased rounding keep the whole operator unbiased.
Wire: [tile bitmap if both widths occur] + hi tiles' codes + scales (+ zero points) + lo tiles' codes + scales
(+ zero points) + pivot values + pivot positions (int16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from . import pivoted
from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .bits import pack_bits, packed_nbytes, unpack_bits
from .groups import check_kernel, check_scale
from .quant import INT_BITS, IntQuant, IntQuantConfig


@dataclass(frozen=True)
class TileQuantConfig(OpConfig):
    """Tile-adaptive rotated quantization, e.g. `tile:3.5` (half the tiles 4-bit, half 3-bit), `tile:3:lo=2:hi=4`."""

    NAME: ClassVar[str] = "tile"
    POSITIONAL: ClassVar[str | None] = "avg"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    FORMS: ClassVar[str] = ("tile:<avg bits in [lo, hi]>[:lo=3][:hi=4][:size=64][:pivots=1][:rot=false][:asym][:stoch]"
                            "[:scale=S][:kernel=fused|eager]")
    EXAMPLES: ClassVar[tuple[str, ...]] = (
        "tile:3.5", "tile:4:lo=4", "tile:3:lo=2:hi=4:stoch", "tile:3.5:asym", "tile:3.5:rot=false:pivots=0",
        "tile:2.5:lo=2:hi=3:size=32:pivots=2", "tile:8:lo=8:hi=8:stoch:scale=fp32", "tile:5:lo=4:hi=8:size=8",
        "tile:3:lo=1:hi=4:size=12:rot=false:asym:pivots=8",
    )

    avg: float = 4.0
    """Average bits per code over the tiles (codes only: scales, bitmap and pivots come on top); in [lo, hi]."""
    lo: int = 3
    """Bits of the low tiles, 1..8."""
    hi: int = 4
    """Bits of the high tiles, lo..8."""
    size: int = 64
    """Channels per tile (a power of two with rotation); rows are zero-padded to a multiple of it."""
    pivots: int = 1
    """Largest-magnitude values per row sent exactly (with their positions), 0..8."""
    rot: bool = True
    """Randomized Hadamard rotation within each tile before quantizing."""
    asym: bool = False
    """Min/max quantization with a zero point per tile instead of symmetric absmax."""
    stoch: bool = False
    """Stochastic rounding (unbiased) instead of round-to-nearest."""
    scale: str = "bf16"
    """Dtype of the per-tile scales (and zero points) on the wire: bf16, fp16 or fp32."""
    kernel: str = "fused"
    """The tiles' quantizer, pivots and rotation: fused (their CPU kernels, or on a CUDA device their Triton kernels,
    where they apply; the same codes) or eager."""

    def __post_init__(self) -> None:
        for name in ("lo", "hi"):
            if getattr(self, name) not in INT_BITS:
                raise ValueError(f"tile {name}={getattr(self, name)}; accepted: 1..8")
        if self.lo > self.hi:
            raise ValueError(f"tile lo={self.lo} > hi={self.hi}; accepted: lo <= hi")
        if not self.lo <= self.avg <= self.hi:
            raise ValueError(f"tile avg={self.avg} bits is outside [lo, hi] = [{self.lo}, {self.hi}]; "
                             "set lo/hi around it")
        pivoted.check("tile", self.size, self.pivots, self.rot)
        check_scale(self.scale)
        check_kernel(self.kernel)

    def build(self) -> "TileQuant":
        return TileQuant(self)


class TileQuant(Compressor):
    config: TileQuantConfig

    def __init__(self, config: TileQuantConfig, nonfinite: str = "raise") -> None:
        super().__init__(config, nonfinite)
        c = config
        # nonfinite="allow": this operator checks its own input and output, and a tile that overflows (finite
        # values whose rotation does not fit fp32) is caught by the parts' check of their scales, which runs under
        # every policy and says the same on every path (a device kernel's own flag would call it NaN input)
        self.parts = [IntQuant(IntQuantConfig(bits=b, per="row", asym=c.asym, stoch=c.stoch, scale=c.scale,
                                              kernel=c.kernel), "allow")
                      for b in (c.hi, c.lo)]
        """The quantizers of the high and the low tiles (each tile is one row of its group)."""

    def _dims(self, shape: tuple[int, ...], where: str) -> tuple[pivoted.Dims, int]:
        """The tiling (ops/pivoted.py) of a tensor of `shape` and how many of its tiles get `hi` bits."""
        c = self.config
        dm = pivoted.dims(shape, c.size, c.pivots, where, self.spec)
        share = (c.avg - c.lo) / (c.hi - c.lo) if c.hi > c.lo else 1.0
        return dm, round(dm.tiles * share)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        dm, n_hi = self._dims(tuple(shape), ctx.name if ctx else "tile")
        out = [TensorSpec((packed_nbytes(dm.tiles, 1) if 0 < n_hi < dm.tiles else 0,), torch.uint8)]
        for part, n in zip(self.parts, (n_hi, dm.tiles - n_hi)):
            out += part.wire_layout((n, c.size), torch.float32)
        return out + pivoted.pivot_layout(dm, dtype)

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        dm, n_hi = self._dims(tuple(x.shape), ctx.name)
        t, pivots = pivoted.split(x, dm, c.size, c.rot, ctx, "tile-rot", c.kernel == "fused")  # (tiles, size)
        spread = t.amax(dim=1) - t.amin(dim=1) if c.asym else 2 * t.abs().amax(dim=1)  # (tiles,)
        # a stable sort breaks ties between equal spreads (frequent in bf16) by position, the same on every device and
        # path, where topk's choice among ties is its implementation's; index_fill_ takes its value as an argument,
        # where `high[i] = True` copies a host scalar to the device, which waits for the device
        ranked = torch.argsort(spread, descending=True, stable=True)  # (tiles,)
        high = torch.zeros(dm.tiles, dtype=torch.bool, device=x.device).index_fill_(0, ranked[:n_hi], True)  # (tiles,)
        bitmap = pack_bits(high.to(torch.uint8), 1) if 0 < n_hi < dm.tiles else x.new_empty((0,), dtype=torch.uint8)
        order = _order(high)  # (tiles,)
        parts = [part.encode_rows(t, rows, ctx).tensors for part, rows in zip(self.parts, (order[:n_hi], order[n_hi:]))]
        return Payload((bitmap, *parts[0], *parts[1], *pivots), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        dm, n_hi = self._dims(shape, ctx.name)
        bitmap, *rest = payload.tensors
        device = bitmap.device
        if 0 < n_hi < dm.tiles:
            high = unpack_bits(bitmap, 1, dm.tiles).bool()  # (tiles,)
        else:
            high = torch.full((dm.tiles,), n_hi == dm.tiles, dtype=torch.bool, device=device)
        order = _order(high)  # (tiles,)
        t = torch.empty((dm.tiles, c.size), dtype=torch.float32, device=device)  # (tiles, size)
        n = len(self.parts[0].wire_layout((1, c.size), torch.float32))  # tensors per part
        for j, (part, rows) in enumerate(zip(self.parts, (order[:n_hi], order[n_hi:]))):
            size = torch.Size((len(rows), c.size))
            part.decode_rows(Payload(tuple(rest[j * n:(j + 1) * n]), size, torch.float32), t, rows, ctx)  # t[rows]
        return pivoted.merge(t, rest[2 * n:], dm, shape, payload.dtype, c.rot, ctx, "tile-rot", c.kernel == "fused")


def _order(high: Tensor) -> Tensor:
    """The tiles' indices, the high ones first, each group in increasing order (int64): the split a boolean mask
    would make, by indices whose number the shape already gives, so that no count is read back from the device."""
    return torch.argsort(~high, stable=True)
