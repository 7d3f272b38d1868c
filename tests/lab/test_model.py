"""The recipes' GPT: LLaMA checkpoints load into our layers with the same logits; configs validate."""
from pathlib import Path

import pytest
import torch

from pp_lab.convert import DEFAULT_OUT
from pp_lab.model import GPT, GPTConfig, lm_loss

transformers = pytest.importorskip("transformers")


def _tiny_llama(tmp_path: Path, tie: bool, bias: bool = False) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tie,
                                   rope_theta=5000.0, attention_bias=bias, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm weights and biases, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("tie,bias", [(True, False), (False, False), (False, True)])
def test_llama_checkpoint_gives_the_same_logits(tmp_path, tie, bias):
    path = _tiny_llama(tmp_path, tie, bias)
    cfg = GPTConfig.from_hf(path)
    assert (cfg.n_kv_head, cfg.tie_embeddings, cfg.rope_theta, cfg.bias) == (2, tie, 5000.0, bias)
    ours = GPT(cfg, path).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_untied_head_from_a_tied_checkpoint_starts_as_the_embedding(tmp_path):
    """--untied on a tied checkpoint: a head of its own (its gradient no longer all-reduced across stages) that
    computes the same logits at step 0."""
    import dataclasses

    path = _tiny_llama(tmp_path, tie=True)
    cfg = GPTConfig.from_hf(path)
    tied, untied = GPT(cfg, path).eval(), GPT(dataclasses.replace(cfg, tie_embeddings=False), path).eval()
    head = [p for n, p in untied.named_parameters() if n.endswith("out.weight")]
    assert len(head) == 1 and head[0].data_ptr() != untied.layers[0].weight.data_ptr()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(tied(ids), untied(ids))


@pytest.mark.skipif(not (DEFAULT_OUT / "config.json").exists(), reason="SmolLM2 not converted (make models)")
def test_smollm2_logits_match_transformers():
    cfg = GPTConfig.from_hf(DEFAULT_OUT)
    ours = GPT(cfg, DEFAULT_OUT).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_OUT).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4114, 314, 253, 3937, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4)


def test_wrong_checkpoint_shape_and_bad_config_fail_clearly(tmp_path):
    path = _tiny_llama(tmp_path, True)
    with pytest.raises(ValueError, match="checkpoint shape"):
        GPT(GPTConfig.from_hf(path).__class__(**{**GPTConfig.from_hf(path).to_dict(), "d_ff": 96}), path)
    with pytest.raises(ValueError, match="accepted: 'swiglu', 'gelu'"):
        GPTConfig(mlp="relu")
    with pytest.raises(ValueError, match="accepted: tiny"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize("mlp,norm", [("swiglu", "rmsnorm"), ("gelu", "layernorm")])
def test_tiny_gpt_learns_and_sample_ids_ride_along(mlp, norm):
    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=32, mlp=mlp, norm=norm, bias=norm == "layernorm")
    model = GPT(cfg)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    sids = torch.arange(4)
    h = model.layers[1](model.layers[0]((x, sids)))
    assert isinstance(h, tuple) and h[1] is sids and h[0].shape == (4, 8, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = lm_loss(model(x), y)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first
