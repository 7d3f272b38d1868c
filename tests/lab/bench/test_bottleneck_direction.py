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


def test_the_fade_route_passes_the_hidden_state_and_its_gradient_whole_at_bypass_1_and_is_trained_at_0():
    g = torch.Generator().manual_seed(1)
    h, up = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)  # (B, T, d)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    trained, trained_grad = value_and_grad("trained", h, ids, up)
    for a, want, want_grad in [(1.0, h, up), (0.0, trained, trained_grad),
                               (0.25, 0.75 * trained + 0.25 * h, 0.75 * trained_grad + 0.25 * up)]:
        x = h.clone().requires_grad_(True)
        route = bd.Route(basis(), 3, "fade")
        route.bypass = a
        out = route(x, ids)
        out.backward(up)
        torch.testing.assert_close(out.detach(), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=1e-6)
        maps = [p.grad for p in route.parameters() if p.requires_grad]
        assert maps and all((m is None or not m.any()) == (a == 1.0) for m in maps)  # the maps learn once a < 1


def test_the_bypass_falls_linearly_from_1_to_0_over_the_fade_and_stays_at_0():
    assert [bd.bypass_at(s, 4) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_a_route_outside_the_list_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="route 'none'; accepted: both, forward, backward, trained, fade"):
        bd.Route(basis(), 3, "none")


def test_the_table_takes_a_shared_start_and_gives_the_gap_each_route_opened():
    rows = {"none": {"start": 4.0, "end": 3.5, "end_projected": 3.65}, "both": {"start": 4.1, "end": 3.7},
            "backward": {"end": 3.6}, "forward": {"end": 3.55}}
    md = bd.table(rows, 25, "cmd")
    assert "| `both` | " in md and "| 4.100 | +0.100 | 3.700 | +0.200 | +0.100 |" in md
    assert "| 4.000 | +0.000 | 3.600 | +0.100 | +0.100 |" in md  # backward starts where none starts
    assert "| 4.100 | +0.100 | 3.550 | +0.050 | -0.050 |" in md  # forward starts where both starts
    assert "initial bottleneck: 3.650, +0.150 from itself (the same bottleneck cost the pretrained model +0.100)" in md


def tiny_setup():
    """A 4-block GPT (d = 64), its data and the study's arguments at a 3-step schedule whose second step moves the
    weights."""
    import argparse

    import datasets

    from pp_lab.model import GPTConfig

    cfg = GPTConfig.preset("tiny", vocab_size=256)
    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": torch.randint(0, 256, (8, 16), generator=g).tolist(), "sample_id": [[0] * 16] * 8,
            "labels": torch.randint(0, 256, (8, 16), generator=g).tolist()}
    ds = datasets.Dataset.from_dict(rows), datasets.Dataset.from_dict(rows)
    sa = argparse.Namespace(**{**vars(bd.study_args()), "micro_batch": 2, "grad_accum": 2, "eval_batches": 1,
                               "steps": 3, "warmup": 1})
    return cfg, ds, sa


def random_bases(cuts=(0, 2)):
    from pp_lab.bottleneck import fixed_basis

    return {c: fixed_basis(64, 16, "random", c) for c in cuts}


def plan(tmp_path, **kw):
    return bd.Plan(**{"k": 16, "steps": 3, "late_at": 1, "fade": 2, "every": 0, "state_dir": tmp_path, **kw})


def test_the_late_route_trains_as_none_until_its_step_then_through_the_bases_fitted_to_the_model_as_it_is_then(
        tmp_path):
    cfg, ds, sa = tiny_setup()
    calls = []

    def fit(layers):
        calls.append(len(layers))
        return random_bases()

    none = bd.measure("none", cfg, None, None, plan(tmp_path), ds, sa, fit)
    late = bd.measure("late", cfg, None, None, plan(tmp_path), ds, sa, fit)
    assert len(calls) == 1 and late["late_at"] == 1  # fitted once, at step 1, to the model's layers as they were
    assert "start" in none and "start" not in late  # late starts where none starts
    assert late["train_loss"][0] == none["train_loss"][0]  # the first step has no bottleneck
    assert late["train_loss"][1] != none["train_loss"][1] and late["end"] != none["end"]


def test_a_route_stopped_part_way_resumes_from_its_last_evaluation_and_ends_where_the_whole_run_ends(tmp_path,
                                                                                                    monkeypatch):
    cfg, ds, sa = tiny_setup()
    p = plan(tmp_path, every=1)
    whole = bd.measure("fade", cfg, None, random_bases(), p, ds, sa, lambda layers: {})
    assert set(whole["curve"]) == {"1", "2"} and whole["fade"] == 2 and not list(tmp_path.iterdir())
    real, calls = bd.lm_loss, []

    def crash_in_step_3(*a):  # 2 micro-batches a step and an evaluation: 2 steps and 3 evaluations before step 3
        calls.append(1)
        if len(calls) == 2 * (2 + 3) + 1:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(bd, "lm_loss", crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        bd.measure("fade", cfg, None, random_bases(), p, ds, sa, lambda layers: {})
    assert (tmp_path / "fade.pt").exists()
    monkeypatch.setattr(bd, "lm_loss", real)
    with pytest.raises(SystemExit, match=r"--k/--steps/--fade/--every \(16, 3, 2, 1\), not \(16, 3, 1, 1\)"):
        bd.measure("fade", cfg, None, random_bases(), plan(tmp_path, every=1, fade=1), ds, sa, lambda layers: {})
    resumed = bd.measure("fade", cfg, None, random_bases(), p, ds, sa, lambda layers: {})
    assert resumed["train_loss"] == whole["train_loss"] and resumed["curve"] == whole["curve"]
    assert resumed["end"] == whole["end"] and resumed["start"] == whole["start"]
    assert not (tmp_path / "fade.pt").exists()


def test_the_curve_table_puts_study_runs_beside_the_routes_and_gives_gaps_to_none(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"kind": "eval", "step": 25, "val_loss": 3.5}\n{"kind": "train", "step": 25}\n'
                       '{"kind": "eval", "step": 50, "val_loss": 3.4}\n')
    rows = {"fade": {"steps": 50, "curve": {"25": 3.7}, "end": 3.45}, "both": {"steps": 50, "end": 3.6}}
    md = bd.curve_table(rows, {"none": bd.evals(metrics)})
    assert "| | step 25 | step 50 |" in md
    assert "| `fade` | 3.700 (+0.200) | 3.450 (+0.050) |" in md
    assert "| none (study run) | 3.500 (+0.000) | 3.400 (+0.000) |" in md
    assert bd.curve_table({"both": rows["both"]}, {}) == ""
