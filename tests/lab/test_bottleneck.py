"""pp_lab.bottleneck: the boundary bottleneck's shapes, identity at k = d, its PCA initialisation, and the code through
a pp_compress codec in process."""
import dataclasses
import json

import pytest
import torch

import pp_compress as ppc
from pp_lab.bottleneck import Decoder, Encoder, calibrate, fixed_basis
from pp_lab.model import GPT, Block, GPTConfig

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
    mu, u = bases[1]
    assert u.shape == (64, 64) and torch.allclose(u.T @ u, torch.eye(64), atol=1e-5)
    torch.manual_seed(0)
    full = GPT(bottlenecked(64), bases=bases)  # k = d: the projection is the identity up to rounding
    assert torch.allclose(plain(ids), full(ids), atol=1e-4)
    k8 = calibrate(list(plain.layers), [1], 8, 1, ids.split(4))[1]
    assert torch.allclose(k8[1], u[:, :8], atol=1e-4) or torch.allclose(k8[1].abs(), u[:, :8].abs(), atol=1e-4)


def test_a_frozen_bottleneck_does_not_train_and_a_bad_config_names_the_accepted_values():
    block = Block(bottlenecked(8, bottleneck_trainable=False), 1)
    assert not any(p.requires_grad for p in block.encoder.parameters())
    with pytest.raises(ValueError, match="bottleneck_after=\\(3,\\); accepted: block indices in 0..2"):
        dataclasses.replace(CFG, bottleneck=8, bottleneck_after=(3,))
    with pytest.raises(ValueError, match="bottleneck=65; accepted: None or an integer in 1..d_model=64"):
        dataclasses.replace(CFG, bottleneck=65, bottleneck_after=(1,))
    with pytest.raises(ValueError, match="expected \\(64,\\), \\(64, 8\\)"):
        Encoder(64, 8, 1, 1, fixed_basis(64, 4, "random", 0), True)
    with pytest.raises(ValueError, match="needs data"):
        fixed_basis(64, 8, "pca", 0)


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


def test_decoder_and_encoder_round_trip_a_subspace_exactly():
    mu, u = fixed_basis(32, 8, "random", 3)
    enc, dec = Encoder(32, 8, 1, 1, (mu, u), True, group=5), Decoder(32, 8, 1, (mu, u), True, group=5)
    h = torch.randn(2, 5, 32)
    h[:, 1:] = h[:, 1:] @ u @ u.T  # already in the subspace: nothing is lost but rounding
    assert torch.allclose(dec(*enc(h)), h, atol=1e-5)
