"""batch_dim: operators that group per sample see Megatron's [seq, batch, hidden] as [batch, seq, hidden]."""
import pytest
import torch

import pp_compress as ppc

GROUPED = ["topk:0.1", "randk:0.2", "lowrank:3", "int8:per=channel", "nat:bits=4:per=channel", "topk:0.2>int8",
           "topk:0.1+ef", "lowrank:2+ef21"]


@pytest.mark.parametrize("spec", GROUPED)
def test_per_sample_grouping_on_sbh_equals_the_transposed_bsh(spec):
    sbh = torch.randn(12, 3, 16, generator=torch.Generator().manual_seed(0))  # [seq, batch, hidden]
    bsh = sbh.transpose(0, 1).contiguous()
    megatron, plain = ppc.build(spec), ppc.build(spec)
    for step in range(3):  # stateful wrappers too
        ctx = ppc.Context(step=step)
        p1 = megatron.compress(sbh, ctx.replace(batch_dim=1))
        p0 = plain.compress(bsh, ctx)
        assert p1.shape == sbh.shape and all(torch.equal(a, b) for a, b in zip(p1.tensors, p0.tensors))
        assert p1.layout == megatron.layout(tuple(sbh.shape), sbh.dtype, ctx.replace(batch_dim=1))
        y1 = megatron.decompress(p1, ctx.replace(batch_dim=1))
        assert torch.equal(y1, plain.decompress(p0, ctx).transpose(0, 1))
        assert torch.equal(megatron.estimate(p1, ctx.replace(batch_dim=1)), y1)


def test_aqsgd_keys_its_buffers_by_the_samples_of_the_batch_dim():
    sbh = torch.randn(6, 4, 8)
    ids = torch.tensor([10, 11, 12, 13])
    op = ppc.build("int4+aqsgd")
    ctx = ppc.Context(sample_ids=ids, batch_dim=1)
    y, p = op.roundtrip(sbh, ctx)
    assert torch.equal(y, sbh)  # first visits travel raw
    assert sorted(op.send[ctx.sample_key]) == [10, 11, 12, 13]
    y2, _ = op.roundtrip(sbh + 0.01, ctx.replace(step=1))
    assert (y2 - sbh - 0.01).abs().max() < 0.01


def test_row_operators_ignore_batch_dim():
    x = torch.randn(5, 3, 8)
    p1 = ppc.build("int8").compress(x, ppc.Context(batch_dim=1))
    p0 = ppc.build("int8").compress(x)
    assert all(torch.equal(a, b) for a, b in zip(p1.tensors, p0.tensors))


def test_a_tensor_without_the_batch_dim_is_refused_by_name():
    with pytest.raises(ValueError, match=r"batch_dim=1 but the tensor has shape \(7,\)"):
        ppc.build("topk:0.1").compress(torch.randn(7), ppc.Context(batch_dim=1))


def test_the_boundary_and_the_pipeline_pass_batch_dim_on():
    b = ppc.CompressionBoundary("act=topk:0.25,grad=none,batch_dim=1,min_numel=0")
    b.train()
    sbh = torch.randn(8, 2, 4)
    y = b(sbh)
    per_sample = (y != 0).sum(dim=(0, 2))  # kept values per sample of the batch dim
    assert per_sample.tolist() == [8, 8]
