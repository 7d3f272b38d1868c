"""Subspace pipelines: residual writes in span(U), so c = U^T (x - E0[ids]) and the token ids carry the stream exactly."""
import dataclasses

import pytest
import torch

from pp_lab.model import GPT, Block, GPTConfig, id_dtype, lm_loss, subspace_basis

CONFIGS = [dict(mlp="swiglu", norm="rmsnorm", n_kv_head=2, tie_embeddings=True, layout="bsh"),
           dict(mlp="gelu", norm="layernorm", bias=True, tie_embeddings=False, layout="sbh")]


def _model(k=8, **kw):
    cfg = GPTConfig(vocab_size=300, n_layer=3, n_head=4, d_model=32, subspace=k, **kw)
    torch.manual_seed(0)
    return GPT(cfg)


def _dense_twin(sub: GPT) -> GPT:
    """The same function as a dense model: embedding E0 + A U^T, o = U B_o, down = U B_down, the rest copied."""
    dense = GPT(dataclasses.replace(sub.cfg, subspace=None))
    e0, u = subspace_basis(sub.cfg)
    with torch.no_grad():
        for ls, ld in zip(sub.layers, dense.layers):
            mine = dict(ls.named_parameters())
            for name, p in ld.named_parameters():
                q = mine[name]
                if name == "weight" and ls is sub.layers[0]:
                    p.copy_(e0 + q @ u.T)
                elif getattr(ls, "writes_k", False) and name.split(".")[0] in ("o", "down"):
                    p.copy_(u @ q if q.dim() == 2 else u @ q)
                else:
                    p.copy_(q)
    return dense


def _streams(model: GPT, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The dense residual stream after every block but the last (rebuilt from (c, ids) for a subspace model)."""
    out, x = [], ids
    for layer in model.layers:
        x = layer(x)
        if isinstance(layer, Block) and layer.index < model.cfg.n_layer - 1:
            h = layer.dense(x[0], x[1]) if model.cfg.subspace else (x[0] if isinstance(x, tuple) else x)
            out.append(h.transpose(0, 1) if model.cfg.layout == "sbh" else h)
    return out, x


@pytest.mark.parametrize("kw", CONFIGS)
def test_rebuilt_streams_equal_the_dense_twin_after_training_and_a_reload(kw):
    sub = _model(**kw)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(sub.parameters(), lr=1e-2)
    for _ in range(5):  # the parametrisation keeps the constraint through optimizer steps
        ids = torch.randint(0, 300, (2, 12), generator=gen)
        lm_loss(sub(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    fresh = GPT(sub.cfg)
    state = sub.state_dict()
    assert not any(k.endswith((".e0", ".u")) for k in state)  # regenerated from the seed, never saved
    fresh.load_state_dict(state)
    ids = torch.randint(0, 300, (3, 10), generator=gen)
    dense = _dense_twin(fresh)
    with torch.no_grad():
        (s1, s2), logits = _streams(fresh, ids)
        (d1, d2), ref = _streams(dense, ids)
    for s, d in ((s1, d1), (s2, d2)):
        assert float((s - d).norm() / d.norm()) < 1e-5
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_the_gradient_crossing_back_is_u_transpose_g():
    sub = _model()
    dense = _dense_twin(sub)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    x, y = ids, ids
    for layer in sub.layers[:2]:  # embedding, block 0: the boundary after block 0
        x = layer(x)
    c = x[0].detach().requires_grad_()
    out = (c, x[1])
    for layer in sub.layers[2:]:
        out = layer(out)
    lm_loss(out[:, :-1], ids[:, 1:]).backward()
    for layer in dense.layers[:2]:
        y = layer(y)
    h = y.detach().requires_grad_()
    out = h
    for layer in dense.layers[2:]:
        out = layer(out)
    lm_loss(out[:, :-1], ids[:, 1:]).backward()
    _, u = subspace_basis(sub.cfg)
    torch.testing.assert_close(c.grad, h.grad @ u, rtol=1e-4, atol=1e-7)


def test_what_crosses_is_k_coordinates_and_small_token_ids():
    sub = _model(k=4, layout="bsh")
    c, ids = sub.layers[1](sub.layers[0](torch.randint(0, 300, (2, 7))))
    assert c.shape == (2, 7, 4) and ids.dtype == torch.int16 and ids.shape == (2, 7)
    assert id_dtype(256) == torch.uint8 and id_dtype(8192) == torch.int16 and id_dtype(50257) == torch.int32


def test_a_tied_embedding_trains_only_k_columns():
    sub = _model(k=4)
    assert sub.layers[0].weight.shape == (300, 4)


@pytest.mark.parametrize("bad", [0, 33])
def test_bad_subspace_sizes_name_the_value(bad):
    with pytest.raises(ValueError, match=f"subspace={bad}"):
        GPTConfig(d_model=32, n_head=4, subspace=bad)
