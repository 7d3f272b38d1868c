import torch

import pp_compress as ppc


def test_indices_never_travel_and_receiver_derives_them():
    x = torch.randn(4, 100)
    op = ppc.build("randk:0.1")
    ctx = ppc.Context(step=7, boundary=2, micro_batch=1)
    p = op.compress(x, ctx)
    assert len(p.tensors) == 1 and p.tensors[0].shape == (4, 10)
    y = ppc.build("randk:0.1").decompress(p, ctx)  # a separate receiver object
    kept = y != 0
    assert (kept.sum(1) == 10).all() and torch.equal(y[kept], x[kept])


def test_unbiased_randk_mean_converges():
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    op = ppc.build("randk:0.2:unbiased")
    n = 4000
    mean = sum(op.roundtrip(x, ppc.Context(step=i))[0] for i in range(n)) / n
    # each entry: mean of n draws of 5*x w.p. 0.2; std = |x| * 2 / sqrt(n)
    assert ((mean - x).abs() <= 5 * 2 * x.abs() / n**0.5 + 1e-6).all()


def test_every_position_is_equally_likely():
    counts = torch.zeros(3, 40)
    op = ppc.build("randk:0.25")
    for i in range(800):
        counts += op.roundtrip(torch.ones(3, 40), ppc.Context(step=i))[0]
    freq = counts / 800
    assert (freq - 0.25).abs().max() < 0.08
