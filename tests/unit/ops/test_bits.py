import pytest
import torch

from pp_compress.ops.bits import PACKABLE_BITS, pack_bits, packed_nbytes, unpack_bits


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
