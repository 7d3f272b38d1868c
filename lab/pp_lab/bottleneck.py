"""A learned bottleneck at each pipeline boundary: the sending stage encodes the hidden state to k < d coordinates, the
receiving stage decodes them, and the code then crosses the wire through any pp_compress spec, so the two
reductions multiply (d/k from the bottleneck times the codec's own ratio).

What crosses boundary b is `(code, sink)` instead of the hidden state `h` (B, T, d):
- `code` = E(h) = W_e h + b_e, (B, T, k), zero at the first s tokens, laid out g tokens to a row with `group` g:
  (B, T / g, g k);
- `sink` = h[:, :s], (B, s, d): the first s tokens exactly (the attention sink of LLaMA-family models carries
  channels ~100x the median token's, which no low-rank code keeps; s = 1 by default);
and the receiving block rebuilds h = D(code) with D(c) = W_d c + b_d, its first s tokens replaced by the sink, before
it runs. The gradient that crosses back has the same shapes: the bottleneck shrinks both directions.

Initialised from the boundary's principal subspace (`calibrate`): W_e = U^T, b_e = -U^T mu, W_d = U, b_d = mu, with
U (d, k) the top-k principal directions of the hidden states after the cut on calibration text (sink tokens left
out) and mu their mean, so a pretrained model starts as its own projection onto the subspace; then both train with
the model (or stay fixed, `trainable=False`: the fixed-subspace control). With k = d and U = I the bottleneck is the
identity, bitwise.

Or from the loss-weighted subspace (`calibrate_fisher`): the principal subspace minimises the hidden state's squared
error, but the loss is more sensitive to some directions than others. With F = E[g g^T] the (damped) second moment
of the loss gradient g at the cut, a change e of h costs about e^T F e / 2, and the rank-k map that minimises
E[e^T F e] is the principal subspace in coordinates whitened by F: with V the top-k eigenvectors of F^1/2 C F^1/2
(C the covariance of h), W_e = V^T F^1/2 and W_d = F^-1/2 V, an oblique projection W_d W_e.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Basis = tuple[Tensor, Tensor, Tensor]
"""(mu (d,), W_e (k, d), W_d (d, k)) of one boundary: code = W_e (h - mu), h = W_d code + mu."""
Init = Literal["pca", "fisher", "random", "identity"]
INITS: tuple[str, ...] = ("pca", "fisher", "random", "identity")
FROM_DATA: tuple[str, ...] = ("pca", "fisher")
"""The inits computed from a pretrained model's hidden states (`calibrate`, `calibrate_fisher`)."""


class Encoder(nn.Module):
    """h (B, T, d) [or (T, B, d) with seq_dim 0] -> (code, sink (B, s, d)); the code is (B, T, k), or with `group` g
    (B, T / g, g k): g tokens' codes in one row, so that a codec with a fixed cost per row (a scale, vq's pivot) pays
    it over g k values instead of k."""

    def __init__(self, d: int, k: int, sink: int, seq_dim: int, basis: Basis, trainable: bool, group: int = 1) -> None:
        super().__init__()
        self.sink, self.seq_dim, self.group = sink, seq_dim, group
        mu, enc, _ = _check(basis, d, k)
        # parameters set from the basis, not drawn: the model's other weights see the same random numbers as without
        self.weight = nn.Parameter(enc.clone(), requires_grad=trainable)  # (k, d)
        self.bias = nn.Parameter(-(enc @ mu), requires_grad=trainable)  # (k,)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        t, dim = h.shape[self.seq_dim], self.seq_dim
        sink = h.narrow(dim, 0, self.sink).contiguous()  # (B, s, d)
        code = F.linear(h.narrow(dim, self.sink, t - self.sink), self.weight, self.bias)  # (B, T - s, k)
        # the sink tokens' places stay in the code, as zeros: rows keep whole groups of tokens, and the sink's own
        # code (its channels are ~100x the others') would otherwise set the scale of every row it shares
        zeros = code.new_zeros(code.shape[:dim] + (self.sink,) + code.shape[dim + 1:])  # (B, s, k)
        return _rows(torch.cat([zeros, code], dim=dim), self.group), sink


class Decoder(nn.Module):
    """(code, sink (B, s, d)) -> h (B, T, d): the decoded code, with the first s tokens replaced by the sink."""

    def __init__(self, d: int, k: int, seq_dim: int, basis: Basis, trainable: bool, group: int = 1) -> None:
        super().__init__()
        self.seq_dim, self.k, self.group = seq_dim, k, group
        mu, _, dec = _check(basis, d, k)
        self.weight = nn.Parameter(dec.clone(), requires_grad=trainable)  # (d, k)
        self.bias = nn.Parameter(mu.clone(), requires_grad=trainable)  # (d,)

    def forward(self, code: Tensor, sink: Tensor) -> Tensor:
        if self.group > 1:
            code = code.reshape(code.shape[0], -1, self.k)  # (B, T, k)
        h = F.linear(code, self.weight, self.bias)  # (B, T, d)
        s = sink.shape[self.seq_dim]
        return torch.cat([sink, h.narrow(self.seq_dim, s, h.shape[self.seq_dim] - s)], dim=self.seq_dim)  # (B, T, d)


def _rows(code: Tensor, group: int) -> Tensor:
    """(B, T, k) -> (B, T / group, group k)."""
    if group == 1:
        return code
    b, t, k = code.shape
    if t % group:
        raise ValueError(f"bottleneck_group={group} needs a sequence length that it divides; got {t}")
    return code.reshape(b, t // group, group * k)


def _check(basis: Basis, d: int, k: int) -> Basis:
    mu, enc, dec = basis
    if tuple(mu.shape) != (d,) or tuple(enc.shape) != (k, d) or tuple(dec.shape) != (d, k):
        raise ValueError(f"bottleneck basis of shapes {tuple(mu.shape)}, {tuple(enc.shape)}, {tuple(dec.shape)}; "
                         f"expected ({d},), ({k}, {d}), ({d}, {k})")
    # dense fp32 (a QR gives a column-major Q, a transpose is a view; parameters must be dense)
    return mu.float().contiguous(), enc.float().contiguous(), dec.float().contiguous()


def orthonormal(mu: Tensor, u: Tensor) -> Basis:
    """The basis of the orthogonal projection onto U's columns (orthonormal, (d, k)): W_e = U^T, W_d = U."""
    return mu, u.T, u


def fixed_basis(d: int, k: int, how: Init, seed: int) -> Basis:
    """A basis that needs no data: `identity` (U = the first k columns of I, mu = 0: with k = d the identity map) or
    `random` (the Q of a seeded Gaussian's QR, mu = 0)."""
    if how == "identity":
        return orthonormal(torch.zeros(d), torch.eye(d)[:, :k])
    if how == "random":
        g = torch.Generator().manual_seed(seed)
        q = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64)).Q.float()  # (d, k)
        return orthonormal(torch.zeros(d), q)
    raise ValueError(f"bottleneck init {how!r} needs data (calibrate, calibrate_fisher); accepted here: identity, "
                     "random")


def _hiddens(layers: list[nn.Module], cuts: list[int], ids: Tensor, keep_grad: bool) -> tuple[Any, dict[int, Tensor]]:
    """Run `ids` through `layers` (embedding first, then the blocks, then the head): (the output, cut -> its hidden
    state (B, T, d) after the cut, kept for its gradient with `keep_grad`). The head runs only with `keep_grad`."""
    x, at = layers[0](ids), {}
    last = len(layers) if keep_grad else cuts[-1] + 2  # blocks 0 .. the last cut, or the whole model
    for i, layer in enumerate(layers[1:last]):
        x = layer(x)
        if i in cuts:
            h = x[0] if isinstance(x, tuple) else x  # (B, T, d)
            if keep_grad and not h.requires_grad:  # the first cut, with the model's parameters frozen: a leaf
                h.requires_grad_(True)
            elif keep_grad:
                h.retain_grad()
            at[i] = h
    return x, at


def _tokens(h: Tensor, sink: int, seq_dim: int) -> Tensor:
    """The hidden states of every token but the first `sink` of each sequence, (B (T - s), d) float64."""
    h = h.narrow(seq_dim, sink, h.shape[seq_dim] - sink)
    return h.reshape(-1, h.shape[-1]).double()


@torch.no_grad()
def calibrate(layers: list[nn.Module], cuts: Iterable[int], k: int, sink: int, batches: Iterable[Tensor],
              seq_dim: int = 1) -> dict[int, Basis]:
    """The principal subspace of the hidden state after each cut: `layers` are a model's layers without a bottleneck
    (embedding first, then the blocks), `cuts` block indices, `batches` token ids (B, T). Returns cut -> its basis
    from the hidden states of every token but the first `sink` of each sequence, in float64."""
    cuts = sorted(cuts)
    stats: dict[int, list[Tensor]] = {c: [] for c in cuts}
    for ids in batches:
        for c, h in _hiddens(layers, cuts, ids, keep_grad=False)[1].items():
            stats[c].append(_tokens(h, sink, seq_dim))
    out: dict[int, Basis] = {}
    for c, rows in stats.items():
        mu, cov = _moments(_enough(torch.cat(rows), k, c))  # (d,), (d, d)
        _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
        out[c] = orthonormal(mu.float(), vecs[:, -k:].flip(1).float())  # (d,), (d, k): largest variance first
    return out


def calibrate_fisher(layers: list[nn.Module], cuts: Iterable[int], k: int, sink: int,
                     batches: Iterable[tuple[Tensor, Tensor]], loss: Callable[[Any, Tensor], Tensor],
                     damping: float = 1.0, seq_dim: int = 1) -> dict[int, Basis]:
    """The loss-weighted subspace of the hidden state after each cut (the module docstring): as `calibrate`, with
    `batches` of (token ids (B, T), labels) and `loss(output, labels)` the mean loss of a batch, whose gradient at
    each cut weighs the directions. F is damped by `damping` times its mean eigenvalue (F + damping tr(F)/d I: large
    damping gives the principal subspace). The model's own parameters get no gradient."""
    if not damping > 0:
        raise ValueError(f"fisher damping {damping!r}; accepted: a number > 0")
    cuts = sorted(cuts)
    hs: dict[int, list[Tensor]] = {c: [] for c in cuts}
    gs: dict[int, list[Tensor]] = {c: [] for c in cuts}
    frozen = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for ids, labels in batches:
            with torch.enable_grad():
                out, at = _hiddens(layers, cuts, ids, keep_grad=True)
                (loss(out, labels) * labels.numel()).backward()  # per-token gradients: the sum's
            for c, h in at.items():
                hs[c].append(_tokens(h.detach(), sink, seq_dim))
                gs[c].append(_tokens(h.grad, sink, seq_dim))
    finally:
        for p, was in frozen:
            p.requires_grad_(was)
    out: dict[int, Basis] = {}
    for c in cuts:
        mu, cov = _moments(_enough(torch.cat(hs[c]), k, c))  # (d,), (d, d)
        g = torch.cat(gs[c])  # (N, d)
        fisher = g.T @ g / g.shape[0]  # (d, d)
        fisher = fisher + damping * fisher.diagonal().mean() * torch.eye(fisher.shape[0], dtype=fisher.dtype)
        vals, vecs = torch.linalg.eigh(fisher)
        half, inv_half = (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T  # F^1/2, F^-1/2 (d, d)
        _, v = torch.linalg.eigh(half @ cov @ half)  # ascending
        v = v[:, -k:].flip(1)  # (d, k): the largest loss-weighted variance first
        out[c] = mu.float(), (v.T @ half).float(), (inv_half @ v).float()  # (d,), (k, d), (d, k)
    return out


def _moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """(mean (d,), covariance (d, d)) of the rows of x (N, d)."""
    mu = x.mean(0)  # (d,)
    return mu, (x - mu).T @ (x - mu) / (x.shape[0] - 1)


def _enough(x: Tensor, k: int, cut: int) -> Tensor:
    if x.shape[0] < k:
        raise ValueError(f"calibration gave {x.shape[0]} hidden states at cut {cut}, fewer than k = {k}")
    return x
