"""Compressed point-to-point traffic of one pipeline stage, independent of the engine that drives it.

`StageCompression.send(...)` compresses each floating-point tensor of what crosses a boundary into
one flat uint8 buffer and hands it to `send_fn` (one message per tensor); non-float tensors go as
they are (bool as its uint8 bytes), and first. `recv(...)` computes the same layout from the uncompressed (shape, dtype) the
receiver already knows, receives exactly that many bytes and decompresses. No extra metadata travels.

Sample ids (for `+aqsgd`) ride in the activation tuple itself: when its last tensor is a 1-D integer
tensor, it holds one id per row. It arrives before the float tensors, so both sides key their
per-sample buffers alike; for gradients the engine passes the ids it already holds.

Boundary b lies between stage b and stage b + 1: activations cross it forward, gradients backward.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import Tensor

from .config import CompressionConfig
from .ops.base import FLOAT_DTYPES, Compressor, Context, TensorSpec
from .stats import DirectionStats
from .wire import from_buffer, to_buffer

Transfer = Callable[[Tensor], Any]


class StageCompression:
    """Compressors, their state and byte counters for the boundaries one stage touches."""

    def __init__(self, cfg: CompressionConfig, stage: int, num_stages: int) -> None:
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        for b in cfg.boundaries:
            if b >= num_stages - 1:
                raise ValueError(f"pp_compress override for boundary {b}, but {num_stages} stages have boundaries 0..{num_stages - 2}")
        self._ops: dict[tuple[int, str, bool], Compressor | None] = {}
        self.stats: dict[str, DirectionStats] = {}
        self._act_floats: dict[int, list[int]] = {}
        """Per boundary this stage sends activations over: the tuple positions of its float tensors, in the order
        their gradients come back."""

    def op(self, boundary: int, direction: str, training: bool) -> Compressor | None:
        key = (boundary, direction, training)
        if key not in self._ops:
            spec = self.cfg.spec_for(boundary, direction, training)
            same = self._ops.get((boundary, direction, True)) if not training and spec == self.cfg.spec_for(boundary, direction) else None
            self._ops[key] = same or (None if spec.is_identity else spec.build(self.cfg.nonfinite))
        return self._ops[key]

    def _plan(self, spec: TensorSpec, ctx: Context) -> Compressor | None:
        if spec.dtype not in FLOAT_DTYPES or not self.cfg.compresses(spec.numel, spec.dtype, ctx.step, ctx.training):
            return None
        return self.op(ctx.boundary, ctx.direction, ctx.training)

    def _ctx(self, boundary: int, direction: str, step: int, micro_batch: int, training: bool, i: int,
             sample_ids: Tensor | None) -> Context:
        return Context(name=f"boundary{boundary}.{direction}", boundary=boundary, direction=direction, step=step,
                       micro_batch=micro_batch, tensor=i, seed=self.cfg.seed, sample_ids=sample_ids, training=training,
                       batch_dim=self.cfg.batch_dim)

    def _stats(self, boundary: int, direction: str, training: bool) -> DirectionStats:
        """Counters under "b<boundary>.<act|grad>" (training) or "b<boundary>.act_eval"; the sender counts
        calls and bytes, the receiver adds its decompression time to the same name."""
        return self.stats.setdefault(f"b{boundary}.{direction}" + ("" if training else "_eval"), DirectionStats())

    def _check_ids(self, op: Compressor, ctx: Context) -> None:
        if ctx.sample_ids is None and ctx.training and getattr(op, "tag", "") == "aqsgd":
            raise ValueError(f"{ctx.name}: +aqsgd needs sample ids on every stage: make the tensors that cross the "
                             "boundary a tuple ending with an integer tensor of shape (micro_batch,) holding "
                             "the sample ids, e.g. (hidden, sample_ids); see README 'Sample ids'")

    def send(self, tensors: list[Tensor], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, send_fn: Transfer, sample_ids: Tensor | None = None) -> None:
        """Send what crosses one boundary: integer/bool tensors first (as they are), then each float
        tensor compressed. For activations, the sample ids are found in `tensors` (see `sample_ids_of`)."""
        stats = self._stats(boundary, direction, training)
        specs = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]
        if direction == "act":
            self._act_floats[boundary] = [i for i, s in enumerate(specs) if s.dtype.is_floating_point]
        ids = sample_ids if sample_ids is not None else sample_ids_of(tensors)
        for i in wire_order(specs):
            t = tensors[i]
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i, ids)
            op = self._plan(specs[i], ctx)
            raw = t.numel() * t.element_size()
            if op is None:
                send_fn(_wire(t.contiguous()))
                stats.record(raw, raw)
                continue
            self._check_ids(op, ctx)
            t0 = time.perf_counter()
            payload = op.compress(t.detach(), ctx)
            buf = to_buffer(payload)
            t1 = time.perf_counter()
            send_fn(buf)
            stats.record(raw, buf.numel(), compress_s=t1 - t0)
            stats.saturated = op.saturated  # cumulative per operator, and one operator per boundary and direction
            if self.cfg.error_every and micro_batch == 0 and step % self.cfg.error_every == 0:
                stats.record_error(t, op.estimate(payload, ctx))

    def recv(self, specs: list[TensorSpec], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, recv_fn: Transfer, device: torch.device, sample_ids: Tensor | None = None) -> list[Tensor]:
        """Receive what `send` sent, in the same order; returns the tensors in `specs` order."""
        out: list[Tensor | None] = [None] * len(specs)
        ids = sample_ids
        for i in wire_order(specs):
            spec = specs[i]
            if ids is None and spec.dtype.is_floating_point and len(specs) > 1 and _is_ids(specs[-1]):
                ids = out[-1]  # integer tensors arrived first, so the sample ids are known
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i, ids)
            op = self._plan(spec, ctx)
            if op is None:
                buf = torch.empty(spec.shape, dtype=torch.uint8 if spec.dtype == torch.bool else spec.dtype, device=device)
                recv_fn(buf)
                out[i] = buf.view(torch.bool) if spec.dtype == torch.bool else buf
                continue
            self._check_ids(op, ctx)
            layout = op.layout(spec.shape, spec.dtype, ctx)
            buf = torch.empty(sum(s.nbytes for s in layout), dtype=torch.uint8, device=device)
            recv_fn(buf)
            t0 = time.perf_counter()
            out[i] = op.decompress(from_buffer(buf, layout, torch.Size(spec.shape), spec.dtype), ctx)
            self._stats(boundary, direction, training).decompress_s += time.perf_counter() - t0
        if direction == "grad" and training:
            self._observe(out, boundary, step, micro_batch, sample_ids)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def _observe(self, grads: list[Tensor], boundary: int, step: int, micro_batch: int, sample_ids: Tensor | None) -> None:
        """Hand the gradients that came back to the activation operator that sent their tensors (mdtopk learns from
        them; for every other operator it does nothing). The j-th gradient belongs to the j-th float activation."""
        act, floats = self._ops.get((boundary, "act", True)), self._act_floats.get(boundary)
        if act is None or floats is None:
            return
        for j, g in enumerate(grads):
            i = floats[j]
            act.observe(g, self._ctx(boundary, "act", step, micro_batch, True, i, sample_ids))

    def state_dict(self) -> dict[str, Any]:
        return {"config": str(self.cfg),
                "ops": {f"{b}.{d}": op.state_dict() for (b, d, tr), op in self._ops.items() if op is not None and tr}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != str(self.cfg):
            raise ValueError(f"checkpoint was written with pp_compress config {state['config']!r}, this run has {str(self.cfg)!r}")
        for key, sub in state["ops"].items():
            b, d = key.split(".")
            op = self.op(int(b), d, True)
            if op is not None:
                op.load_state_dict(sub)


def _wire(t: Tensor) -> Tensor:
    """A tensor as it travels uncompressed: bool as its uint8 bytes (NCCL cannot send bool; DeepSpeed casts such
    masks to half, twice the bytes), everything else as it is."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def wire_order(specs: list[TensorSpec]) -> list[int]:
    """Integer/bool tensors travel first, so the receiver knows the sample ids before it decodes."""
    return [i for i, s in enumerate(specs) if not s.dtype.is_floating_point] + \
           [i for i, s in enumerate(specs) if s.dtype.is_floating_point]


def _is_ids(spec: TensorSpec) -> bool:
    return not spec.dtype.is_floating_point and spec.dtype != torch.bool and len(spec.shape) == 1


def sample_ids_of(tensors: list[Tensor]) -> Tensor | None:
    """The sample ids of a tuple crossing a boundary: its last tensor, when that is a 1-D integer tensor."""
    if len(tensors) > 1 and _is_ids(TensorSpec(tuple(tensors[-1].shape), tensors[-1].dtype)):
        return tensors[-1]
    return None
