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

Or from the blended subspace (`principal_bases` with a `grad_weight`): the principal subspace keeps the hidden
state's variance but is close to blind to where the loss's gradient lies, and the layers before a cut learn only
from the gradient the bottleneck passes back (W_e^T W_d^T g). With C and G = E[g g^T] each scaled to unit trace, U =
the top-k eigenvectors of C + w G keeps most of both for a weight w > 0 (w = 0 is the principal subspace), and W_e =
U^T, W_d = U stay orthonormal, as pca's.

With `tokens` both sides also predict each token's hidden state from its token id, as Subspace Networks rebuild the
token embedding at every stage: T[id] = (E[id] - mean) A with E the input embedding and A the least-squares map from
a token's embedding to its hidden state on the calibration data (a frozen table, V x d). The code then carries only
h - T[id], whose principal subspace holds more of what is left; the token ids cross the boundary beside the code
(a few bytes a token against the d values of the hidden state). A model trained from scratch has no hidden states to
fit T to: `random_tokens` gives it a seeded random table instead, which the blocks after each cut learn to read.

With a `residual` width r, in the manner of ResBM, each map stays fixed at its initialisation (an explicit low-rank
identity path) and a trained branch beside it adds what a linear map cannot: code = W_e h + b_e + B_e(h) and h = W_d
code + b_d + B_d(code), with B(x) = W_2 gelu(W_1 rmsnorm(x)) (width r). W_2 starts at zero, so the bottleneck starts
as its identity path, bitwise.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn



class Basis(NamedTuple):
    """One boundary's initial map: code = W_e (h - mu - T[ids]), h = W_d code + mu + T[ids] (T: none without tokens)."""

    mu: Tensor
    """(d,) the hidden state's mean."""
    enc: Tensor
    """(k, d) W_e."""
    dec: Tensor
    """(d, k) W_d."""
    tokens: Tensor | None = None
    """(V, d) each token's predicted hidden state less mu (`tokens`), or None."""


Init = Literal["pca", "blend", "fisher", "random", "identity"]
INITS: tuple[str, ...] = ("pca", "blend", "fisher", "random", "identity")
FROM_DATA: tuple[str, ...] = ("pca", "blend", "fisher")
"""The inits computed from a pretrained model's hidden states (`hidden_moments`, then `principal_bases` or
`fisher_bases`)."""
WITH_GRADS: tuple[str, ...] = ("blend", "fisher")
"""The inits that need the loss's gradient at each cut (moments taken with a loss)."""
TUNING: dict[str, float] = {"fisher": 1.0, "blend": 0.25}
"""The default of the one parameter that tunes each of these inits: fisher's damping, blend's gradient weight."""


class Branch(nn.Module):
    """The trained residual beside a fixed map (the module docstring): x (..., n_in) -> W_2 gelu(W_1 rmsnorm(x))
    (..., n_out) through width r. W_2 starts at zero, so the branch adds exactly nothing until it trains; W_1 is drawn
    from a generator of its own `seed`, so that the model's other weights see the same random numbers as without it."""

    def __init__(self, n_in: int, n_out: int, width: int, std: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = nn.RMSNorm(n_in)
        self.inner = nn.Parameter(torch.randn(width, n_in, generator=g) * std)  # (r, n_in)
        self.outer = nn.Parameter(torch.zeros(n_out, width))  # (n_out, r)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.gelu(F.linear(self.norm(x), self.inner)), self.outer)  # (..., n_out)


class _Coder(nn.Module):
    """What the encoder and the decoder share: a linear map (weight (out, in), bias (out,)) and the basis's frozen
    token table (V, d) or None, all set from a basis (`set_basis`), not drawn, so that the model's other weights see
    the same random numbers as without a bottleneck; the table is in the checkpoint. With a `branch` (ResBM's
    design) the map stays fixed, the low-rank identity path, and only the branch trains."""

    def __init__(self, weight: tuple[int, int], basis: Basis, trainable: bool, branch: Branch | None = None) -> None:
        super().__init__()
        if branch is not None and not trainable:
            raise ValueError("a bottleneck with a residual branch and trainable=False would train nothing; accepted: "
                             "trainable=True with a branch (its maps then stay fixed), or no branch")
        fixed = branch is not None or not trainable
        self.weight = nn.Parameter(torch.empty(weight), requires_grad=not fixed)  # (out, in)
        self.bias = nn.Parameter(torch.empty(weight[0]), requires_grad=not fixed)  # (out,)
        self.register_buffer("tokens", None if basis.tokens is None else torch.empty(basis.tokens.shape))  # (V, d)
        self.branch = branch
        self.set_basis(basis)

    def map(self, x: Tensor) -> Tensor:
        """W x + b, plus the branch's output where there is one: (..., in) -> (..., out)."""
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        return y if self.branch is None else y + self.branch(x)

    def set_basis(self, basis: Basis) -> None:
        """Weight, bias and token table from `basis`, in place: the encoder's map or the decoder's."""
        raise NotImplementedError


class Encoder(_Coder):
    """h (B, T, d) [or (T, B, d) with seq_dim 0] [, token ids (B, T)] -> (code, sink (B, s, d)); the code is (B, T, k),
    or with `group` g (B, T / g, g k): g tokens' codes in one row, so that a codec with a fixed cost per row (a scale,
    vq's pivot) pays it over g k values instead of k. With the basis's token table the code is of h - T[ids]."""

    def __init__(self, d: int, k: int, sink: int, seq_dim: int, basis: Basis, trainable: bool, group: int = 1,
                 branch: Branch | None = None) -> None:
        super().__init__((k, d), basis, trainable, branch)
        self.sink, self.seq_dim, self.group = sink, seq_dim, group

    def set_basis(self, basis: Basis) -> None:
        """W_e, b_e = -W_e mu and the token table from `basis` (in place)."""
        mu, enc, _, _ = _set_table(self, basis, self.weight.shape[1], self.weight.shape[0])
        with torch.no_grad():
            self.weight.copy_(enc)
            self.bias.copy_(-(enc @ mu))

    def forward(self, h: Tensor, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        t, dim = h.shape[self.seq_dim], self.seq_dim
        sink = h.narrow(dim, 0, self.sink).contiguous()  # (B, s, d)
        rest = h.narrow(dim, self.sink, t - self.sink)  # (B, T - s, d)
        if self.tokens is not None:
            rest = rest - _predicted(self.tokens, ids, rest, self.sink, dim)
        code = self.map(rest)  # (B, T - s, k)
        # the sink tokens' places stay in the code, as zeros: rows keep whole groups of tokens, and the sink's own
        # code (its channels are ~100x the others') would otherwise set the scale of every row it shares
        zeros = code.new_zeros(code.shape[:dim] + (self.sink,) + code.shape[dim + 1:])  # (B, s, k)
        return _rows(torch.cat([zeros, code], dim=dim), self.group), sink


class Decoder(_Coder):
    """(code, sink (B, s, d) [, token ids (B, T)]) -> h (B, T, d): the decoded code (plus T[ids] with the basis's
    token table), with the first s tokens replaced by the sink."""

    def __init__(self, d: int, k: int, seq_dim: int, basis: Basis, trainable: bool, group: int = 1,
                 branch: Branch | None = None) -> None:
        super().__init__((d, k), basis, trainable, branch)
        self.seq_dim, self.k, self.group = seq_dim, k, group

    def set_basis(self, basis: Basis) -> None:
        """W_d, b_d = mu and the token table from `basis` (in place)."""
        mu, _, dec, _ = _set_table(self, basis, self.weight.shape[0], self.weight.shape[1])
        with torch.no_grad():
            self.weight.copy_(dec)
            self.bias.copy_(mu)

    def forward(self, code: Tensor, sink: Tensor, ids: Tensor | None = None) -> Tensor:
        if self.group > 1:
            code = code.reshape(code.shape[0], -1, self.k)  # (B, T, k)
        h = self.map(code)  # (B, T, d)
        s, dim = sink.shape[self.seq_dim], self.seq_dim
        h = h.narrow(dim, s, h.shape[dim] - s)  # (B, T - s, d)
        if self.tokens is not None:
            h = h + _predicted(self.tokens, ids, h, s, dim)
        return torch.cat([sink, h], dim=dim)  # (B, T, d)


def _predicted(tokens: Tensor, ids: Tensor | None, like: Tensor, sink: int, seq_dim: int) -> Tensor:
    """T[ids] for the tokens after the first `sink`, (B, T - s, d) in `like`'s dtype."""
    if ids is None:
        raise ValueError("a bottleneck with a token table needs the token ids beside the hidden state (the model's "
                         "embedding sends them with bottleneck_tokens)")
    ids = ids.narrow(seq_dim, sink, ids.shape[seq_dim] - sink)
    return F.embedding(ids.long(), tokens).to(like.dtype)  # (B, T - s, d)


def _rows(code: Tensor, group: int) -> Tensor:
    """(B, T, k) -> (B, T / group, group k)."""
    if group == 1:
        return code
    b, t, k = code.shape
    if t % group:
        raise ValueError(f"bottleneck_group={group} needs a sequence length that it divides; got {t}")
    return code.reshape(b, t // group, group * k)


def _set_table(coder: Encoder | Decoder, basis: Basis, d: int, k: int) -> Basis:
    """`basis` checked against (d, k) and as dense fp32, its token table copied into the coder's (which has one
    exactly when the basis does)."""
    basis = _check(basis, d, k)
    if (basis.tokens is None) != (coder.tokens is None):
        raise ValueError(f"a basis {'with' if basis.tokens is not None else 'without'} a token table for a bottleneck "
                         f"{'without' if coder.tokens is None else 'with'} one")
    if basis.tokens is not None:
        with torch.no_grad():
            coder.tokens.copy_(basis.tokens)
    return basis


def _check(basis: Basis, d: int, k: int) -> Basis:
    mu, enc, dec, tokens = basis
    if tuple(mu.shape) != (d,) or tuple(enc.shape) != (k, d) or tuple(dec.shape) != (d, k):
        raise ValueError(f"bottleneck basis of shapes {tuple(mu.shape)}, {tuple(enc.shape)}, {tuple(dec.shape)}; "
                         f"expected ({d},), ({k}, {d}), ({d}, {k})")
    if tokens is not None and (tokens.dim() != 2 or tokens.shape[1] != d):
        raise ValueError(f"bottleneck token table of shape {tuple(tokens.shape)}; expected (vocab_size, {d})")
    # dense fp32 (a QR gives a column-major Q, a transpose is a view; parameters must be dense)
    dense = [t.float().contiguous() for t in (mu, enc, dec)]
    return Basis(*dense, None if tokens is None else tokens.float().contiguous())


def orthonormal(mu: Tensor, u: Tensor, tokens: Tensor | None = None) -> Basis:
    """The basis of the orthogonal projection onto U's columns (orthonormal, (d, k)): W_e = U^T, W_d = U."""
    return Basis(mu, u.T, u, tokens)


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


def random_tokens(vocab: int, d: int, std: float, seed: int) -> Tensor:
    """(V, d) a token table for a model trained from scratch, which has no hidden states to fit one to: a seeded
    Gaussian at the embedding's init scale, the same at every cut, as Subspace Networks re-add a fixed random
    embedding at every stage. The blocks after a cut learn to read each token's identity from it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, d, generator=g) * std  # (V, d)


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


def token_rows(h: Tensor, sink: int, seq_dim: int) -> Tensor:
    """The rows of every token but the first `sink` of each sequence, (B (T - s), ...) float64."""
    h = h.narrow(seq_dim, sink, h.shape[seq_dim] - sink)
    return h.reshape(-1, *h.shape[2:]).double()


class Moments:
    """Running sums over the calibration tokens of one cut, in float64: of the hidden states x (N, d), with their token
    embeddings e (N, d) beside them when `tokens`, and of the loss gradient's outer products g g^T when `grads`. A
    fixed memory however much text; one pass serves every k with or without a token table; and sums from processes
    that each took a share of the text add up (`reduce`)."""

    def __init__(self, d: int, tokens: bool = False, grads: bool = False) -> None:
        w = 2 * d if tokens else d
        self.d, self.n = d, torch.zeros((), dtype=torch.float64)
        self.sum, self.outer = torch.zeros(w, dtype=torch.float64), torch.zeros(w, w, dtype=torch.float64)
        self.grad = torch.zeros(d, d, dtype=torch.float64) if grads else None

    def add(self, x: Tensor, e: Tensor | None = None, g: Tensor | None = None) -> None:
        z = x if e is None else torch.cat([x, e], 1)  # (N, d) or (N, 2d)
        if z.shape[1] != self.sum.shape[0] or (g is None) != (self.grad is None):
            raise ValueError(f"rows of width {z.shape[1]} (gradients: {g is not None}) for moments of width "
                             f"{self.sum.shape[0]} (gradients: {self.grad is not None})")
        self.n, self.sum, self.outer = self.n + z.shape[0], self.sum + z.sum(0), self.outer + z.T @ z
        if g is not None:
            self.grad = self.grad + g.T @ g  # (d, d)

    def reduce(self, all_reduce: Callable[[Tensor], Any]) -> None:
        """Sum these moments over processes in place: `all_reduce` sums a float64 tensor across them in place
        (torch.distributed.all_reduce)."""
        grad = [] if self.grad is None else [self.grad.flatten()]
        packed = torch.cat([self.n.reshape(1), self.sum, self.outer.flatten(), *grad])
        all_reduce(packed)
        n, w = 1, self.sum.shape[0]
        self.n, self.sum = packed[0].clone(), packed[n:n + w].clone()
        self.outer = packed[n + w:n + w + w * w].reshape(w, w).clone()
        if self.grad is not None:
            self.grad = packed[n + w + w * w:].reshape(self.d, self.d).clone()

    def fit(self, k: int, cut: int, embedding: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(mean of h (d,), covariance (d, d) of what the code carries, the token table (V, d) or None): without an
        embedding, h's own covariance; with it, that of h less its least-squares prediction from e (the ridge keeps
        the solve well posed for embeddings no calibration token used)."""
        n, d = float(self.n), self.d
        if n < max(k, 2):
            raise ValueError(f"calibration gave {n:.0f} hidden states at cut {cut}, fewer than k = {k}")
        mu = self.sum / n  # (d,) or (2d,)
        cov = (self.outer - n * torch.outer(mu, mu)) / (n - 1)
        if embedding is None:
            return mu[:d], cov[:d, :d], None
        if cov.shape[0] != 2 * d:
            raise ValueError("a token table needs moments taken with tokens=True")
        c_hh, c_he, c_ee = cov[:d, :d], cov[:d, d:], cov[d:, d:]
        ridge = 1e-3 * c_ee.diagonal().mean() * torch.eye(d, dtype=cov.dtype)
        a = torch.linalg.solve(c_ee + ridge, c_he.T)  # (d_e, d): h - mu ~ (e - mean) A
        resid = c_hh - c_he @ a - a.T @ c_he.T + a.T @ c_ee @ a  # (d, d): the covariance of h - T[ids]
        return mu[:d], resid, ((embedding.double() - mu[d:]) @ a).float()  # (d,), (d, d), (V, d)


def embedding_of(layers: list[nn.Module]) -> Tensor:
    """The input embedding (V, d) of a model's layers (embedding first): what a token table is fitted from."""
    return layers[0].weight.detach()


def hidden_moments(layers: list[nn.Module], cuts: Iterable[int], sink: int, batches: Iterable[Any],
                   seq_dim: int = 1, tokens: bool = False,
                   loss: Callable[[Any, Tensor], Tensor] | None = None) -> dict[int, Moments]:
    """cut -> the moments of the hidden states after it (every token but the first `sink` of each sequence), with
    their token embeddings beside them when `tokens`: `layers` are a model's layers without a bottleneck (embedding
    first, then the blocks, then the head), `cuts` block indices, `batches` token ids (B, T). With `loss(output,
    labels)` (a batch's mean loss) the batches are (token ids, labels), and the moments take the second moment of the
    loss's gradient at each cut too (per token: the gradient of the sum); the model's own parameters get none."""
    cuts, emb = sorted(cuts), embedding_of(layers) if tokens else None
    stats = {c: Moments(embedding_of(layers).shape[1], tokens, loss is not None) for c in cuts}
    frozen = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for batch in batches:
            ids, labels = batch if loss is not None else (batch, None)
            with torch.set_grad_enabled(loss is not None):
                out, at = _hiddens(layers, cuts, ids, keep_grad=loss is not None)
                if loss is not None:
                    (loss(out, labels) * labels.numel()).backward()  # per-token gradients: the sum's
            e = None if emb is None else token_rows(F.embedding(ids, emb), sink, 1)  # (N, d)
            for c, h in at.items():
                g = None if loss is None else token_rows(h.grad, sink, seq_dim)  # (N, d)
                stats[c].add(token_rows(h.detach(), sink, seq_dim), e, g)
    finally:
        for p, was in frozen:
            p.requires_grad_(was)
    return stats


def principal_bases(stats: dict[int, Moments], k: int, embedding: Tensor | None = None,
                    grad_weight: float = 0.0) -> dict[int, Basis]:
    """cut -> the principal subspace of its moments, of h less each token's prediction with an `embedding` (V, d);
    with `grad_weight` w > 0 the blended one (the module docstring: moments taken with a loss)."""
    if not grad_weight >= 0:
        raise ValueError(f"blend grad_weight {grad_weight!r}; accepted: a number >= 0 (0: the principal subspace)")
    out: dict[int, Basis] = {}
    for c, m in stats.items():
        mu, cov, table = m.fit(k, c, embedding)  # (d,), (d, d), (V, d) or None
        if grad_weight > 0:
            if m.grad is None:
                raise ValueError("the blend init needs moments taken with a loss (their gradients)")
            cov = cov / torch.trace(cov) + grad_weight * m.grad / torch.trace(m.grad)  # (d, d), both of unit trace
        _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
        out[c] = orthonormal(mu.float(), vecs[:, -k:].flip(1).float(), table)  # (d, k): largest variance first
    return out


def fisher_bases(stats: dict[int, Moments], k: int, damping: float = 1.0,
                 embedding: Tensor | None = None) -> dict[int, Basis]:
    """cut -> the loss-weighted subspace of its moments (taken with a loss; the module docstring). F is damped by
    `damping` times its mean eigenvalue (F + damping tr(F)/d I: large damping gives the principal subspace)."""
    if not damping > 0:
        raise ValueError(f"fisher damping {damping!r}; accepted: a number > 0")
    out: dict[int, Basis] = {}
    for c, m in stats.items():
        if m.grad is None:
            raise ValueError("the fisher init needs moments taken with a loss (their gradients)")
        mu, cov, table = m.fit(k, c, embedding)  # (d,), (d, d), (V, d) or None
        fisher = m.grad / m.n  # (d, d)
        fisher = fisher + damping * fisher.diagonal().mean() * torch.eye(fisher.shape[0], dtype=fisher.dtype)
        vals, vecs = torch.linalg.eigh(fisher)
        half, inv_half = (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T  # F^1/2, F^-1/2 (d, d)
        _, v = torch.linalg.eigh(half @ cov @ half)  # ascending
        v = v[:, -k:].flip(1)  # (d, k): the largest loss-weighted variance first
        out[c] = Basis(mu.float(), (v.T @ half).float(), (inv_half @ v).float(), table)  # (d,), (k, d), (d, k)
    return out


def data_bases(how: str, stats: dict[int, Moments], k: int, embedding: Tensor | None = None,
               tuning: float | None = None) -> dict[int, Basis]:
    """cut -> the basis of init `how` (one of FROM_DATA) from its moments (taken with a loss where `how` is in
    WITH_GRADS); `tuning` is its parameter where it has one (None: TUNING's default)."""
    if how not in FROM_DATA:
        raise ValueError(f"init {how!r} is not computed from data; accepted: {', '.join(FROM_DATA)}")
    t = TUNING[how] if how in TUNING and tuning is None else tuning
    if how == "fisher":
        return fisher_bases(stats, k, t, embedding)
    return principal_bases(stats, k, embedding, t if how == "blend" else 0.0)


def calibrate(layers: list[nn.Module], cuts: Iterable[int], k: int, sink: int, batches: Iterable[Tensor],
              seq_dim: int = 1, tokens: bool = False) -> dict[int, Basis]:
    """The principal subspace of the hidden state after each cut (`hidden_moments`'s arguments): cut -> its basis, in
    float64; with `tokens`, of what is left after each token's predicted hidden state (the module docstring), and
    that prediction's table."""
    stats = hidden_moments(layers, cuts, sink, batches, seq_dim, tokens)
    return principal_bases(stats, k, embedding_of(layers) if tokens else None)


def calibrate_fisher(layers: list[nn.Module], cuts: Iterable[int], k: int, sink: int,
                     batches: Iterable[tuple[Tensor, Tensor]], loss: Callable[[Any, Tensor], Tensor],
                     damping: float = 1.0, seq_dim: int = 1, tokens: bool = False) -> dict[int, Basis]:
    """The loss-weighted subspace of the hidden state after each cut (the module docstring): as `calibrate`, with
    `batches` of (token ids (B, T), labels) and `loss(output, labels)` the mean loss of a batch, whose gradient at
    each cut weighs the directions (`fisher_bases`, which checks the damping)."""
    stats = hidden_moments(layers, cuts, sink, batches, seq_dim, tokens, loss)
    return fisher_bases(stats, k, damping, embedding_of(layers) if tokens else None)
