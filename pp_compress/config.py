"""Typed configs, the spec-string grammar and its JSON round-trip.

Grammar (one parser for the CLI flag, the DeepSpeed JSON and Python):

    config     := [preset ","] item ("," item)* | spec ("," item)*
                                                   a bare spec (first item) sets both directions; a preset
                                                   (pp_compress/presets.py: safe, aggressive) stands for its spec
    item       := key "=" value
    key        := act | grad | eval | warmup | min_numel | seed | nonfinite | b<N>.act | b<N>.grad
    spec       := op (">" op)* ["+" feedback]      e.g. topk:0.1>int8+ef
    op         := name (":" arg)*                  arg := value | field=value | flag
    feedback   := ef | ef21 | aqsgd [":first=" op (">" op)*]
                                                   AQ-SGD's first visit of a sample compressed (default raw)

`str(cfg)` is canonical and `parse_spec(str(cfg)) == cfg`; `to_dict`/`from_dict` round-trip the same
content as JSON-able dicts (the `"pp_compress"` section of a DeepSpeed config).
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .feedback import FEEDBACKS, WRAPPERS
from .ops import op_configs
from .ops.base import NONFINITE_POLICIES, Compressor, OpConfig, format_op
from .ops.chain import Chain
from .presets import MODELS, PRESETS, expand

SPEC_FORMS = ("op[:args][>op[:args]][+ef|+ef21|+aqsgd[:first=op[:args]]], op one of: "
              + "; ".join(c.FORMS for c in op_configs()))


def _accepted() -> str:
    return ("accepted operators: " + "; ".join(c.FORMS for c in op_configs()) + "; feedback suffix: +"
            + ", +".join(FEEDBACKS) + "; or a preset: " + ", ".join(PRESETS))


def _convert(raw: str, typ: Any, token: str, forms: str) -> Any:
    try:
        if typ is bool:
            if raw.lower() in ("true", "1", "yes"):
                return True
            if raw.lower() in ("false", "0", "no"):
                return False
            raise ValueError(raw)
        return typ(raw)
    except ValueError:
        raise ValueError(f"bad value {raw!r} in {token!r}: expected {typ.__name__}; accepted forms: {forms}") from None


def parse_op(token: str) -> OpConfig:
    """One operator, e.g. `int4:per=block64:asym`."""
    name, *args = token.strip().split(":")
    matches = [(cls, preset) for cls in op_configs() if (preset := cls.from_name(name)) is not None]
    if not matches:
        raise ValueError(f"unknown operator {name!r} in {token!r}; {_accepted()}")
    if len(matches) > 1:
        raise TypeError(f"operator name {name!r} is claimed by {[c.__qualname__ for c, _ in matches]}")
    cls, preset = matches[0]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(preset)
    positional_used = False
    for arg in args:
        if "=" in arg:
            key, raw = arg.split("=", 1)
        elif arg in names and hints[arg] is bool:
            key, raw = arg, "true"
        elif arg in cls.FLAGS:
            key, raw = arg, cls.FLAGS[arg]
        elif cls.POSITIONAL and not positional_used:
            key, raw, positional_used = cls.POSITIONAL, arg, True
        else:
            raise ValueError(f"unexpected argument {arg!r} in {token!r}; accepted forms: {cls.FORMS}")
        if key not in names or key in preset:
            raise ValueError(f"unknown option {key!r} in {token!r}; accepted forms: {cls.FORMS}")
        kwargs[key] = _convert(raw, hints[key], token, cls.FORMS)
    if cls.POSITIONAL_REQUIRED and cls.POSITIONAL not in kwargs:
        raise ValueError(f"{token!r} needs a value, e.g. {cls.FORMS.split('[')[0]}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"bad operator {token!r}: {e}") from None


@dataclass(frozen=True)
class CompressorSpec:
    """A chain of operators, optionally wrapped in error feedback: `topk:0.1>int8+ef`."""

    ops: tuple[OpConfig, ...] = ()
    """Operators applied in order: each later one compresses the float tensors of the one before."""
    feedback: str | None = None
    """Error compensation wrapper: ef, ef21, aqsgd, or None."""
    first: tuple[OpConfig, ...] = ()
    """+aqsgd only: the chain that compresses a sample's first visit (`+aqsgd:first=int8`); empty sends it raw."""

    def __post_init__(self) -> None:
        if not self.ops:
            object.__setattr__(self, "ops", (parse_op("identity"),))
        if self.feedback is not None and self.feedback not in FEEDBACKS:
            raise ValueError(f"feedback {self.feedback!r}; accepted: {', '.join(FEEDBACKS)}")
        if self.first and self.feedback != "aqsgd":
            first = ">".join(format_op(op) for op in self.first)
            got = "+" + self.feedback if self.feedback else "no feedback"
            raise ValueError(f"first={first} compresses AQ-SGD's first visit of a sample; it needs +aqsgd, not {got}")
        for op in self.first:
            if op.LEARNS_FROM_GRAD:
                raise ValueError(f"{format_op(op)} learns from the gradient, so it cannot compress AQ-SGD's first "
                                 "visit")
        for i, op in enumerate(self.ops):
            if op.LEARNS_FROM_GRAD and (i > 0 or self.feedback == "aqsgd"):
                raise ValueError(f"{format_op(op)} learns from the gradient of the tensor it compresses, so it must "
                                 f"come first in a chain and not under +aqsgd (got {self})")

    @property
    def learns_from_grad(self) -> bool:
        """Whether an operator of this spec adapts to the gradient that comes back (activations only)."""
        return any(op.LEARNS_FROM_GRAD for op in self.ops)

    @classmethod
    def parse(cls, text: str) -> "CompressorSpec":
        text = text.strip()
        if not text:
            raise ValueError(f"empty compression spec; accepted: {SPEC_FORMS}")
        body, *fb = text.split("+")
        if len(fb) > 1:
            raise ValueError(f"at most one feedback suffix in {text!r}; accepted: +{', +'.join(FEEDBACKS)}")
        feedback, _, arg = fb[0].strip().partition(":") if fb else (None, "", "")
        if feedback is not None and feedback not in FEEDBACKS:
            raise ValueError(f"unknown feedback {feedback!r} in {text!r}; accepted: +{', +'.join(FEEDBACKS)}")
        first: tuple[OpConfig, ...] = ()
        if arg:  # the rest of the token is the first-visit chain: its operators may have arguments of their own
            if feedback != "aqsgd" or not arg.startswith("first="):
                raise ValueError(f"unexpected feedback argument {arg!r} in {text!r}; accepted: "
                                 "+aqsgd:first=<op>[><op>]")
            first = tuple(parse_op(t) for t in arg[len("first="):].split(">"))
        return cls(tuple(parse_op(t) for t in body.split(">")), feedback, first)

    def __str__(self) -> str:
        first = f":first={'>'.join(format_op(op) for op in self.first)}" if self.first else ""
        return ">".join(format_op(op) for op in self.ops) + (f"+{self.feedback}{first}" if self.feedback else "")

    @property
    def is_identity(self) -> bool:
        return str(self) == "identity"

    def build(self, nonfinite: str = "raise") -> Compressor:
        comp = _chain(self.ops)
        if self.feedback:  # `first` only ever comes with aqsgd (__post_init__)
            comp = WRAPPERS[self.feedback](comp, **({"first": _chain(self.first)} if self.first else {}))
        for part in _walk(comp):
            part.nonfinite = nonfinite
        return comp


def _chain(ops: tuple[OpConfig, ...]) -> Compressor:
    """The operators applied in order, as one compressor."""
    comp = ops[-1].build()
    for op in reversed(ops[:-1]):
        comp = Chain(op.build(), comp)
    return comp


def _walk(comp: Compressor) -> list[Compressor]:
    parts = [comp]
    for child in ("inner", "outer", "first"):
        if getattr(comp, child, None) is not None:
            parts += _walk(getattr(comp, child))
    return parts


SpecLike = CompressorSpec | str


def _spec(value: SpecLike | None) -> CompressorSpec | None:
    return CompressorSpec.parse(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class BoundaryOverride:
    """Per-boundary replacement of the default specs (None keeps the default)."""

    activations: CompressorSpec | None = None
    """Spec of forward activations crossing this boundary."""
    gradients: CompressorSpec | None = None
    """Spec of backward activation-gradients crossing this boundary."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activations", _spec(self.activations))
        object.__setattr__(self, "gradients", _spec(self.gradients))


_KEYS = {"act": "activations", "grad": "gradients", "eval": "eval", "auto": "auto", "warmup": "warmup_steps",
         "min_numel": "min_numel", "seed": "seed", "nonfinite": "nonfinite", "error_every": "error_every",
         "batch_dim": "batch_dim"}
_INT_FIELDS = ("warmup_steps", "min_numel", "seed", "error_every", "batch_dim")
_BOUNDARY_KEY = re.compile(r"b(\d+)\.(act|grad)")


Budget = Literal["safe", "aggressive"]
RUNGS: tuple[str, ...] = ("none", "safe", "aggressive")
"""The budgets' order: a budget admits the candidates on its rung and below it."""


def model_name(text: str) -> str | None:
    """The family among MODELS that `text` names, compared without case and with '-' or '_' for spaces (so that a
    spec needs no quoting: `model=small-gpt`); None if it names none."""
    def key(t: str) -> str:
        return t.lower().replace("-", " ").replace("_", " ")

    return next((m for m in MODELS if key(m) == key(text)), None)


@dataclass(frozen=True)
class AutoConfig:
    """`auto[:max=safe|aggressive][:model=...][:every=N]`: the spec alone; which candidates it admits and how it
    decides are in auto.py and decide.py."""

    max: Budget = "safe"
    """The most aggressive preset `auto` may pick."""
    model: str | None = None
    """The model family whose verdicts admit a candidate ('small GPT' or 'SmolLM2-135M'; `parse` also takes them
    without case and with '-' for spaces); None: a preset must be at parity by the loss rule on every testbed it was
    measured on, and no other candidate is admitted."""
    every: int = 20
    """Steps between decisions: the first is made at step 1 (on step 0's tensors), then at 1 + every, 1 + 2 every..."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"auto:every={self.every!r}; accepted: an integer >= 1")
        if self.max not in RUNGS[1:]:
            raise ValueError(f"auto:max={self.max!r}; accepted: {', '.join(RUNGS[1:])}")
        if self.model is not None and self.model not in MODELS:
            raise ValueError(f"auto:model={self.model!r}; accepted: {', '.join(MODELS)}")

    @classmethod
    def parse(cls, spec: str) -> "AutoConfig":
        """`auto`, `auto:max=aggressive`, `auto:model=SmolLM2-135M:max=safe:every=50`; an unknown key is an error."""
        head, *items = spec.split(":")
        if head != "auto":
            raise ValueError(f"{spec!r} is not an auto spec; accepted: auto[:max=safe|aggressive][:model=<family>]"
                             "[:every=N]")
        kwargs: dict[str, object] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in ("max", "model", "every") or key in kwargs:
                raise ValueError(f"auto: {item!r} in {spec!r}; accepted keys: max=safe|aggressive, model=<family> "
                                 f"({', '.join(MODELS)}), every=<steps>, each once")
            kwargs[key] = int(value) if key == "every" and value.isdigit() else value
        if "model" in kwargs:
            kwargs["model"] = model_name(str(kwargs["model"])) or kwargs["model"]
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CompressionConfig:
    """Everything pp_compress needs to know: what to apply where and when."""

    activations: CompressorSpec = field(default_factory=CompressorSpec)
    """Spec of forward activations at every boundary (default identity)."""
    gradients: CompressorSpec = field(default_factory=CompressorSpec)
    """Spec of backward activation-gradients at every boundary (default identity)."""
    eval: CompressorSpec | None = None
    """Spec of activations at inference (eval_batch / model.eval()); None = same as `activations`."""
    auto: str = ""
    """`auto[:max=safe|aggressive][:model=<family>][:every=N]` (pp_compress/auto.py): each boundary and direction
    picks its setting from its measured link and codec time, among the presets at parity; "" = off. Excludes act=,
    grad=, eval= and per-boundary specs."""
    warmup_steps: int = 0
    """Steps sent uncompressed before compression starts."""
    min_numel: int = 1024
    """Tensors with fewer elements than this are sent uncompressed. The default keeps scalars and tiny tensors
    (a MoE model's aggregated loss, gates, small masks) exact: below ~4 KB a message's cost is its latency. It is a
    fixed count rather than one scaled to the hidden size because what it protects (scalars, gates, masks) does not
    scale with the model; a boundary whose every message falls below it warns once and names this setting."""
    seed: int = 0
    """Seed of every random choice (RandK indices, stochastic rounding, sketches)."""
    nonfinite: str = "raise"
    """NaN/Inf in a tensor to compress: raise (default, names the boundary) or allow."""
    error_every: int = 10
    """Measure the relative error ||x - x_hat|| / ||x|| for the statistics on the sender, on micro-batch 0
    of every N-th step (one extra local decode; the in-process boundary too); 0 = never."""
    batch_dim: int = 0
    """Which dim of the tensors crossing a boundary is the batch: 0 for [batch, seq, hidden], 1 for Megatron's
    [seq, batch, hidden]. Per-sample grouping (per=sample, per=channel, lowrank) and per-sample state (+aqsgd) use
    it; with a wrong value they silently group by sequence position instead."""
    boundaries: dict[int, BoundaryOverride] = field(default_factory=dict)
    """Overrides by boundary index (0 = between stage 0 and stage 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activations", _spec(self.activations))
        object.__setattr__(self, "gradients", _spec(self.gradients))
        object.__setattr__(self, "eval", _spec(self.eval))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}; accepted: an integer >= 0")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={self.nonfinite!r}; accepted: {', '.join(NONFINITE_POLICIES)}")
        if self.auto:
            AutoConfig.parse(self.auto)  # a bad auto spec fails here, naming what is accepted
            fixed_specs = [k for k, v in (("act", self.activations), ("grad", self.gradients), ("eval", self.eval))
                           if v is not None and not v.is_identity] + [f"b{b}" for b in self.boundaries]
            if fixed_specs:
                raise ValueError(f"{self.auto} chooses every boundary's setting itself; it cannot be combined with "
                                 f"{', '.join(fixed_specs)}")
        fixed = {}
        for b, o in dict(self.boundaries).items():
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ValueError(f"boundary index {b!r}; accepted: an integer >= 0")
            fixed[b] = o if isinstance(o, BoundaryOverride) else BoundaryOverride(**o)
        object.__setattr__(self, "boundaries", dict(sorted(fixed.items())))
        grads = [("grad", self.gradients)] + [(f"b{b}.grad", o.gradients) for b, o in self.boundaries.items()
                                              if o.gradients]
        for key, spec in grads:
            if spec.learns_from_grad:
                raise ValueError(f"{key}={spec}: this operator learns from the gradient that comes back for what it "
                                 "sends, and only activations get one (a bare spec sets both directions); use "
                                 "act=..., and e.g. nat, int<b>:stoch or topk for gradients")

    def __hash__(self) -> int:
        return hash(str(self))

    def spec_for(self, boundary: int, direction: str, training: bool = True) -> CompressorSpec:
        """The spec that applies to one boundary and direction ("act" or "grad")."""
        if direction not in ("act", "grad"):
            raise ValueError(f"direction={direction!r}; accepted: act, grad")
        if direction == "act" and not training:
            return self.eval or self.spec_for(boundary, "act")
        o = self.boundaries.get(boundary)
        chosen = (o.activations if direction == "act" else o.gradients) if o else None
        return chosen or (self.activations if direction == "act" else self.gradients)

    def compresses(self, numel: int, dtype: torch.dtype, step: int, training: bool) -> bool:
        """Whether a tensor of this size and dtype is compressed at this step: floating point, at least min_numel
        (and non-empty) elements, and past the warm-up when training. The pipeline and the in-process boundary
        both ask here."""
        if not dtype.is_floating_point or numel < max(self.min_numel, 1):
            return False
        return not training or step >= self.warmup_steps

    def __str__(self) -> str:
        items = [self.auto] if self.auto else [f"act={self.activations}", f"grad={self.gradients}"]
        if self.eval is not None:
            items.append(f"eval={self.eval}")
        for key, name in list(_KEYS.items())[4:]:
            value = getattr(self, name)
            if value != getattr(CompressionConfig, name, None):
                items.append(f"{key}={value}")
        for b, o in self.boundaries.items():
            items += [f"b{b}.act={o.activations}"] if o.activations else []
            items += [f"b{b}.grad={o.gradients}"] if o.gradients else []
        return ",".join(items)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"auto": self.auto} if self.auto else {"activations": str(self.activations),
                                                                    "gradients": str(self.gradients)}
        if self.eval is not None:
            d["eval"] = str(self.eval)
        d.update(warmup_steps=self.warmup_steps, min_numel=self.min_numel, seed=self.seed, nonfinite=self.nonfinite,
                 error_every=self.error_every, batch_dim=self.batch_dim)
        if self.boundaries:
            d["boundaries"] = {
                str(b): {k: str(v) for k, v in (("activations", o.activations), ("gradients", o.gradients)) if v}
                for b, o in self.boundaries.items()
            }
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressionConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown pp_compress key(s) {unknown}; accepted: {sorted(names)}")
        kwargs = dict(d)
        bounds: dict[int, BoundaryOverride] = {}
        for b, o in dict(kwargs.pop("boundaries", {})).items():
            if not str(b).isdigit():
                raise ValueError(f"boundary key {b!r}; accepted: a boundary index such as \"0\"")
            bad = sorted(set(o) - {"activations", "gradients"})
            if bad:
                raise ValueError(f"unknown key(s) {bad} in boundaries[{b!r}]; accepted: activations, gradients")
            bounds[int(b)] = BoundaryOverride(**o)
        return cls(**kwargs, boundaries=bounds)


def parse_spec(text: str) -> CompressionConfig:
    """`topk:0.1`, `act=int8,grad=topk:0.1+ef`, `act=int8,grad=int8,b2.grad=bf16,warmup=100`, `safe`."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"malformed pp_compress spec {text!r}: empty item; e.g. 'topk:0.1' or "
                         "'act=int8,grad=topk:0.1+ef'")
    preset = items[0] if items[0] in PRESETS else None
    items = expand(items)
    kwargs: dict[str, Any] = {}
    bounds: dict[int, dict[str, str]] = {}
    for i, item in enumerate(items):
        key, sep, value = item.partition("=")
        m = _BOUNDARY_KEY.fullmatch(key.strip())
        if sep and m:
            bounds.setdefault(int(m.group(1)), {})[_KEYS[m.group(2)]] = value
        elif sep and key.strip() in _KEYS:
            name = _KEYS[key.strip()]
            if name in kwargs:
                raise ValueError(f"{key.strip()!r} given twice in {text!r}"
                                 + (f" (the preset {preset!r} stands for {PRESETS[preset]!r})" if preset else ""))
            kwargs[name] = int(value) if name in _INT_FIELDS and value.strip().isdigit() else value.strip()
        elif i == 0 and (item == "auto" or item.startswith("auto:")):
            kwargs["auto"] = item
        elif i == 0:
            kwargs["activations"] = kwargs["gradients"] = item
        else:
            raise ValueError(
                f"bad item {item!r} in {text!r}; accepted keys: {', '.join(_KEYS)}, b<N>.act, b<N>.grad "
                "(a bare spec is allowed only as the first item)"
            )
    for name in _INT_FIELDS:
        if isinstance(kwargs.get(name), str):
            raise ValueError(f"{name}={kwargs[name]!r} in {text!r}; accepted: an integer >= 0")
    return CompressionConfig(**kwargs, boundaries={b: BoundaryOverride(**o) for b, o in bounds.items()})


def build(spec: SpecLike, nonfinite: str = "raise") -> Compressor:
    """Any operator spec (`topk:0.1`, `int4:per=block64`, `topk:0.1>int8+ef`) -> Compressor."""
    return _spec(spec).build(nonfinite)  # type: ignore[union-attr]
