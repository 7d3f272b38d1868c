import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pp_compress as ppc
from pp_compress.wire import from_buffer, pack_bits, packed_nbytes, to_buffer, unpack_bits


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 300), seed=st.integers(0, 100))
def test_pack_unpack_roundtrip(bits, n, seed):
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_bit_order_is_lowest_first():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).item() == 0b10000001
    assert pack_bits(torch.tensor([0x3, 0xA], dtype=torch.uint8), 4).item() == 0xA3


def test_buffer_is_aligned_and_zero_copy():
    p = ppc.Payload((torch.ones(3, dtype=torch.uint8), torch.randn(5), torch.ones(2, dtype=torch.bfloat16)), torch.Size([9]), torch.float32)
    buf = to_buffer(p)
    assert buf.numel() == 3 + 20 + 4
    q = from_buffer(buf, p.layout, p.shape, p.dtype)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))
    assert q.tensors[1].data_ptr() == buf.data_ptr()  # fp32 first: aligned view, no copy


def test_buffer_size_mismatch_is_an_error():
    p = ppc.Payload((torch.randn(4),), torch.Size([4]), torch.float32)
    with pytest.raises(ValueError, match="bytes"):
        from_buffer(torch.zeros(15, dtype=torch.uint8), p.layout, p.shape, p.dtype)
