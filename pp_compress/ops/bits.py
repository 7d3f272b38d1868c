"""Bit packing of codes of 1..8 bits with tensor ops (no Python loop over elements).

Widths that divide 8 (1, 2, 4) pack whole codes into each byte; the others (3, 5, 6, 7) pack 8 codes into one
64-bit word and keep its low `bits` bytes. Either way n codes take exactly ceil(n * bits / 8) bytes, first code
in the lowest bits.

Codes of L levels, L not a power of two, are packed k at a time as one base-L number of m bits (L**k <= 2**m), so
they cost m / k bits each instead of ceil(log2 L): 5 levels take 7 bits per 3 codes (2.33 bits), 40 levels 16 bits
per 3 codes (5.33 bits).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

PACKABLE_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# 1-bit packing with 64-bit multiplies (little-endian byte order, as torch views are on every supported platform)
_GATHER = 0x0102040810204080  # byte i (bit 8i) -> bit 56 + i
_SPREAD = 0x0101010101010101  # a byte into all 8 bytes of a word
_SELECT = -0x7FBFDFEFF7FBFDFF  # 0x8040201008040201 as int64: bit i of byte i


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy after packing."""
    return (n * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack a flat uint8 tensor of codes < 2**bits into bytes, first code in the lowest bits."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits={bits}; accepted: {PACKABLE_BITS}")
    codes = codes.reshape(-1).to(torch.uint8)  # (n,)
    if bits == 8:
        return codes
    if 8 % bits:
        return _pack_words(codes, bits)
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if bits == 1:  # 8 bytes as one int64; one multiply gathers byte i's low bit into bit 56 + i (no carries)
        words = codes.contiguous().view(torch.int64)  # (n / 8,)
        return ((words * _GATHER) >> 56).to(torch.uint8)  # the wrap-around of the product is intended
    grouped = codes.view(-1, per)  # (n / per, per)
    out = grouped[:, 0].clone()  # (n / per,)
    for i in range(1, per):
        out |= grouped[:, i] << (i * bits)
    return out


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of `pack_bits`: the first `n` codes as a flat uint8 tensor."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits={bits}; accepted: {PACKABLE_BITS}")
    if bits == 8:
        return packed[:n]
    if 8 % bits:
        return _unpack_words(packed, bits, n)
    if bits == 1:  # replicate each byte 8 times in an int64, keep bit i in byte i
        words = (packed.to(torch.int64) * _SPREAD) & _SELECT  # (nbytes,)
        return (words.view(torch.uint8) != 0).to(torch.uint8)[:n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (8 // bits,)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (nbytes, 8 // bits)
    return codes.reshape(-1)[:n]


MAX_LEVELS = 256
GROUP_CODES = 8
"""The most codes one base-L number holds (k)."""


@functools.cache
def level_packing(levels: int) -> tuple[int, int]:
    """(k, m): codes per base-`levels` number and its bits, the fewest bits per code for k <= 8 (the smaller k on a
    tie). A power of two gets (1, log2 L): plain bit packing."""
    if not 2 <= levels <= MAX_LEVELS:
        raise ValueError(f"levels={levels}; accepted: 2 .. {MAX_LEVELS}")
    fits = [(k, m) for k in range(1, GROUP_CODES + 1) if (m := (levels**k - 1).bit_length()) < 64]  # int64 arithmetic
    return min(fits, key=lambda km: (km[1] / km[0], km[0]))


def levels_nbytes(n: int, levels: int) -> int:
    """Bytes that `n` codes of `levels` levels occupy after `pack_levels`."""
    k, m = level_packing(levels)
    if k == 1:
        return packed_nbytes(n, m)
    words = -(-n // k)
    return words * (m // 8) + packed_nbytes(words, m % 8)


def pack_levels(codes: Tensor, levels: int) -> Tensor:
    """Pack a flat uint8 tensor of codes < `levels`: k codes as one base-L number (first code the lowest digit),
    whose m bits go as m // 8 whole bytes per number, then the m % 8 high bits of every number bit-packed."""
    k, m = level_packing(levels)
    if k == 1:
        return pack_bits(codes, m)
    codes = codes.reshape(-1).to(torch.int64)  # (n,)
    pad = (-codes.numel()) % k
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    words = (codes.view(-1, k) * _digits(levels, k, codes.device)).sum(1)  # (n / k,), each < 2**m
    q, r = divmod(m, 8)
    low = (words[:, None] >> (8 * torch.arange(q, device=codes.device))) & 0xFF  # (n / k, q)
    parts = [low.to(torch.uint8).reshape(-1)]
    if r:
        parts.append(pack_bits((words >> (8 * q)).to(torch.uint8), r))
    return torch.cat(parts)


def unpack_levels(packed: Tensor, levels: int, n: int) -> Tensor:
    """Inverse of `pack_levels`: the first `n` codes as a flat uint8 tensor."""
    k, m = level_packing(levels)
    if k == 1:
        return unpack_bits(packed, m, n)
    words_n = -(-n // k)
    q, r = divmod(m, 8)
    low = packed[: words_n * q].view(words_n, q).to(torch.int64)  # (words, q)
    words = (low << (8 * torch.arange(q, device=packed.device))).sum(1)  # (words,)
    if r:
        words |= unpack_bits(packed[words_n * q:], r, words_n).to(torch.int64) << (8 * q)
    return ((words[:, None] // _digits(levels, k, packed.device)) % levels).to(torch.uint8).reshape(-1)[:n]


def _digits(levels: int, k: int, device: torch.device) -> Tensor:
    """(k,) int64 place values levels**i, made on `device` (no host-to-device copy per micro-batch)."""
    return levels ** torch.arange(k, dtype=torch.int64, device=device)


def _shifts(bits: int, device: torch.device) -> Tensor:
    return torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=device)  # (8,)


def _pack_words(codes: Tensor, bits: int) -> Tensor:
    """8 codes -> one int64 word (disjoint bit ranges, so the sum is an OR) -> its low `bits` bytes."""
    n = codes.numel()
    pad = (-n) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    words = (codes.view(-1, 8).to(torch.int64) << _shifts(bits, codes.device)).sum(1)  # (n / 8,)
    packed = words.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)  # (n / 8 * bits,), little-endian
    return packed[: packed_nbytes(n, bits)]  # the bytes cut off hold padding codes only (zeros)


def _unpack_words(packed: Tensor, bits: int, n: int) -> Tensor:
    words = -(-n // 8)
    flat = torch.nn.functional.pad(packed, (0, words * bits - packed.numel()))  # (words * bits,): cut bytes back
    grid = torch.nn.functional.pad(flat.view(words, bits), (0, 8 - bits))  # (words, 8): one int64 each
    codes = (grid.view(torch.int64) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)  # (words, 8)
    return codes.to(torch.uint8).reshape(-1)[:n]
