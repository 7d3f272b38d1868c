"""Compressed point-to-point traffic of one pipeline stage, independent of the engine that drives it.

`StageCompression.encode(...)` compresses each floating-point tensor of what crosses a boundary into one flat uint8
buffer (one message per tensor); non-float tensors go as they are (bool as its uint8 bytes), and first. The receiver
computes the same layouts from the uncompressed (shape, dtype) it already knows (`recv_buffers`), receives exactly
that many bytes and decompresses (`decode`). No extra metadata travels. `send` / `recv` do this over blocking p2p.

Sample ids (for `+aqsgd`) ride in the activation tuple itself: when its last tensor is a 1-D integer
tensor, it holds one id per row. It arrives before the float tensors, so both sides key their
per-sample buffers alike; for gradients the engine passes the ids it already holds.

Boundary b lies between stage b and stage b + 1: activations cross it forward, gradients backward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .config import CompressionConfig
from .ops.base import Compressor, Context, Payload, TensorSpec
from .ops.deferred import Deferred
from .policy import BoundaryPolicy, Where
from .stats import DirectionStats
from .wire import from_buffer, to_buffer

Transfer = Callable[[Tensor], Any]
View = tuple[tuple[int, ...], "int | None"]
Views = Callable[[list["Tensor | None"]], dict[int, View]]
"""How to see some float tensors of a tuple while compressing them: {position: (shape, batch dim in that shape or None
where the shape keeps no whole samples)}. It is called with the tuple once its integer tensors are known (the sender's
whole tuple; on the receiver, the integer tensors that arrived first), so both sides derive the same views. A
tensor-parallel engine uses it to give the flat 1/TP slice it sends back its rows (the DeepSpeed shim's
`partition_view`)."""


class StageCompression:
    """Compressors, their state and byte counters for the boundaries one stage touches.

    Compression is separate from transport. `encode` turns a tuple into the buffers to send (in wire order, one
    message each); `plain_buffers` and `recv_buffers` allocate what to receive into; `decode` turns received buffers
    back into the tuple. An engine that posts its own (batched, asynchronous) P2P ops on preallocated buffers calls
    these; `send` and `recv` are the blocking helpers DeepSpeed's p2p uses. Receiving comes in two phases because the
    float payloads' layouts may depend on integer tensors of the same tuple (sample ids for +aqsgd, a tensor-parallel
    partition's meta): receive the plain buffers first, then allocate and receive the payloads (both in one batch
    when the config needs neither). The phases keep no state between them (each derives the plan from what it is
    given), so an engine may interleave the receives of many micro-batches.
    """

    def __init__(self, cfg: CompressionConfig, stage: int, num_stages: int, defer_on_cpu: bool = False) -> None:
        self.stage, self.num_stages = stage, num_stages
        self.deferred = Deferred()
        """The non-finite verdicts of tensors on an accelerator (and on the CPU with `defer_on_cpu`): the per-message
        path never waits for the device; the engine reads them at the end of each step (`raise_pending`)."""
        self.defer_on_cpu = defer_on_cpu
        for b in cfg.boundaries:
            if b >= num_stages - 1:
                raise ValueError(f"pp_compress override for boundary {b}, but {num_stages} stages have boundaries "
                                 f"0..{num_stages - 2}")
        self.policy = BoundaryPolicy(cfg)
        self.stats: dict[str, DirectionStats] = {}
        self._act_floats: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
        """Per boundary this stage sends activations over and micro-batch: (tuple position, shape as compressed) of its
        float tensors, in the order their gradients come back. Keyed per micro-batch: where micro-batches differ in
        length (variable sequence lengths, packed sequences), the gradient that comes back belongs to an earlier
        micro-batch than the last one sent."""

    @property
    def cfg(self) -> CompressionConfig:
        return self.policy.cfg

    def op(self, boundary: int, direction: str, training: bool) -> Compressor | None:
        return self.policy.op(boundary, direction, training)

    def _stats(self, where: Where) -> DirectionStats:
        """The sender counts calls and bytes, the receiver adds its decompression time to the same key."""
        return self.stats.setdefault(where.stats_key, DirectionStats())

    def raise_pending(self) -> None:
        """Raise the first failed deferred check of the messages so far (one host read for all of them)."""
        self.deferred.raise_pending()

    def _plan(self, spec: TensorSpec, where: Where, i: int, ids: Tensor | None, view: View | None,
              device: torch.device | None = None) -> tuple[Compressor | None, Context]:
        ctx = self.policy.context(where, i, ids, None if view is None else (view[1] if view[1] is not None else 0))
        if device is not None and (device.type != "cpu" or self.defer_on_cpu):
            ctx = ctx.replace(deferred=self.deferred)
        op = self.policy.plan(spec, where)
        if op is not None:
            if ctx.sample_ids is None and where.training and getattr(op, "tag", "") == "aqsgd":
                raise ValueError(f"{ctx.name}: +aqsgd needs sample ids on every stage: make the tensors that cross the "
                                 "boundary a tuple ending with an integer tensor of shape (micro_batch,) holding "
                                 "the sample ids, e.g. (hidden, sample_ids); see README 'Sample ids'")
            if view is not None and view[1] is None and op.batch_grouped():
                raise ValueError(f"{ctx.name}: tensor {i} travels as a tensor-parallel slice of shape {view[0]} that "
                                 f"holds no whole samples, and {op.spec} groups per sample; use a per-row operator "
                                 "(e.g. int8, topk:<r>:per=row) or a sequence length divisible by the "
                                 "tensor-parallel size")
        return op, ctx

    # --- compression ------------------------------------------------------------------------
    def encode(self, tensors: list[Tensor], where: Where, sample_ids: Tensor | None = None,
               views: Views | None = None) -> list[tuple[int, Tensor]]:
        """(tuple position, buffer) for each tensor, in wire order: integer/bool tensors first, as they are (bool as
        uint8), then each float tensor compressed into one flat uint8 buffer (or as it is where the policy says so).
        For activations the sample ids are found in `tensors` (see `sample_ids_of`)."""
        stats = self._stats(where)
        self.policy.remember(tensors, where)
        specs = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]
        seen = views(list(tensors)) if views else {}
        if where.direction == "act":
            self._act_floats[where.boundary, where.micro_batch] = [(i, seen[i][0] if i in seen else s.shape)
                                                                   for i, s in enumerate(specs)
                                                                   if s.dtype.is_floating_point]
        ids = sample_ids if sample_ids is not None else sample_ids_of(tensors)
        measure = self.policy.measures_error(where)  # on an accelerator, these messages are the ones timed too
        out, ops = [], []
        for i in wire_order(specs):
            t = tensors[i]
            op, ctx = self._plan(specs[i], where, i, ids, seen.get(i), t.device)
            ops.append(op)
            raw = t.numel() * t.element_size()
            if op is None:
                out.append((i, _wire(t.contiguous())))
                stats.record(raw, raw)
                continue
            t = t.reshape(seen[i][0]) if i in seen else t
            span = stats.start(t.device, measure)
            payload = op.compress(t.detach(), ctx)
            buf = to_buffer(payload)
            stats.stop(span, "compress")
            stats.record(raw, buf.numel())
            stats.saturated = op.saturated  # cumulative per operator, and one operator per boundary and direction
            if measure:
                stats.record_error(t, op.estimate(payload, ctx))
            out.append((i, buf))
        self.policy.account(specs, ops, where, stats)
        return out

    @staticmethod
    def plain_buffers(specs: list[TensorSpec], device: torch.device) -> list[tuple[int, Tensor]]:
        """Phase 1 of receiving: (position, buffer) for the integer/bool tensors, which travel first and as they are."""
        return [(i, torch.empty(s.shape, dtype=torch.uint8 if s.dtype == torch.bool else s.dtype, device=device))
                for i, s in enumerate(specs) if not s.dtype.is_floating_point]

    def recv_buffers(self, specs: list[TensorSpec], where: Where, device: torch.device, plain: list[Tensor | None],
                     sample_ids: Tensor | None = None, views: Views | None = None) -> list[tuple[int, Tensor]]:
        """Phase 2: (position, buffer) for the float tensors, their exact payload sizes derived from (shape, dtype),
        the config and `plain` (the tuple with its integer tensors received, see `decode`)."""
        ids, seen = self._known(specs, plain, sample_ids, views)
        out = []
        for i, spec in enumerate(specs):
            if not spec.dtype.is_floating_point:
                continue
            op, ctx = self._plan(spec, where, i, ids, seen.get(i))
            if op is None:
                out.append((i, torch.empty(spec.shape, dtype=spec.dtype, device=device)))
                continue
            layout = op.layout(seen[i][0] if i in seen else spec.shape, spec.dtype, ctx)
            out.append((i, torch.empty(sum(s.nbytes for s in layout), dtype=torch.uint8, device=device)))
        return out

    def decode(self, specs: list[TensorSpec], where: Where, plain: list[Tensor | None],
               buffers: list[tuple[int, Tensor]], sample_ids: Tensor | None = None,
               views: Views | None = None) -> list[Tensor]:
        """The tuple in `specs` order from the plain tensors and the received float buffers (`recv_buffers`)."""
        ids, seen = self._known(specs, plain, sample_ids, views)
        timed = self.policy.measures_error(where)  # on an accelerator, the sender's sampled messages are timed here too
        out = [t.view(torch.bool) if t is not None and s.dtype == torch.bool and t.dtype == torch.uint8 else t
               for t, s in zip(plain, specs)]  # bool travels as its uint8 bytes
        for i, buf in buffers:
            spec = specs[i]
            op, ctx = self._plan(spec, where, i, ids, seen.get(i), buf.device)
            if op is None:
                out[i] = buf
                continue
            shape = seen[i][0] if i in seen else spec.shape
            stats = self._stats(where)
            span = stats.start(buf.device, timed)
            layout = op.layout(shape, spec.dtype, ctx)
            payload = from_buffer(buf, layout, torch.Size(shape), spec.dtype)
            out[i] = decode_received(op, payload, ctx).reshape(spec.shape)
            stats.stop(span, "decompress")
        if where.direction == "grad" and where.training:
            self._observe(out, where, sample_ids)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    @staticmethod
    def _known(specs: list[TensorSpec], plain: list[Tensor | None], sample_ids: Tensor | None,
               views: Views | None) -> tuple[Tensor | None, dict[int, View]]:
        """Sample ids (given, or the tuple's last integer tensor) and the views, from what arrived in phase 1."""
        ids = sample_ids if sample_ids is not None else (plain[-1] if len(specs) > 1 and _is_ids(specs[-1]) else None)
        return ids, (views(plain) if views else {})

    # --- blocking transport (DeepSpeed's p2p) -------------------------------------------------
    def send(self, tensors: list[Tensor], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, send_fn: Transfer, sample_ids: Tensor | None = None, views: Views | None = None) -> None:
        """Send what crosses one boundary, one blocking message per tensor (see `encode`)."""
        for _, buf in self.encode(tensors, Where(boundary, direction, step, micro_batch, training), sample_ids, views):
            send_fn(buf)

    def recv(self, specs: list[TensorSpec], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, recv_fn: Transfer, device: torch.device, sample_ids: Tensor | None = None,
             views: Views | None = None) -> list[Tensor]:
        """Receive what `send` sent, in the same order; returns the tensors in `specs` order."""
        where = Where(boundary, direction, step, micro_batch, training)
        plain: list[Tensor | None] = [None] * len(specs)
        for i, buf in self.plain_buffers(specs, device):
            recv_fn(buf)
            plain[i] = buf.view(torch.bool) if specs[i].dtype == torch.bool else buf
        buffers = self.recv_buffers(specs, where, device, plain, sample_ids, views)
        for _, buf in buffers:
            recv_fn(buf)
        return self.decode(specs, where, plain, buffers, sample_ids, views)

    def _observe(self, grads: list[Tensor], where: Where, sample_ids: Tensor | None) -> None:
        """Hand the gradients that came back to the activation operator that sent their tensors (mdtopk learns from
        them; for every other operator it does nothing). The j-th float gradient belongs to the j-th float
        activation."""
        act, floats = self.policy.built(where.boundary, "act"), self._act_floats.get((where.boundary,
                                                                                      where.micro_batch))
        if act is None or floats is None:
            return
        act_where = Where(where.boundary, "act", where.step, where.micro_batch, True)
        for (i, shape), g in zip(floats, [g for g in grads if g.is_floating_point()]):
            act.observe(g.reshape(shape), self.policy.context(act_where, i, sample_ids))

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)


def decode_received(op: Compressor, payload: Payload, ctx: Context) -> Tensor:
    """`op.decompress` of a payload that came from a peer: untrusted bytes. A payload that does not decode (an index
    out of range, a count that does not match) is one error that says so and names the boundary and step."""
    try:
        return op.decompress(payload, ctx)
    except (IndexError, RuntimeError, ValueError) as e:
        raise ValueError(f"{ctx.name}: the message received at step {ctx.step} (micro-batch {ctx.micro_batch}) does "
                         f"not decode with {op.spec} ({type(e).__name__}: {str(e).splitlines()[0][:200]}): it is "
                         "corrupt, or its sender runs another config") from e


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
