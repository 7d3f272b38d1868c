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
View = tuple[tuple[int, ...], "int | None"]
Views = Callable[[list["Tensor | None"]], dict[int, View]]
"""How to see some float tensors of a tuple while compressing them: {position: (shape, batch dim in that shape or None
where the shape keeps no whole samples)}. It is called with the tuple once its integer tensors are known (the sender's
whole tuple; on the receiver, the integer tensors that arrived first), so both sides derive the same views. A
tensor-parallel engine uses it to give the flat 1/TP slice it sends back its rows (see `partition_view`)."""


class StageCompression:
    """Compressors, their state and byte counters for the boundaries one stage touches."""

    def __init__(self, cfg: CompressionConfig, stage: int, num_stages: int) -> None:
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        for b in cfg.boundaries:
            if b >= num_stages - 1:
                raise ValueError(f"pp_compress override for boundary {b}, but {num_stages} stages have boundaries 0..{num_stages - 2}")
        self._ops: dict[tuple[int, str, bool], Compressor | None] = {}
        self.stats: dict[str, DirectionStats] = {}
        self._act_floats: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        """Per boundary this stage sends activations over: (tuple position, shape as compressed) of its float tensors,
        in the order their gradients come back."""

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
             sample_ids: Tensor | None, view: View | None = None) -> Context:
        bd = self.cfg.batch_dim if view is None else (view[1] if view[1] is not None else 0)
        return Context(name=f"boundary{boundary}.{direction}", boundary=boundary, direction=direction, step=step,
                       micro_batch=micro_batch, tensor=i, seed=self.cfg.seed, sample_ids=sample_ids, training=training,
                       batch_dim=bd)

    @staticmethod
    def _check_view(op: Compressor, ctx: Context, view: View | None) -> None:
        if view is not None and view[1] is None and op.batch_grouped():
            raise ValueError(f"{ctx.name}: tensor {ctx.tensor} travels as a tensor-parallel slice of shape {view[0]} that "
                             f"holds no whole samples, and {op.spec} groups per sample; use a per-row operator (e.g. "
                             "int8, topk:<r>:per=row) or a sequence length divisible by the tensor-parallel size")

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
             training: bool, send_fn: Transfer, sample_ids: Tensor | None = None, views: Views | None = None) -> None:
        """Send what crosses one boundary: integer/bool tensors first (as they are), then each float
        tensor compressed. For activations, the sample ids are found in `tensors` (see `sample_ids_of`)."""
        stats = self._stats(boundary, direction, training)
        specs = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]
        seen = views(list(tensors)) if views else {}
        if direction == "act":
            self._act_floats[boundary] = [(i, seen[i][0] if i in seen else s.shape) for i, s in enumerate(specs)
                                          if s.dtype.is_floating_point]
        ids = sample_ids if sample_ids is not None else sample_ids_of(tensors)
        for i in wire_order(specs):
            t = tensors[i]
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i, ids, seen.get(i))
            op = self._plan(specs[i], ctx)
            raw = t.numel() * t.element_size()
            if op is None:
                send_fn(_wire(t.contiguous()))
                stats.record(raw, raw)
                continue
            self._check_ids(op, ctx)
            self._check_view(op, ctx, seen.get(i))
            if i in seen:
                t = t.reshape(seen[i][0])
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
             training: bool, recv_fn: Transfer, device: torch.device, sample_ids: Tensor | None = None,
             views: Views | None = None) -> list[Tensor]:
        """Receive what `send` sent, in the same order; returns the tensors in `specs` order."""
        out: list[Tensor | None] = [None] * len(specs)
        ids = sample_ids
        seen: dict[int, View] | None = None
        for i in wire_order(specs):
            spec = specs[i]
            if spec.dtype.is_floating_point and seen is None:  # integer tensors arrived first
                seen = views(out) if views else {}
                if ids is None and len(specs) > 1 and _is_ids(specs[-1]):
                    ids = out[-1]  # so the sample ids are known
            view = seen.get(i) if seen else None
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i, ids, view)
            op = self._plan(spec, ctx)
            if op is None:
                buf = torch.empty(spec.shape, dtype=torch.uint8 if spec.dtype == torch.bool else spec.dtype, device=device)
                recv_fn(buf)
                out[i] = buf.view(torch.bool) if spec.dtype == torch.bool else buf
                continue
            self._check_ids(op, ctx)
            self._check_view(op, ctx, view)
            shape = view[0] if view else spec.shape
            layout = op.layout(shape, spec.dtype, ctx)
            buf = torch.empty(sum(s.nbytes for s in layout), dtype=torch.uint8, device=device)
            recv_fn(buf)
            t0 = time.perf_counter()
            out[i] = op.decompress(from_buffer(buf, layout, torch.Size(shape), spec.dtype), ctx).reshape(spec.shape)
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
        for (i, shape), g in zip(floats, [g for g in grads if g.is_floating_point()]):
            act.observe(g.reshape(shape), self._ctx(boundary, "act", step, micro_batch, True, i, sample_ids))

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


def partition_view(meta: list[int], batch_dim: int) -> View:
    """The view of one rank's flat slice of a partitioned tensor (DeepSpeed's PartitionedTensor meta: [ndim, *shape,
    parts, rank, *offsets]) that keeps the most structure: (n, *shape[j:]) for the smallest j >= 1 whose trailing
    product divides the slice's offset and length. [s, b, h] split along s when TP divides s gives (s/TP, b, h), batch
    dim intact; otherwise rows (n, h), or the flat slice (n,) as the last resort. The batch dim survives where the slice
    holds whole samples (None otherwise)."""
    ndim = meta[0]
    shape, parts, rank = meta[1:1 + ndim], meta[1 + ndim], meta[2 + ndim]
    offsets = meta[3 + ndim:4 + ndim + parts]
    start, length = offsets[rank], offsets[rank + 1] - offsets[rank]
    for j in range(1, ndim + 1):
        tail = 1
        for s in shape[j:]:
            tail *= s
        if tail and start % tail == 0 and length % tail == 0:
            bd: int | None = batch_dim - j + 1 if batch_dim >= j else (0 if j == 1 and batch_dim == 0 else None)
            return (length // tail, *shape[j:]), bd
    return (length,), None


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
