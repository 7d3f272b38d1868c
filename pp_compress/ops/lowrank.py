"""lowrank:<rank>: per-sample rank-r factorization M ~ P @ Q.T of (seq, hidden) activations.

Inputs are viewed as (batch, rows, cols): (B, S, H) stays, (S, H) is one sample, more dims are folded
into rows. Two methods:
  power  PowerSGD: one power iteration P = orth(M Q0), Q = M.T P, warm-started from the previous Q of
         the same state key (sender-side state; both factors travel, so the receiver needs none).
  svd    randomized SVD (Halko et al.): `iters` power iterations on a Gaussian sketch of r + 4
         columns, then an exact SVD of the small projected matrix, truncated to r.
Both methods work on M / max|M| (so products of values near the dtype's max cannot overflow fp32) and send each
rank-one term with its magnitude split evenly between the factors, sqrt(sigma_i * max|M|) on each, so neither
factor leaves the input dtype's range where the product does not.
Wire: P (B, rows, r) and Q (B, cols, r) in the input dtype (compose `>int8` to quantize them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec

LOWRANK_METHODS = ("power", "svd")
_OVERSAMPLE = 4


@dataclass(frozen=True)
class LowRankConfig(OpConfig):
    """Low-rank factorization, e.g. `lowrank:8`, `lowrank:16:method=svd:iters=2`."""

    NAME: ClassVar[str] = "lowrank"
    POSITIONAL: ClassVar[str | None] = "rank"
    FORMS: ClassVar[str] = "lowrank:<rank>[:method=power|svd][:iters=N]"
    POSITIONAL_REQUIRED: ClassVar[bool] = True
    EXAMPLES: ClassVar[tuple[str, ...]] = ("lowrank:4", "lowrank:4:method=svd:iters=2")

    rank: int = 8
    """Rank r of the factorization (capped at min(rows, cols))."""
    method: str = "power"
    """power (PowerSGD, warm-started) or svd (randomized SVD)."""
    iters: int = 1
    """Power iterations of the randomized SVD (the power method always does one per call)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lowrank rank={self.rank!r}; accepted: an integer >= 1, e.g. lowrank:8")
        if self.method not in LOWRANK_METHODS:
            raise ValueError(f"lowrank method={self.method!r}; accepted: {', '.join(LOWRANK_METHODS)}")
        if self.iters < 0:
            raise ValueError(f"lowrank iters={self.iters}; accepted: an integer >= 0")

    def build(self) -> "LowRank":
        return LowRank(self)


def matrix_dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, rows, cols) the input is viewed as."""
    dims = list(shape) or [1]
    if len(dims) == 1:
        return 1, 1, dims[0]
    batch = dims[0] if len(dims) >= 3 else 1
    rows = 1
    for d in dims[(1 if len(dims) >= 3 else 0) : -1]:
        rows *= d
    return batch, rows, dims[-1]


class LowRank(Compressor):
    config: LowRankConfig

    def batch_grouped(self) -> bool:
        return True  # one matrix per sample

    def __init__(self, config: LowRankConfig, nonfinite: str = "raise") -> None:
        super().__init__(config, nonfinite)
        self.warm: dict[str, Tensor] = {}  # state key -> previous Q (B, cols, r), fp32

    def _rank(self, rows: int, cols: int) -> int:
        return min(self.config.rank, rows, cols)

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        b, rows, cols = matrix_dims(tuple(shape))
        r = self._rank(rows, cols)
        return [TensorSpec((b, rows, r), dtype), TensorSpec((b, cols, r), dtype)]

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        b, rows, cols = matrix_dims(tuple(x.shape))
        r = self._rank(rows, cols)
        m = x.reshape(b, rows, cols).float()  # (B, rows, cols)
        top = m.abs().amax()  # scalar
        m = m / torch.where(top > 0, top, torch.ones_like(top))
        gen = ctx.generator(x.device, "lowrank")
        if self.config.method == "power":
            q0 = self.warm.get(ctx.key)
            if q0 is None or q0.shape != (b, cols, r) or q0.device != x.device:
                q0 = torch.randn(b, cols, r, generator=gen, device=x.device)  # (B, cols, r)
            u = torch.linalg.qr(m @ q0).Q  # (B, rows, r), orthonormal columns
            q = m.transpose(1, 2) @ u  # (B, cols, r)
            if ctx.training:
                self.warm[ctx.key] = q
            sigma = q.norm(dim=1)  # (B, r)
            v = q / torch.where(sigma > 0, sigma, torch.ones_like(sigma))[:, None, :]  # (B, cols, r)
        else:
            sketch = torch.randn(b, cols, min(r + _OVERSAMPLE, cols), generator=gen, device=x.device)
            y = torch.linalg.qr(m @ sketch).Q  # (B, rows, r + p)
            for _ in range(self.config.iters):
                y = torch.linalg.qr(m @ torch.linalg.qr(m.transpose(1, 2) @ y).Q).Q
            # (B, r+p, r+p), (B, r+p), (B, r+p, cols)
            u, s, vh = torch.linalg.svd(y.transpose(1, 2) @ m, full_matrices=False)
            u = y @ u[:, :, :r]  # (B, rows, r)
            sigma = s[:, :r]  # (B, r)
            v = vh[:, :r, :].transpose(1, 2)  # (B, cols, r)
        w = (sigma.sqrt() * top.sqrt())[:, None, :]  # (B, 1, r): sqrt(sigma_i * max|M|), never above fp32's range
        return Payload(((u * w).to(x.dtype), (v * w).to(x.dtype)), x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        p, q = payload.tensors
        return (p.float() @ q.float().transpose(1, 2)).reshape(payload.shape).to(payload.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"warm": dict(self.warm)} if self.warm else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warm = dict(state.get("warm", {}))
