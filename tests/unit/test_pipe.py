"""StageCompression without DeepSpeed: two stages joined by an in-memory queue instead of p2p."""
from collections import deque

import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import TensorSpec
from pp_compress.pipe import StageCompression, wire_order


def _pair(spec: str):
    cfg = ppc.parse_spec(spec + ",min_numel=0")  # these tensors are tiny
    return StageCompression(cfg, 0, 2), StageCompression(cfg, 1, 2)


def _link():
    q: deque = deque()
    return q.append, lambda t: t.copy_(q.popleft())


def test_bool_masks_travel_as_their_uint8_bytes():
    a, b = _pair("int8")
    sent = []
    q = _link()
    mask = torch.tensor([[True, False], [False, True]])
    a.send([torch.randn(2, 2), mask], 0, "act", step=0, micro_batch=0, training=True,
           send_fn=lambda t: (sent.append(t.dtype), q[0](t)))
    y = b.recv([TensorSpec((2, 2), torch.float32), TensorSpec((2, 2), torch.bool)], 0, "act", step=0, micro_batch=0,
               training=True, recv_fn=q[1], device=torch.device("cpu"))
    assert sent[0] == torch.uint8 and torch.equal(y[1], mask) and y[1].dtype == torch.bool


def test_integer_tensors_travel_first_and_untouched():
    specs = [TensorSpec((2, 3), torch.float32), TensorSpec((2,), torch.int64), TensorSpec((4,), torch.bool)]
    assert wire_order(specs) == [1, 2, 0]
    a, b = _pair("int8")
    send, recv = _link()
    x = (torch.randn(2, 3), torch.tensor([7, 9]), torch.tensor([True, False, True, True]))
    a.send(list(x), 0, "act", step=0, micro_batch=0, training=True, send_fn=send)
    y = b.recv(specs, 0, "act", step=0, micro_batch=0, training=True, recv_fn=recv, device=torch.device("cpu"))
    assert torch.equal(y[1], x[1]) and torch.equal(y[2], x[2]) and y[2].dtype == torch.bool
    assert (y[0] - x[0]).abs().max() < 0.05 and a.stats["b0.act"].wire_bytes < x[0].numel() * 4 + 2 * 8 + 4
    # on CPU every message's codec time is counted: the sender's compress, the receiver's decompress
    assert a.stats["b0.act"].compress_timed == 1 and b.stats["b0.act"].decompress_timed == 1


@pytest.mark.parametrize("spec", ["act=topk:0.2+aqsgd,grad=int8+aqsgd", "topk:0.1+ef21"])
def test_per_sample_state_agrees_across_stages_with_ids_from_the_tuple(spec):
    a, b = _pair(spec)
    act_send, act_recv = _link()
    grad_send, grad_recv = _link()
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 5, 6, generator=g)
    specs = [TensorSpec((4, 5, 6), torch.float32), TensorSpec((4,), torch.int64)]
    for step in range(12):
        for mb in range(2):
            ids = torch.randperm(8, generator=g)[:4]
            x = base[ids] + 0.05 * torch.randn(4, 5, 6, generator=g)
            where = dict(step=step, micro_batch=mb, training=True)
            a.send([x, ids], 0, "act", send_fn=act_send, **where)
            y, got = b.recv(specs, 0, "act", recv_fn=act_recv, device=torch.device("cpu"), **where)
            assert torch.equal(got, ids)
            b.send([y * 2], 0, "grad", send_fn=grad_send, sample_ids=got, **where)
            (gy,) = a.recv(specs[:1], 0, "grad", recv_fn=grad_recv, device=torch.device("cpu"),
                                                sample_ids=ids, **where)
    # the relative error was measured on the sender (error_every=10: steps 0 and 10) and is believable
    err = a.stats["b0.act"].rel_error
    assert 0 < err < 1
    if "aqsgd" in spec:  # buffers are keyed by sample id, not by micro-batch slot: all 8 samples known
        assert sorted(a.state_dict()["ops"]["0.act"]["send"]["b0.act"]) == list(range(8))


def test_aqsgd_without_ids_explains_how_to_provide_them():
    a, _ = _pair("act=int8+aqsgd")
    with pytest.raises(ValueError, match=r"tuple ending with an integer tensor"):
        a.send([torch.randn(4, 3)], 0, "act", step=0, micro_batch=0, training=True, send_fn=lambda t: None)


def test_error_every_zero_measures_nothing():
    cfg = ppc.parse_spec("int8,error_every=0")
    assert cfg.error_every == 0 and ppc.parse_spec(str(cfg)) == cfg
    a = StageCompression(cfg, 0, 2)
    a.send([torch.randn(4, 3)], 0, "act", step=0, micro_batch=0, training=True, send_fn=lambda t: None)
    assert a.stats["b0.act"].ref_sq == 0


def test_mdtopk_sender_learns_from_the_gradient_that_comes_back():
    """Stage 0 sends (hidden, ids); the gradient of hidden returns and lands in its activation operator's w."""
    a, b = _pair("act=mdtopk:0.1+ef,grad=nat:bits=4")
    act_send, act_recv = _link()
    grad_send, grad_recv = _link()
    g = torch.Generator().manual_seed(0)
    hot = [2, 7, 30]
    specs = [TensorSpec((4, 8, 40), torch.float32), TensorSpec((4,), torch.int64)]
    for step in range(15):
        for mb in range(2):
            ids = torch.arange(4) + 4 * mb
            x = torch.randn(4, 8, 40, generator=g)
            where = dict(step=step, micro_batch=mb, training=True)
            a.send([x, ids], 0, "act", send_fn=act_send, **where)
            y, _ = b.recv(specs, 0, "act", recv_fn=act_recv, device=torch.device("cpu"), **where)
            grad = 0.01 * torch.randn(4, 8, 40, generator=g)
            grad[..., hot] = 1.0
            b.send([grad], 0, "grad", send_fn=grad_send, **where)
            a.recv(specs[:1], 0, "grad", recv_fn=grad_recv, device=torch.device("cpu"), **where)
    op = a.op(0, "act", True).inner
    assert op.sent == {}  # every stashed activation met its gradient
    w = op.weights(ppc.Context(boundary=0, direction="act"), 40, torch.device("cpu"))
    assert set(torch.topk(w, 3).indices.tolist()) == set(hot)
    assert "log_w" in a.state_dict()["ops"]["0.act"]["inner"]


def test_micro_batches_of_different_lengths_get_their_own_gradients_back():
    """Variable sequence lengths under 1F1B: two micro-batches' activations cross before the first one's gradient comes
    back, each of its own length ([seq, batch, hidden], 17 then 16 positions); each gradient is decoded against its
    own micro-batch's shape (it was kept per boundary only, and the first gradient failed to reshape)."""
    a, b = _pair("act=int8,grad=int8,batch_dim=1")
    act_send, act_recv = _link()
    grad_send, grad_recv = _link()
    cpu = torch.device("cpu")
    xs = {mb: torch.randn(17 - mb, 4, 32) for mb in (0, 1)}
    for mb, x in xs.items():
        a.send([x], 0, "act", step=0, micro_batch=mb, training=True, send_fn=act_send)
        b.recv([TensorSpec(tuple(x.shape), x.dtype)], 0, "act", step=0, micro_batch=mb, training=True,
               recv_fn=act_recv, device=cpu)
    for mb, x in xs.items():  # the gradients come back in the same order, after both forwards
        b.send([torch.ones_like(x)], 0, "grad", step=0, micro_batch=mb, training=True, send_fn=grad_send)
        g = a.recv([TensorSpec(tuple(x.shape), x.dtype)], 0, "grad", step=0, micro_batch=mb, training=True,
                   recv_fn=grad_recv, device=cpu)
        assert g[0].shape == x.shape and torch.allclose(g[0], torch.ones_like(x), atol=1e-3)


def test_encode_and_decode_serve_an_engine_that_posts_every_buffer_at_once():
    """Compression apart from transport: with no sample ids or views, the receiver allocates every buffer up front
    (as a batched, asynchronous P2P engine does), and gets what the blocking send/recv path gets."""
    from pp_compress.policy import Where

    a, b = _pair("act=int4:rot,grad=int8")
    x = [torch.randn(4, 8, 64), torch.tensor([3, 1, 2, 0]), torch.randn(2, 64)]
    specs = [TensorSpec(tuple(t.shape), t.dtype) for t in x]
    where = Where(0, "act", step=3)
    sent = a.encode(x, where)
    assert [i for i, _ in sent] == [1, 0, 2]  # integer tensors first
    plain_bufs = b.plain_buffers(specs, torch.device("cpu"))
    float_bufs = b.recv_buffers(specs, where, torch.device("cpu"), [None] * 3)
    for (i, dst), (j, src) in zip(plain_bufs + float_bufs, sent):  # "post" them all, then complete
        assert i == j and dst.shape == src.shape and dst.dtype == src.dtype
        dst.copy_(src)
    plain = [None] * 3
    for i, buf in plain_bufs:
        plain[i] = buf
    got = b.decode(specs, where, plain, float_bufs)
    c, d = _pair("act=int4:rot,grad=int8")
    send, recv = _link()
    c.send(x, 0, "act", step=3, micro_batch=0, training=True, send_fn=send)
    ref = d.recv(specs, 0, "act", step=3, micro_batch=0, training=True, recv_fn=recv, device=torch.device("cpu"))
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_where_names_its_direction():
    from pp_compress.policy import Where

    with pytest.raises(ValueError, match="direction='fwd'"):
        Where(0, "fwd")
    assert Where(2, "act", training=False).stats_key == "b2.act_eval"


def test_an_auto_trial_switches_both_stages_in_step():
    """During a trial of auto's (decide.py) the two candidates alternate step by step: the sender's buffers and the
    receiver's expected ones change together, and each step's message arrives as its candidate sends it."""
    from pp_compress.policy import Where

    a, b = _pair("auto:model=small-gpt")
    for stage in (a, b):
        stage.policy.decide(0, "act", "int8")
        stage.policy.alternate_with(0, "act", "none", 4)
    x = [torch.randn(4, 8, 64)]
    specs = [TensorSpec((4, 8, 64), torch.float32)]
    sizes = []
    for step in (4, 5, 6, 7):
        where = Where(0, "act", step=step)
        sent = a.encode(x, where)
        bufs = b.recv_buffers(specs, where, torch.device("cpu"), [None])
        assert [t.shape for _, t in bufs] == [t.shape for _, t in sent]
        for (_, dst), (_, src) in zip(bufs, sent):
            dst.copy_(src)
        got = b.decode(specs, where, [None], bufs)[0]
        sizes.append(sum(t.numel() * t.element_size() for _, t in sent))
        assert torch.equal(got, x[0]) == (step % 2 == 1)  # `none` on the odd steps after the start: exact
        assert (got - x[0]).abs().max() < 0.05
    assert sizes[1] == sizes[3] == x[0].numel() * 4 and sizes[0] == sizes[2] < sizes[1] / 3
