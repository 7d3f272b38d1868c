"""Error compensation: wrappers that are themselves compressors (`+ef`, `+ef21`, `+aqsgd`).

State is keyed explicitly by `ctx.key` (boundary, direction, micro-batch slot) or, for AQ-SGD, by
`ctx.sample_key` (boundary, direction) and sample id. Sender-side state lives in `send`, receiver-side state in `recv`:
one process holds only one side of a boundary, while the in-process boundary holds both, which must
stay bit-identical. With `ctx.training == False` the wrappers compress plainly and touch no state.

States are kept in fp32 (float64 input: float64) whatever the input dtype. What the inner operator gets, x + e
or x - g, is computed there and cast back to the input dtype; where it exceeds that dtype's finite range (fp16
near 65504) it is clipped, the clipped part stays in the state (EF's residual, EF21's and AQ-SGD's distance to
x) and is sent on later steps, and `saturated` counts the clipped elements (the pipeline reports it per boundary).

  EF     c = C(x + e);  e <- x + e - D(c)                  sender only; the payload is C's
  EF21   c = C(x - g);  g <- g + D(c); output g            g mirrored on both sides
  AQSGD  per sample s: first visit sends x raw (or c0 = F(x), m_s <- D(c0) with `+aqsgd:first=F`),
         then c = C(x - m_s); m_s <- m_s + D(c)
         payload = (first-visit rows, raw or F's payload; C's payload for the others)
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .ops.base import Compressor, Context, Layout, Payload, TensorSpec, saturate

FEEDBACKS = ("ef", "ef21", "aqsgd")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residuals/states keep at least fp32 precision (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _fit(wrapper: Compressor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (acc dtype) as the inner operator's input in `dtype`, clipped to its range and counted."""
    out, clipped = saturate(x, dtype)
    wrapper.saturated += clipped
    return out


def _copy(tree: dict[Any, Any]) -> dict[Any, Any]:
    """Copy nested dicts; tensors are shared, since the wrappers replace them and never write in place."""
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


class _Wrapper(Compressor):
    tag = ""

    def __init__(self, inner: Compressor, nonfinite: str = "raise") -> None:
        super().__init__(f"{inner.spec}+{self.tag}", nonfinite)
        self.inner = inner
        self.send: dict[str, Any] = {}
        self.recv: dict[str, Any] = {}

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        return self.inner.wire_layout(shape, dtype, ctx)

    def batch_grouped(self) -> bool:
        return self.inner.batch_grouped()

    def observe(self, grad: Tensor, ctx: Context) -> None:
        if ctx.training:
            self.inner.observe(grad, ctx)

    def state_dict(self) -> dict[str, Any]:
        return {"send": _copy(self.send), "recv": _copy(self.recv), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.send = _copy(state.get("send", {}))
        self.recv = _copy(state.get("recv", {}))
        self.inner.load_state_dict(state.get("inner", {}))

    def _state(self, table: dict[str, Tensor], ctx: Context, like: Tensor) -> Tensor:
        """The state under ctx.key, zeros (acc dtype) on first use or after a shape change."""
        state = table.get(ctx.key)
        if state is not None and state.shape == like.shape:
            return state
        if state is not None:
            warnings.warn(
                f"{ctx.name}: {self.tag} state {ctx.key} had shape {tuple(state.shape)}, input has "
                f"{tuple(like.shape)}; restarting it from zero",
                stacklevel=3,
            )
        return torch.zeros(like.shape, dtype=_acc_dtype(like.dtype), device=like.device)


class EF(_Wrapper):
    """Classic error feedback: the residual of what compression dropped is added to the next input."""

    tag = "ef"

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        if not ctx.training:
            return self.inner.encode(x, ctx)
        corrected = x.to(_acc_dtype(x.dtype)) + self._state(self.send, ctx, x)  # x.shape
        payload = self.inner.encode(_fit(self, corrected, x.dtype), ctx)
        self.send[ctx.key] = corrected - self.inner.decode(payload, ctx).to(corrected.dtype)
        return payload

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        return self.inner.decode(payload, ctx)

    def _estimate(self, payload: Payload, ctx: Context) -> Tensor:
        return self.inner._estimate(payload, ctx)


class EF21(_Wrapper):
    """EF21: both sides keep g; the wire carries C(x - g) and both add its decoding to g."""

    tag = "ef21"

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        if not ctx.training:
            return self.inner.encode(x, ctx)
        g = self._state(self.send, ctx, x)  # x.shape, acc dtype
        payload = self.inner.encode(_fit(self, x.to(g.dtype) - g, x.dtype), ctx)
        self.send[ctx.key] = g + self.inner.decode(payload, ctx).to(g.dtype)
        return payload

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        delta = self.inner.decode(payload, ctx)
        if not ctx.training:
            return delta
        g = self._state(self.recv, ctx, delta) + delta.to(_acc_dtype(delta.dtype))
        self.recv[ctx.key] = g
        return g.to(payload.dtype, copy=True)  # never hand out the state itself (a pipeline sets requires_grad on it)

    def _estimate(self, payload: Payload, ctx: Context) -> Tensor:
        if not ctx.training:
            return self.inner._estimate(payload, ctx)
        return self.send[ctx.key].to(payload.dtype)  # the receiver's g equals the sender's after this step


class AQSGD(_Wrapper):
    """AQ-SGD: compress each sample's change against a buffer both sides keep per sample id."""

    tag = "aqsgd"

    def __init__(self, inner: Compressor, nonfinite: str = "raise", first: Compressor | None = None) -> None:
        super().__init__(inner, nonfinite)
        self.first = first
        """Compresses a sample's first visit (None: sent raw). Both sides then start its buffer from the decoded
        first visit, and later deltas correct what it lost."""
        if first is not None:
            self.config = f"{self.config}:first={first.spec}"

    def batch_grouped(self) -> bool:
        return True  # buffers are kept per sample: one row of the batch dim each

    @staticmethod
    def _ids(ctx: Context, batch: int) -> list[int]:
        if ctx.sample_ids is None:
            raise ValueError(
                f"{ctx.name}: +aqsgd needs per-sample ids (ctx.sample_ids, one per sample of the batch dim); "
                "pass them with the batch (see README, 'Sample ids')"
            )
        ids = [int(i) for i in ctx.sample_ids.reshape(-1).tolist()]
        if len(ids) != batch or len(set(ids)) != len(ids):
            raise ValueError(f"{ctx.name}: +aqsgd got sample ids {ids} for a batch of {batch}; need {batch} distinct "
                             "ids")
        return ids

    def _split(self, ctx: Context, shape: tuple[int, ...],
               table: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """(ids, rows with a buffer, rows sent raw) by one side's buffers; a buffer of another
        shape (e.g. a new sequence length) counts as a first visit on both sides alike."""
        ids = self._ids(ctx, shape[0])
        known = table.get(ctx.sample_key, {})
        old = [i for i, s in enumerate(ids) if s in known and tuple(known[s].shape) == tuple(shape[1:])]
        new = [i for i in range(len(ids)) if i not in set(old)]
        return ids, old, new

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        if ctx is None or not ctx.training:
            return self.inner.wire_layout(shape, dtype, ctx)
        # A receiver asks before decoding; a sender (or an in-process pair) before encoding.
        _, old, new = self._split(ctx, tuple(shape), self.recv if ctx.sample_key in self.recv else self.send)
        rest = tuple(shape[1:])
        return (self._first_layout((len(new),) + rest, dtype, ctx)
                + self.inner.wire_layout((len(old),) + rest, dtype, ctx))

    def _first_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context) -> Layout:
        """The first-visit rows' tensors: the rows themselves, or the first-visit compressor's payload."""
        return [TensorSpec(shape, dtype)] if self.first is None else self.first.wire_layout(shape, dtype, ctx)

    def _sub(self, ctx: Context, rows: list[int]) -> Context:
        ids = ctx.sample_ids.reshape(-1)[rows] if ctx.sample_ids is not None else None  # (len(rows),)
        return ctx.replace(sample_ids=ids)

    def _encode(self, x: Tensor, ctx: Context) -> Payload:
        if not ctx.training:
            return self.inner.encode(x, ctx)
        ids, old, new = self._split(ctx, tuple(x.shape), self.send)
        buf = self.send.setdefault(ctx.sample_key, {})
        acc = _acc_dtype(x.dtype)
        base = (torch.stack([buf[ids[i]] for i in old]) if old
                else x.new_zeros((0,) + x.shape[1:], dtype=acc))  # (n_old, ...)
        delta = _fit(self, x[old].to(acc) - base, x.dtype)  # (n_old, ...)
        inner = self.inner.encode(delta, self._sub(ctx, old))
        if self.first is None:
            first, seen = (x[new].contiguous(),), x[new]  # (n_new, ...)
        else:  # the receiver's view of the first visit is what both sides keep
            p = self.first.encode(x[new].contiguous(), self._sub(ctx, new))
            first, seen = p.tensors, self.first.decode(p, self._sub(ctx, new))  # seen: (n_new, ...)
        self._update(buf, ids, old, new, base, self.inner.decode(inner, self._sub(ctx, old)), seen)
        return Payload(tuple(first) + inner.tensors, x.shape, x.dtype)

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        if not ctx.training:
            return self.inner.decode(payload, ctx)
        ids, old, new = self._split(ctx, tuple(payload.shape), self.recv)
        buf = self.recv.setdefault(ctx.sample_key, {})
        rows = tuple(payload.shape[1:])
        n = len(self._first_layout((len(new),) + rows, payload.dtype, ctx))
        first, rest = payload.tensors[:n], payload.tensors[n:]
        raw = first[0] if self.first is None else self.first.decode(
            Payload(tuple(first), torch.Size((len(new),) + rows), payload.dtype), self._sub(ctx, new))  # (n_new, ...)
        delta = self.inner.decode(Payload(tuple(rest), torch.Size((len(old),) + rows), payload.dtype),
                                  self._sub(ctx, old))
        base = torch.stack([buf[ids[i]] for i in old]) if old else delta.to(_acc_dtype(delta.dtype))
        return self._update(buf, ids, old, new, base, delta, raw)

    def _estimate(self, payload: Payload, ctx: Context) -> Tensor:
        if not ctx.training:
            return self.inner._estimate(payload, ctx)
        buf = self.send[ctx.sample_key]  # holds this batch's reconstructions, identical to the receiver's
        return torch.stack([buf[i] for i in self._ids(ctx, payload.shape[0])]).to(payload.dtype)

    @staticmethod
    def _update(
        buf: dict[int, Tensor], ids: list[int], old: list[int], new: list[int], base: Tensor, delta: Tensor, raw: Tensor
    ) -> Tensor:
        """Store new reconstructions in `buf` (acc dtype, same arithmetic on both sides) and return the batch in
        the input dtype."""
        acc = _acc_dtype(raw.dtype)
        recon_old = base.to(acc) + delta.to(acc)  # (n_old, ...)
        out = raw.new_empty((len(ids),) + tuple(raw.shape[1:]))
        out[old] = recon_old.to(raw.dtype)
        out[new] = raw
        for j, i in enumerate(old):
            buf[ids[i]] = recon_old[j].clone()
        for j, i in enumerate(new):
            buf[ids[i]] = raw[j].to(acc, copy=True)
        return out


WRAPPERS: dict[str, type[_Wrapper]] = {"ef": EF, "ef21": EF21, "aqsgd": AQSGD}
