import copy

import pytest
import torch
from torch import nn

import pp_compress as ppc


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


def _mlp(cfg=None, width=16, device="cpu"):
    torch.manual_seed(0)
    layers = [nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)]
    if cfg is not None:
        layers.insert(2, ppc.CompressionBoundary(cfg + ",min_numel=0"))
    return nn.Sequential(*layers).to(device)


def _grads(model, x):
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_identity_boundary_is_bitwise_invisible(device):
    x = torch.randn(8, 16, device=device)
    plain, wrapped = _mlp(device=device), _mlp("identity", device=device)
    assert torch.equal(plain(x), wrapped(x))
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain, x), _grads(wrapped, x)))


def test_gradient_direction_is_compressed_too():
    x = torch.randn(8, 16)
    m = _mlp("act=identity,grad=topk:0.1")
    m.zero_grad()
    h = m[0](x).detach().requires_grad_()
    y = m[3](m[2](m[1](h)))
    y.pow(2).sum().backward()
    assert int((h.grad != 0).sum()) <= 8 * 32 * 0.1 + 8  # TopK of the gradient reached the input side
    b = m[2]
    assert b.stats["grad"].ratio > 3 and b.stats["act"].ratio == 1.0


def test_function_form():
    x = torch.randn(4, 40, requires_grad=True)
    y = ppc.compressed_boundary(x, ppc.build("int8"), ppc.build("topk:0.5"))
    y.sum().backward()
    assert float((y - x).abs().max()) < 0.05 and int((x.grad != 0).sum()) == 80


def test_warmup_and_min_numel():
    b = ppc.CompressionBoundary("act=topk:0.1,grad=topk:0.1,warmup=2,min_numel=0")
    x = torch.randn(4, 64, requires_grad=True)
    assert torch.equal(b(x), x) and torch.equal(b(x), x)
    assert not torch.equal(b(x), x)
    small = ppc.CompressionBoundary("act=topk:0.1,min_numel=1000")
    assert torch.equal(small(x), x)


def test_eval_uses_eval_spec_and_leaves_state_alone():
    b = ppc.CompressionBoundary("act=topk:0.1+ef,grad=int8,eval=none,min_numel=0")
    x = torch.randn(4, 64, requires_grad=True)
    b(x).sum().backward()
    state = copy.deepcopy(b.state_dict())
    b.eval()
    assert torch.equal(b(x), x)
    b2 = ppc.CompressionBoundary("act=topk:0.1+ef,grad=int8,min_numel=0").eval()  # eval follows act by default
    assert torch.equal(b2(x), ppc.build("topk:0.1").roundtrip(x.detach())[0])
    assert all(torch.equal(state["_extra_state"]["ops"]["0.act"]["send"][k], v)
               for k, v in b.state_dict()["_extra_state"]["ops"]["0.act"]["send"].items())


def test_state_dict_resume_and_config_guard():
    a = ppc.CompressionBoundary("act=topk:0.1+ef,grad=topk:0.2+ef21,min_numel=0")
    xs = [torch.randn(4, 64, requires_grad=True) for _ in range(6)]
    for x in xs[:3]:
        a(x).pow(2).sum().backward()
    b = ppc.CompressionBoundary("act=topk:0.1+ef,grad=topk:0.2+ef21,min_numel=0")
    b.load_state_dict(a.state_dict())
    assert b.step == 3
    for x in xs[3:]:
        xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        a(xa).pow(2).sum().backward()
        b(xb).pow(2).sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    with pytest.raises(ValueError, match="saved with config"):
        ppc.CompressionBoundary("int8").load_state_dict(a.state_dict())


def test_nonfinite_names_the_boundary():
    b = ppc.CompressionBoundary("int8,min_numel=0", boundary=2)
    with pytest.raises(FloatingPointError, match="boundary2.act"):
        b(torch.tensor([[1.0, float("nan")]]))


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_insert_boundaries_into_a_transformers_model():
    ids = torch.randint(0, 64, (2, 16))
    base = _tiny_gpt2()
    same = copy.deepcopy(base)
    bounds = ppc.insert_boundaries(same, after=[0, 2], cfg="identity")
    assert [b.boundary for b in bounds] == [0, 1]
    out_a = base(ids, labels=ids)
    out_b = same(ids, labels=ids)
    assert torch.equal(out_a.logits, out_b.logits)
    out_a.loss.backward()
    out_b.loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(base.parameters(), same.parameters()))

    comp = copy.deepcopy(base)
    bounds = ppc.insert_boundaries(comp, after=[0, 2], cfg="act=int4:per=block32,grad=topk:0.3+ef,eval=none")
    loss = comp(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and not torch.equal(comp(ids).logits, base(ids).logits)
    assert all(b.stats["act"].ratio > 3 and b.stats["grad"].ratio > 1.5 for b in bounds)
    comp.eval()
    assert torch.equal(comp(ids).logits, base.eval()(ids).logits)  # inference without compression
    with pytest.raises(ValueError, match="already has a boundary"):
        ppc.insert_boundaries(comp, after=[0], cfg="int8")
    with pytest.raises(ValueError, match="block indices"):
        ppc.insert_boundaries(_tiny_gpt2(), after=[7], cfg="int8")


def test_set_sample_ids_feeds_aqsgd():
    model = _tiny_gpt2()
    ppc.insert_boundaries(model, after=[1], cfg="act=topk:0.2+aqsgd,grad=int8")
    ids = torch.randint(0, 64, (2, 16))
    ppc.set_sample_ids(model, torch.tensor([3, 4]))
    model(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    (b,) = [m for m in model.modules() if isinstance(m, ppc.CompressionBoundary)]
    assert sorted(b.ops["act"].state_dict()["send"]["b0.act"]) == [3, 4]


def test_mdtopk_learns_in_process_and_its_w_is_in_the_state_dict():
    hot = [1, 5, 9]
    b = ppc.CompressionBoundary("act=mdtopk:0.25,grad=none,min_numel=0")
    b.train()
    g = torch.Generator().manual_seed(0)
    scale = torch.full((16,), 0.01)
    scale[hot] = 1.0
    for _ in range(10):
        x = torch.randn(6, 16, generator=g, requires_grad=True)
        (b(x) * scale).sum().backward()  # the loss depends on the hot channels only
    w = b.ops["act"].weights(ppc.Context(direction="act"), 16, torch.device("cpu"))
    assert set(torch.topk(w, 3).indices.tolist()) == set(hot)
    state = b.get_extra_state()
    assert "log_w" in state["ops"]["0.act"]
    fresh = ppc.CompressionBoundary("act=mdtopk:0.25,grad=none,min_numel=0")
    fresh.set_extra_state(state)
    assert torch.equal(fresh.ops["act"].weights(ppc.Context(direction="act"), 16, torch.device("cpu")), w)


def test_codec_time_is_counted_per_direction():
    model = _mlp("int8", width=64)
    model(torch.randn(8, 64)).sum().backward()
    (b,) = [m for m in model.modules() if isinstance(m, ppc.CompressionBoundary)]
    for d in ("act", "grad"):
        s = b.stats[d].as_dict()
        assert s["compress_s"] > 0 and s["decompress_s"] > 0 and not b.stats[d].pending_times
        assert s["compress_timed"] == s["decompress_timed"] == s["calls"] == 1  # on CPU every message is timed


def test_an_accelerator_times_only_the_sampled_messages():
    from pp_compress.stats import DirectionStats

    s = DirectionStats()
    span = s.start(torch.device("cuda"), sampled=False)  # no event is made: nothing here touches a device
    s.stop(span, "compress")
    assert span is None and s.compress_timed == 0 and s.compress_s == 0.0
    s.stop(s.start(torch.device("cpu"), sampled=False), "decompress")  # the CPU's clock costs nothing: always timed
    assert s.decompress_timed == 1 and s.as_dict()["decompress_timed"] == 1
