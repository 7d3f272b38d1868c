"""Randomized Hadamard rotation over blocks of the last dim (QuaRot / TAH-Quant style).

`rotate(x, n, key)` multiplies the last dim by random signs D (one per position, counter-based from `key`) and applies
the orthonormal Walsh-Hadamard transform H_n to each block of n consecutive positions: y = H_n D x. Both factors
are orthogonal and H_n is symmetric, so `unrotate(y, n, key)` = D H_n y is the exact inverse, and a sender and a
receiver that derive `key` from the same Context agree on D without sending it, on any device.

Why: an outlier channel holds most of a row's absmax, so a low-bit grid scaled to it rounds every other value to
a few levels. After the rotation each block's energy is spread over all n outputs, so the absmax falls towards
the block's RMS and the grid fits the bulk of the values.

The reference transform (`kernel=eager`) is a butterfly: one product with fp32 1/sqrt(n), then log2(n)
add/subtract levels over the position's bits, lowest first: O(n log n) elementwise work with no matmul, so its
rounding is the same on every device and backend (no TF32, no GEMM reduction order). The fused CPU kernel
(csrc/fused.cpp: `fwht`) does the same operations in the same order on a block held in L1, so its outputs are
bitwise these; this eager path runs on CPU over chunks of rows that stay in cache, on other devices in one shot.

On an accelerator the fused path is instead one matrix product per block with the dense H_n (blocks up to
GEMM_MAX_BLOCK): log2(n) add/subtract levels cost three passes over the tensor each there, where the product reads
and writes it once. Its rounding is the GEMM's (TF32 where the user enabled it for fp32 matmuls), equal to the
butterfly's to fp32 rounding, not bitwise; a sender and a receiver on the same device type run the same product.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import fused as kernels
from . import noise

MAX_AUTO_BLOCK = 256
"""`rot` (auto) uses the largest power of two up to this that divides the last dim."""
GEMM_MAX_BLOCK = 256
"""Largest block that an accelerator rotates by a matrix product: the product's work per value grows with n, the
butterfly's with log2(n), and `rot`'s automatic blocks stop at 256."""


def auto_block(last: int) -> int:
    """Largest power of two <= MAX_AUTO_BLOCK dividing `last` (1 when `last` is odd)."""
    n = 1
    while n < MAX_AUTO_BLOCK and last % (2 * n) == 0:
        n *= 2
    return n


def check_block(n: int, shape: tuple[int, ...], where: str) -> None:
    """ValueError unless n is a power of two >= 2 that divides the last dim of `shape`."""
    last = shape[-1] if shape else 1
    if n < 2 or n & (n - 1) or last % n:
        raise ValueError(f"{where}: Hadamard rotation block {n} does not fit tensor shape {tuple(shape)}: it must be a "
                         f"power of two >= 2 that divides the last dim ({last}); accepted for this shape: "
                         f"{_fitting(last) or 'none (odd last dim): use a spec without rot'}")


def _fitting(last: int) -> str:
    return ", ".join(str(1 << i) for i in range(1, int(math.log2(max(last, 1))) + 1) if last % (1 << i) == 0)


_CHUNK = 1 << 17  # elements per CPU chunk: 512 KiB of fp32 per temporary, reused from cache


def _fwht_rows(y: Tensor, n: int, d: Tensor | None, after: bool) -> Tensor:
    """H_n D y (or D H_n y with `after`) for fp32 rows y (rows, n) whose sign pattern repeats every d.shape[0] rows
    (d: (period, n) or None). Returns a new tensor. The 1/sqrt(n) comes first, so that no partial sum of the levels
    exceeds what the orthonormal output may reach: values near the dtype's max do not overflow on the way."""
    y = y.mul(1 / math.sqrt(n))  # (rows, n), a new tensor; the scalar is rounded to fp32 once, as the kernel's
    if d is not None and not after:
        y = y.view(-1, d.shape[0], n).mul_(d)  # (rows / period, period, n)
    h = 1
    while h < n:  # one butterfly level per bit of the index, lowest first
        v = y.reshape(-1, 2, h)  # (pairs of half-blocks, 2, h)
        a, b = v[:, 0], v[:, 1]
        y = torch.stack([a + b, a - b], 1)  # (pairs, 2, h)
        h *= 2
    y = y.reshape(-1, n)  # (rows, n)
    if d is not None and after:
        y = y.view(-1, d.shape[0], n).mul_(d).view(-1, n)
    return y


def fwht(x: Tensor, n: int, d: Tensor | None = None, after: bool = False, dtype: torch.dtype = torch.float32,
         fused: bool = True) -> Tensor:
    """Orthonormal Walsh-Hadamard transform of every block of n along the last dim of `x`, computed in fp32, with the
    last dim multiplied by `d` (signs of shape (last,), or None) before the transform, or after it with `after`.
    Returns a new tensor of x's shape in `dtype`. On CPU the fused kernel runs where it is built (`fused`), else
    each chunk is cast and written once; both give the same bits."""
    last = x.shape[-1]
    if fused and x.device.type == "cpu" and kernels.usable(x, n):
        return kernels.kernels().fwht(x.contiguous(), d, n, after, x.new_empty((0,), dtype=dtype))
    if fused and x.device.type != "cpu" and n <= GEMM_MAX_BLOCK:
        return fwht_gemm(x, n, d, after, dtype)
    y = x.reshape(-1, n)  # (blocks, n)
    dv = d.view(last // n, n) if d is not None else None  # (blocks per row, n)
    period = last // n
    rows = max(period, _CHUNK // n // period * period)  # whole rows of x per chunk, so the signs line up
    if x.device.type != "cpu" or y.shape[0] <= rows:
        return _fwht_rows(y.float(), n, dv, after).to(dtype).view(x.shape)
    out = torch.empty(y.shape, dtype=dtype, device=x.device)  # (blocks, n)
    for i in range(0, y.shape[0], rows):
        out[i:i + rows] = _fwht_rows(y[i:i + rows].float(), n, dv, after)
    return out.view(x.shape)


@functools.cache
def hadamard_matrix(n: int, device: torch.device) -> Tensor:
    """The orthonormal Sylvester Hadamard matrix H_n (n, n) in fp32, the butterfly's transform; symmetric."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # (2m, 2m)
    return (h / math.sqrt(n)).float().to(device)


def fwht_gemm(x: Tensor, n: int, d: Tensor | None = None, after: bool = False,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """`fwht` as one matrix product with the dense H_n over every block (the accelerator path): a new tensor of x's
    shape in `dtype`, equal to the butterfly's to fp32 rounding."""
    last = x.shape[-1]
    y = x.reshape(-1, last // n, n).float()  # (rows, blocks per row, n); x itself when fp32: not written
    if d is not None and not after:
        y = y * d.view(last // n, n)  # a new tensor
    y = y.reshape(-1, n) @ hadamard_matrix(n, x.device)  # (rows * blocks, n), a new tensor
    if d is not None and after:
        y = y.view(-1, last // n, n).mul_(d.view(last // n, n))
    return y.to(dtype).view(x.shape)


def signs(last: int, key: int, device: torch.device, fused: bool = True) -> Tensor:
    """Random +-1 (fp32) for each position of the last dim, counter-based from `key` (ops/noise.py): the same on
    every device, and a device kernel computes them where it uses them. `fused`: on CPU the compiled loop where built
    (the same values)."""
    ext = kernels.kernels() if fused and torch.device(device).type == "cpu" else None
    return ext.noise_signs(last, key) if ext is not None else noise.signs(last, key, device)  # (last,)


def rotate(x: Tensor, n: int, key: int, fused: bool = True) -> Tensor:
    """H_n D x over blocks of n of the last dim, in fp32 (never modifies x); `fused`: the CPU kernel where built."""
    return fwht(x, n, signs(x.shape[-1], key, x.device, fused), fused=fused)  # x.shape, fp32


def unrotate(y: Tensor, n: int, key: int, dtype: torch.dtype = torch.float32, fused: bool = True) -> Tensor:
    """Inverse of `rotate` with the same key: D H_n y, in `dtype` (H_n is symmetric and orthonormal: its own
    inverse)."""
    return fwht(y, n, signs(y.shape[-1], key, y.device, fused), after=True, dtype=dtype, fused=fused)  # y.shape
