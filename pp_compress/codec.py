"""One call per message, for a trainer or server that owns its transport.

    from pp_compress import Codec

    send = Codec("safe", direction="act")                 # on the sending side, one per link and direction
    buf, n = send.pack(hidden)                            # a flat uint8 tensor and the bytes used (the whole buffer)
    ...                                                   # the trainer's own transport moves buf
    recv = Codec("safe", direction="act")                 # on the receiving side, the same spec
    hidden = recv.unpack(buf, hidden_shape, hidden_dtype) # the receiver knows the shape and dtype, as with any p2p

This is the shape of a codec slot such as the Protocol NanoGPT speedrun's `pack(t) -> (bytes, n)` /
`unpack(bytes, meta)`, or a serving engine's pipeline transport hook. `nbytes(shape, dtype)` is exact before any
message, so a receiver can preallocate. Each side counts its calls, and the count is the message's step: noise for
stochastic rounding and error-feedback state then agree on both sides as long as messages arrive in the order they
were sent (one Codec per link and direction). Pass `step=` explicitly where that order is not guaranteed.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from . import wire
from .config import CompressionConfig, parse_spec
from .ops.base import Compressor, Context
from .pipe import decode_received
from .policy import BoundaryPolicy, Where


class Codec:
    """A compression spec bound to one link and direction, with `pack` and `unpack` for the two ends."""

    def __init__(self, spec: str | CompressionConfig, direction: Literal["act", "grad"] = "act", boundary: int = 0,
                 training: bool = True) -> None:
        cfg = parse_spec(spec) if isinstance(spec, str) else spec
        self.config = cfg
        """The whole configuration (a preset or spec string is parsed once)."""
        self.op: Compressor = cfg.spec_for(boundary, direction, training).build(cfg.nonfinite)
        """The operator of this boundary and direction (its error-feedback state lives here)."""
        self.policy = BoundaryPolicy(cfg)
        """The boundary policy every engine uses: it names the boundary and seeds each message's Context."""
        self.where = Where(boundary, direction, 0, 0, training)
        """Where the messages travel; each call's step is filled in."""
        self.calls = 0
        """Messages packed or unpacked so far: the next message's default step."""

    def _context(self, step: int | None) -> Context:
        ctx = self.policy.context(dataclasses.replace(self.where, step=self.calls if step is None else step))
        self.calls += 1
        return ctx

    def nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
        """The exact size of one message for a tensor of this shape and dtype."""
        return self.op.wire_nbytes(tuple(shape), dtype, self.policy.context(self.where))

    def pack(self, x: Tensor, step: int | None = None) -> tuple[Tensor, int]:
        """Compress x into one flat uint8 buffer on x's device; returns (buffer, bytes used)."""
        buf = wire.to_buffer(self.op.compress(x, self._context(step)))  # (nbytes,) uint8
        return buf, buf.numel()

    def unpack(self, buffer: Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
               step: int | None = None) -> Tensor:
        """The tensor a `pack` of this shape and dtype sent (a buffer of another size is refused by name)."""
        ctx = self._context(step)
        layout = self.op.wire_layout(tuple(shape), dtype, ctx)
        return decode_received(self.op, wire.from_buffer(buffer.reshape(-1), layout, torch.Size(shape), dtype), ctx)
