import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("per", ["sample", "row", "tensor"])
def test_keeps_exactly_the_largest_magnitudes(per):
    x = torch.randn(4, 8, 50)
    y, _ = ppc.build(f"topk:0.1:per={per}").roundtrip(x)
    groups = {"sample": x.reshape(4, -1), "row": x.reshape(-1, 50), "tensor": x.reshape(1, -1)}[per]
    out = y.reshape(groups.shape)
    k = round(0.1 * groups.shape[1])
    kept = out != 0
    assert (kept.sum(1) == k).all()
    thresh = groups.abs().topk(k, dim=1).values[:, -1:]
    assert torch.equal(out[kept], groups[kept]) and (groups.abs()[kept.logical_not()] <= thresh.expand_as(groups)[kept.logical_not()]).all()


def test_index_dtype_and_bitmap_choice():
    op = ppc.build("topk:0.01")
    # 2 samples of 40000 elements: 400 int16 indices each (800 B) beat a 5000 B bitmap
    assert [s.dtype for s in op.wire_layout((2, 40000), torch.float32)] == [torch.float32, torch.int16]
    # 70000 elements per sample: int32 indices
    assert op.wire_layout((1, 70000), torch.float32)[1].dtype == torch.int32
    # at 30% a bitmap (1 bit per element) is smaller than 16 bits per kept value
    assert ppc.build("topk:0.3").wire_layout((2, 40000), torch.float32)[1] == ((10000,), torch.uint8)


def test_large_groups_use_int32_indices_correctly():
    x = torch.randn(1, 70000)
    y, p = ppc.build("topk:0.001:index=index").roundtrip(x)
    assert p.tensors[1].dtype == torch.int32
    idx = x.abs().topk(70, dim=1).indices
    assert torch.equal(y[0, idx[0]], x[0, idx[0]]) and int((y != 0).sum()) == 70


def test_int16_offset_covers_full_range():
    x = torch.zeros(1, 65536)
    x[0, [0, 32767, 32768, 65535]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y, p = ppc.build("topk:0.00006:index=index").roundtrip(x)
    assert p.tensors[1].dtype == torch.int16 and torch.equal(y, x)


def test_bf16_wire_ratio_with_cheaper_values():
    x = torch.randn(8, 1024, 768, dtype=torch.bfloat16)
    plain = ppc.build("topk:0.1").compress(x).nbytes
    q8 = ppc.build("topk:0.1>int8").compress(x).nbytes
    assert q8 < plain and x.numel() * 2 / q8 > 8
