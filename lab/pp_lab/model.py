"""A readable Megatron-style GPT, written as a list of layers so DeepSpeed can cut it into pipeline stages.

    layers = embedding | block x n_layer | head        (pre-norm, RoPE, SwiGLU or GELU, GQA)

What flows between layers (and so between pipeline stages) is `hidden` (B, T, D), or the tuple
`(hidden, sample_ids)` when the batch carries sample ids (needed by `+aqsgd`): integer tensors ride
along untouched, only `hidden` is compressed. `pp_lab.pipeline.pipeline_module(cfg, stages)` builds the
`deepspeed.pipe.PipelineModule`; `GPT(cfg)` is the same layers run in one process (tests, eval).

`GPTConfig.from_hf(path)` + `checkpoint=path` load a LLaMA-family transformers checkpoint (safetensors)
into the same layers: every layer reads only its own tensors, so a pipeline stage never loads the rest.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pp_lab.bottleneck import Basis, Branch, Decoder, Encoder, fixed_basis

Flow = Union[Tensor, tuple[Tensor, ...]]  # hidden, or (hidden, sample_ids)
PRESETS: dict[str, dict[str, Any]] = {
    # parameters with the default 8192-token BPE (with GPT-2's 50257 tokens)
    "tiny": dict(n_layer=4, n_head=4, d_model=64),  # CI: 0.74M (3.4M)
    "small": dict(n_layer=6, n_head=6, d_model=192),  # demo, studies on 2 CPU cores: 4.2M (12.3M)
    "medium": dict(n_layer=8, n_head=8, d_model=384),  # studies: 17.3M (33.5M)
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, mlp="gelu", norm="layernorm", bias=True),  # GPUs: 124M
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    """Tokenizer vocabulary size (GPT-2: 50257)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads; d_model must divide by it."""
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention; None = n_head (plain multi-head)."""
    d_model: int = 64
    """Hidden size: the width of what crosses every pipeline boundary."""
    d_ff: int | None = None
    """MLP inner size; None = 4*d_model for GELU, 8/3*d_model rounded up to 64 for SwiGLU."""
    mlp: str = "swiglu"
    """'swiglu' (LLaMA) or 'gelu' (GPT-2)."""
    norm: str = "rmsnorm"
    """'rmsnorm' (LLaMA) or 'layernorm' (GPT-2)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    rope_theta: float = 10000.0
    """RoPE base."""
    bias: bool = False
    """Biases in linear layers."""
    tie_embeddings: bool = True
    """Output head shares the embedding matrix (a tied layer across the first and last stage)."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections get init_std / sqrt(2 * n_layer)."""
    layout: str = "bsh"
    """Layout of the hidden states between layers (and pipeline stages): 'bsh' (batch, seq, hidden) or Megatron's
    'sbh' (seq, batch, hidden); pp_compress then needs batch_dim=1."""
    subspace: int | None = None
    """Subspace pipelines (Protocol Models): every residual write but the last block's lies in span(U), U a fixed
    d x k orthonormal basis, so layers pass the k coordinates c = U^T (x - E0[ids]) and the token ids instead of x.
    None = a dense model."""
    subspace_seed: int = 1234
    """Seed of the fixed token embedding E0 and basis U (identical on every rank, never trained, not checkpointed)."""
    bottleneck: int | None = None
    """A learned bottleneck at each boundary (pp_lab/bottleneck.py): the hidden state crosses after each block of
    `bottleneck_after` as k coordinates per token plus the first `bottleneck_sink` tokens in full. None = none."""
    bottleneck_after: tuple[int, ...] = ()
    """Block indices after which a bottleneck sits: the pipeline's cuts (`stage_cuts` less one: it counts the embedding)."""
    bottleneck_sink: int = 1
    """Leading tokens of every sequence that cross the bottleneck in full (the attention sink)."""
    bottleneck_group: int = 1
    """Tokens whose codes share one row on the wire (a codec's per-row cost is then paid over group x k values);
    1 for the Megatron layout."""
    bottleneck_trainable: bool = True
    """False keeps the encoders and decoders at their initialisation: a fixed subspace, the learned one's control."""
    bottleneck_residual: int = 0
    """Width r of a trained residual branch beside each encoder and decoder (ResBM's design, pp_lab/bottleneck.py):
    their linear maps then stay at their initialisation, a low-rank identity path, and only the branches train,
    starting from zero. 0 = none."""
    bottleneck_tokens: bool = False
    """Each bottleneck also predicts every token's hidden state from its token id (a frozen table, V x d, fitted on
    the calibration data and kept in the checkpoint), and the code carries the rest; the token ids cross every
    boundary beside the code. 'bsh' layout only."""

    def __post_init__(self) -> None:
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r}; accepted: 'swiglu', 'gelu'")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm={self.norm!r}; accepted: 'rmsnorm', 'layernorm'")
        if self.layout not in ("bsh", "sbh"):
            raise ValueError(f"layout={self.layout!r}; accepted: 'bsh', 'sbh'")
        if self.subspace is not None and not 1 <= self.subspace <= self.d_model:
            raise ValueError(f"subspace={self.subspace}; accepted: None or an integer in 1..d_model={self.d_model}")
        if min(self.vocab_size, self.n_layer, self.n_head, self.d_model) < 1 or self.d_model % self.n_head:
            raise ValueError(f"need positive sizes and d_model % n_head == 0, got d_model={self.d_model}, n_head={self.n_head}")
        object.__setattr__(self, "bottleneck_after", tuple(int(c) for c in self.bottleneck_after))  # JSON gives a list
        if self.bottleneck is not None:
            if not 1 <= self.bottleneck <= self.d_model or self.subspace is not None:
                raise ValueError(f"bottleneck={self.bottleneck}; accepted: None or an integer in 1..d_model="
                                 f"{self.d_model}, and not with a subspace model")
            if not self.bottleneck_after or any(not 0 <= c < self.n_layer - 1 for c in self.bottleneck_after):
                raise ValueError(f"bottleneck_after={self.bottleneck_after}; accepted: block indices in "
                                 f"0..{self.n_layer - 2} (a block that another block follows), at least one")
            if self.bottleneck_sink < 0:
                raise ValueError(f"bottleneck_sink={self.bottleneck_sink}; accepted: an integer >= 0")
            if self.bottleneck_group < 1 or (self.bottleneck_group > 1 and self.layout != "bsh"):
                raise ValueError(f"bottleneck_group={self.bottleneck_group}; accepted: an integer >= 1 (> 1 with the "
                                 "'bsh' layout only)")
        if self.bottleneck_residual < 0 or (self.bottleneck_residual and (self.bottleneck is None
                                                                          or not self.bottleneck_trainable)):
            raise ValueError(f"bottleneck_residual={self.bottleneck_residual} with bottleneck={self.bottleneck}, "
                             f"bottleneck_trainable={self.bottleneck_trainable}; accepted: 0, or a width >= 1 with a "
                             "trainable bottleneck (the branch is what trains)")
        if self.bottleneck_tokens and (self.bottleneck is None or self.layout != "bsh"):
            raise ValueError(f"bottleneck_tokens=True with bottleneck={self.bottleneck}, layout={self.layout!r}; "
                             "accepted: with a bottleneck and the 'bsh' layout")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ff(self) -> int:
        if self.d_ff:
            return self.d_ff
        return 4 * self.d_model if self.mlp == "gelu" else 64 * math.ceil(8 * self.d_model / 3 / 64)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"model preset {name!r}; accepted: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, path: str | Path) -> GPTConfig:
        """Sizes of a local LLaMA-family transformers checkpoint (config.json)."""
        hf = json.loads((Path(path) / "config.json").read_text())
        if hf.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"{path}: model_type={hf.get('model_type')!r}; the loader maps LLaMA-family models (llama, mistral, qwen2)")
        rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), "rope_type": "default"}
        if (hf.get("rope_scaling") or rope).get("rope_type", "default") != "default":
            raise ValueError(f"{path}: rope scaling {rope} is not supported (plain RoPE only)")
        if hf.get("mlp_bias"):
            raise ValueError(f"{path}: mlp_bias=true is not supported")
        if hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]) != hf["hidden_size"] // hf["num_attention_heads"]:
            raise ValueError(f"{path}: head_dim={hf['head_dim']} != hidden_size / num_attention_heads is not supported")
        return cls(vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
                   n_kv_head=hf.get("num_key_value_heads"), d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
                   norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope["rope_theta"]),
                   bias=bool(hf.get("attention_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- layers -------------------------------------------------------------------------------------
def _split(x: Flow) -> tuple[Tensor, tuple[Tensor, ...]]:
    return (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, ())


def _join(h: Tensor, rest: tuple[Tensor, ...]) -> Flow:
    return (h, *rest) if rest else h


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


_BASES: dict[tuple[int, int, int, int], tuple[Tensor, Tensor]] = {}


def subspace_basis(cfg: GPTConfig) -> tuple[Tensor, Tensor]:
    """(E0 (V, d), U (d, k)) for cfg.subspace: a random token embedding of the init scale and the Q of a Gaussian's
    QR (orthonormal columns), both from cfg.subspace_seed, so every rank and every load regenerates them bit for
    bit. Shared by all layers of a process."""
    key = (cfg.vocab_size, cfg.d_model, int(cfg.subspace or 0), cfg.subspace_seed)
    if key not in _BASES:
        g = torch.Generator().manual_seed(cfg.subspace_seed)
        e0 = torch.randn(cfg.vocab_size, cfg.d_model, generator=g) * cfg.init_std  # (V, d)
        u = torch.linalg.qr(torch.randn(cfg.d_model, key[2], generator=g, dtype=torch.float64)).Q.float()  # (d, k)
        _BASES[key] = (e0, u)
    return _BASES[key]


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer dtype holding every token id: what travels next to the coordinates."""
    return torch.uint8 if vocab_size <= 256 else torch.int16 if vocab_size <= 32768 else torch.int32


class _Subspace(nn.Module):
    """E0 and U as non-persistent buffers (regenerated from the seed, never saved), for the layers that need them."""

    def _subspace_buffers(self, cfg: GPTConfig) -> None:
        e0, u = subspace_basis(cfg)
        self.register_buffer("e0", e0, persistent=False)
        self.register_buffer("u", u, persistent=False)

    def dense(self, c: Tensor, ids: Tensor) -> Tensor:
        """The residual stream x = E0[ids] + U c: (..., k) coordinates and (...) token ids -> (..., d)."""
        return F.embedding(ids.long(), self.e0).to(c.dtype) + c @ self.u.to(c.dtype).T


def _rope(cfg: GPTConfig, t: int, device: torch.device) -> tuple[Tensor, Tensor]:
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, hd), the LLaMA/HF "rotate half" layout
    return emb.cos(), emb.sin()


def _rope_at(cfg: GPTConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin at each sequence's own positions (B, T) -> (B, 1, T, hd) each (generation with a KV cache)."""
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device, dtype=torch.float32) / cfg.head_dim)
    freqs = positions.float()[..., None] * inv  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, hd)
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, hd/2) each
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)  # (B, H, T, hd)


class _Loadable(_Subspace):
    """A layer that can fill itself from a transformers checkpoint: {our name: checkpoint name}."""

    def _fill(self, cfg: GPTConfig, checkpoint: str | Path | None) -> None:
        """After the layer's parameters exist: the subspace's fixed buffers, or the checkpoint's weights."""
        if cfg.subspace is not None:
            if checkpoint is not None:
                raise ValueError("a subspace model cannot load a dense checkpoint (its residual writes are not in span(U))")
            self._subspace_buffers(cfg)
        if checkpoint is not None:
            self.load_hf(checkpoint)

    def hf_names(self) -> dict[str, str]:
        raise NotImplementedError

    def load_hf(self, checkpoint: str | Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(checkpoint).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{checkpoint}: no *.safetensors files (convert the checkpoint with recipes/convert.py)")
        want = self.hf_names()
        found: dict[str, Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for ours, theirs in want.items():
                    if theirs in st.keys():
                        found[ours] = st.get_tensor(theirs)
        missing = sorted(set(want) - set(found))
        if missing:
            raise KeyError(f"{checkpoint}: tensors {[want[m] for m in missing]} not found")
        with torch.no_grad():
            params = dict(self.named_parameters())
            for ours, t in found.items():
                if params[ours].shape != t.shape:
                    raise ValueError(f"{want[ours]}: checkpoint shape {tuple(t.shape)}, layer expects {tuple(params[ours].shape)}")
                params[ours].copy_(t)


class Embedding(_Loadable):
    """Token ids (B, T) [+ sample ids (B,)] -> hidden (B, T, D) [+ sample ids]; also the tied output head."""

    def __init__(self, cfg: GPTConfig, checkpoint: str | Path | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # subspace: only the k-wide part A trains (the embedding is E0 + A U^T), so a tied embedding's all-reduce
        # between the first and the last stage shrinks by d / k too
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.subspace or cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.init_std)
        self._fill(cfg, checkpoint)

    def hf_names(self) -> dict[str, str]:
        return {"weight": "model.embed_tokens.weight"}

    def forward(self, x: Flow) -> Flow:
        ids, rest = _split(x)
        h = F.embedding(ids, self.weight)  # (B, T, D), or the coordinates (B, T, k) of a subspace model
        sbh = self.cfg.layout == "sbh"
        h = h.transpose(0, 1).contiguous() if sbh else h  # (T, B, .) for sbh
        if self.cfg.bottleneck_tokens:  # the bottlenecks' token tables need the ids at every boundary
            return (h, ids.to(id_dtype(self.cfg.vocab_size)), *rest)
        if self.cfg.subspace is None:
            return _join(h, rest)
        ids = ids.to(id_dtype(self.cfg.vocab_size))  # (B, T): travels with the coordinates, in as few bytes as fit
        return (h, ids.t().contiguous() if sbh else ids, *rest)

    def logits(self, h: Tensor) -> Tensor:
        if self.cfg.subspace is None:
            return F.linear(h, self.weight)  # (B, T, V)
        return F.linear(h, self.e0.to(h.dtype)) + F.linear(h @ self.u.to(h.dtype), self.weight)  # h (E0 + A U^T)^T


class Block(_Loadable):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, index: int = 0, checkpoint: str | Path | None = None,
                 bases: dict[int, Basis] | None = None) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        d, hd, kv = cfg.d_model, cfg.head_dim, cfg.kv_heads
        # subspace: every block but the last writes k coordinates (o = U B_o, down = U B_down, parametrised: the
        # constraint holds after any optimizer step, with no projection); the last block stays full rank
        self.writes_k = cfg.subspace is not None and index < cfg.n_layer - 1
        out = cfg.subspace if self.writes_k else d
        self.attn_norm, self.mlp_norm = _norm(cfg), _norm(cfg)
        self.q = nn.Linear(d, cfg.n_head * hd, bias=cfg.bias)
        self.k = nn.Linear(d, kv * hd, bias=cfg.bias)
        self.v = nn.Linear(d, kv * hd, bias=cfg.bias)
        self.o = nn.Linear(cfg.n_head * hd, out, bias=cfg.bias)
        mlp_bias = cfg.bias and cfg.mlp == "gelu"  # GPT-2 has MLP biases, LLaMA (attention_bias) does not
        if cfg.mlp == "swiglu":
            self.gate = nn.Linear(d, cfg.ff, bias=False)
        self.up = nn.Linear(d, cfg.ff, bias=mlp_bias)
        self.down = nn.Linear(cfg.ff, out, bias=mlp_bias)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = cfg.init_std / math.sqrt(2 * cfg.n_layer) if name.split(".")[0] in ("o", "down") else cfg.init_std
                if name.split(".")[0] in ("o", "down") and self.writes_k:  # ||U B y|| = ||B y||: match a dense write
                    std *= math.sqrt(d / out)
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        self._fill(cfg, checkpoint)
        self.encoder = self.decoder = None
        if cfg.bottleneck is not None:  # after the blocks above, which draw the same random numbers as without it
            self._bottleneck(cfg, bases or {})

    def _bottleneck(self, cfg: GPTConfig, bases: dict[int, Basis]) -> None:
        """The encoder of the boundary after this block and the decoder of the one before it, where they exist;
        `bases` maps a cut to its basis (mu, W_e, W_d), else a seeded random one (a checkpoint then sets the
        weights)."""
        seq_dim = 0 if cfg.layout == "sbh" else 1
        k, i = cfg.bottleneck, self.index

        def basis(cut: int) -> Basis:
            b = bases[cut] if cut in bases else fixed_basis(cfg.d_model, k, "random", cfg.subspace_seed + cut)
            if cfg.bottleneck_tokens and b.tokens is None:  # a checkpoint then sets the table
                b = b._replace(tokens=torch.zeros(cfg.vocab_size, cfg.d_model))
            if not cfg.bottleneck_tokens and b.tokens is not None:
                raise ValueError(f"the basis of cut {cut} has a token table but bottleneck_tokens=False; accepted: "
                                 "bottleneck_tokens=True, or a basis without one")
            return b

        def branch(n_in: int, n_out: int, seed: int) -> Branch | None:
            r = cfg.bottleneck_residual
            return Branch(n_in, n_out, r, cfg.init_std, cfg.subspace_seed + seed) if r else None

        # each branch's own seed, apart from the bases' (subspace_seed + cut)
        if i in cfg.bottleneck_after:
            self.encoder = Encoder(cfg.d_model, k, cfg.bottleneck_sink, seq_dim, basis(i), cfg.bottleneck_trainable,
                                   cfg.bottleneck_group, branch(cfg.d_model, k, 1000 * (i + 1)))
        if i - 1 in cfg.bottleneck_after:
            self.decoder = Decoder(cfg.d_model, k, seq_dim, basis(i - 1), cfg.bottleneck_trainable,
                                   cfg.bottleneck_group, branch(k, cfg.d_model, 1000 * i + 1))

    def hf_names(self) -> dict[str, str]:
        p = f"model.layers.{self.index}."
        names = {"attn_norm.weight": p + "input_layernorm.weight", "mlp_norm.weight": p + "post_attention_layernorm.weight",
                 "q.weight": p + "self_attn.q_proj.weight", "k.weight": p + "self_attn.k_proj.weight",
                 "v.weight": p + "self_attn.v_proj.weight", "o.weight": p + "self_attn.o_proj.weight",
                 "gate.weight": p + "mlp.gate_proj.weight", "up.weight": p + "mlp.up_proj.weight",
                 "down.weight": p + "mlp.down_proj.weight"}
        if self.cfg.bias:
            names.update({f"{n}.bias": p + f"self_attn.{n}_proj.bias" for n in "qkvo"})
        return names

    def attention(self, x: Tensor) -> Tensor:
        if self.cfg.layout == "sbh":  # (T, B, D): the attention itself runs batch-first
            return self.heads(x.transpose(0, 1), self.cfg.n_head, self.cfg.kv_heads).transpose(0, 1)
        return self.heads(x, self.cfg.n_head, self.cfg.kv_heads)

    def heads(self, x: Tensor, n_head: int, kv_heads: int) -> Tensor:
        """Causal attention of n_head query heads over kv_heads key/value heads (all of them, or one tensor-parallel
        rank's share): x (B, T, D) -> (B, T, D), the output projection applied (partial sums under TP)."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q(x).view(b, t, n_head, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(b, t, kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v(x).view(b, t, kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        cos, sin = _rope(self.cfg, t, x.device)  # (T, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != n_head)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(b, t, n_head * hd))  # (B, T, D)

    def cached(self, h: Tensor, cache: dict[str, Tensor], positions: Tensor, key_valid: Tensor) -> Tensor:
        """One generation step with this block's KV cache: h (B, T, D) at positions (B, T) -> (B, T, D). The cache
        holds "k", "v" (B, KV, L, hd) and "len" (filled slots); key_valid (B, len + T) marks real (not padding)
        keys. Attention is causal over the filled slots plus the new ones."""
        b, t, _ = h.shape
        cfg, hd, start = self.cfg, self.cfg.head_dim, int(cache["len"])
        x = self.attn_norm(h)
        q = self.q(x).view(b, t, cfg.n_head, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(b, t, cfg.kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v(x).view(b, t, cfg.kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        cos, sin = _rope_at(cfg, positions)  # (B, 1, T, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache["k"][:, :, start:start + t], cache["v"][:, :, start:start + t] = k, v
        cache["len"] = torch.tensor(start + t)
        keys = torch.arange(start + t, device=h.device)  # (L',)
        query = (start + torch.arange(t, device=h.device))[:, None]  # (T, 1)
        # real keys up to the query, and always the query's own slot: a padding query with no real key before it would
        # otherwise attend to nothing (NaN); padding keys stay masked for the real queries
        mask = ((keys[None, :] <= query)[None, None] & key_valid[:, None, None, : start + t]) | (keys[None, :] == query)
        mask = mask.expand(b, 1, t, start + t)  # (B, 1, T, L')
        y = F.scaled_dot_product_attention(q, cache["k"][:, :, : start + t], cache["v"][:, :, : start + t], attn_mask=mask,
                                           enable_gqa=cfg.kv_heads != cfg.n_head)  # (B, H, T, hd)
        h = h + self.o(y.transpose(1, 2).reshape(b, t, cfg.n_head * hd))  # (B, T, D)
        return h + self.mlp(self.mlp_norm(h))

    def mlp(self, x: Tensor) -> Tensor:
        if self.cfg.mlp == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, D)
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (B, T, D)

    def forward(self, x: Flow) -> Flow:
        h, rest = _split(x)
        if self.cfg.subspace is not None:  # (c, token ids, ...): rebuild x = E0[ids] + U c exactly
            return self._subspace_forward(h, rest[0], rest[1:])
        tokens = self.cfg.bottleneck_tokens  # then the flow is (hidden or code, [sink,] token ids (B, T), ...)
        if self.decoder is not None:  # (code, sink, ...) from the boundary before this block
            h, rest = self.decoder(h, rest[0], rest[1] if tokens else None), rest[1:]  # (B, T, D)
        h = h + self.attention(self.attn_norm(h))  # (B, T, D)
        h = h + self.mlp(self.mlp_norm(h))  # (B, T, D)
        if self.encoder is not None:  # (code (B, T / g, g k), sink (B, s, D), ...) cross the boundary after it
            return (*self.encoder(h, rest[0] if tokens else None), *rest)
        return _join(h, rest)

    def _subspace_forward(self, c: Tensor, ids: Tensor, rest: tuple[Tensor, ...]) -> Flow:
        h = self.dense(c, ids)  # (B, T, D)
        if not self.writes_k:  # the last block: full rank, its output is the dense stream (no boundary follows it)
            h = h + self.attention(self.attn_norm(h))
            return _join(h + self.mlp(self.mlp_norm(h)), rest)
        c = c + self.attention(self.attn_norm(h))  # (B, T, k): the write is U times this
        c = c + self.mlp(self.mlp_norm(self.dense(c, ids)))  # (B, T, k)
        return (c, ids, *rest)


class Head(_Loadable):
    """Final norm + output projection (untied), dropping the sample ids: hidden -> logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig, checkpoint: str | Path | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = _norm(cfg)
        self.out = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if self.out is not None:
            nn.init.normal_(self.out.weight, std=cfg.init_std)
        self.head_name = "lm_head.weight"
        """The checkpoint tensor an untied head loads: a tied checkpoint has none, so it starts as the embedding."""
        if checkpoint is not None:
            hf = json.loads((Path(checkpoint) / "config.json").read_text())
            self.head_name = "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else self.head_name
            self.load_hf(checkpoint)

    def hf_names(self) -> dict[str, str]:
        return {"norm.weight": "model.norm.weight", **({} if self.out is None else {"out.weight": self.head_name})}

    def forward(self, x: Flow) -> Tensor:
        h, _ = _split(x)
        h = self.norm(h.transpose(0, 1) if self.cfg.layout == "sbh" else h)  # (B, T, D)
        return h if self.out is None else self.out(h)  # (B, T, D) when tied (the embedding projects), else (B, T, V)


def tied_logits(embedding: Embedding, h: Tensor) -> Tensor:
    return embedding.logits(h)


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross entropy over labels != -100 (labels are already shifted)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


# --- whole models ---------------------------------------------------------------------------------
def layer(cfg: GPTConfig, i: int, checkpoint: str | Path | None = None,
          bases: dict[int, Basis] | None = None) -> nn.Module:
    """Entry i of `layers`' list up to the head: 0 the embedding, 1..n_layer the blocks, n_layer + 1 the head."""
    if i == 0:
        return Embedding(cfg, checkpoint)
    return Head(cfg, checkpoint) if i == cfg.n_layer + 1 else Block(cfg, i - 1, checkpoint, bases)


def layers(cfg: GPTConfig, checkpoint: str | Path | None = None, bases: dict[int, Basis] | None = None) -> list[nn.Module]:
    """The layer list in one process; with tied embeddings the last entry reuses the first. `bases`: the bottleneck's
    initial basis per cut (pp_lab.bottleneck.calibrate, calibrate_fisher)."""
    out = [layer(cfg, i, checkpoint, bases) for i in range(cfg.n_layer + 2)]
    if cfg.tie_embeddings:
        out.append(_TiedProjection(out[0]))
    return out


class _TiedProjection(nn.Module):
    def __init__(self, emb: Embedding) -> None:
        super().__init__()
        self.emb = [emb]  # a list: not registered twice as a submodule

    def forward(self, h: Tensor) -> Tensor:
        return self.emb[0].logits(h)


def stage_cuts(cfg: GPTConfig, stages: int) -> list[int]:
    """Layer indices after which a stage ends, as DeepSpeed's type:Block partitioning places them (every engine's
    recipe cuts the model there)."""
    from deepspeed.runtime.utils import partition_balanced

    n_layers = cfg.n_layer + 2 + (1 if cfg.tie_embeddings else 0)  # embedding, blocks, head[, tied projection]
    weights = [1 if 1 <= i <= cfg.n_layer else 0 for i in range(n_layers)]
    parts = partition_balanced(weights=weights, num_parts=stages)
    return [parts[s] - 1 for s in range(1, stages)]


class GPT(nn.Module):
    """The pipeline's layers run in sequence in one process; `boundaries` puts modules between blocks
    (e.g. pp_compress.CompressionBoundary for in-process compression at the pipeline's cut points)."""

    def __init__(self, cfg: GPTConfig, checkpoint: str | Path | None = None,
                 bases: dict[int, Basis] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(layers(cfg, checkpoint, bases))

    def forward(self, ids: Tensor) -> Tensor:
        x: Flow = ids  # (B, T)
        for layer in self.layers:
            x = layer(x)
        return x  # (B, T, V)
