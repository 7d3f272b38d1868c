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
