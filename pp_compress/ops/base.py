"""The operator contract: Payload, Context, TensorSpec, OpConfig and the Compressor base class.

An operator is pure: `encode(x, ctx) -> Payload`, `decode(payload, ctx) -> Tensor`, and
`wire_layout(shape, dtype, ctx)` gives the exact (shape, dtype) of every tensor that travels, so a
receiver can preallocate without seeing `x`. Randomness comes from the Context, keyed by (seed, boundary,
direction, step, micro-batch): `ctx.generator(...)`, a `torch.Generator`, or `ctx.uniform(...)`, counter-based
noise for stochastic rounding that fused kernels reproduce; never the global RNG.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from . import triton_int
from .deferred import Deferred, Flag
from . import noise

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NONFINITE_POLICIES = ("raise", "allow")


class TensorSpec(NamedTuple):
    """Shape and dtype of one tensor on the wire."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Layout = list[TensorSpec]


def layout_nbytes(layout: Layout) -> int:
    """Exact number of bytes a payload with this layout puts on the wire."""
    return sum(spec.nbytes for spec in layout)


def new_flag(ctx: "Context", device: torch.device, error: type[Exception], message: Callable[[], str]) -> Flag:
    """A zeroed int32 slot for a kernel's own check (error(message()) if the kernel sets it): a slot of
    `ctx.deferred`'s buffer, read with the step's other verdicts, or a fresh one that `settle` reads at once."""
    if ctx.deferred is not None:
        return ctx.deferred.flag(device, error, message)
    return Flag(torch.zeros(1, dtype=torch.int32, device=device), 0, error, message)


def settle(flag: Flag, ctx: "Context") -> None:
    """After the kernel: raise its error now if it set the flag, unless `ctx.deferred` reads it later."""
    if ctx.deferred is None and int(flag.buf[flag.index]):
        raise flag.error(flag.message())


def expect_finite(t: Tensor, ctx: "Context", error: type[Exception], message: Callable[[], str],
                  detail: Callable[[], str] | None = None) -> None:
    """Raise error(message() + detail()) if t holds NaN/Inf: now, or under `ctx.deferred` when the engine reads the
    step's verdicts (then without `detail`, which may look at tensors that must not be kept alive until then)."""
    if not t.numel():
        return
    if ctx.deferred is not None:
        if triton_int.screens(t):  # one kernel and a slot, not five kernels and a verdict tensor
            triton_int.screen(t, ctx.deferred.flag(t.device, error, message))
        else:
            ctx.deferred.expect(torch.isfinite(t).all(), error, message)
    elif has_nonfinite(t):
        raise error(message() + (detail() if detail else ""))


@dataclass(frozen=True, eq=False)
class Payload:
    """What travels (`tensors`) plus what both sides already know (`shape`, `dtype` of the input)."""

    tensors: tuple[Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: the sum of the payload tensors' bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def layout(self) -> Layout:
        return [TensorSpec(tuple(t.shape), t.dtype) for t in self.tensors]


@dataclass(frozen=True, eq=False)
class Context:
    """Where a tensor travels. Operators read it; they never mutate it."""

    name: str = "boundary0.act"
    """Human-readable place, used in error messages."""
    boundary: int = 0
    """Index of the stage boundary (0 = between stage 0 and stage 1)."""
    direction: str = "act"
    """"act" for forward activations, "grad" for backward activation-gradients."""
    step: int = 0
    """Optimizer step (global_steps in DeepSpeed)."""
    micro_batch: int = 0
    """Micro-batch slot within the step."""
    tensor: int = 0
    """Position of the tensor in a tuple that crosses the boundary together."""
    seed: int = 0
    """Base seed of every generator derived from this context."""
    sample_ids: Tensor | None = None
    """Per-sample ids (int64, shape (batch,)) for AQ-SGD buffers; None where unknown."""
    batch_dim: int = 0
    """Which dim of the tensor is the batch (1 for Megatron's [seq, batch, hidden]). Operators that group per sample
    see the tensor with this dim moved to the front (see `Compressor.batch_grouped`)."""
    training: bool = True
    """False for inference: stateful wrappers then neither read nor update their state."""
    deferred: "Deferred | None" = None
    """Where the non-finite checks leave their verdicts when they must not wait for the device (an accelerator):
    the engine reads them at the end of the step (`Deferred.raise_pending`). None: each check reads its verdict now."""

    @property
    def key(self) -> str:
        """State key of error-feedback buffers: boundary, direction, micro-batch slot (and tensor)."""
        return f"b{self.boundary}.{self.direction}.mb{self.micro_batch}" + (f".t{self.tensor}" if self.tensor else "")

    @property
    def sample_key(self) -> str:
        """State key of per-sample buffers (AQ-SGD): a sample may come back in any micro-batch slot."""
        return f"b{self.boundary}.{self.direction}" + (f".t{self.tensor}" if self.tensor else "")

    def noise_key(self, salt: str) -> int:
        """A 63-bit key that sender and receiver derive identically from this place; `salt` names the user."""
        text = f"{self.seed}|{self.boundary}|{self.direction}|{self.step}|{self.micro_batch}|{self.tensor}|{salt}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)

    def generator(self, device: torch.device, salt: str) -> torch.Generator:
        """A fresh generator seeded with `noise_key(salt)`."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.noise_key(salt))
        return gen

    def uniform(self, shape: tuple[int, ...] | torch.Size, device: torch.device, salt: str) -> Tensor:
        """fp32 uniforms in [0, 1) for stochastic rounding, counter-based (ops/noise.py): a fused kernel given
        `noise_key(salt)` draws the same values without this tensor."""
        return noise.uniform(shape, self.noise_key(salt), device)

    def replace(self, **changes: Any) -> "Context":
        return dataclasses.replace(self, **changes)


REGISTRY: dict[str, type["OpConfig"]] = {}
"""Every operator config by NAME, filled as each operator module is imported (see `OpConfig.__init_subclass__`)."""


class OpConfig:
    """Base of the operator configs (frozen dataclasses). See `pp_compress.config` for the grammar.

    Subclasses set NAME (the spec name), POSITIONAL (the field a bare `name:value` sets), EXAMPLES and implement
    `build()`; `from_name()` maps a spelling such as int8 or fp16 to preset fields. Defining a subclass with a
    NAME registers it: an operator is one module under pp_compress/ops/ and nothing else to edit.
    """

    NAME: ClassVar[str]
    POSITIONAL: ClassVar[str | None] = None
    FORMS: ClassVar[str] = ""
    POSITIONAL_REQUIRED: ClassVar[bool] = False
    """Whether a spec must give the POSITIONAL value (`topk` alone is an error, `topk:0.1` is not)."""
    FLAGS: ClassVar[dict[str, str]] = {}
    """Non-bool fields that a bare word sets, and to what: {"rot": "auto"} makes `int4:rot` mean `int4:rot=auto`."""
    EXAMPLES: ClassVar[tuple[str, ...]] = ()
    """Specs that together exercise every option that changes the encoding: the contract tests run each one."""
    LEARNS_FROM_GRAD: ClassVar[bool] = False
    """Whether the operator adapts to the gradient that comes back for what it sent (`Compressor.observe`). Only
    activations get such a gradient, so the config accepts it for activations only, first in a chain, and not
    under +aqsgd (whose inner operator sees a subset of the rows)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("NAME")
        if name is None:
            return
        if name in REGISTRY and REGISTRY[name].__qualname__ != cls.__qualname__:
            raise TypeError(f"operator name {name!r} of {cls.__qualname__} is taken by {REGISTRY[name].__qualname__}")
        if not cls.__dict__.get("EXAMPLES"):
            raise TypeError(f"operator config {cls.__qualname__} must list EXAMPLES (specs the contract tests run)")
        REGISTRY[name] = cls

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        """Preset fields when `name` spells this operator, else None."""
        return {} if name == cls.NAME else None

    def spec_name(self) -> str:
        return self.NAME

    def build(self) -> "Compressor":
        raise NotImplementedError


class Compressor(abc.ABC):
    """Base class: public `compress`/`decompress` check their input and call `encode`/`decode`."""

    def __init__(self, config: Any, nonfinite: str = "raise") -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r}; accepted: {', '.join(NONFINITE_POLICIES)}")
        self.config = config
        self.nonfinite = nonfinite
        self.saturated = 0
        """Elements clipped to the input dtype's finite range on the way into an inner operator (error-feedback
        wrappers only; the clipped part stays in their fp32 state). Reported as `saturated` in the statistics."""

    # --- public API -------------------------------------------------------------------------
    def compress(self, x: Tensor, ctx: Context | None = None) -> Payload:
        ctx = ctx or Context()
        check_input(x, ctx, self.nonfinite, scan=not (self.nonfinite == "raise" and self.screens_input(x)))
        bd = self._batch_dim(tuple(x.shape), ctx)
        if not bd:
            return self.encode(x, ctx)
        p = self.encode(x.movedim(bd, 0), ctx.replace(batch_dim=0))  # batch first: samples are rows of dim 0
        return Payload(p.tensors, x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Context | None = None) -> Tensor:
        """The receiver's tensor. Under nonfinite="raise" the sender's input was finite, so a NaN/Inf here means the
        reconstruction does not fit the dtype (e.g. unbiased RandK's n/k rescaling of fp16 values near its max):
        FloatingPointError naming the boundary, never a silent inf."""
        ctx = ctx or Context()
        out = self._batch_first(self.decode, payload, ctx)
        if self.nonfinite == "raise" and not self.screens_output(payload):
            expect_finite(out, ctx, FloatingPointError, self.output_message(ctx, payload.dtype),
                          lambda: f"; {int((~torch.isfinite(out)).sum())} of them")
        return out

    def output_message(self, ctx: Context, dtype: torch.dtype) -> Callable[[], str]:
        """The error of a decoded NaN/Inf under nonfinite="raise" (the sender's input was finite)."""
        return lambda: (
            f"{ctx.name}: {self.spec} decoded finite input to NaN/Inf at step {ctx.step}: the message is corrupt, or "
            f"the reconstruction does not fit {dtype} (largest finite {torch.finfo(dtype).max:.4g}; then send this "
            "tensor in a wider dtype or use an operator whose output stays within the input's range)")

    def screens_input(self, x: Tensor) -> bool:
        """Whether `_encode` reports NaN/Inf in x itself (with check_input's error, from what its own pass over x
        computes), so that `compress` need not read x once more for it. Device kernels do."""
        return False

    def screens_output(self, payload: Payload) -> bool:
        """Whether `_decode` checks its output's finiteness itself (with `output_message`, under nonfinite="raise"),
        so that `decompress` need not read the output once more for it."""
        return False

    def roundtrip(self, x: Tensor, ctx: Context | None = None) -> tuple[Tensor, Payload]:
        """compress + decompress in one process (what a sender/receiver pair does over the wire)."""
        ctx = ctx or Context()
        payload = self.compress(x, ctx)
        return self.decompress(payload, ctx), payload

    def estimate(self, payload: Payload, ctx: Context | None = None) -> Tensor:
        """What the receiver will reconstruct from `payload`, computed on the sending side right after
        `compress` without touching any state (for the relative error in the statistics)."""
        return self._batch_first(self._estimate, payload, ctx or Context())

    def layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        """The wire layout of `compress(x, ctx)` for x of this shape and dtype (what a receiver preallocates)."""
        ctx = ctx or Context()
        bd = self._batch_dim(tuple(shape), ctx)
        if not bd:
            return self.wire_layout(tuple(shape), dtype, ctx)
        return self.wire_layout(_front(tuple(shape), bd), dtype, ctx.replace(batch_dim=0))

    def batch_grouped(self) -> bool:
        """Whether this operator groups or keys anything per sample (per=sample, per=channel, lowrank's matrices,
        AQ-SGD's buffers), so that `ctx.batch_dim` must be moved to the front before it runs."""
        return False

    def _batch_dim(self, shape: tuple[int, ...], ctx: Context) -> int:
        if not ctx.batch_dim or not self.batch_grouped():
            return 0
        if len(shape) <= ctx.batch_dim:
            raise ValueError(f"{ctx.name}: batch_dim={ctx.batch_dim} but the tensor has shape {shape}; {self.spec} "
                             "groups per sample, so it needs the batch dim (set batch_dim to the dim that holds the "
                             "batch, or raise min_numel so that small tensors pass uncompressed)")
        return ctx.batch_dim

    def _batch_first(self, fn: Any, payload: Payload, ctx: Context) -> Tensor:
        """fn(payload, ctx) with the batch dim moved to the front and back again where this operator needs it."""
        bd = self._batch_dim(tuple(payload.shape), ctx)
        if not bd:
            return fn(payload, ctx)
        inner = Payload(payload.tensors, torch.Size(_front(tuple(payload.shape), bd)), payload.dtype)
        return fn(inner, ctx.replace(batch_dim=0)).movedim(0, bd)

    def _estimate(self, payload: Payload, ctx: Context) -> Tensor:
        return self.decode(payload, ctx)

    def encode(self, x: Tensor, ctx: Context) -> Payload:
        """compress without the input checks (what composed operators call); empty input -> empty payload."""
        if x.numel() == 0:
            layout = self.wire_layout(tuple(x.shape), x.dtype, ctx)
            return Payload(tuple(x.new_empty(s.shape, dtype=s.dtype) for s in layout), x.shape, x.dtype)
        return self._encode(x, ctx)

    def decode(self, payload: Payload, ctx: Context) -> Tensor:
        if TensorSpec(tuple(payload.shape), payload.dtype).numel == 0:
            device = payload.tensors[0].device if payload.tensors else None
            return torch.empty(payload.shape, dtype=payload.dtype, device=device)
        return self._decode(payload, ctx)

    # --- implemented by operators -----------------------------------------------------------
    @abc.abstractmethod
    def _encode(self, x: Tensor, ctx: Context) -> Payload: ...

    @abc.abstractmethod
    def _decode(self, payload: Payload, ctx: Context) -> Tensor: ...

    @abc.abstractmethod
    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout: ...

    def wire_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> int:
        return layout_nbytes(self.layout(tuple(shape), dtype, ctx))

    def observe(self, grad: Tensor, ctx: Context) -> None:
        """The gradient that came back for what this operator sent under `ctx` (activations only; the pipeline and
        the in-process boundary both call it). Stateless operators ignore it; see `OpConfig.LEARNS_FROM_GRAD`."""

    # --- state (only error-feedback wrappers and warm-started operators have any) ---------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self!r} is stateless but got state with keys {sorted(state)}")

    @property
    def spec(self) -> str:
        """The operator's spec string (worked out once per config: messages name it)."""
        cached = self.__dict__.get("_spec")
        if cached is None or cached[0] is not self.config:
            text = format_op(self.config) if isinstance(self.config, OpConfig) else str(self.config)
            cached = (self.config, text)
            self.__dict__["_spec"] = cached
        return cached[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _front(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """`shape` with dim `dim` moved to the front."""
    return (shape[dim],) + shape[:dim] + shape[dim + 1:]


def check_input(x: Tensor, ctx: Context, nonfinite: str, scan: bool = True) -> None:
    """TypeError for non-float input; FloatingPointError for NaN/Inf unless nonfinite == "allow" (or not `scan`: the
    operator reports them itself, `Compressor.screens_input`)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{ctx.name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{ctx.name}: only floating-point tensors are compressed, got {x.dtype} "
            f"(accepted: {', '.join(str(d) for d in FLOAT_DTYPES)}); pass other tensors through untouched"
        )
    if nonfinite == "raise" and scan:
        expect_finite(x, ctx, FloatingPointError, input_message(ctx),
                      lambda: f"; {int((~torch.isfinite(x)).sum())} of them")


def input_message(ctx: Context) -> Callable[[], str]:
    """The error of NaN/Inf input under nonfinite="raise"."""
    return lambda: (f"{ctx.name}: input has NaN/Inf values at step {ctx.step}; refusing to compress (set "
                    "nonfinite='allow' to send them through operators that preserve them)")


def saturate(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
    """Finite x (a wider float) cast to `dtype` with values beyond its finite range clipped to +-max, and how many
    were. The common case costs the cast and one fast reduction; only an overflowing cast is redone clipped."""
    out = x.to(dtype)
    if dtype == x.dtype or torch.finfo(dtype).max >= torch.finfo(x.dtype).max or not has_nonfinite(out):
        return out, 0
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype), int((x.abs() > top).sum())


def has_nonfinite(x: Tensor) -> bool:
    """Whether x holds NaN/Inf, in one fast reduction: any NaN/Inf makes the sum non-finite, and a finite sum
    proves there is none. The sum stays in x's dtype (fp32 accumulation inside; an fp32 copy of a bf16 tensor
    cost 14x the sum here). Only a sum that overflowed (finite values, mostly fp16) takes the exact check:
    max and min propagate NaN and show +-Inf."""
    if bool(torch.isfinite(x.sum())):
        return False
    return not (bool(torch.isfinite(x.amax())) and bool(torch.isfinite(x.amin())))


def format_op(cfg: OpConfig) -> str:
    """Canonical spec of one operator config: name, positional value, then non-default fields."""
    parts = [cfg.spec_name()]
    preset = cfg.from_name(cfg.spec_name()) or {}
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if f.name in preset:
            continue
        if f.name == cfg.POSITIONAL:
            parts.append(_fmt(value))
        elif f.name in cfg.FLAGS and value == cfg.FLAGS[f.name]:
            parts.append(f.name)
        elif value != f.default:
            parts.append(f.name if value is True else f"{f.name}={_fmt(value)}")
    return ":".join(parts)


def _fmt(value: Any) -> str:
    """A float as the user would type it (`vq:4`, not `vq:4.0`), exactly enough to parse back to the same value."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)
