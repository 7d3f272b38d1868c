"""pp_lab.bench.bottleneck_refit: a bottleneck re-fitted to its body, and the body without it."""
import dataclasses

import pytest
import torch

from pp_lab.bench.bottleneck_refit import encoder_moments, refit, without_bottleneck
from pp_lab.bottleneck import calibrate, fixed_basis
from pp_lab.model import GPT, GPTConfig

CFG = GPTConfig.preset("tiny", vocab_size=256)  # 4 blocks, d = 64


@pytest.mark.parametrize("tokens", [False, True])
def test_refit_sets_each_bottleneck_to_the_principal_subspace_of_what_reaches_it(tokens):
    torch.manual_seed(0)
    plain = GPT(CFG)
    ids = torch.randint(0, 256, (8, 16))
    cfg = dataclasses.replace(CFG, bottleneck=16, bottleneck_after=(0, 2), bottleneck_tokens=tokens)
    fresh = calibrate(list(plain.layers), [0], 16, 1, ids.split(4), tokens=tokens)  # cut 0 sees the plain model
    torch.manual_seed(0)
    model = GPT(cfg, bases={c: fixed_basis(64, 16, "random", c) for c in (0, 2)})  # far from the data's subspace
    before = model(ids)
    refit(model, ids)
    enc, dec = model.layers[1].encoder, model.layers[2].decoder
    assert torch.allclose(enc.weight, fresh[0].enc, atol=1e-5) and torch.allclose(dec.weight, fresh[0].dec, atol=1e-5)
    assert torch.allclose(dec.bias, fresh[0].mu, atol=1e-5)
    if tokens:
        assert torch.allclose(enc.tokens, fresh[0].tokens, atol=1e-4) and torch.equal(enc.tokens, dec.tokens)
    # cut 2 is fitted to what reaches it with cut 0 re-fitted: a second refit changes nothing
    again = encoder_moments(model, 2, ids)
    w = model.layers[3].encoder.weight.clone()
    refit(model, ids)
    assert torch.allclose(model.layers[3].encoder.weight.abs(), w.abs(), atol=1e-4) and again.n == 8 * 15
    assert not torch.allclose(before, model(ids))


def test_the_body_without_its_bottleneck_is_the_plain_model_with_the_same_weights():
    torch.manual_seed(0)
    plain = GPT(CFG)
    ids = torch.randint(0, 256, (2, 12))
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, bottleneck=16, bottleneck_after=(1,)),
                bases={1: fixed_basis(64, 16, "random", 1)})
    assert torch.equal(without_bottleneck(model)(ids), plain(ids))
