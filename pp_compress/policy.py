"""The boundary policy: for a tensor crossing a stage boundary, which operator runs, with which Context, and under which
statistics key. The pipeline (`pipe.StageCompression`, under any engine) and the in-process boundary
(`boundary.CompressionBoundary`) are both thin adapters over `BoundaryPolicy`, so the two cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .config import CompressionConfig
from .ops.base import FLOAT_DTYPES, Compressor, Context, TensorSpec

DIRECTIONS = ("act", "grad")


@dataclass(frozen=True)
class Where:
    """Where a tuple of tensors crosses: what both sides of a boundary know without talking."""

    boundary: int
    """Boundary b lies between stage b and stage b + 1."""
    direction: str
    """"act" (activations, forward) or "grad" (activation-gradients, backward)."""
    step: int = 0
    """Optimizer step."""
    micro_batch: int = 0
    """Micro-batch slot within the step."""
    training: bool = True
    """False for inference (eval_batch, model.eval())."""

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction={self.direction!r}; accepted: {', '.join(DIRECTIONS)}")

    @property
    def stats_key(self) -> str:
        """"b<boundary>.<act|grad>" while training, "b<boundary>.act_eval" at inference."""
        return f"b{self.boundary}.{self.direction}" + ("" if self.training else "_eval")


class BoundaryPolicy:
    """Builds each boundary's operators once (an inference spec equal to the training one shares its operator) and
    decides per tensor: floating point, at least min_numel elements, past the warm-up (`CompressionConfig.compresses`)."""

    def __init__(self, cfg: CompressionConfig) -> None:
        self.cfg = cfg
        self._ops: dict[tuple[int, str, bool], Compressor | None] = {}

    def op(self, boundary: int, direction: str, training: bool) -> Compressor | None:
        """The operator of one boundary and direction (None for identity), built on first use."""
        key = (boundary, direction, training)
        if key not in self._ops:
            spec = self.cfg.spec_for(boundary, direction, training)
            same = not training and spec == self.cfg.spec_for(boundary, direction)
            self._ops[key] = self.op(boundary, direction, True) if same else (
                None if spec.is_identity else spec.build(self.cfg.nonfinite))
        return self._ops[key]

    def built(self, boundary: int, direction: str, training: bool = True) -> Compressor | None:
        """The operator if it was built already (it has state or stashed tensors only then), else None."""
        return self._ops.get((boundary, direction, training))

    def plan(self, spec: TensorSpec, where: Where) -> Compressor | None:
        """The operator that compresses a tensor of this shape and dtype here, or None: it travels as it is."""
        if spec.dtype not in FLOAT_DTYPES or not self.cfg.compresses(spec.numel, spec.dtype, where.step, where.training):
            return None
        return self.op(where.boundary, where.direction, where.training)

    def context(self, where: Where, tensor: int = 0, sample_ids: Tensor | None = None, batch_dim: int | None = None,
                name: str | None = None) -> Context:
        """The operator's Context for tensor `tensor` of the tuple; `name` (default "boundary<b>") prefixes messages."""
        return Context(name=f"{name or f'boundary{where.boundary}'}.{where.direction}", boundary=where.boundary,
                       direction=where.direction, step=where.step, micro_batch=where.micro_batch, tensor=tensor,
                       seed=self.cfg.seed, sample_ids=sample_ids, training=where.training,
                       batch_dim=self.cfg.batch_dim if batch_dim is None else batch_dim)

    def state_dict(self) -> dict[str, Any]:
        """The training operators' state (error feedback, importance vectors, warm starts) and the config it belongs to."""
        return {"config": str(self.cfg),
                "ops": {f"{b}.{d}": op.state_dict() for (b, d, tr), op in self._ops.items() if op is not None and tr}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != str(self.cfg):
            raise ValueError(f"this state was saved with config {state['config']!r}; this run's pp_compress config is "
                             f"{str(self.cfg)!r}")
        for key, sub in state["ops"].items():
            b, d = key.split(".")
            op = self.op(int(b), d, True)
            if op is not None:
                op.load_state_dict(sub)
