"""vq:<bits>: vector quantization of rotated tiles with a fixed gaussian codebook (QuIP#/AQLM-class, no training).

The tile-adaptive quantizer's preparation (ops/pivoted.py: each row's largest values sent exactly, a Hadamard
rotation inside tiles of `size` channels) leaves every tile close to a gaussian sample. A uniform absmax grid is a
poor code for a gaussian: its outermost levels sit at the rare tail and leave few levels for the bulk. Here each
tile is scaled by its RMS and cut into vectors of `dim` values, and each vector is sent as the index of its nearest
point in a codebook of 2**(bits * dim) points, the k-means (Lloyd) codebook of the standard normal in `dim`
dimensions: the MSE-optimal scalar code for dim 1 (Lloyd-Max), and a denser packing of the plane or of 4-space
for dim 2 and 4 (a quarter of a bit or more per element at the same error).

The codebooks are constants shipped with the package (ops/vq_codebooks.json, written by
`python -m pp_compress.ops.vq`), so the sender and the receiver hold the same points on every machine. Only the
encoder searches; the decoder looks the points up. The search measures squared distances in one fixed order of
fp32 operations, so that its two forms agree bitwise: the exhaustive reference (`kernel=eager`, every point) and
the default pruned search, which looks a vector's grid cell up in a table of the few points that can be nearest
anywhere in that cell (a bound computed once per codebook), and measures only those.
Rounding is to the nearest point (the lowest index on a tie): biased, like int<b> without `stoch`.
Wire: tiles * size / dim codes of bits * dim bits, one RMS scale per tile, the pivots (values, int16 positions).
On a CUDA device with Triton, Triton kernels encode and decode (ops/triton_vq.py), bitwise `kernel=eager`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch
from torch import Tensor

from . import fused, pivoted, triton_vq
from .base import (Compressor, Context, Layout, OpConfig, Payload, TensorSpec, expect_finite, input_message,
                   new_flag, settle)
from .bits import pack_bits, packed_nbytes, unpack_bits
from .groups import SCALE_DTYPES, check_kernel, check_scale, safe_scale

DIMS = (1, 2, 4)
CODE_BITS = range(2, 9)
"""Bits per code (bits per element x dim): a codebook of 4 to 256 points."""
CODEBOOKS = Path(__file__).with_name("vq_codebooks.json")
_CHUNK = 1 << 15  # vectors per search step: a (chunk, points) fp32 distance matrix of at most 32 MiB
GRID_CELLS = {1: 1024, 2: 128, 4: 12}
"""Cells per axis of the pruned search's grid, per dim: at most 21k cells, and a few candidates per cell."""


@dataclass(frozen=True)
class VectorQuantConfig(OpConfig):
    """Vector quantization of rotated tiles, e.g. `vq:2.5` (pairs, 5-bit codes), `vq:2:dim=4`, `vq:3:dim=1`."""

    NAME: ClassVar[str] = "vq"
    POSITIONAL: ClassVar[str | None] = "bits"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    FORMS: ClassVar[str] = ("vq:<bits per element>[:dim=2][:size=64][:pivots=1][:rot=false][:scale=S]"
                            "[:kernel=fused|eager], dim in 1, 2, 4, bits x dim in 2..8")
    EXAMPLES: ClassVar[tuple[str, ...]] = ("vq:2.5", "vq:2:dim=4", "vq:3:dim=1", "vq:1.5:dim=4:size=16:pivots=0",
                                           "vq:4:rot=false:scale=fp32", "vq:3:pivots=2:kernel=eager",
                                           "vq:2:dim=1:size=8")

    bits: float = 2.5
    """Bits per element: each vector of `dim` values is one code of bits x dim bits (an integer, 2..8)."""
    dim: int = 2
    """Values per vector: 1 (Lloyd-Max scalar levels), 2 or 4."""
    size: int = 64
    """Channels per tile (a power of two with rotation, a multiple of dim); rows are zero-padded to a multiple."""
    pivots: int = 1
    """Largest-magnitude values per row sent exactly (with their positions), 0..8."""
    rot: bool = True
    """Randomized Hadamard rotation within each tile before quantizing."""
    scale: str = "bf16"
    """Dtype of the per-tile RMS scales on the wire: bf16, fp16 or fp32."""
    kernel: str = "fused"
    """fused: the rotation's CPU kernel (where built) and the pruned codebook search; eager: the reference rotation
    and the exhaustive search. The same codes either way."""

    def __post_init__(self) -> None:
        if self.dim not in DIMS:
            raise ValueError(f"vq dim={self.dim}; accepted: {', '.join(map(str, DIMS))}")
        code = self.bits * self.dim
        if code != round(code) or round(code) not in CODE_BITS:
            accepted = ", ".join(f"{b / self.dim:g}" for b in CODE_BITS)
            raise ValueError(f"vq bits={self.bits:g} with dim={self.dim} gives {code:g}-bit codes; accepted bits for "
                             f"dim {self.dim}: {accepted}")
        pivoted.check("vq", self.size, self.pivots, self.rot, multiple_of=self.dim)
        check_scale(self.scale)
        check_kernel(self.kernel)

    @property
    def code_bits(self) -> int:
        return round(self.bits * self.dim)

    def build(self) -> "VectorQuant":
        return VectorQuant(self)


@functools.cache
def codebook(dim: int, code_bits: int, device: torch.device = torch.device("cpu")) -> Tensor:
    """The shipped codebook: (2**code_bits, dim) fp32 points for the standard normal in `dim` dimensions."""
    books = json.loads(CODEBOOKS.read_text())["codebooks"]
    return torch.tensor(books[f"{dim}x{code_bits}"], dtype=torch.float32, device=device).reshape(-1, dim)


def distances(v: Tensor, points: Tensor) -> Tensor:
    """Squared distances from v (n, 1, dim) to points (n or 1, k, dim) -> (n, k)."""
    return coord_distances(v, points.unbind(-1))


def coord_distances(v: Tensor, coords: Sequence[Tensor]) -> Tensor:
    """Squared distances from v (..., dim) to points given per coordinate (coords[i] broadcasts against v[..., i]),
    summed over the coordinates in order: the same fp32 operations for a point wherever it appears, so every search
    picks the same one."""
    d = (v[..., 0] - coords[0]).square()
    for i in range(1, v.shape[-1]):
        d = d + (v[..., i] - coords[i]).square()
    return d


def nearest(v: Tensor, cb: Tensor) -> Tensor:
    """Index of the nearest codebook point for each row of v (n, dim), the lowest on a tie: every point, in chunks
    (the reference)."""
    out = torch.empty(v.shape[0], dtype=torch.uint8, device=v.device)  # (n,)
    for i in range(0, v.shape[0], _CHUNK):
        out[i:i + _CHUNK] = distances(v[i:i + _CHUNK, None, :], cb[None]).argmin(1)  # (chunk,)
    return out


@dataclass(frozen=True)
class Grid:
    """A uniform grid over [lo, -lo]^dim and, per cell, every codebook point that can be nearest to a vector in it."""

    lo: float
    """The grid's lower corner on every axis (beyond its extent the search is exhaustive)."""
    inv_h: float
    """Cells per unit length."""
    cells: int
    """Cells per axis."""
    candidates: Tensor
    """(cells**dim, k) int64 point indices per cell (last axis fastest), ascending, padded with the cell's last."""
    by_rank: Tensor
    """The same table transposed, (k, cells**dim): the torch search reads it one rank at a time."""


@functools.cache
def search_grid(dim: int, code_bits: int, device: torch.device = torch.device("cpu")) -> Grid:
    """The pruned search's table. A point p can be nearest to some v in a cell only if its distance to the cell is at
    most the smallest, over the points q, of q's distance to the cell's farthest corner (the nearest point to any v
    there is at most that far). The cell is widened by a thousandth of its side, and the bound by a relative 1e-6,
    so that fp32 rounding of the cell index and of the distances cannot leave the true nearest point out."""
    cb = codebook(dim, code_bits).double()  # (points, dim)
    cells = GRID_CELLS[dim]
    half = float(cb.abs().max()) + 1.0
    h = 2 * half / cells
    axis = torch.arange(cells, dtype=torch.float64) * h - half  # (cells,) lower edges
    corners = torch.cartesian_prod(*[axis] * dim).reshape(-1, dim)  # (cells**dim, dim)
    keep = []
    for lo in corners.split(1024):
        lo, hi = lo[:, None] - h * 1e-3, lo[:, None] + h * (1 + 1e-3)  # (c, 1, dim) each
        near = (cb.clamp(lo, hi) - cb).square().sum(-1)  # (c, points): to the cell
        far = torch.maximum(cb - lo, hi - cb).square().sum(-1)  # (c, points): to its farthest corner
        keep.append(near <= far.min(1, keepdim=True).values * (1 + 1e-6))
    mask = torch.cat(keep)  # (cells**dim, points)
    k = int(mask.sum(1).max())
    index = torch.arange(cb.shape[0], dtype=torch.int64).expand_as(mask)
    ranked = torch.where(mask, index, cb.shape[0]).sort(1).values[:, :k]  # (cells**dim, k): candidates first
    last = ranked.gather(1, mask.sum(1, keepdim=True) - 1)  # (cells**dim, 1)
    cand = torch.where(ranked < cb.shape[0], ranked, last)
    cand = cand.to(device)
    return Grid(-half, 1 / h, cells, cand, cand.t().contiguous())


@functools.cache
def kernel_grid(dim: int, code_bits: int, device: torch.device) -> triton_vq.Grid:
    """`search_grid` as the device kernel reads it: one byte per candidate index."""
    g = search_grid(dim, code_bits)
    return triton_vq.Grid(g.candidates.to(device=device, dtype=torch.uint8), g.lo, g.inv_h, g.cells)


def nearest_pruned(v: Tensor, cb: Tensor, grid: Grid) -> Tensor:
    """`nearest`'s codes, measuring only the candidates of each vector's cell (vectors beyond the grid: every point)."""
    f = (v - grid.lo) * grid.inv_h  # (n, dim) in cell units
    inside = ((f >= 0) & (f < grid.cells)).all(1)  # (n,)
    cell = f.clamp(0, grid.cells - 1).long()  # (n, dim), floor of the non-negative
    flat = cell[:, 0]
    for i in range(1, cell.shape[1]):
        flat = flat * grid.cells + cell[:, i]  # (n,)
    # One rank of candidates at a time, each coordinate from its own flat table: measuring all k at once would hold
    # an (n, k, dim) array (gigabytes for fours with 8-bit codes, k = 58), and on a GPU lookups of short rows (a
    # table's or the codebook's) are far slower than flat ones.
    axes = cb.t().contiguous()  # (dim, points)
    out = grid.by_rank[0, flat]  # (n,)
    least = coord_distances(v, [a[out] for a in axes])  # (n,)
    for rank in grid.by_rank[1:]:
        c = rank[flat]  # (n,)
        d = coord_distances(v, [a[c] for a in axes])  # (n,)
        closer = d < least  # strict: of equals the earlier rank, the lower index, stays (argmin's choice)
        out, least = torch.where(closer, c, out), torch.where(closer, d, least)
    out = out.to(torch.uint8)
    if not bool(inside.all()):
        out[~inside] = nearest(v[~inside], cb)
    return out


def tree_sum(t: Tensor) -> Tensor:
    """Each row of t (n, m) summed in a fixed order that a device kernel repeats: the first half plus the second,
    until one is left (rows zero-padded to a power of two; torch's own sum order differs by device)."""
    if t.shape[1] & (t.shape[1] - 1):
        t = torch.nn.functional.pad(t, (0, (1 << t.shape[1].bit_length()) - t.shape[1]))  # (n, 2**ceil(log2 m))
    while t.shape[1] > 1:
        h = t.shape[1] // 2
        t = t[:, :h] + t[:, h:]  # (n, h)
    return t[:, 0]  # (n,)


@functools.cache
def max_coord(dim: int, code_bits: int) -> float:
    """The codebook's largest |coordinate| (an fp32 value): a tile's scale times it is the decoder's largest
    product."""
    return float(codebook(dim, code_bits).abs().max())


def search(v: Tensor, cb: Tensor, c: VectorQuantConfig) -> Tensor:
    """The pruned search: the CPU kernel where built, else its torch form (any device); `nearest`'s codes."""
    grid = search_grid(c.dim, c.code_bits, v.device)
    ext = fused.kernels() if v.device.type == "cpu" else None
    if ext is None:
        return nearest_pruned(v, cb, grid)
    return ext.vq_search(v.contiguous(), cb, grid.candidates, grid.lo, grid.inv_h, grid.cells)


class VectorQuant(Compressor):
    config: VectorQuantConfig

    def _dims(self, shape: tuple[int, ...], where: str) -> pivoted.Dims:
        c = self.config
        return pivoted.dims(shape, c.size, c.pivots, where, self.spec)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        dm = self._dims(tuple(shape), ctx.name if ctx else "vq")
        codes = dm.tiles * c.size // c.dim
        return [TensorSpec((packed_nbytes(codes, c.code_bits),), torch.uint8),
                TensorSpec((dm.tiles,), SCALE_DTYPES[c.scale])] + pivoted.pivot_layout(dm, dtype)

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        dm = self._dims(tuple(x.shape), ctx.name)
        cb = codebook(c.dim, c.code_bits, x.device)  # (points, dim)
        spec, dtype = self.spec, x.dtype  # the message must not hold x: a deferred check keeps it until read
        message = lambda: (  # noqa: E731
            f"{ctx.name}: {spec} at step {ctx.step}: a tile's RMS times the codebook's outermost point overflows fp32 "
            f"or scale={c.scale} in {dtype}; values this close to the dtype's max need absmax scales: int<b>:rot or "
            "tile")
        if self._on_device(x):  # two kernels: pivots, rotation, scales and both checks; search and packing
            flag_in = new_flag(ctx, x.device, FloatingPointError, input_message(ctx)) if (
                self.nonfinite == "raise") else None
            flag_ovf = new_flag(ctx, x.device, FloatingPointError, message)
            tensors = triton_vq.encode(x, cb, max_coord(c.dim, c.code_bits), c.size, c.dim, c.code_bits, c.pivots,
                                       c.rot, ctx.noise_key("vq-rot") if c.rot else 0, SCALE_DTYPES[c.scale], flag_in,
                                       flag_ovf, kernel_grid(c.dim, c.code_bits, x.device))
            for f in (flag_in, flag_ovf):
                if f is not None:
                    settle(f, ctx)
            return Payload(tensors, x.shape, x.dtype)
        t, pivots = pivoted.split(x, dm, c.size, c.rot, ctx, "vq-rot", c.kernel == "fused")  # (tiles, size)
        peak = t.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # (tiles, 1)
        # the square root through fp64, rounded once to fp32: correctly rounded, as the device kernel's sqrt_rn (torch's
        # fp32 sqrt on CPU is not, on some CPUs: the scale's last bit would depend on the machine)
        rms = (tree_sum((t / peak).square()) / c.size).double().sqrt().float() * peak[:, 0]  # (tiles,); no overflow
        scale = rms.to(SCALE_DTYPES[c.scale])
        expect_finite(scale.float() * max_coord(c.dim, c.code_bits), ctx, FloatingPointError, message,
                      lambda: f" (max |x| {float(x.abs().max()):.4g})")  # the decoder's largest product
        v = (t / safe_scale(scale.float())[:, None]).reshape(-1, c.dim)  # (tiles * size / dim, dim)
        codes = search(v, cb, c) if c.kernel == "fused" else nearest(v, cb)  # (tiles * size / dim,)
        return Payload((pack_bits(codes, c.code_bits), scale, *pivots), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        dm = self._dims(shape, ctx.name)
        packed, scale, *pivots = payload.tensors
        cb = codebook(c.dim, c.code_bits, packed.device)  # (points, dim)
        if self._on_device(packed, shape):
            flag = new_flag(ctx, packed.device, FloatingPointError, self.output_message(ctx, payload.dtype)) if (
                self.nonfinite == "raise") else None
            out = triton_vq.decode(packed, cb, scale, *pivots, shape, payload.dtype, c.size, c.dim, c.code_bits, c.rot,
                                   ctx.noise_key("vq-rot") if c.rot else 0, flag)
            if flag is not None:
                settle(flag, ctx)
            return out
        codes = unpack_bits(packed, c.code_bits, dm.tiles * c.size // c.dim).long()  # (tiles * size / dim,)
        t = cb.index_select(0, codes).reshape(dm.tiles, c.size)  # (tiles, size)
        t = t * scale.float()[:, None]
        return pivoted.merge(t, pivots, dm, shape, payload.dtype, c.rot, ctx, "vq-rot", c.kernel == "fused")

    def screens_input(self, x: Tensor) -> bool:
        return self._on_device(x)

    def screens_output(self, payload: Payload) -> bool:
        return bool(payload.tensors) and self._on_device(payload.tensors[0], tuple(payload.shape))

    def _on_device(self, like: Tensor, shape: tuple[int, ...] | None = None) -> bool:
        """Whether the device kernels (ops/triton_vq.py) encode and decode this tensor (of `like`'s shape, or
        `shape` where `like` is a payload's)."""
        c = self.config
        shape = tuple(like.shape) if shape is None else shape
        return (c.kernel == "fused" and len(shape) > 0 and shape[-1] < pivoted.MAX_ROW
                and triton_vq.usable(like, shape[-1], c.size, c.dim, c.code_bits))


# --- the codebooks: written once by `python -m pp_compress.ops.vq`, shipped as constants ---------------------------
def lloyd_max(points: int, iters: int = 2000) -> Tensor:
    """The MSE-optimal `points` levels for N(0, 1), by Lloyd's iteration on exact gaussian integrals (float64)."""
    c = torch.special.ndtri(torch.linspace(0.5 / points, 1 - 0.5 / points, points, dtype=torch.float64))  # (points,)
    pdf = lambda t: torch.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    for _ in range(iters):
        edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), (c[1:] + c[:-1]) / 2,
                           torch.tensor([math.inf], dtype=torch.float64)])  # (points + 1,)
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])  # (points,)
        c = (pdf(edges[:-1]) - pdf(edges[1:])) / mass  # the conditional mean of each cell
    return c[:, None]  # (points, 1)


def kmeans(dim: int, points: int, samples: int = 1 << 19, iters: int = 300, seed: int = 0) -> Tensor:
    """Lloyd's k-means on a fixed sample of N(0, I_dim), from the product of the 1-D Lloyd-Max levels where
    `points` is a dim-th power, else from sample points; float64, (points, dim)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(samples, dim, generator=g, dtype=torch.float64)  # (samples, dim)
    side = round(points ** (1 / dim))
    if side**dim == points:
        c = torch.cartesian_prod(*[lloyd_max(side)[:, 0]] * dim).reshape(points, dim)
    else:
        c = s[torch.randperm(samples, generator=g)[:points]].clone()
    for _ in range(iters):
        a = torch.cat([torch.addmm((c * c).sum(1), p, c.t(), alpha=-2).argmin(1) for p in s.split(1 << 16)])
        count = torch.bincount(a, minlength=points).double()  # (points,)
        total = torch.zeros_like(c).index_add_(0, a, s)
        moved = count > 0
        c[moved] = total[moved] / count[moved, None]
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description="Write the shipped gaussian codebooks (ops/vq_codebooks.json)")
    ap.add_argument("--out", type=Path, default=CODEBOOKS)
    args = ap.parse_args()
    books, mse = {}, {}
    probe = torch.randn(1 << 18, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for dim in DIMS:
        for b in CODE_BITS:
            cb = (lloyd_max(2**b) if dim == 1 else kmeans(dim, 2**b)).float()  # (points, dim)
            v = probe[:, :dim].float()
            err = (cb[nearest(v, cb).long()] - v).pow(2).mean()
            books[f"{dim}x{b}"], mse[f"{dim}x{b}"] = cb.tolist(), round(float(err), 6)
            print(f"dim {dim}, {b}-bit codes ({b / dim:g} bits per element): MSE on N(0, 1) {float(err):.5f}",
                  flush=True)
    args.out.write_text(json.dumps({"generator": "python -m pp_compress.ops.vq", "mse_on_unit_gaussian": mse,
                                    "codebooks": books}, indent=0) + "\n")


if __name__ == "__main__":
    main()
