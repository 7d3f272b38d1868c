import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.mdtopk import _inclusion, _systematic


def _salient_case(rows=64, d=40, hot=(3, 11, 17, 29), seed=0):
    """Activations of equal size on every channel; gradients large on `hot` channels only."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen)
    g = 0.01 * torch.randn(rows, d, generator=gen)
    g[:, list(hot)] *= 100
    return x, g


def _learn(op, x, g, steps=20, **ctx):
    for step in range(steps):
        c = ppc.Context(step=step, **ctx)
        op.compress(x, c)
        op.observe(g, c)


@pytest.mark.parametrize("mode", ["greedy", "greedy_weighted", "weighted_greedy", "stochastic"])
def test_w_moves_towards_the_channels_that_carry_saliency(mode):
    hot = (3, 11, 17, 29)
    x, g = _salient_case(hot=hot)
    op = ppc.build(f"mdtopk:0.1:mode={mode}")
    w0 = op.weights(ppc.Context(), 40, x.device)
    assert torch.allclose(w0, torch.full((40,), 1 / 40))
    _learn(op, x, g)
    w = op.weights(ppc.Context(), 40, x.device)
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-5)
    assert set(torch.topk(w, 4).indices.tolist()) == set(hot)
    assert float(w[list(hot)].min()) > 5 * float(w[[c for c in range(40) if c not in hot]].max())
    if mode in ("greedy", "greedy_weighted"):  # the learned choice: exactly the hot channels, for every row
        y, _ = op.roundtrip(x, ppc.Context(step=99))
        assert set((y != 0).any(0).nonzero().flatten().tolist()) == set(hot)


def test_greedy_sends_k_channel_values_per_row_and_k_indices():
    x = torch.randn(2, 8, 100)
    op = ppc.build("mdtopk:0.1")
    y, p = op.roundtrip(x)
    assert p.nbytes == 16 * 10 * 4 + 10 * 2 == op.wire_nbytes(x.shape, x.dtype)
    kept = (y != 0).reshape(16, 100)
    assert (kept == kept[0]).all() and int(kept[0].sum()) == 10  # the same channels in every row
    assert torch.equal(y[y != 0], x[y != 0])


def test_weighted_greedy_at_uniform_w_is_topk_per_row():
    x = torch.randn(4, 6, 50)
    a = ppc.build("mdtopk:0.2:mode=weighted_greedy").compress(x)
    b = ppc.build("topk:0.2:per=row").compress(x)
    assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))


def test_greedy_weighted_scales_kept_values_by_relative_importance():
    x, g = _salient_case()
    plain, weighted = ppc.build("mdtopk:0.2"), ppc.build("mdtopk:0.2:mode=greedy_weighted")
    y0, _ = weighted.roundtrip(x)
    assert torch.allclose(y0, plain.roundtrip(x)[0], rtol=1e-6, atol=0)  # uniform w: gain 1
    _learn(plain, x, g)
    _learn(weighted, x, g)
    w = weighted.weights(ppc.Context(), 40, x.device)
    chan = torch.topk(w, 8).indices
    y, _ = weighted.roundtrip(x, ppc.Context(step=50))
    gain = w[chan] / w[chan].mean()
    assert torch.allclose(y[:, chan], x[:, chan] * gain, rtol=1e-6)


def test_stochastic_draws_each_channel_with_probability_k_times_w():
    w = torch.softmax(torch.linspace(-2, 2, 20), 0)
    p = _inclusion(w, 5)
    assert float(p.sum()) == pytest.approx(5, abs=1e-5) and float(p.max()) <= 1
    counts = torch.zeros(20)
    gen = torch.Generator().manual_seed(0)
    n = 4000
    for _ in range(n):
        at = _systematic(p, torch.rand((), generator=gen), 5)
        assert at.unique().numel() == 5
        counts[at] += 1
    assert float((counts / n - p).abs().max()) < 0.03


def test_inclusion_caps_at_one_and_rescales_the_rest():
    w = torch.tensor([0.7, 0.2, 0.05, 0.05])
    p = _inclusion(w, 2)  # 2 * 0.7 > 1: fixed at 1, the other 1 spread over 0.2 : 0.05 : 0.05
    assert torch.allclose(p, torch.tensor([1.0, 2 / 3, 1 / 6, 1 / 6]))


def _inclusion_by_rounds(w, k):
    """The definition: fix whatever exceeds 1 at 1, rescale the rest to the remaining sum, until nothing does."""
    fixed = torch.zeros_like(w, dtype=torch.bool)
    while True:
        rest = w.masked_fill(fixed, 0)
        p = torch.where(fixed, torch.ones_like(w), rest * ((k - int(fixed.sum())) / rest.sum()))
        over = (p > 1) & ~fixed
        if not bool(over.any()):
            return p.clamp(max=1)
        fixed |= over


@pytest.mark.parametrize("seed", range(40))
def test_inclusion_in_one_pass_is_where_the_rounds_end(seed):
    gen = torch.Generator().manual_seed(seed)
    d = int(torch.randint(1, 300, (), generator=gen))
    k = int(torch.randint(1, d + 1, (), generator=gen))
    w = torch.softmax(torch.randn(d, generator=gen) * float(8 * torch.rand((), generator=gen)), 0)  # flat to peaked
    if seed % 4 == 0:  # ties
        w = torch.round(w * 40) / 40 + 1e-6
    p = _inclusion(w, k)
    assert p.dtype == w.dtype and p.shape == w.shape
    assert torch.allclose(p, _inclusion_by_rounds(w, k), rtol=0, atol=1e-6)
    assert float(p.sum()) == pytest.approx(k, rel=1e-5) and float(p.max()) <= 1


def test_a_zero_gradient_leaves_w_where_it_was():
    x, g = _salient_case()
    op = ppc.build("mdtopk:0.1")
    _learn(op, x, g, steps=3)
    before = op.state_dict()["log_w"]["b0.act"].clone()
    _learn(op, x, torch.zeros_like(g), steps=2)
    assert torch.equal(op.state_dict()["log_w"]["b0.act"], before)
    fresh = ppc.build("mdtopk:0.1")
    _learn(fresh, x, torch.zeros_like(g), steps=1)  # from uniform: stays uniform
    assert torch.allclose(fresh.weights(ppc.Context(), 40, x.device), torch.full((40,), 1 / 40))


def test_state_is_keyed_per_boundary_and_tensor_resumes_and_rejects_junk():
    x, g = _salient_case()
    op = ppc.build("mdtopk:0.1:mode=stochastic")
    _learn(op, x, g, boundary=1, micro_batch=2)
    state = op.state_dict()
    assert list(state["log_w"]) == ["b1.act"]  # shared by micro-batch slots
    fresh = ppc.build("mdtopk:0.1:mode=stochastic")
    fresh.load_state_dict(state)
    ctx = ppc.Context(step=77, boundary=1)
    assert all(torch.equal(s, t) for s, t in zip(op.compress(x, ctx).tensors, fresh.compress(x, ctx).tensors))
    with pytest.raises(ValueError, match="unknown state keys"):
        fresh.load_state_dict({"w": {}})


def test_inference_neither_stashes_nor_learns():
    x, g = _salient_case()
    op = ppc.build("mdtopk:0.1")
    ctx = ppc.Context(training=False)
    op.compress(x, ctx)
    op.observe(g, ctx)
    assert op.sent == {} and op.state_dict() == {}


def test_a_gradient_of_another_shape_is_an_error():
    op = ppc.build("mdtopk:0.1")
    op.compress(torch.randn(4, 10))
    with pytest.raises(ValueError, match=r"gradient of shape \(4, 9\)"):
        op.observe(torch.randn(4, 9), ppc.Context())


@pytest.mark.parametrize("spec", ["mdtopk:0.2+ef", "mdtopk:0.2:mode=greedy_weighted+ef21", "mdtopk:0.2>int8"])
def test_learns_through_wrappers_and_chains(spec):
    x, g = _salient_case(d=40)
    op = ppc.build(spec)
    _learn(op, x, g)
    inner = op
    while not hasattr(inner, "log_w"):
        inner = getattr(inner, "inner", None) if not hasattr(inner, "outer") else inner.outer
    assert set(torch.topk(inner.weights(ppc.Context(), 40, x.device), 4).indices.tolist()) == {3, 11, 17, 29}


@pytest.mark.parametrize("bad,token", [
    ("mdtopk:0.1", "only activations get one"), ("act=int8>mdtopk:0.1", "first in a chain"),
    ("act=mdtopk:0.1+aqsgd", "not under \\+aqsgd"), ("act=mdtopk:0.1:mode=best", "mode='best'"),
    ("act=mdtopk:0.1:decay=1", "decay=1.0"), ("act=mdtopk:0.1:lr=0", "lr=0.0"),
    ("act=mdtopk:0.1:index=bitmap", "weighted_greedy only"), ("act=int8,b1.grad=mdtopk:0.2", "b1.grad=mdtopk"),
])
def test_bad_configs_name_the_value(bad, token):
    with pytest.raises(ValueError, match=token):
        ppc.parse_spec(bad)
