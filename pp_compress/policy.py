"""The boundary policy: for a tensor crossing a stage boundary, which operator runs, with which Context, and under which
statistics key. The pipeline (`pipe.StageCompression`, under any engine) and the in-process boundary
(`boundary.CompressionBoundary`) are both thin adapters over `BoundaryPolicy`, so the two cannot drift apart.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .config import CompressionConfig
from .ops.base import FLOAT_DTYPES, Compressor, Context, TensorSpec
from .stats import DirectionStats

DIRECTIONS = ("act", "grad")
NOOP_WARN_AFTER = 8
"""Messages a boundary sends under a compressing spec, none of them compressed, before it warns that the setting does
nothing there (a few, so one odd message does not warn; few enough to warn within the first step)."""


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

    def account(self, specs: list[TensorSpec], ops: list[Compressor | None], where: Where, stats: DirectionStats,
                name: str | None = None) -> None:
        """Count one message (the tensors of one tuple and the operator each got) in `stats`, and warn once when a
        compressing spec has done nothing for NOOP_WARN_AFTER messages: every float tensor was below min_numel, or
        none was floating point. Warm-up and identity specs are intended and never warn."""
        stats.compressed += sum(op is not None for op in ops)
        if any(op is not None for op in ops) or self.op(where.boundary, where.direction, where.training) is None:
            return
        if where.training and where.step < self.cfg.warmup_steps:
            return
        floats = [s for s in specs if s.dtype in FLOAT_DTYPES]
        stats.skipped += 1
        stats.skip_reason = "below min_numel" if floats else "no floating-point tensors"
        if stats.compressed or stats.skipped != NOOP_WARN_AFTER:
            return
        spec = self.cfg.spec_for(where.boundary, where.direction, where.training)
        what = f"{name or f'boundary{where.boundary}'}.{where.direction}"
        if floats:
            big = max(floats, key=lambda s: s.numel)
            why = (f"its largest float tensor has {big.numel} elements (shape {tuple(big.shape)}), below "
                   f"min_numel={self.cfg.min_numel}. To compress it, lower min_numel to {big.numel} or less: "
                   f"'{self.cfg},min_numel=0' on the command line, or \"min_numel\": 0 in the \"pp_compress\" section "
                   "(tensors this small cost mostly latency on the wire, so compression gains little there)")
        else:
            why = "no tensor it sends is floating point, and only floating-point tensors are compressed"
        warnings.warn(f"pp_compress {what}: {stats.skipped} messages sent with {spec} and none was compressed: {why}",
                      RuntimeWarning, stacklevel=2)

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
