"""mdtopk:<ratio>: keep the feature channels that an importance vector w, learned by mirror descent, ranks highest.

After Khafizov & Beznosikov, "Adaptive compression in distributed optimization". There w lives on the simplex, weights
the coordinates of a compressed step, and follows mirror descent on the loss after that step,
w = argmin_{w in simplex} f(x - eta * (w * grad f(x))). Its gradient in w_i is -eta * grad_i f(x+) * grad_i f(x):
coordinates whose product of value and returning gradient is large gain weight.

At a pipeline boundary the coordinates are the d feature channels (the last dim) of the activation x (rows, d), and
the stage that sends x later receives the gradient g of the loss at what the next stage decoded. Dropping channel c
changes the loss, to first order, by -sum_t x_tc g_tc, which is at most s_c = sum_t |x_tc g_tc| in size (the
saliency, over the micro-batch's rows t). If channel c is kept with probability k * w_c (the stochastic reading of
"keep k channels weighted by w"), the expected first-order loss of the compression is bounded by
    phi(w) = sum_c s_c (1 - k w_c),
linear in w with gradient -k s. Entropic mirror descent on the simplex with a KL pull towards uniform (strength
decay / lr, so that channels whose saliency fades lose weight again) gives the exponentiated-gradient update
    log w <- (1 - decay) * log w + lr * s / mean(s),    then normalise (log-sum-exp),
with s divided by its mean so that lr does not depend on the scale of activations and gradients. For a saliency that
stays put, w settles at softmax(lr / decay * s / mean(s)): the defaults (lr = decay = 0.1) weight channel c by
exp(s_c / mean(s)) and forget over ~10 micro-batches.

The sender holds both x (it sent it) and the decoded gradient (it received it), so it computes the saliency of every
channel, kept or not; the receiver never needs w, because the chosen positions travel (as for TopK). w is the
operator's state, one vector per boundary, direction and tensor of the tuple (`ctx.sample_key`: shared by the
micro-batch slots), in `state_dict` and hence in checkpoints. Between `encode` and `observe` the operator keeps a
reference to the tensor it compressed (per micro-batch slot, so at most one each), which the pipeline holds for the
backward pass anyway.

Modes (k = round(ratio * d) channels, at least 1):
  greedy           the k channels of largest w, the same for every row. Wire: values (rows, k) + k channel indices.
  greedy_weighted  greedy, with kept values scaled by w_c / mean of w over the kept channels (mean gain 1): the
                   receiver gets the importance-reweighted values. Same wire.
  weighted_greedy  per row, the k positions of largest w_c |x_tc| (TopK per row on importance-weighted magnitudes).
                   Wire: TopK's (values, indices or bitmap per row).
  stochastic       k distinct channels drawn with inclusion probabilities k * w_c (capped at 1, the rest rescaled; w
                   mixed with 1e-3 of uniform so every channel can be drawn) by systematic sampling from the context's
                   generator. Same wire as greedy; kept values are not rescaled (biased, like randk without unbiased).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec
from .sparse import check_sparse, from_wire_index, index_dtype, keep_count, to_wire_index
from .topk import INDEX_MODES, TopK, TopKConfig

MODES = ("greedy", "weighted_greedy", "greedy_weighted", "stochastic")
_UNIFORM_MIX = 1e-3


@dataclass(frozen=True)
class MDTopKConfig(OpConfig):
    """Importance-weighted channel selection, e.g. `mdtopk:0.2`, `mdtopk:0.1:mode=stochastic`."""

    NAME: ClassVar[str] = "mdtopk"
    POSITIONAL: ClassVar[str | None] = "ratio"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    LEARNS_FROM_GRAD: ClassVar[bool] = True
    FORMS: ClassVar[str] = (f"mdtopk:<ratio in (0,1]>[:mode={'|'.join(MODES)}][:lr=F][:decay=F]"
                            f"[:index={'|'.join(INDEX_MODES)}]")
    EXAMPLES: ClassVar[tuple[str, ...]] = ("mdtopk:0.1", "mdtopk:0.2:mode=weighted_greedy",
                                           "mdtopk:0.3:mode=greedy_weighted", "mdtopk:0.25:mode=stochastic",
                                           "mdtopk:0.5:mode=weighted_greedy:index=bitmap")

    ratio: float = 0.1
    """Fraction of the channels (greedy, greedy_weighted, stochastic) or of each row (weighted_greedy) that is kept."""
    mode: str = "greedy"
    """How w chooses: greedy, greedy_weighted, weighted_greedy or stochastic (see the module docstring)."""
    lr: float = 0.1
    """Mirror-descent step on the mean-normalised saliency (> 0)."""
    decay: float = 0.1
    """Pull of log w towards uniform per update, in [0, 1): w forgets old saliency over ~1/decay micro-batches."""
    index: str = "auto"
    """weighted_greedy only: position encoding as for topk (index, bitmap or auto)."""

    def __post_init__(self) -> None:
        check_sparse("mdtopk", self.ratio, "row")
        if self.mode not in MODES:
            raise ValueError(f"mdtopk mode={self.mode!r}; accepted: {', '.join(MODES)}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"mdtopk lr={self.lr!r}; accepted: a number > 0")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 <= self.decay < 1:
            raise ValueError(f"mdtopk decay={self.decay!r}; accepted: a number in [0, 1)")
        if self.index not in INDEX_MODES:
            raise ValueError(f"mdtopk index={self.index!r}; accepted: {', '.join(INDEX_MODES)}")
        if self.index != "auto" and self.mode != "weighted_greedy":
            raise ValueError(f"mdtopk index={self.index!r} applies to mode=weighted_greedy only (the channel modes "
                             "send k channel indices per tensor)")

    def build(self) -> "MDTopK":
        return MDTopK(self)


class MDTopK(Compressor):
    config: MDTopKConfig

    def __init__(self, config: MDTopKConfig, nonfinite: str = "raise") -> None:
        super().__init__(config, nonfinite)
        self.rows_topk = TopK(TopKConfig(config.ratio, per="row", index=config.index))
        self.log_w: dict[str, Tensor] = {}
        """log w per `ctx.sample_key`, fp32 (d,), normalised (log-sum-exp 0)."""
        self.sent: dict[str, Tensor] = {}
        """What `encode` compressed, per `ctx.key`, until `observe` gets its gradient."""

    # --- wire ----------------------------------------------------------------------------------
    @staticmethod
    def _dims(shape: tuple[int, ...]) -> tuple[int, int]:
        d = shape[-1] if shape else 1
        numel = TensorSpec(tuple(shape), torch.float32).numel
        return (numel // d if d else 0), d

    def _channel_layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> Layout:
        rows, d = self._dims(shape)
        k = keep_count(self.config.ratio, d)
        return [TensorSpec((rows, k), dtype), TensorSpec((k,), index_dtype(d))]

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        if self.config.mode == "weighted_greedy":
            return self.rows_topk.wire_layout(shape, dtype, ctx)
        return self._channel_layout(tuple(shape), dtype)

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        rows, d = self._dims(tuple(x.shape))
        w = self.weights(ctx, d, x.device)  # (d,)
        if ctx.training:
            self.sent[ctx.key] = x
        k = keep_count(self.config.ratio, d)
        g = x.reshape(rows, d)  # (rows, d)
        mode = self.config.mode
        if mode == "weighted_greedy":
            index = torch.topk(g.abs().float() * w, k, dim=1, sorted=False).indices  # (rows, k)
            return self.rows_topk.encode_at(x, index)
        if mode == "stochastic":
            chan = _systematic(_inclusion((1 - _UNIFORM_MIX) * w + _UNIFORM_MIX / d, k),
                               torch.rand((), generator=ctx.generator(x.device, "mdtopk"), device=x.device), k)  # (k,)
        else:
            chan = torch.topk(w, k).indices.sort().values  # (k,)
        values = g.index_select(1, chan)  # (rows, k)
        if mode == "greedy_weighted":
            kept = w[chan]  # (k,)
            values = (values.float() * (kept / kept.mean())).to(x.dtype)
        return Payload((values.contiguous(), to_wire_index(chan, index_dtype(d))), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        if self.config.mode == "weighted_greedy":
            return self.rows_topk._decode(payload, ctx)
        values, chan = payload.tensors  # (rows, k), (k,)
        rows, d = self._dims(tuple(payload.shape))
        chan = from_wire_index(chan)
        out = values.new_zeros((rows, d)).index_copy_(1, chan, values)  # (rows, d)
        return out.view(payload.shape).to(payload.dtype)

    # --- the importance vector -----------------------------------------------------------------
    def weights(self, ctx: Context, d: int, device: torch.device) -> Tensor:
        """w (d,) fp32 on the simplex for this boundary, direction and tensor: uniform until the first gradient."""
        log_w = self.log_w.get(ctx.sample_key)
        if log_w is None or log_w.numel() != d:
            if log_w is not None:
                warnings.warn(f"{ctx.name}: mdtopk importance vector {ctx.sample_key} had {log_w.numel()} channels, "
                              f"the input has {d}; restarting it from uniform", stacklevel=3)
            return torch.full((d,), 1.0 / d, device=device)
        return log_w.to(device).exp()

    def observe(self, grad: Tensor, ctx: Context) -> None:
        """One mirror-descent step on log w from the saliency sum_t |x_tc g_tc| of what was sent under ctx."""
        x = self.sent.pop(ctx.key, None)
        if x is None or not ctx.training:
            return
        if tuple(grad.shape) != tuple(x.shape):
            raise ValueError(f"{ctx.name}: mdtopk got a gradient of shape {tuple(grad.shape)} for an activation of "
                             f"shape {tuple(x.shape)} (micro-batch slot {ctx.micro_batch})")
        rows, d = self._dims(tuple(x.shape))
        s = (x.float() * grad.float()).abs().reshape(rows, d).sum(0)  # (d,)
        mean = s.mean()  # ()
        prev = self.log_w.get(ctx.sample_key)
        log_w = torch.log(self.weights(ctx, d, x.device)) if prev is None or prev.numel() != d else prev.to(x.device)
        step = (1 - self.config.decay) * log_w + self.config.lr * (s / mean.clamp_min(1e-30))  # (d,)
        step = step - torch.logsumexp(step, 0)
        # a zero gradient carries no information about the channels: w stays (picked on the device, not read back)
        self.log_w[ctx.sample_key] = torch.where(mean > 0, step, log_w)

    def state_dict(self) -> dict[str, Any]:
        return {"log_w": dict(self.log_w)} if self.log_w else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bad = sorted(set(state) - {"log_w"})
        if bad:
            raise ValueError(f"{self!r}: unknown state keys {bad}; expected log_w")
        self.log_w = dict(state.get("log_w", {}))
        self.sent = {}


def _inclusion(w: Tensor, k: int) -> Tensor:
    """Inclusion probabilities p (d,) proportional to w with sum k and none above 1: the m largest are fixed at 1 and
    the rest scaled by (k - m) / (their sum), for the smallest m at which the (m+1)-th largest stays at or below 1.

    This is where fixing whatever exceeds 1 and rescaling the rest, round after round, ends (each fixed channel raises
    the others' scale, so the rounds only ever fix channels among the m largest), computed in one pass on the device:
    a loop would read a count and a flag back to the host every round."""
    ranked = torch.sort(w.double(), descending=True).values  # (d,)
    tails = torch.flip(torch.cumsum(torch.flip(ranked, (0,)), 0), (0,))  # (d,) sum of ranked[m:]
    m = torch.arange(k, device=w.device)  # (k,) channels fixed at 1 before the candidate (k <= d)
    fits = ranked[m] * (k - m) <= tails[m]  # (k,) the (m+1)-th largest at or below 1 once the m largest are fixed
    first = torch.where(fits, m, k - 1).amin(0, keepdim=True)  # (1,) the smallest (m = k - 1 always fits)
    scale = (k - first) / tails.gather(0, first).clamp_min(1e-30)  # (1,)
    p = torch.where(w.double() > ranked.gather(0, first), 1.0, w.double() * scale)  # (d,) above the first left: 1
    return p.clamp(max=1).to(w.dtype)  # ties across the cut would need equal values on both sides: only by rounding


def _systematic(p: Tensor, u: Tensor, k: int) -> Tensor:
    """k positions by systematic sampling: position c is drawn iff an offset u + j (j = 0..k-1) falls in
    [cum_{c-1}, cum_c), so P(c drawn) = p_c exactly when sum(p) = k and every p_c <= 1; sorted, and distinct up to
    rounding at intervals of length exactly 1."""
    cum = torch.cumsum(p.double(), 0)  # (d,)
    cum = cum * (k / cum[-1])  # exact total k despite rounding
    at = torch.searchsorted(cum, u.double() + torch.arange(k, device=p.device, dtype=torch.float64), right=True)  # (k,)
    return at.clamp(max=p.numel() - 1)
