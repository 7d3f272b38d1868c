import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("inner", ["topk:0.1", "int2", "randk:0.2", "lowrank:2", "topk:0.05>int4"])
def test_ef_invariant_in_float64(inner):
    """sum of what was sent + final residual == sum of inputs (EF loses nothing)."""
    op = ppc.build(f"{inner}+ef")
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 8, 16, generator=g, dtype=torch.float64) for _ in range(30)]
    sent = sum(op.roundtrip(x, ppc.Context(step=i))[0] for i, x in enumerate(inputs))
    residual = op.state_dict()["send"]["b0.act.mb0"]
    assert torch.allclose(sent + residual, sum(inputs), rtol=0, atol=1e-10)


def test_ef_residual_is_kept_per_boundary_direction_and_micro_batch():
    op = ppc.build("topk:0.1+ef")
    for mb in range(3):
        op.roundtrip(torch.randn(2, 10), ppc.Context(micro_batch=mb, direction="grad", boundary=1))
    assert sorted(op.state_dict()["send"]) == ["b1.grad.mb0", "b1.grad.mb1", "b1.grad.mb2"]


@pytest.mark.parametrize("spec", ["topk:0.1+ef", "lowrank:2+ef", "int4+ef", "randk:0.1"])
def test_estimate_is_what_a_separate_receiver_decodes(spec):
    sender, receiver = ppc.build(spec), ppc.build(spec)
    for step in range(5):
        x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(step))
        ctx = ppc.Context(step=step)
        p = sender.compress(x, ctx)
        assert torch.equal(sender.estimate(p, ctx), receiver.decompress(p, ctx))


@pytest.mark.parametrize("spec", ["topk:0.1+ef21", "int2:stoch+ef21", "randk:0.1+ef21", "topk:0.2+aqsgd", "int4+aqsgd",
                                  "int2+aqsgd:first=int8:rot", "int3:stoch+aqsgd:first=topk:0.3>int8"])
def test_sender_and_receiver_state_stay_bit_identical(spec):
    sender, receiver = ppc.build(spec), ppc.build(spec)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(12, 6, 8, generator=g)
    for step in range(40):
        ids = torch.randperm(12, generator=g)[:4]
        x = base[ids] + 0.1 * torch.randn(4, 6, 8, generator=g)
        ctx = ppc.Context(step=step, sample_ids=ids, micro_batch=step % 2)
        layout = receiver.wire_layout(x.shape, x.dtype, ctx)
        p = sender.compress(x, ctx)
        assert p.layout == layout
        wire = tuple(t.clone() for t in p.tensors)  # only these bytes travel
        guess = sender.estimate(p, ctx)  # the sender's view of what arrives (statistics), touches no state
        y = receiver.decompress(ppc.Payload(wire, x.shape, x.dtype), ctx)
        assert torch.equal(guess, y)
        local = sender.decompress(p, ctx)  # the sender's in-process receiver side
        assert torch.equal(y, local)
    s, r = sender.state_dict(), receiver.state_dict()
    assert s["send"].keys() == r["recv"].keys()
    for key in s["send"]:
        a, b = s["send"][key], r["recv"][key]
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)
        else:
            assert torch.equal(a, b)


def test_ef21_converges_to_a_fixed_input():
    x = torch.randn(3, 50)
    op = ppc.build("topk:0.1+ef21")
    errs = [float((op.roundtrip(x)[0] - x).norm() / x.norm()) for _ in range(60)]
    assert errs[0] > 0.5 and errs[-1] < 1e-3


def test_aqsgd_first_visit_is_raw_then_deltas():
    op = ppc.build("topk:0.1+aqsgd")
    x = torch.randn(2, 100)
    ctx = ppc.Context(sample_ids=torch.tensor([5, 9]))
    y, p = op.roundtrip(x, ctx)
    assert torch.equal(y, x) and p.tensors[0].shape == (2, 100)
    ctx2 = ppc.Context(sample_ids=torch.tensor([9, 3]), step=1)
    x2 = torch.stack([x[1] + 0.01, torch.randn(100)])
    y2, p2 = op.roundtrip(x2, ctx2)
    assert p2.tensors[0].shape == (1, 100)  # sample 3 is new
    assert torch.equal(y2[1], x2[1]) and float((y2[0] - x2[0]).norm()) < float(x2[0].norm()) * 0.05


def test_aqsgd_compressed_first_visit_sends_the_first_ops_bytes_then_deltas():
    op, first = ppc.build("int2+aqsgd:first=int8"), ppc.build("int8")
    x = torch.randn(2, 100, dtype=torch.float64)
    ctx = ppc.Context(sample_ids=torch.tensor([5, 9]))
    y, p = op.roundtrip(x, ctx)
    want = first.compress(x, ctx)
    assert p.layout[:len(want.layout)] == want.layout  # the first visit travels as int8's payload, no raw rows
    assert p.nbytes == want.nbytes + sum(t.numel() * t.element_size() for t in p.tensors[len(want.tensors):])
    assert torch.equal(y, first.decompress(want, ctx))  # both sides start the buffer from the decoded first visit
    # later visits of the same samples: deltas correct what int8 lost, so the error falls below int8's
    errs = [float((op.roundtrip(x, ctx.replace(step=s))[0] - x).norm() / x.norm()) for s in range(1, 12)]
    assert errs[-1] < 0.1 * float((y - x).norm() / x.norm())


def test_aqsgd_first_visit_spec_round_trips_and_bad_forms_are_named():
    from pp_compress.config import CompressorSpec
    for text in ["int2+aqsgd:first=int8:rot", "topk:0.1>int8+aqsgd:first=topk:0.3>int8"]:
        spec = CompressorSpec.parse(text)
        assert str(spec) == text and CompressorSpec.parse(str(spec)) == spec and ppc.build(text).spec == text
    cfg = ppc.parse_spec("act=int2+aqsgd:first=int8,grad=int8")
    assert ppc.CompressionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"'first=int8' in 'int2\+ef:first=int8'; accepted: \+aqsgd:first="):
        CompressorSpec.parse("int2+ef:first=int8")
    with pytest.raises(ValueError, match=r"needs \+aqsgd, not \+ef"):
        CompressorSpec((ppc.parse_op("int2"),), "ef", (ppc.parse_op("int8"),))
    with pytest.raises(ValueError, match=r"'foo=1'.*accepted: \+aqsgd:first="):
        CompressorSpec.parse("int2+aqsgd:foo=1")
    with pytest.raises(ValueError, match="unsupported bit width in 'int9'; accepted: int1 .. int8"):
        CompressorSpec.parse("int2+aqsgd:first=int9")


def test_aqsgd_needs_sample_ids():
    with pytest.raises(ValueError, match="sample ids"):
        ppc.build("int8+aqsgd").compress(torch.randn(2, 4))
    with pytest.raises(ValueError, match="distinct"):
        ppc.build("int8+aqsgd").compress(torch.randn(2, 4), ppc.Context(sample_ids=torch.tensor([1, 1])))


@pytest.mark.parametrize("spec", ["topk:0.1+ef", "topk:0.1+ef21", "int4+aqsgd", "lowrank:2>int8+ef", "int2+aqsgd:first=int8"])
def test_state_dict_resume_is_identical(spec):
    xs = [torch.randn(3, 4, 20) for _ in range(8)]
    ctx = lambda i: ppc.Context(step=i, sample_ids=torch.tensor([i % 4, 4 + i % 3, 10]))  # noqa: E731
    a = ppc.build(spec)
    for i in range(4):
        a.roundtrip(xs[i], ctx(i))
    b = ppc.build(spec)
    b.load_state_dict(a.state_dict())
    for i in range(4, 8):
        assert torch.equal(a.roundtrip(xs[i], ctx(i))[0], b.roundtrip(xs[i], ctx(i))[0])


def test_inference_leaves_state_untouched():
    op = ppc.build("topk:0.1+ef21")
    x = torch.randn(2, 30)
    op.roundtrip(x)
    before = {k: v.clone() for k, v in op.state_dict()["send"].items()}
    y, _ = op.roundtrip(x, ppc.Context(training=False))
    assert torch.equal(y, ppc.build("topk:0.1").roundtrip(x)[0])
    assert all(torch.equal(before[k], v) for k, v in op.state_dict()["send"].items())


def test_ef21_output_is_not_its_state():
    """A receiver's output becomes a leaf with requires_grad in a pipeline: it must not alias the state."""
    op = ppc.build("topk:0.5+ef21")
    for step in range(2):
        y = op.decompress(op.compress(torch.randn(3, 4), ppc.Context(step=step)), ppc.Context(step=step))
        y.requires_grad_(True)
        assert y.data_ptr() != op.recv["b0.act.mb0"].data_ptr() and not op.recv["b0.act.mb0"].requires_grad
