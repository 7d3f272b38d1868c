"""pp_compress for Megatron-Core: its pipeline schedules' point-to-point traffic travels compressed.

    import pp_compress.megatron as ppm
    ppm.enable("safe")                       # once, before training: every schedule compresses
    forward_backward = get_forward_backward_func()
    losses = forward_backward(...)           # as before: 1F1B, interleaved (virtual pipeline), forward-only
    ppm.stats()                              # per link and direction: raw / wire bytes, ratio, relative error
    ppm.save(checkpoint_dir) / ppm.load(checkpoint_dir)   # the compression state, beside Megatron's checkpoint
    ppm.state_dict() / ppm.load_state_dict(state)         # or inside a checkpoint of your own

Megatron-LM (`pretrain_gpt.py`): `pretrain(..., extra_args_provider=ppm.add_arguments)` adds `--pp-compress SPEC` and
`--pp-compress-config FILE` to its command line and compresses with them.

Where it hooks: every public method of Megatron's `P2PCommunicator` (`send_forward`, `send_forward_recv_backward`,
...) goes through `_communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
wait_on_reqs)`: `tensor_send_next` carries activations to the next pipeline rank, `tensor_send_prev`
activation-gradients to the previous one. `CompressedP2PCommunicator` overrides that method alone, on the shared
`StageCompression` path (encode, recv_buffers, decode around one batch of P2P ops). `enable()` puts it where the
schedules build their communicator (the module-level name `P2PCommunicator` in `schedules.py`, one per call of a
schedule, so one per step) and marks whether each schedule call trains; after `enable()`, passing
`p2p_communicator=CompressedP2PCommunicator(pp_group, config)` with `pg_collection=` works too (a new one per call).

Link b carries activations from pipeline rank b to rank b + 1 (mod the pipeline size: the interleaved schedule's last
rank sends its chunk's output to rank 0) and their gradients back. Messages are numbered per link and direction
within a step, which both sides count alike (point-to-point messages between two ranks arrive in order), so error
feedback and seeded noise agree without any metadata on the wire. With `variable_seq_lengths`, Megatron's own
shape exchange runs first. The ops are posted as send-next, receive-prev, send-prev, receive-next: with two pipeline
ranks the previous and the next rank are one rank, and two messages to it must be posted in the order the peer
receives them (stock Megatron-Core posts send-prev first, and with the interleaved schedule on gloo the activation
and the gradient then swap).

`auto` decides each link's codec before a training step where a round is due (pp_compress.decide), over the
communicator's own p2p. Not served (refused at the first schedule call, with one message): `+aqsgd` (Megatron's
tensors carry no sample ids), `auto` with the interleaved schedule, `use_ring_exchange_p2p`. Megatron sends
[seq, batch, hidden]: per-sample operators group along dim 1 (`batch_dim=1` is set unless the spec sets it).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import package_info
from megatron.core.pipeline_parallel import p2p_communication, schedules
from torch import Tensor

from .config import CompressionConfig
from .decide import begin_step
from .ops.base import TensorSpec
from .pipe import StageCompression
from .policy import Where
from .runtime import add_spec_argument, check_args, check_same_config, load_state, resolve_config, save_state
from .selfcheck import self_check
from .stats import format_table
from .versions import EngineRange

TESTED = EngineRange("Megatron-Core", "0.16.1", "0.19.2",
                     ("0.16.1 (Python 3.11, torch 2.13.0) and 0.19.2 (Python 3.12, torch 2.14.1) on CPU with gloo",),
                     "pip install 'pp_compress[megatron]'")
"""The Megatron-Core releases whose P2PCommunicator and schedules this adapter was tested against."""
SCHEDULES = ("forward_backward_pipelining_without_interleaving", "forward_backward_pipelining_with_interleaving")


@dataclasses.dataclass
class _Session:
    """What outlives each step's communicator: the compression (state, statistics) of this rank's links."""

    cfg: CompressionConfig | None
    """None: Megatron-LM's command line says (`add_arguments`), read at the first schedule call."""
    stage: StageCompression | None = None
    step: int = -1
    training: bool = True
    counts: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    loaded: dict[str, Any] | None = None
    """State that `load` read before the first schedule call built the links: applied then."""


_SESSION: _Session | None = None


class CompressedP2PCommunicator(p2p_communication.P2PCommunicator):
    """Megatron's P2PCommunicator whose activations and activation-gradients travel compressed (module docstring).
    One per schedule call, as the schedules build theirs; the compression state lives in `enable()`'s session."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any) -> None:
        super().__init__(pp_group, config)
        if _SESSION is None:
            raise RuntimeError("pp_compress.megatron: call pp_compress.megatron.enable(spec) before the first schedule")
        self.session = _SESSION
        self.pp, self.rank = pp_group.size(), pp_group.rank()
        if self.session.stage is None:
            self.session.stage = self._start()
        self.session.step += 1
        self.session.counts.clear()
        if self.session.training:  # `auto`'s decision rounds, where due, before the step's first message
            for line in begin_step(self.session.stage.policy, self.rank, self.pp, _device(), self._exchange,
                                   self.session.step):
                print(f"[rank {dist.get_rank()}] {line}", file=sys.stderr, flush=True)  # on the sender's rank

    def _start(self) -> StageCompression:
        """The first schedule call: refuse what cannot be served, agree on the config, check the transport."""
        TESTED.check(package_info.__version__)
        cfg = _configured(self.session)
        specs = [cfg.activations, cfg.gradients, *(o for b in cfg.boundaries.values()
                                                   for o in (b.activations, b.gradients) if o)]
        refused = ([f"{s}: +aqsgd needs sample ids, which Megatron's tensors do not carry" for s in specs
                    if s.feedback == "aqsgd"]
                   + ([(f"{cfg.auto} with the interleaved schedule: auto's link probes run between neighbouring "
                        "ranks, one stage each")] if cfg.auto and self.config.virtual_pipeline_model_parallel_size
                      else [])
                   + (["use_ring_exchange_p2p"] if self.config.use_ring_exchange_p2p else []))
        if refused:
            raise NotImplementedError("pp_compress.megatron cannot serve: " + "; ".join(refused)
                                      + "; use a fixed setting such as safe, with +ef or +ef21 for error feedback")
        check_same_config(cfg, self.pp_group)
        device = _device()
        self_check(self.rank, self.pp, device, self._exchange, f"Megatron-Core {package_info.__version__}")
        links = self.pp + (1 if self.config.virtual_pipeline_model_parallel_size else 0)
        stage = StageCompression(cfg, self.rank, links)
        if self.session.loaded is not None:
            stage.load_state_dict(self.session.loaded)
            self.session.loaded = None
        return stage

    def _exchange(self, ops: list[tuple[str, int, Tensor]]) -> None:
        """The self-check's messages (peer = pipeline rank), posted at once and waited for."""
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, buf,
                                                   dist.get_global_rank(self.pp_group, peer), self.pp_group)
                                        for kind, peer, buf in ops]) if ops else []
        for work in works:
            work.wait()

    def _where(self, link: int, direction: str) -> Where:
        key = (link, direction)
        slot = self.session.counts.get(key, 0)
        self.session.counts[key] = slot + 1
        return Where(link, direction, self.session.step, slot, self.session.training)

    def _communicate(self, *, tensor_send_next: Tensor | None, tensor_send_prev: Tensor | None, recv_prev: bool,
                     recv_next: bool, tensor_shape: Any, wait_on_reqs: bool = True) -> tuple:
        stage, config = self.session.stage, self.config
        assert stage is not None
        if config.variable_seq_lengths or getattr(config, "mtp_standalone", False):
            prev_shape, next_shape = self._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev,
                                                               recv_next)
        else:
            prev_shape = next_shape = tensor_shape
        prev, nxt = (self.rank - 1) % self.pp, self.rank
        ops: dict[str, list[dist.P2POp]] = {}
        decoders: dict[str, Callable[[], Tensor]] = {}
        # the order the peer receives in (see the module docstring): send-next, recv-prev, send-prev, recv-next
        if tensor_send_next is not None:
            ops["send_next"] = self._send(tensor_send_next, nxt, "act", self.next_rank)
        if recv_prev:
            ops["recv_prev"], decoders["prev"] = self._recv(prev_shape, prev, "act", self.prev_rank)
        if tensor_send_prev is not None:
            ops["send_prev"] = self._send(tensor_send_prev, prev, "grad", self.prev_rank)
        if recv_next:
            ops["recv_next"], decoders["next"] = self._recv(next_shape, nxt, "grad", self.next_rank)
        flat = [op for group in ops.values() for op in group]
        works = dist.batch_isend_irecv(flat) if flat else []
        if wait_on_reqs:
            for work in works:
                work.wait()
            got = {name: decode() for name, decode in decoders.items()}  # the decoded tensors themselves: no copy
            return got.get("prev"), got.get("next"), None
        # the overlapped schedule holds the received tensors before they arrive: Megatron's own buffers, filled by
        # the handle's wait()
        out: dict[str, Tensor] = {}
        finish: dict[str, Callable[[], None]] = {}
        for name, shape in (("prev", prev_shape), ("next", next_shape)):
            if name in decoders:
                out[name] = torch.empty(tuple(shape), requires_grad=True, device=_device(),
                                        dtype=self.config.pipeline_dtype)
                finish[f"recv_{name}"] = functools.partial(_fill, out[name], decoders[name])
        handles, i = {}, 0
        for name, group in ops.items():
            handles[name] = _Handle(works[i:i + len(group)], finish.get(name))
            i += len(group)
        return out.get("prev"), out.get("next"), handles

    def _send(self, t: Tensor, link: int, direction: str, peer: int) -> list[dist.P2POp]:
        stage = self.session.stage
        assert stage is not None
        bufs = stage.encode([t.detach()], self._where(link, direction))
        return [dist.P2POp(dist.isend, buf, peer, self.pp_group) for _, buf in bufs]

    def _recv(self, shape: Any, link: int, direction: str, peer: int
              ) -> tuple[list[dist.P2POp], Callable[[], Tensor]]:
        """The receives to post, and what decodes them once they arrived: a leaf that wants its gradient, as
        Megatron's own receive buffers are."""
        stage, dtype = self.session.stage, self.config.pipeline_dtype
        assert stage is not None
        if dtype is None:
            raise RuntimeError("pipeline_dtype must be provided to receive (Megatron-Core's own requirement)")
        specs, where = [TensorSpec(tuple(shape), dtype)], self._where(link, direction)
        bufs = stage.recv_buffers(specs, where, _device(), [None])

        def decode() -> Tensor:
            with torch.no_grad():
                return stage.decode(specs, where, [None], bufs)[0].detach().requires_grad_()

        return [dist.P2POp(dist.irecv, buf, peer, self.pp_group) for _, buf in bufs], decode


def _fill(target: Tensor, decode: Callable[[], Tensor]) -> None:
    with torch.no_grad():
        target.copy_(decode())


class _Handle:
    """What `wait_on_reqs=False` returns per operation (the overlapped interleaved schedule waits on these): waiting
    also decodes a receive into the tensor the schedule already holds."""

    def __init__(self, works: list[Any], finish: Callable[[], None] | None) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def _device() -> torch.device:
    """Where Megatron-Core allocates what it receives: the current CUDA device."""
    current = torch.cuda.current_device()
    return current if isinstance(current, torch.device) else torch.device("cuda", current)


def _schedule(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A schedule that tells the session whether its call trains (`forward_only`)."""

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        if _SESSION is not None:
            _SESSION.training = not kwargs.get("forward_only", False)
        return fn(*args, **kwargs)

    marked._pp_compress_stock = fn  # type: ignore[attr-defined]
    return marked


def enable(compression: CompressionConfig | str | dict | None = "safe") -> None:
    """Compress every Megatron-Core pipeline schedule's traffic with `compression` (a spec string, a dict like the
    "pp_compress" JSON section, or a CompressionConfig). A bad spec fails here, with one message."""
    _, cfg = resolve_config(None, compression)
    _install(_Session(_for_megatron(cfg)))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider` (`pretrain(..., extra_args_provider=ppm.add_arguments)`): adds
    `--pp-compress SPEC` and `--pp-compress-config FILE` (JSON or YAML: its "pp_compress" section), each checked as
    the command line is parsed, and compresses every schedule with what they say (read from Megatron-LM's parsed
    arguments, `megatron.training.get_args()`, at the first schedule call). Returns the parser."""
    group = parser.add_argument_group(title="pp_compress")
    add_spec_argument(group, "--pp-compress-config")
    group.add_argument("--pp-compress-config", dest="pp_compress_config", default=None, metavar="FILE",
                       type=_config_arg, help="a JSON or YAML file whose \"pp_compress\" section is the compression")
    _install(_Session(None))
    return parser


def from_args(args: argparse.Namespace) -> CompressionConfig:
    """The compression a parsed command line asks for: --pp-compress over --pp-compress-config's section, else over
    --deepspeed_config's (Megatron-DeepSpeed). A bad file stops the job with one message."""
    return check_args(args, getattr(args, "pp_compress_config", None))


def _config_arg(path: str) -> str:
    check_args(argparse.Namespace(pp_compress=None), path)  # a bad file stops the job here, with one message
    return path


def _for_megatron(cfg: CompressionConfig) -> CompressionConfig:
    return dataclasses.replace(cfg, batch_dim=1) if cfg.batch_dim == 0 else cfg  # Megatron's [seq, batch, hidden]


def _configured(session: _Session) -> CompressionConfig:
    """The session's config; after `add_arguments`, read from Megatron-LM's arguments the first time."""
    if session.cfg is None:
        from megatron.training import get_args

        session.cfg = _for_megatron(from_args(get_args()))
    return session.cfg


def _install(session: _Session) -> None:
    global _SESSION
    _SESSION = session
    schedules.P2PCommunicator = CompressedP2PCommunicator
    for name in SCHEDULES:
        fn = getattr(schedules, name)
        setattr(schedules, name, _schedule(getattr(fn, "_pp_compress_stock", fn)))


def disable() -> None:
    """Undo `enable()`: stock communicator and schedules (the session's state is dropped)."""
    global _SESSION
    _SESSION = None
    schedules.P2PCommunicator = p2p_communication.P2PCommunicator
    for name in SCHEDULES:
        fn = getattr(schedules, name)
        setattr(schedules, name, getattr(fn, "_pp_compress_stock", fn))


def _stage() -> StageCompression:
    if _SESSION is None or _SESSION.stage is None:
        raise RuntimeError("pp_compress.megatron: nothing has run yet (enable(), then a schedule call)")
    return _SESSION.stage


def stats() -> dict[str, dict[str, Any]]:
    """This rank's counters per link and direction ("b0.act", "b0.grad", "b0.act_eval"); none before the first
    schedule call."""
    if _SESSION is None or _SESSION.stage is None:
        return {}
    return {k: v.as_dict() for k, v in _SESSION.stage.stats.items() if v.calls or v.decompress_s}


def report() -> str:
    """`stats()` as a table."""
    return format_table(_stage().stats)


def check() -> None:
    """Raise the first failed non-finite check of the step's messages (on an accelerator they are read here, not per
    message); call it after each schedule call."""
    _stage().raise_pending()


class _State:
    """The session's compression state and step, as runtime.save_state / load_state read and write it."""

    def state_dict(self) -> dict[str, Any]:
        assert _SESSION is not None
        return {"step": _SESSION.step, **_stage().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if _SESSION is None:
            raise RuntimeError("pp_compress.megatron: call enable(spec) before load()")
        rest = {k: v for k, v in state.items() if k != "step"}
        cfg = _configured(_SESSION)
        if rest["config"] != str(cfg):
            raise ValueError(f"this state was saved with config {rest['config']!r}; this run's pp_compress config is "
                             f"{str(cfg)!r}")
        if _SESSION.stage is None:
            _SESSION.loaded = rest
        else:
            _SESSION.stage.load_state_dict(rest)
        _SESSION.step = int(state["step"])


def state_dict() -> dict[str, Any]:
    """This rank's compression state and step, for a checkpoint a loop writes itself (`save` writes a file of its own)."""
    return _State().state_dict()


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore what `state_dict` returned, after `enable()` (before or after the first schedule call)."""
    _State().load_state_dict(state)


def save(checkpoint_dir: str) -> None:
    """Write this rank's compression state beside Megatron's checkpoint (one file per global rank)."""
    save_state(_State(), checkpoint_dir, dist.get_rank())


def load(checkpoint_dir: str) -> None:
    """Read what `save` wrote, after `enable()` (before or after the resumed run's first schedule call)."""
    load_state(_State(), checkpoint_dir, dist.get_rank())

