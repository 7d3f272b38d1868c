"""Counter-based uniform noise for stochastic rounding: u_i = splitmix64(key + (i + 1) * GAMMA) >> 40, over 2**24; and
random signs for rotations from the same stream (its top bit).

Each value's draw is a function of (key, its index) alone, not a generator's running state. So a fused kernel
computes it where it rounds, without a noise tensor in memory (csrc/fused.cpp, `noise_uniform`), and this module
computes the same values with plain torch integer ops, on any device: the eager reference and the fused path round
with the same draws, bitwise. The key comes from the Context (`Context.noise_key`), like a generator's seed.

splitmix64 (Steele, Lea, Flood 2014, as in java.util.SplittableRandom and Vigna's xoshiro seeding) is a bijective
mixer with full avalanche; its top 24 bits are the mantissa of a uniform float in [0, 1), as torch.rand's.
int64 arithmetic here wraps modulo 2**64 (two's complement) as uint64 would; right shifts are made logical by masks.
"""
from __future__ import annotations

import torch
from torch import Tensor

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def _i64(v: int) -> int:
    """The int64 with the bits of uint64 v."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 bits."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix(n: int, key: int, device: torch.device | str) -> Tensor:
    """splitmix64(key + (i + 1) * GAMMA) for i < n, as int64 bits (n,)."""
    z = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_i64(GAMMA)).add_(_i64(key))  # (n,)
    z = (z ^ _shr(z, 30)).mul_(_i64(MIX1))
    z = (z ^ _shr(z, 27)).mul_(_i64(MIX2))
    return z ^ _shr(z, 31)


def uniform(shape: tuple[int, ...] | torch.Size, key: int, device: torch.device | str = "cpu") -> Tensor:
    """fp32 uniforms in [0, 1) with 24 random bits each, element i (row-major) from (key, i)."""
    n = 1
    for s in shape:
        n *= int(s)
    return _shr(_mix(n, key, device), 40).float().mul_(2.0**-24).view(tuple(shape))  # exact: 24-bit integers * 2**-24


def signs(n: int, key: int, device: torch.device | str = "cpu") -> Tensor:
    """fp32 +-1 (n,): element i is +1 where the top bit of splitmix64(key + (i + 1) * GAMMA) is set."""
    return _shr(_mix(n, key, device), 63).float().mul_(2).sub_(1)  # (n,)
