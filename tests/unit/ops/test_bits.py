import math

import pytest
import torch

from pp_compress.ops.bits import (PACKABLE_BITS, level_packing, levels_nbytes, pack_bits, pack_levels, packed_nbytes,
                                  unpack_bits, unpack_levels)


@pytest.mark.parametrize("bits", PACKABLE_BITS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1000, 12345])
def test_pack_roundtrip_with_exact_bytes(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits) == (n * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_first_code_in_the_lowest_bits():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 2], dtype=torch.uint8), 3).tolist() == [1, 0, 0x40]  # code 7 starts at bit 21: its value 2 sets bit 22
    with pytest.raises(ValueError, match="accepted"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)


@pytest.mark.parametrize("levels,k,m", [(3, 5, 8), (5, 3, 7), (40, 3, 16), (48, 5, 28), (16, 1, 4), (255, 1, 8), (256, 1, 8)])
def test_level_packing_takes_the_fewest_bits_per_code(levels, k, m):
    assert level_packing(levels) == (k, m)
    assert 2 ** (m - 1) < levels**k <= 2**m  # m is the fewest bits that hold k codes
    assert all(m / k <= math.ceil(j * math.log2(levels)) / j + 1e-9 for j in range(1, 9))  # no other k <= 8 does better


@pytest.mark.parametrize("levels", [3, 5, 6, 7, 40, 48, 100, 129, 255, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 1000, 12345])
def test_pack_levels_roundtrip_with_exact_bytes(levels, n):
    codes = torch.randint(0, levels, (n,), generator=torch.Generator().manual_seed(n)).to(torch.uint8)
    packed = pack_levels(codes, levels)
    k, m = level_packing(levels)
    words = -(-n // k)  # base-L numbers: m // 8 whole bytes each, then their m % 8 high bits bit-packed
    assert packed.dtype == torch.uint8
    assert packed.numel() == levels_nbytes(n, levels) == (words * (m // 8) + (words * (m % 8) + 7) // 8 if k > 1 else (n * m + 7) // 8)
    assert torch.equal(unpack_levels(packed, levels, n), codes)


def test_pack_levels_is_base_l_and_power_of_two_counts_are_bit_packing():
    # 5 levels: codes 1, 2, 3 -> 1 + 2 * 5 + 3 * 25 = 86, one 7-bit number in the low bits of one byte
    assert pack_levels(torch.tensor([1, 2, 3], dtype=torch.uint8), 5).tolist() == [86]
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(pack_levels(codes, 16), pack_bits(codes, 4))
    with pytest.raises(ValueError, match="levels=257; accepted: 2 .. 256"):
        level_packing(257)
