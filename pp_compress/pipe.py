"""Compressed point-to-point traffic of one pipeline stage, independent of the engine that drives it.

`StageCompression.send(...)` compresses each floating-point tensor of what crosses a boundary into
one flat uint8 buffer and hands it to `send_fn` (one message per tensor); non-float tensors go as
they are. `recv(...)` computes the same layout from the uncompressed (shape, dtype) the receiver
already knows, receives exactly that many bytes and decompresses. No extra metadata travels.

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
        for b in range(num_stages - 1):
            for d in ("act", "grad"):
                if cfg.spec_for(b, d).feedback == "aqsgd":
                    raise ValueError("+aqsgd needs sample ids on every stage; the DeepSpeed engine does not carry them yet")
        self._ops: dict[tuple[int, str, bool], Compressor | None] = {}
        self.stats: dict[str, DirectionStats] = {}

    def op(self, boundary: int, direction: str, training: bool) -> Compressor | None:
        key = (boundary, direction, training)
        if key not in self._ops:
            spec = self.cfg.spec_for(boundary, direction, training)
            same = self._ops.get((boundary, direction, True)) if not training and spec == self.cfg.spec_for(boundary, direction) else None
            self._ops[key] = same or (None if spec.is_identity else spec.build(self.cfg.nonfinite))
        return self._ops[key]

    def _plan(self, spec: TensorSpec, ctx: Context) -> Compressor | None:
        if spec.dtype not in FLOAT_DTYPES or spec.numel < max(self.cfg.min_numel, 1):
            return None
        if ctx.training and ctx.step < self.cfg.warmup_steps:
            return None
        return self.op(ctx.boundary, ctx.direction, ctx.training)

    def _ctx(self, boundary: int, direction: str, step: int, micro_batch: int, training: bool, i: int) -> Context:
        return Context(name=f"boundary{boundary}.{direction}", boundary=boundary, direction=direction, step=step,
                       micro_batch=micro_batch, tensor=i, seed=self.cfg.seed, training=training)

    def _stats(self, boundary: int, direction: str) -> DirectionStats:
        return self.stats.setdefault(f"b{boundary}.{direction}", DirectionStats())

    def send(self, tensors: list[Tensor], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, send_fn: Transfer) -> None:
        stats = self._stats(boundary, direction)
        for i, t in enumerate(tensors):
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i)
            op = self._plan(TensorSpec(tuple(t.shape), t.dtype), ctx)
            raw = t.numel() * t.element_size()
            if op is None:
                send_fn(t.contiguous())
                stats.record(raw, raw)
                continue
            t0 = time.perf_counter()
            buf = to_buffer(op.compress(t.detach(), ctx))
            t1 = time.perf_counter()
            send_fn(buf)
            stats.record(raw, buf.numel(), compress_s=t1 - t0)

    def recv(self, specs: list[TensorSpec], boundary: int, direction: str, step: int, micro_batch: int,
             training: bool, recv_fn: Transfer, device: torch.device) -> list[Tensor]:
        out = []
        for i, spec in enumerate(specs):
            ctx = self._ctx(boundary, direction, step, micro_batch, training, i)
            op = self._plan(spec, ctx)
            if op is None:
                t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                recv_fn(t)
                out.append(t)
                continue
            layout = op.wire_layout(spec.shape, spec.dtype, ctx)
            buf = torch.empty(sum(s.nbytes for s in layout), dtype=torch.uint8, device=device)
            recv_fn(buf)
            t0 = time.perf_counter()
            out.append(op.decompress(from_buffer(buf, layout, torch.Size(spec.shape), spec.dtype), ctx))
            self._stats(boundary, f"{direction}_recv").decompress_s += time.perf_counter() - t0
        return out

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
