"""The boundary policy: for a tensor crossing a stage boundary, which operator runs, with which Context, and under which
statistics key. The pipeline (`pipe.StageCompression`, under any engine) and the in-process boundary
(`boundary.CompressionBoundary`) are both thin adapters over `BoundaryPolicy`, so the two cannot drift apart.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .auto import LADDER, candidate_op
from .config import AutoConfig, CompressionConfig
from .ops.base import FLOAT_DTYPES, Compressor, Context, TensorSpec
from .stats import DirectionStats

DIRECTIONS = ("act", "grad")
NOOP_WARN_AFTER = 8
"""Messages a boundary sends under a compressing spec, none of them compressed, before it warns that the setting does
nothing there (a few, so one odd message does not warn; few enough to warn within the first step)."""


@dataclass(frozen=True)
class Trial:
    """`auto`'s close call (decide.py) being tried for one window of steps from `start`: `challenger` runs on the steps
    an even number after it, `incumbent` on the others."""

    incumbent: str
    challenger: str
    start: int


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
    decides per tensor: floating point, at least min_numel elements, past the warm-up
    (`CompressionConfig.compresses`)."""

    def __init__(self, cfg: CompressionConfig) -> None:
        self.cfg = cfg
        self._ops: dict[tuple[int, str, bool], Compressor | None] = {}
        self.auto = AutoConfig.parse(cfg.auto) if cfg.auto else None
        self.decisions: dict[tuple[int, str], str] = {}
        """auto: the candidate each boundary and direction runs ("none" until its first decision); inference uses the
        activations' decision."""
        self.samples: dict[tuple[int, str], Tensor] = {}
        """auto: a copy of the last message's largest tensor before a decision step, on the side that sends it."""
        self._auto_ops: dict[tuple[int, str, str], Compressor] = {}
        self.validated: dict[tuple[int, str, str], float] = {}
        """auto, on the sending side: each candidate's relative error on a boundary when it was first chosen there."""
        self.barred: set[tuple[int, str, str]] = set()
        """auto, on the sending side: candidates the guard stepped back from, per boundary and direction."""
        self.links: dict[tuple[int, str], Any] = {}
        """auto, on the sending side: each boundary and direction's last measured link (auto.Link)."""
        self.probed: dict[tuple[int, str], int] = {}
        """auto, on the sending side: the round in which each link was last measured."""
        self.costs: dict[tuple[int, str], tuple[Any, dict[str, Any]]] = {}
        """auto, on the sending side: ((shape, dtype), each candidate's auto.Cost) last measured per boundary and
        direction (again with the link, or for a new shape)."""
        self.rounds = 0
        """auto: decision rounds run so far in this process."""
        self.tick: float | None = None
        """auto: the host clock when this stage's current step began (after its round, if it had one)."""
        self.durations: list[tuple[int, float]] = []
        """auto: this stage's (step, seconds) since the last round (decide.begin_step), rounds excluded."""
        self.window_steps: list[tuple[int, float]] = []
        """auto: the (step, seconds) of the window that the last round closed."""
        self.window: float | None = None
        """auto: the median step time of the window before the last round."""
        self.trials: dict[tuple[int, str], Trial] = {}
        """auto, on the sending side: the close call being tried per boundary and direction (Trial)."""
        self.alternate: dict[tuple[int, str], tuple[str, int]] = {}
        """auto, on both sides: during a trial, (the candidate that runs in place of the decision on odd steps after
        the start, the start step)."""
        self.settled: dict[tuple[int, str], tuple[str, int]] = {}
        """auto, on the sending side: (what the last trial kept, the round it was settled in)."""

    def op(self, boundary: int, direction: str, training: bool, step: int | None = None) -> Compressor | None:
        """The operator of one boundary and direction (None for identity), built on first use; under auto, at `step`
        where a trial alternates two candidates (None: the decision)."""
        if self.auto is not None:
            direction = direction if training else "act"
            name = self.decisions.get((boundary, direction), "none")
            alternate = self.alternate.get((boundary, direction)) if training and step is not None else None
            if alternate is not None and (step - alternate[1]) % 2:
                name = alternate[0]
            if name == "none":
                return None
            if (boundary, direction, name) not in self._auto_ops:
                self._auto_ops[boundary, direction, name] = candidate_op(name, boundary, direction, self.cfg.nonfinite)
            return self._auto_ops[boundary, direction, name]
        key = (boundary, direction, training)
        if key not in self._ops:
            spec = self.cfg.spec_for(boundary, direction, training)
            same = not training and spec == self.cfg.spec_for(boundary, direction)
            self._ops[key] = self.op(boundary, direction, True) if same else (
                None if spec.is_identity else spec.build(self.cfg.nonfinite))
        return self._ops[key]

    def built(self, boundary: int, direction: str, training: bool = True) -> Compressor | None:
        """The operator if it was built already (it has state or stashed tensors only then), else None."""
        if self.auto is not None:
            return self.op(boundary, direction, training)
        return self._ops.get((boundary, direction, training))

    # --- auto ---------------------------------------------------------------------------------
    def auto_due(self, step: int) -> bool:
        """Whether `auto` decides before training step `step` (both sides of every boundary ask the same)."""
        return self.auto is not None and step >= 1 and (step - 1) % self.auto.every == 0

    def remember(self, tensors: list[Tensor], where: Where) -> None:
        """Keep a copy of the message's largest float tensor when the next step decides (micro-batch 0)."""
        if not (where.training and where.micro_batch == 0 and self.auto_due(where.step + 1)):
            return
        floats = [t for t in tensors if t.dtype in FLOAT_DTYPES]
        if floats:
            self.samples[where.boundary, where.direction] = max(floats, key=lambda t: t.numel()).detach().clone()

    def decide(self, boundary: int, direction: str, name: str) -> bool:
        """Run candidate `name` from now on; True when that is a change. A candidate switched to starts with fresh
        state (its error feedback, if any, belongs to the messages it sent, not to those another candidate sent)."""
        _candidate(name, "auto decision {!r}")
        old = self.decisions.get((boundary, direction), "none")
        self.decisions[boundary, direction] = name
        if name == old:
            return False
        self._auto_ops.pop((boundary, direction, name), None)
        return True

    def alternate_with(self, boundary: int, direction: str, name: str | None, start: int) -> None:
        """During a trial: run candidate `name` in place of the decision on the odd steps after `start` (None: no
        trial). Each keeps its own operator, and with it its state, while they alternate."""
        if name is None:
            self.alternate.pop((boundary, direction), None)
        else:
            self.alternate[boundary, direction] = (_candidate(name, "auto trial candidate {!r}"), start)

    def measures_error(self, where: Where) -> bool:
        """Whether this message's relative error goes into the statistics: micro-batch 0 of every error_every-th step
        (it costs a decode, or a pass over both tensors, on the sender)."""
        return bool(self.cfg.error_every) and where.micro_batch == 0 and where.step % self.cfg.error_every == 0

    def plan(self, spec: TensorSpec, where: Where) -> Compressor | None:
        """The operator that compresses a tensor of this shape and dtype here, or None: it travels as it is."""
        if spec.dtype not in FLOAT_DTYPES:
            return None
        if not self.cfg.compresses(spec.numel, spec.dtype, where.step, where.training):
            return None
        return self.plan_op(where)

    def plan_op(self, where: Where) -> Compressor | None:
        """The operator this boundary, direction and step runs, whatever the tensor."""
        return self.op(where.boundary, where.direction, where.training, where.step)

    def account(self, specs: list[TensorSpec], ops: list[Compressor | None], where: Where, stats: DirectionStats,
                name: str | None = None) -> None:
        """Count one message (the tensors of one tuple and the operator each got) in `stats`, and warn once when a
        compressing spec has done nothing for NOOP_WARN_AFTER messages: every float tensor was below min_numel, or
        none was floating point. Warm-up and identity specs are intended and never warn."""
        stats.compressed += sum(op is not None for op in ops)
        if any(op is not None for op in ops) or self.plan_op(where) is None:
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
        """The training operators' state (error feedback, importance vectors, warm starts) and the config it belongs to;
        under auto also each boundary's decision."""
        if self.auto is not None:
            ops = {f"{b}.{d}": op.state_dict() for (b, d) in self.decisions if (op := self.op(b, d, True)) is not None}
            return {"config": str(self.cfg), "ops": ops,
                    "auto": {f"{b}.{d}": name for (b, d), name in sorted(self.decisions.items())},
                    "auto_validated": {f"{b}.{d}.{n}": v for (b, d, n), v in sorted(self.validated.items())},
                    "auto_barred": sorted(f"{b}.{d}.{n}" for b, d, n in self.barred),
                    "auto_settled": {f"{b}.{d}": name for (b, d), (name, _) in sorted(self.settled.items())},
                    "auto_trials": {f"{b}.{d}": [t.incumbent, t.challenger, t.start]
                                    for (b, d), t in sorted(self.trials.items())},
                    "auto_alternate": {f"{b}.{d}": [name, start]
                                       for (b, d), (name, start) in sorted(self.alternate.items())}}
        return {"config": str(self.cfg),
                "ops": {f"{b}.{d}": op.state_dict() for (b, d, tr), op in self._ops.items() if op is not None and tr}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != str(self.cfg):
            raise ValueError(f"this state was saved with config {state['config']!r}; this run's pp_compress config is "
                             f"{str(self.cfg)!r}")
        for key, name in state.get("auto", {}).items():
            b, d = key.split(".")
            self.decide(int(b), d, name)
        for key, level in state.get("auto_validated", {}).items():
            b, d, n = key.split(".")
            self.validated[int(b), d, n] = float(level)
        for key in state.get("auto_barred", []):
            b, d, n = key.split(".")
            self.barred.add((int(b), d, n))
        for key, name in state.get("auto_settled", {}).items():  # rounds count from 0 again in this process
            b, d = key.split(".")
            self.settled[int(b), d] = (_candidate(name, _FROM_STATE), 0)
        for key, (incumbent, challenger, start) in state.get("auto_trials", {}).items():
            b, d = key.split(".")
            self.trials[int(b), d] = Trial(_candidate(incumbent, _FROM_STATE), _candidate(challenger, _FROM_STATE),
                                           _start(start))
        for key, (name, start) in state.get("auto_alternate", {}).items():
            b, d = key.split(".")
            self.alternate_with(int(b), d, _candidate(name, _FROM_STATE), _start(start))
        for key, sub in state["ops"].items():
            b, d = key.split(".")
            op = self.op(int(b), d, True)
            if op is not None:
                op.load_state_dict(sub)


_FROM_STATE = "auto candidate {!r} in the checkpoint's state"


def _start(step: Any) -> int:
    """A trial's start step read from a checkpoint's state: an integer, else a ValueError that says what it was."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"auto trial start {step!r} in the checkpoint's state; accepted: an integer step")
    return step


def _candidate(name: str, what: str) -> str:
    """`name` if it is one of auto's candidates, else a ValueError that says what it was (`what`, formatted with the
    name): a decision, or a name read from a checkpoint's state, which is input like any other."""
    if name not in LADDER:
        raise ValueError(f"{what.format(name)}; accepted: {', '.join(LADDER)}")
    return name
