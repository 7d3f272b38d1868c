"""pp_lab.bottleneck: the boundary bottleneck's shapes, identity at k = d, its PCA initialisation, and the code through
a pp_compress codec in process."""
import dataclasses
import json

import pytest
import torch

import pp_compress as ppc
from pp_lab.bottleneck import Basis, Branch, Decoder, Encoder, calibrate, calibrate_fisher, fixed_basis, random_tokens
from pp_lab.model import GPT, Block, GPTConfig, lm_loss

CFG = GPTConfig.preset("tiny", vocab_size=256)  # 4 blocks, d = 64


def bottlenecked(k: int, **kw) -> GPTConfig:
    return dataclasses.replace(CFG, bottleneck=k, bottleneck_after=(1,), **kw)


def test_what_crosses_is_the_code_and_the_sink_and_both_directions_shrink():
    cfg = bottlenecked(16, bottleneck_sink=2)
    torch.manual_seed(0)
    plain = Block(CFG, 1)
    torch.manual_seed(0)
    enc, dec = Block(cfg, 1), Block(cfg, 2)
    assert enc.encoder is not None and enc.decoder is None and dec.decoder is not None and dec.encoder is None
    h = torch.randn(3, 10, 64, requires_grad=True)
    code, sink, ids = enc((h, torch.arange(3)))
    assert code.shape == (3, 10, 16) and sink.shape == (3, 2, 64) and torch.equal(ids, torch.arange(3))
    assert torch.equal(sink, plain(h)[:, :2])  # the first tokens cross exactly
    assert not code[:, :2].any() and code[:, 2:].abs().sum() > 0  # their codes are zeros: no row scale is theirs
    code.retain_grad()
    out, _ = dec((code, sink, ids))
    out.sum().backward()
    assert code.grad.shape == (3, 10, 16)  # the gradient that crosses back is k-wide too
    grouped = Block(bottlenecked(16, bottleneck_group=5), 1)
    assert grouped((h, torch.arange(3)))[0].shape == (3, 2, 80)  # five tokens' codes to a row
    with pytest.raises(ValueError, match="bottleneck_group=3 needs a sequence length that it divides; got 10"):
        Block(bottlenecked(16, bottleneck_group=3), 1)(h)


def test_k_equal_d_with_the_identity_init_is_the_model_itself_bitwise():
    ids = torch.randint(0, 256, (2, 12))
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)  # the bottleneck draws no random numbers: every other weight is the same
    same = GPT(bottlenecked(64), bases={1: fixed_basis(64, 64, "identity", 0)})
    assert torch.equal(plain(ids), same(ids))


def test_the_pca_init_starts_at_the_projection_onto_the_principal_subspace():
    torch.manual_seed(0)
    plain = GPT(CFG)
    ids = torch.randint(0, 256, (8, 16))
    bases = calibrate(list(plain.layers), [1], 64, 1, ids.split(4))
    mu, enc, u, _ = bases[1]
    assert u.shape == (64, 64) and torch.allclose(u.T @ u, torch.eye(64), atol=1e-5) and torch.equal(enc, u.T)
    torch.manual_seed(0)
    full = GPT(bottlenecked(64), bases=bases)  # k = d: the projection is the identity up to rounding
    assert torch.allclose(plain(ids), full(ids), atol=1e-4)
    k8 = calibrate(list(plain.layers), [1], 8, 1, ids.split(4))[1]
    assert torch.allclose(k8[2], u[:, :8], atol=1e-4) or torch.allclose(k8[2].abs(), u[:, :8].abs(), atol=1e-4)


def test_a_frozen_bottleneck_does_not_train_and_a_bad_config_names_the_accepted_values():
    block = Block(bottlenecked(8, bottleneck_trainable=False), 1)
    assert not any(p.requires_grad for p in block.encoder.parameters())
    with pytest.raises(ValueError, match="bottleneck_after=\\(3,\\); accepted: block indices in 0..2"):
        dataclasses.replace(CFG, bottleneck=8, bottleneck_after=(3,))
    with pytest.raises(ValueError, match="bottleneck=65; accepted: None or an integer in 1..d_model=64"):
        dataclasses.replace(CFG, bottleneck=65, bottleneck_after=(1,))
    with pytest.raises(ValueError, match="expected \\(64,\\), \\(8, 64\\), \\(64, 8\\)"):
        Encoder(64, 8, 1, 1, fixed_basis(64, 4, "random", 0), True)
    with pytest.raises(ValueError, match="needs data"):
        fixed_basis(64, 8, "pca", 0)


def test_a_residual_branch_starts_at_its_identity_path_bitwise_and_is_all_that_trains():
    """ResBM's design: with k = d and the identity init, a model with branches is the model itself until they train
    (their output layers start at zero, their first layers come from generators of their own, so every other weight
    is the same); the maps stay fixed, and one step moves the branches alone."""
    ids = torch.randint(0, 256, (2, 12))
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)
    same = GPT(bottlenecked(64, bottleneck_residual=32), bases={1: fixed_basis(64, 64, "identity", 0)})
    assert torch.equal(plain(ids), same(ids))
    enc, dec = same.layers[2].encoder, same.layers[3].decoder  # block 1's encoder, block 2's decoder (embedding first)
    assert enc.branch.inner.shape == (32, 64) and enc.branch.outer.shape == (64, 32)
    assert dec.branch.inner.shape == (32, 64)
    assert not enc.branch.outer.any() and not torch.equal(enc.branch.inner, dec.branch.inner)  # seeded apart
    trained = [n for n, p in same.named_parameters() if p.requires_grad and "coder." in n]
    assert sorted(trained) == sorted(f"layers.{i}.{c}.branch.{w}" for i, c in ((2, "encoder"), (3, "decoder"))
                                     for w in ("norm.weight", "inner", "outer"))
    maps = [enc.weight.clone(), dec.weight.clone()]
    opt = torch.optim.SGD([p for p in same.parameters() if p.requires_grad], lr=0.1)
    lm_loss(same(ids), ids).backward()
    opt.step()
    assert enc.branch.outer.any() and dec.branch.outer.any()  # the branches train ...
    assert torch.equal(enc.weight, maps[0]) and torch.equal(dec.weight, maps[1])  # ... the identity path does not
    assert not torch.equal(plain(ids), same(ids))


def test_a_branch_adds_its_own_output_to_the_map_and_a_frozen_one_is_refused():
    basis = fixed_basis(32, 8, "random", 3)
    branch = Branch(32, 8, 16, 0.02, 5)
    with torch.no_grad():
        branch.outer.normal_()
    enc, plain = Encoder(32, 8, 0, 1, basis, True, branch=branch), Encoder(32, 8, 0, 1, basis, True)
    h = torch.randn(2, 5, 32)
    assert torch.allclose(enc(h)[0], plain(h)[0] + branch(h), atol=1e-6)
    with pytest.raises(ValueError, match="trainable=False would train nothing"):
        Decoder(32, 8, 1, basis, False, branch=Branch(8, 32, 16, 0.02, 5))
    with pytest.raises(ValueError, match="bottleneck_residual=4 with bottleneck=8, bottleneck_trainable=False; "
                                         "accepted: 0, or a width >= 1 with a trainable bottleneck"):
        bottlenecked(8, bottleneck_residual=4, bottleneck_trainable=False)
    with pytest.raises(ValueError, match="bottleneck_residual=-1"):
        bottlenecked(8, bottleneck_residual=-1)


def test_the_config_survives_the_run_record():
    cfg = bottlenecked(16, bottleneck_sink=0)
    assert GPTConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_the_code_goes_through_a_codec_in_process():
    torch.manual_seed(0)
    model = GPT(bottlenecked(16))
    bounds = ppc.insert_boundaries(model, after=[2], cfg="int8:rot,min_numel=0", blocks=model.layers)  # block 1
    model(torch.randint(0, 256, (2, 12))).sum().backward()
    stats = bounds[0].stats
    assert stats["act"].raw_bytes == 2 * 12 * 16 * 4 and stats["act"].wire_bytes < stats["act"].raw_bytes
    assert stats["grad"].raw_bytes == 2 * 12 * 16 * 4


def test_a_random_token_table_is_seeded_at_the_embeddings_scale_and_rebuilt_by_the_decoder():
    table = random_tokens(4096, 64, 0.02, 7)  # (V, d)
    assert table.shape == (4096, 64) and torch.equal(table, random_tokens(4096, 64, 0.02, 7))
    assert not torch.equal(table, random_tokens(4096, 64, 0.02, 8)) and abs(float(table.std()) - 0.02) < 1e-3
    basis = fixed_basis(64, 16, "random", 0)._replace(tokens=table)
    enc, dec = Encoder(64, 16, 1, 1, basis, True), Decoder(64, 16, 1, basis, True)
    ids = torch.randint(0, 4096, (2, 5))
    h = table[ids]  # (B, T, d): what the table predicts, so the code is zero and the decoder rebuilds h exactly
    code, sink = enc(h, ids)
    assert torch.equal(code, torch.zeros_like(code)) and torch.equal(dec(code, sink, ids), h)


def test_decoder_and_encoder_round_trip_a_subspace_exactly():
    basis = fixed_basis(32, 8, "random", 3)
    u = basis[2]
    enc, dec = Encoder(32, 8, 1, 1, basis, True, group=5), Decoder(32, 8, 1, basis, True, group=5)
    h = torch.randn(2, 5, 32)
    h[:, 1:] = h[:, 1:] @ u @ u.T  # already in the subspace: nothing is lost but rounding
    assert torch.allclose(dec(*enc(h)), h, atol=1e-5)


def test_the_fisher_init_is_an_oblique_projection_that_loses_less_loss_weighted_error():
    torch.manual_seed(0)
    plain = GPT(CFG)
    ids = torch.randint(0, 256, (8, 16))
    batches = list(zip(ids.split(4), torch.roll(ids, -1, 1).split(4)))
    mu, enc, dec, _ = calibrate_fisher(list(plain.layers), [1], 8, 1, batches, lm_loss)[1]
    assert enc.shape == (8, 64) and dec.shape == (64, 8)
    assert torch.allclose(enc @ dec, torch.eye(8), atol=1e-4)  # W_d W_e is a projection: W_e W_d = I
    assert all(p.requires_grad for p in plain.parameters())  # the model's own flags are back
    # huge damping: F is a multiple of I, and the subspace is the principal one
    pca = calibrate(list(plain.layers), [1], 8, 1, ids.split(4))[1]
    _, enc_big, dec_big, _ = calibrate_fisher(list(plain.layers), [1], 8, 1, batches, lm_loss, damping=1e9)[1]
    proj = lambda e, d: d @ e  # noqa: E731 (d, d)
    assert torch.allclose(proj(enc_big, dec_big), proj(pca[1], pca[2]), atol=1e-3)
    # on the calibration data it keeps the loss-weighted error below the principal subspace's
    hs, gs = [], []
    for x, y in batches:
        h = plain.layers[2](plain.layers[1](plain.layers[0](x)))  # after block 1 (layer 0 is the embedding)
        h = (h[0] if isinstance(h, tuple) else h).detach().requires_grad_(True)
        out = h
        for layer in list(plain.layers)[3:]:
            out = layer(out)
        (lm_loss(out, y) * y.numel()).backward()
        hs.append(h.detach()[:, 1:].reshape(-1, 64).double())
        gs.append(h.grad[:, 1:].reshape(-1, 64).double())
    h, g = torch.cat(hs), torch.cat(gs)
    fisher = g.T @ g / g.shape[0]
    fisher = fisher + fisher.diagonal().mean() * torch.eye(64, dtype=fisher.dtype)  # damping 1, as the default

    def weighted(e, d, m):
        err = (h - m.double()) - (h - m.double()) @ e.double().T @ d.double().T  # (N, d)
        return float(((err @ fisher) * err).sum(1).mean())

    assert weighted(enc, dec, mu) < weighted(pca[1], pca[2], pca[0])
    with pytest.raises(ValueError, match="fisher damping 0; accepted: a number > 0"):
        calibrate_fisher(list(plain.layers), [1], 8, 1, batches, lm_loss, damping=0)


def test_the_blend_init_passes_back_more_of_the_loss_gradient_with_an_orthonormal_basis():
    from pp_lab.bench.bottleneck_init import grad_energy
    from pp_lab.bottleneck import hidden_moments, principal_bases

    torch.manual_seed(0)
    layers = list(GPT(CFG).layers)
    ids = torch.randint(0, 256, (16, 16))
    stats = hidden_moments(layers, [1], 1, list(zip(ids.split(4), torch.roll(ids, -1, 1).split(4))), loss=lm_loss)
    pca, zero = principal_bases(stats, 8)[1], principal_bases(stats, 8, grad_weight=0.0)[1]
    assert torch.equal(pca.enc, zero.enc) and torch.equal(pca.dec, zero.dec)  # weight 0 is the principal subspace
    energy, kept = {}, {}
    _, h, _ = stats[1].fit(8, 1, None)  # (d, d): the hidden state's covariance
    for w in (0.0, 0.5, 4.0):
        b = principal_bases(stats, 8, grad_weight=w)[1]
        assert torch.allclose(b.enc @ b.dec, torch.eye(8), atol=1e-5) and torch.equal(b.enc, b.dec.T)  # orthonormal
        energy[w], kept[w] = grad_energy(b, stats[1].grad), float(torch.trace(b.enc.double() @ h @ b.dec.double()))
    assert energy[0.0] < energy[0.5] < energy[4.0]  # more of the gradient passes back as the weight grows
    assert kept[0.0] > kept[0.5] > kept[4.0]  # for less of the hidden state's variance
    with pytest.raises(ValueError, match="blend grad_weight -1; accepted: a number >= 0"):
        principal_bases(stats, 8, grad_weight=-1)
    with pytest.raises(ValueError, match="the blend init needs moments taken with a loss"):
        principal_bases(hidden_moments(layers, [1], 1, ids.split(4)), 8, grad_weight=0.5)


def test_a_token_table_takes_each_tokens_prediction_out_of_the_code_and_the_ids_cross_beside_it():
    torch.manual_seed(0)
    plain = GPT(CFG)
    ids = torch.randint(0, 256, (16, 16))
    table = calibrate(list(plain.layers), [1], 8, 1, ids.split(4), tokens=True)[1]
    pca = calibrate(list(plain.layers), [1], 8, 1, ids.split(4))[1]
    assert pca.tokens is None and table.tokens.shape == (256, 64)
    torch.manual_seed(0)
    model = GPT(bottlenecked(8, bottleneck_tokens=True), bases={1: table})
    x = model.layers[0](ids)
    assert isinstance(x, tuple) and torch.equal(x[1].long(), ids)  # the ids travel from the embedding on
    code, sink, sent = model.layers[2](model.layers[1](x))  # block 1 holds the encoder
    assert code.shape == (16, 16, 8) and torch.equal(sent, x[1])
    # what the code carries is h less T[ids]: on the calibration data, a k-wide code loses less than pca's
    with torch.no_grad():
        h = plain.layers[2](plain.layers[1](plain.layers[0](ids)))[:, 1:].double()  # (B, T - 1, d)

    def kept(b: Basis) -> torch.Tensor:  # what the decoder rebuilds of h: mu + T[ids] + W_d W_e (h - mu - T[ids])
        t = 0 if b.tokens is None else b.tokens.double()[ids[:, 1:]]  # (B, T - 1, d)
        r = h - b.mu.double() - t
        return b.mu.double() + t + r @ b.enc.double().T @ b.dec.double().T

    # on the calibration data, a k-wide code with the table loses less than pca's without it
    assert (h - kept(table)).pow(2).sum() < 0.9 * (h - kept(pca)).pow(2).sum()
    with torch.no_grad():
        out = model.layers[3].decoder(code, sink, sent)  # (B, T, d): block 2 holds the decoder
    assert torch.equal(out[:, :1], sink) and torch.allclose(out[:, 1:].double(), kept(table), atol=1e-3)
    assert "layers.2.encoder.tokens" in model.state_dict()  # the frozen table is in the checkpoint
    assert not any(n.endswith("tokens") for n, _ in model.named_parameters())
    served = GPT(bottlenecked(8, bottleneck_tokens=True))  # as infer.py builds it: no bases, zero tables
    assert not served.layers[2].encoder.tokens.any()
    served.load_state_dict(model.state_dict())
    assert torch.equal(served.layers[2].encoder.tokens, table.tokens) and torch.equal(served(ids), model(ids))
    bounds = ppc.insert_boundaries(model, after=[2], cfg="int8:rot,min_numel=0", blocks=model.layers)  # in process
    model(ids).sum().backward()
    assert bounds[0].stats["act"].raw_bytes == 16 * 16 * 8 * 4  # the code; the ids and the sink pass as they are
    with pytest.raises(ValueError, match="needs the token ids beside the hidden state"):
        Encoder(64, 8, 1, 1, table, True)(torch.randn(2, 16, 64))
    with pytest.raises(ValueError, match="has a token table but bottleneck_tokens=False"):
        GPT(bottlenecked(8), bases={1: table})
    with pytest.raises(ValueError, match="bottleneck_tokens=True with bottleneck=None"):
        dataclasses.replace(CFG, bottleneck_tokens=True)


@pytest.mark.parametrize("fisher", [False, True])
def test_moments_taken_in_shares_and_summed_give_the_whole_texts_basis(fisher):
    """What the recipes do across processes: each takes every other batch, and `reduce` adds up their sums."""
    from pp_lab.bottleneck import embedding_of, fisher_bases, hidden_moments, principal_bases

    torch.manual_seed(0)
    layers = list(GPT(CFG).layers)
    ids = torch.randint(0, 256, (16, 16))
    batches = list(zip(ids.split(4), torch.roll(ids, -1, 1).split(4))) if fisher else list(ids.split(4))
    loss = lm_loss if fisher else None
    whole = hidden_moments(layers, [0, 1], 1, batches, tokens=True, loss=loss)
    shares = [hidden_moments(layers, [0, 1], 1, batches[r::2], tokens=True, loss=loss) for r in (0, 1)]
    for c in (0, 1):
        packed = []  # the other share's packed sums, as an all-reduce over two processes would add them
        shares[1][c].reduce(packed.append)
        shares[0][c].reduce(lambda t: t.add_(packed[0]))
        assert float(shares[0][c].n) == float(whole[c].n) == 16 * 15
    emb = embedding_of(layers)
    for got, want in [(fisher_bases(shares[0], 8, 1.0, emb), fisher_bases(whole, 8, 1.0, emb)) if fisher else
                      (principal_bases(shares[0], 8, emb), principal_bases(whole, 8, emb))]:
        for c in (0, 1):
            proj = lambda b: b.dec.double() @ b.enc.double()  # noqa: E731 (d, d): the same subspace, whatever the signs
            assert torch.allclose(proj(got[c]), proj(want[c]), atol=1e-6)
            assert torch.allclose(got[c].mu, want[c].mu, atol=1e-6) and torch.allclose(got[c].tokens, want[c].tokens,
                                                                                        atol=1e-5)
    with pytest.raises(ValueError, match="needs moments taken with a loss"):
        fisher_bases(hidden_moments(layers, [1], 1, ids.split(4)), 8)
