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
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Basis = tuple[Tensor, Tensor]
"""(mu (d,), U (d, k) with orthonormal columns) of one boundary."""
Init = Literal["pca", "random", "identity"]
INITS: tuple[str, ...] = ("pca", "random", "identity")


class Encoder(nn.Module):
    """h (B, T, d) [or (T, B, d) with seq_dim 0] -> (code, sink (B, s, d)); the code is (B, T, k), or with `group` g
    (B, T / g, g k): g tokens' codes in one row, so that a codec with a fixed cost per row (a scale, vq's pivot) pays
    it over g k values instead of k."""

    def __init__(self, d: int, k: int, sink: int, seq_dim: int, basis: Basis, trainable: bool, group: int = 1) -> None:
        super().__init__()
        self.sink, self.seq_dim, self.group = sink, seq_dim, group
        mu, u = _check(basis, d, k)
        # parameters set from the basis, not drawn: the model's other weights see the same random numbers as without
        self.weight = nn.Parameter(u.T.contiguous(), requires_grad=trainable)  # (k, d)
        self.bias = nn.Parameter(-(u.T @ mu), requires_grad=trainable)  # (k,)

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
        mu, u = _check(basis, d, k)
        self.weight = nn.Parameter(u.clone(), requires_grad=trainable)  # (d, k)
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
    mu, u = basis
    if tuple(mu.shape) != (d,) or tuple(u.shape) != (d, k):
        raise ValueError(f"bottleneck basis of shapes {tuple(mu.shape)}, {tuple(u.shape)}; expected ({d},), ({d}, {k})")
    return mu.float().contiguous(), u.float().contiguous()  # (a QR gives column-major Q; parameters must be dense)


def fixed_basis(d: int, k: int, how: Init, seed: int) -> Basis:
    """A basis that needs no data: `identity` (U = the first k columns of I, mu = 0: with k = d the identity map) or
    `random` (the Q of a seeded Gaussian's QR, mu = 0)."""
    if how == "identity":
        return torch.zeros(d), torch.eye(d)[:, :k]
    if how == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.zeros(d), torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64)).Q.float()
    raise ValueError(f"bottleneck init {how!r} needs data (calibrate); accepted here: identity, random")


@torch.no_grad()
def calibrate(layers: list[nn.Module], cuts: Iterable[int], k: int, sink: int, batches: Iterable[Tensor],
              seq_dim: int = 1) -> dict[int, Basis]:
    """The principal subspace of the hidden state after each cut: `layers` are a model's layers without a bottleneck
    (embedding first, then the blocks), `cuts` block indices, `batches` token ids (B, T). Returns cut -> (mu, U) from
    the hidden states of every token but the first `sink` of each sequence, in float64."""
    cuts = sorted(cuts)
    stats: dict[int, list[Tensor]] = {c: [] for c in cuts}
    for ids in batches:
        x = layers[0](ids)
        for i, layer in enumerate(layers[1:cuts[-1] + 2]):  # blocks 0 .. the last cut
            x = layer(x)
            if i in stats:
                h = x[0] if isinstance(x, tuple) else x  # (B, T, d)
                h = h.narrow(seq_dim, sink, h.shape[seq_dim] - sink)
                stats[i].append(h.reshape(-1, h.shape[-1]).double())  # (B (T - s), d)
    out: dict[int, Basis] = {}
    for c, rows in stats.items():
        x = torch.cat(rows)  # (N, d)
        if x.shape[0] < k:
            raise ValueError(f"calibration gave {x.shape[0]} hidden states at cut {c}, fewer than k = {k}")
        mu = x.mean(0)  # (d,)
        cov = (x - mu).T @ (x - mu) / (x.shape[0] - 1)  # (d, d)
        _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
        out[c] = mu.float(), vecs[:, -k:].flip(1).float().contiguous()  # (d,), (d, k): largest variance first
    return out
