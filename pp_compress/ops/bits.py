"""Bit packing of codes of 1..8 bits with tensor ops (no Python loop over elements).

Widths that divide 8 (1, 2, 4) pack whole codes into each byte; the others (3, 5, 6, 7) pack 8 codes into one
64-bit word and keep its low `bits` bytes. Either way n codes take exactly ceil(n * bits / 8) bytes, first code
in the lowest bits.
"""
from __future__ import annotations

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
