"""pp_lab.bench.bottleneck_direction: each route sends the value and the gradient that its name says."""
import pytest
import torch

from pp_lab.bench import bottleneck_direction as bd
from pp_lab.bottleneck import orthonormal


def basis(d=8, k=3, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64)).Q.float()  # (d, k)
    return orthonormal(torch.randn(d, generator=g), u, torch.randn(vocab, d, generator=g))


def value_and_grad(route, h, ids, upstream):
    h = h.clone().requires_grad_(True)
    out = bd.Route(basis(), 3, route)(h, ids)
    out.backward(upstream)
    return out.detach(), h.grad


@pytest.mark.parametrize("route", ["both", "forward", "backward", "trained"])
def test_each_route_sends_the_projection_or_the_hidden_state_forward_and_routes_the_gradient(route):
    g = torch.Generator().manual_seed(1)
    h, up = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)  # (B, T, d)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    projected, through = value_and_grad("both", h, ids, up)
    out, grad = value_and_grad(route, h, ids, up)
    assert not torch.allclose(projected, h, atol=1e-3)  # k < d: the projection loses something
    assert not torch.allclose(through, up, atol=1e-3)
    torch.testing.assert_close(out, h if route == "backward" else projected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, up if route == "forward" else through, rtol=0, atol=1e-6)
    trainable = [p.requires_grad for p in bd.Route(basis(), 3, route).parameters()]
    assert trainable and all(t == (route == "trained") for t in trainable)


def test_a_route_outside_the_list_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="route 'none'; accepted: both, forward, backward, trained"):
        bd.Route(basis(), 3, "none")


def test_the_table_takes_a_shared_start_and_gives_the_gap_each_route_opened():
    rows = {"none": {"start": 4.0, "end": 3.5, "end_projected": 3.65}, "both": {"start": 4.1, "end": 3.7},
            "backward": {"end": 3.6}, "forward": {"end": 3.55}}
    md = bd.table(rows, 25, "cmd")
    assert "| `both` | " in md and "| 4.100 | +0.100 | 3.700 | +0.200 | +0.100 |" in md
    assert "| 4.000 | +0.000 | 3.600 | +0.100 | +0.100 |" in md  # backward starts where none starts
    assert "| 4.100 | +0.100 | 3.550 | +0.050 | -0.050 |" in md  # forward starts where both starts
    assert "initial bottleneck: 3.650, +0.150 from itself (the same bottleneck cost the pretrained model +0.100)" in md


def test_the_late_route_trains_as_none_until_its_step_then_through_the_bases_fitted_to_the_model_as_it_is_then():
    import argparse

    import datasets

    from pp_lab.bottleneck import fixed_basis
    from pp_lab.model import GPTConfig

    cfg = GPTConfig.preset("tiny", vocab_size=256)  # 4 blocks, d = 64
    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": torch.randint(0, 256, (8, 16), generator=g).tolist(), "sample_id": [[0] * 16] * 8,
            "labels": torch.randint(0, 256, (8, 16), generator=g).tolist()}
    ds = datasets.Dataset.from_dict(rows), datasets.Dataset.from_dict(rows)
    sa = argparse.Namespace(**{**vars(bd.study_args()), "micro_batch": 2, "grad_accum": 2, "eval_batches": 1,
                               "steps": 3, "warmup": 1})  # a schedule whose second step moves the weights
    calls = []

    def fit(layers):
        calls.append(len(layers))
        return {c: fixed_basis(64, 16, "random", c) for c in (0, 2)}

    none = bd.measure("none", cfg, None, None, 16, 3, ds, sa, fit, 1)
    late = bd.measure("late", cfg, None, None, 16, 3, ds, sa, fit, 1)
    assert len(calls) == 1 and late["late_at"] == 1  # fitted once, at step 1, to the model's layers as they were
    assert "start" in none and "start" not in late  # late starts where none starts
    assert late["train_loss"][0] == none["train_loss"][0]  # the first step has no bottleneck
    assert late["train_loss"][1] != none["train_loss"][1] and late["end"] != none["end"]
