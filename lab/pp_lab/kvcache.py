"""The recipe GPT's stages for KV-cached generation (pp_compress.generate.PipelineGenerator), and loading a model.

Each stage process builds the whole model from a recipe run or a transformers folder (`load_model`), keeps the
layers of its stage (cut where DeepSpeed cuts them, `model.stage_cuts`) and a KV cache per block.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pp_lab import data
from pp_lab.model import GPT, Block, Embedding, GPTConfig, Head, stage_cuts


def load_model(checkpoint: str | Path) -> tuple[GPT, Any, int]:
    """(model, tokenizer, trained sequence length) of a recipe run directory or a transformers folder."""
    checkpoint = Path(checkpoint)
    info = data.run_record(checkpoint)
    if info is not None:
        meta = dict(info["model"])
        tok = data.run_tokenizer(checkpoint, meta.pop("tokenizer"))
        meta.pop("base_checkpoint", None)
        model = GPT(GPTConfig(**meta))
        tag = (checkpoint / "ckpt" / "latest").read_text().strip()
        for i, layer in enumerate(model.layers):  # DeepSpeed writes one file per pipeline layer
            f = checkpoint / "ckpt" / tag / f"layer_{i:02d}-model_states.pt"
            if f.exists():
                layer.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
            elif any(True for _ in layer.parameters(recurse=False)):
                raise FileNotFoundError(f"{f} is missing")
        return model.eval(), tok, int(info["args"].get("seq_len", 1024))
    if (checkpoint / "config.json").exists():
        return GPT(GPTConfig.from_hf(checkpoint), checkpoint).eval(), data.load_tokenizer(str(checkpoint)), 2048
    raise FileNotFoundError(f"{checkpoint}: neither a recipe run (run.json) nor a transformers folder (config.json)")


class CachedStage:
    """One stage's layers with their KV caches: `reset(batch, length)`, then `(x, positions, key_valid) -> y` per
    step. The first stage takes token ids (B, T), the last returns logits (B, T, V) (or (B, 1, V) with `last_only`), the
    others hidden (B, T, D)."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        if model.cfg.subspace is not None or model.cfg.bottleneck is not None:
            raise ValueError("KV-cached generation of a subspace or bottleneck model is not supported; serve it with "
                             "recipes/infer.py --no-kv-cache")
        bounds = [0, *(c + 1 for c in stage_cuts(model.cfg, stages)), len(model.layers)]
        self.cfg, self.layers = model.cfg, list(model.layers)[bounds[stage]:bounds[stage + 1]]
        self.caches: list[dict[str, Tensor]] = []

    def reset(self, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> None:
        """Empty caches for `batch` sequences of up to `length` positions."""
        c = self.cfg
        self.caches = [{"k": torch.zeros(batch, c.kv_heads, length, c.head_dim, device=device, dtype=dtype),
                        "v": torch.zeros(batch, c.kv_heads, length, c.head_dim, device=device, dtype=dtype),
                        "len": torch.tensor(0)} for layer in self.layers if isinstance(layer, Block)]

    @torch.no_grad()
    def __call__(self, x: Tensor, positions: Tensor, key_valid: Tensor, last_only: bool = False) -> Tensor:
        caches = iter(self.caches)
        for layer in self.layers:
            if isinstance(layer, Embedding):
                x = F.embedding(x, layer.weight)  # (B, T, D)
            elif isinstance(layer, Block):
                x = layer.cached(x, next(caches), positions, key_valid)  # (B, T, D)
            elif isinstance(layer, Head):
                x = x[:, -1:] if last_only else x  # (B, 1, D) when only the next token is wanted
                x = layer.norm(x) if layer.out is None else layer.out(layer.norm(x))  # (B, T, D) tied, else (B, T, V)
            elif isinstance(layer, nn.Module):
                x = layer(x)  # the tied output projection: (B, T, V)
        return x
