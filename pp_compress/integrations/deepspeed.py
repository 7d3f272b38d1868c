"""The DeepSpeed shim: a PipelineEngine whose four p2p instructions send compressed payloads.

    engine, optimizer, _, scheduler = pp_compress.deepspeed.initialize(
        model=pipeline_module, config=ds_config, compression="act=int8,grad=topk:0.1+ef")

Only this file imports deepspeed. What it relies on (tested with DeepSpeed `TESTED`; checked when enabled):
- `_INSTRUCTION_MAP` holds base-class functions, so the subclass rebuilds it for its overrides to run;
- `deepspeed.initialize` builds `deepspeed.PipelineEngine` by its package-level name, so `initialize`
  swaps that name for the duration of the call;
- the uncompressed activation meta (shape, dtype) is still exchanged once by DeepSpeed's own
  handshake, and both sides derive the payload layout from it; receive buffers are our own;
- a non-last stage's backward pass backpropagates a single-tensor output with `outputs.backward(self.grad_layer)`
  (`_OneBackwardPass` gives it one root in place of several float outputs);
- `client_state` is written per stage by data-parallel rank 0 only, so compression state goes to a
  file per global rank next to the checkpoint;
- on CPU, DeepSpeed's communication op creates a shared-memory allreduce buffer per rank
  (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, 69 MB) and never removes it: `finish` does.
"""
from __future__ import annotations

import argparse
import copy
import functools
import inspect
import os
import sys
import warnings
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.utils import PartitionedTensor
from deepspeed.utils import logger

try:
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
except ModuleNotFoundError:  # DeepSpeed before 0.19.7 has no DualPipeV schedule: there is nothing of it to adapt
    DualPipeVEngine = DualPipeVModule = None

from .. import buildlock, runtime
from ..decide import begin_step
from ..config import CompressionConfig
from ..ops.base import TensorSpec
from ..ops.fused import environment_ninja
from ..pipe import StageCompression, View, sample_ids_of
from ..policy import Where
from ..runtime import SECTION, check_same_config, load_json, load_state, resolve_config, save_state
from ..selfcheck import self_check
from ..stats import format_table
from ..versions import EngineRange

TESTED = EngineRange("DeepSpeed", "0.18.9", "0.19.8", ("0.18.9", "0.19.8"), "pip install 'pp_compress[deepspeed]'")
"""The DeepSpeed releases whose pipeline internals this adapter was tested against (the pyproject extra's range)."""


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


class _Compressed:
    """What every compressed engine adds besides its p2p: counters, logging, checkpointed compression state, and the
    micro-batch counters that pair a sender's k-th message with the receiver's k-th."""

    pp_compress: StageCompression

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._pp_mb: dict[Any, int] = {}  # each instruction type runs in micro-batch order: count per type
        super()._exec_schedule(pipe_schedule)  # type: ignore[misc]

    def _mb(self, kind: Any) -> int:
        n = self._pp_mb.get(kind, 0)
        self._pp_mb[kind] = n + 1
        return n

    # --- statistics and logging ---------------------------------------------------------------
    def pp_compress_stats(self) -> dict[str, dict[str, Any]]:
        """This stage's counters: raw and wire bytes, ratio, time, relative error (and its sums err_sq / ref_sq), per
        boundary and direction ("b0.act", "b0.grad", "b0.act_eval")."""
        return {k: v.as_dict() for k, v in self.pp_compress.stats.items() if v.calls or v.decompress_s}

    def pp_compress_report(self) -> str:
        """This stage's counters as a table (what `train_batch` logs every steps_per_print steps)."""
        rows = {k: v for k, v in self.pp_compress.stats.items() if v.calls}
        return f"pp_compress stage {self.stage_id} step {self.global_steps}\n{format_table(rows)}"

    def pp_compress_config(self) -> CompressionConfig:
        """The compression config this engine runs."""
        return self.pp_compress.cfg

    def pp_compress_self_check(self) -> None:
        """The start-up self-check (pp_compress/selfcheck.py) through DeepSpeed's p2p.send/recv between neighbouring
        ranks of the pipe; every stage runs it before its first batch."""
        self_check(self.stage_id, self.num_stages, self.device, self.pp_compress_exchange,
                   f"DeepSpeed {deepspeed.__version__}")
        self._pp_checked = True

    def pp_compress_exchange(self, ops: list) -> None:
        """Messages outside the schedule (the self-check's probes, auto's link probes and decisions): DeepSpeed's
        p2p.send/recv between neighbouring ranks of the pipe, one blocking call at a time, in the order given."""
        for kind, peer, buf in ops:
            (p2p.send if kind == "send" else p2p.recv)(buf, peer)

    def train_batch(self, data_iter: Any = None) -> Any:
        if not getattr(self, "_pp_checked", False):
            self.pp_compress_self_check()
        for line in begin_step(self.pp_compress.policy, self.stage_id, self.num_stages, self.device,  # every stage
                               self.pp_compress_exchange, self.global_steps):
            print(f"[rank {self.global_rank}] {line}", file=sys.stderr, flush=True)  # on the sender's rank
        loss = super().train_batch(data_iter)
        self.pp_compress.raise_pending()  # the step's non-finite verdicts left on the device, read once
        every = self.steps_per_print()
        if every and self.global_steps % every == 0 and self.grid.data_parallel_id == 0:
            logger.info(self.pp_compress_report())
        return loss

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_pp_checked", False):
            self.pp_compress_self_check()
        out = super().eval_batch(*args, **kwargs)
        self.pp_compress.raise_pending()
        return out

    # --- checkpoints: one file of compression state per global rank ---------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        # Before super(): it ends with a barrier and writes `latest` last, so no rank sees a partial checkpoint.
        save_state(self.pp_compress, os.path.join(save_dir, tag), self.global_rank)
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                       **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
        load_path, client_state = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if load_path is not None and not kwargs.get("load_module_only"):  # weights only: no training state
            load_state(self.pp_compress, os.path.dirname(load_path), self.global_rank)
        return load_path, client_state



class _OneBackwardPass(PipelineEngine):
    """One backward pass per micro-batch on a stage that sends several float tensors (a hidden state and a side
    tensor, say). DeepSpeed backpropagates a stage's float outputs one at a time (`out.backward(grad,
    retain_graph=True)` for each), so such a stage walks its whole graph once per tensor, and its backward costs
    that many times as much. This hands DeepSpeed a single root instead, r = sum_i <o_i, g_i>: its gradient with
    respect to each output o_i is exactly the received g_i (1 * g_i), so one pass delivers them all. DeepSpeed's own
    hooks on each output still see their gradient, and the rest of its backward (flags, bf16 buffers, timers) runs as
    before. The parameters' gradients are DeepSpeed's up to the order in which two paths' contributions are added
    (as in torch.distributed.pipelining, whose stages take one pass over all their outputs)."""

    def _exec_backward_pass(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        several = not (self.is_last_stage() or torch.is_tensor(outputs) or self.is_pipe_partitioned)
        outs = [t for t in outputs if t.is_floating_point()] if several else []
        if len(outs) > 1 and all(t.requires_grad for t in outs):  # else DeepSpeed's own path (and its own errors)
            root = sum((o * g).sum() for o, g in zip(outs, self.grad_layer))  # () : the inner products' sum
            self.pipe_buffers["outputs"][buffer_id], self.grad_layer = root, torch.ones_like(root)
        super()._exec_backward_pass(buffer_id)


class CompressedPipelineEngine(_Compressed, _OneBackwardPass):
    """PipelineEngine with compressed SendActivation/RecvActivation/SendGrad/RecvGrad."""

    pp_compress: StageCompression

    def pp_compress_setup(self, cfg: CompressionConfig) -> None:
        if self.is_grad_partitioned and not self.is_pipe_partitioned:
            raise NotImplementedError("pipeline.grad_partitioned without pipe_partitioned is not supported (DeepSpeed "
                                      "itself rebuilds the partitioned output only when both are set); set both or "
                                      "neither")
        check_same_config(cfg)
        self.pp_compress = StageCompression(cfg, self.stage_id, self.num_stages)
        self._pp_mb: dict[str, int] = {}
        self._pp_act_specs: list[TensorSpec] | None = None
        self._pp_act_tuple = False

    # --- bookkeeping --------------------------------------------------------------------------
    def reset_activation_shape(self) -> None:
        """DeepSpeed's, and forget the activation shapes received: the sender sends its meta message again, so the
        receiver must read it again (else that message would be taken for the first payload)."""
        super().reset_activation_shape()
        self._pp_act_specs = None

    def _where(self, kind: str) -> dict[str, Any]:
        return {"step": self.global_steps, "micro_batch": self._mb(kind), "training": self.module.training}

    def _views(self, partitioned: bool) -> Any:
        """Under tensor-parallel partitioning a tuple starts (PartitionedTensor meta, this rank's flat slice): compress
        the slice seen with its rows (`partition_view`); nothing else changes."""
        if not partitioned:
            return None
        bd = self.pp_compress.cfg.batch_dim
        return lambda ts: {1: partition_view([int(v) for v in ts[0].tolist()], bd)}

    # --- the four instructions ----------------------------------------------------------------
    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]  # (meta, slice, *rest) when pipe-partitioned
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        tensors = [outputs] if torch.is_tensor(outputs) else list(outputs)
        self.pp_compress.send(tensors, self.stage_id, "act", send_fn=lambda t: p2p.send(t, self.next_stage),
                              views=self._views(self.is_pipe_partitioned), **self._where("send_act"))

    def _exec_recv_activations(self, buffer_id: int) -> None:
        if self.dynamic_shape or self._pp_act_specs is None:
            meta = self._recv_tensor_meta(self.prev_stage)  # DeepSpeed's handshake: shapes and dtypes
            self._pp_act_tuple = not torch.is_tensor(meta)
            self._pp_act_specs = [TensorSpec(tuple(t.shape), t.dtype) for t in (meta if self._pp_act_tuple else [meta])]
        recvd = self.pp_compress.recv(self._pp_act_specs, self.stage_id - 1, "act", device=self.device,
                                      recv_fn=lambda t: p2p.recv(t, self.prev_stage),
                                      views=self._views(self.is_pipe_partitioned), **self._where("recv_act"))
        for t in recvd:
            t.requires_grad = t.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = tuple(recvd) if self._pp_act_tuple else recvd[0]

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]  # pipe-partitioned: the full first input (forward rebuilt it)
        grads = [inputs.grad] if torch.is_tensor(inputs) else [t.grad for t in inputs if t.is_floating_point()]
        if any(g is None for g in grads):
            raise RuntimeError(f"stage {self.stage_id}: a floating-point input received no gradient; cannot send it "
                               "back")
        if self.is_grad_partitioned:  # as DeepSpeed: (meta, this rank's 1/TP slice of the first gradient, *rest)
            part = PartitionedTensor(tensor=grads[0], group=self.grid.get_slice_parallel_group())
            grads = [part.to_meta(), part.data(), *grads[1:]]
        self.pp_compress.send(grads, self.stage_id - 1, "grad", send_fn=lambda t: p2p.send(t, self.prev_stage),
                              sample_ids=_ids(inputs), views=self._views(self.is_grad_partitioned),
                              **self._where("send_grad"))
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.is_pipe_partitioned and not self.is_grad_partitioned:
            # As DeepSpeed: full gradients come back, so rebuild the full output from (meta, slice) for their shapes;
            # its backward pass then takes outputs[0] as the full output.
            part = PartitionedTensor.from_meta(meta=outputs[0].to("cpu"), local_part=outputs[1],
                                               group=self.grid.get_slice_parallel_group())
            outputs[0].data = part.full()
            outputs = (outputs[0], *outputs[2:])
            self.pipe_buffers["outputs"][buffer_id] = outputs
        if self.is_grad_partitioned:  # (meta, slice) of the first gradient, then the other float gradients
            outs = [outputs[0], outputs[1], *(t for t in outputs[2:] if t.is_floating_point())]
        else:
            outs = [outputs] if torch.is_tensor(outputs) else [t for t in outputs if t.is_floating_point()]
        grads = self.pp_compress.recv([TensorSpec(tuple(t.shape), t.dtype) for t in outs], self.stage_id, "grad",
                                      device=self.device, recv_fn=lambda t: p2p.recv(t, self.next_stage),
                                      sample_ids=_ids(outputs), views=self._views(self.is_grad_partitioned),
                                      **self._where("recv_grad"))
        self.grad_layer = grads[0] if torch.is_tensor(outputs) else grads

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.BackwardPass: _OneBackwardPass._exec_backward_pass,
    }

if DualPipeVEngine is not None:
    class CompressedDualPipeVEngine(_Compressed, DualPipeVEngine, _OneBackwardPass):
        """DualPipeVEngine whose batched p2p carries compressed payloads. Rank r runs model stage r in phase 0 and model
        stage 2N - 1 - r in phase 1 (N ranks, 2N model stages); boundary b lies between model stages b and b + 1. Its
        receives are posted with the other p2p ops of a step and decoded once CommitP2P has waited for them. Its
        backward pass calls PipelineEngine's through super(), which this class's order makes `_OneBackwardPass`'s."""

        def pp_compress_setup(self, cfg: CompressionConfig) -> None:
            specs = [cfg.activations, cfg.gradients,
                     *(x for o in cfg.boundaries.values() for x in (o.activations, o.gradients) if x)]
            if any(spec.feedback == "aqsgd" for spec in specs):
                raise NotImplementedError("+aqsgd under DualPipeV: its sample ids would have to be received before "
                                          "the payloads they size, and DualPipeV posts a step's receives together; use "
                                          "+ef / +ef21 or none")
            if cfg.auto:
                raise NotImplementedError(f"{cfg.auto} under DualPipeV: each rank holds two stages of the V, and "
                                          "auto's link probes run between neighbouring stages one rank each; use a "
                                          "fixed setting such as safe")
            check_same_config(cfg)
            self.pp_compress = StageCompression(cfg, self.stage_id, 2 * self.num_stages)
            self._pp_mb = {}
            self._pp_pending: list[tuple[str, int, bool, list[TensorSpec], Where, list, list]] = []

        def _model_stage(self, phase: int) -> int:
            return self.stage_id if phase == 0 else 2 * self.num_stages - 1 - self.stage_id

        def _at(self, boundary: int, direction: str, kind: str, phase: int) -> Where:
            return Where(boundary, direction, self.global_steps, self._mb((kind, phase)), self.module.training)

        def _exec_send_activations(self, buffer_id: int, phase: int) -> None:
            outputs = self.pipe_buffers["outputs"][buffer_id]
            stage = self._downstream_stage(phase)
            if self._first_send[phase]:  # DeepSpeed's meta handshake, once per phase, uncompressed
                self._first_send[phase] = False
                self._send_tensor_meta(outputs, stage)
            where = self._at(self._model_stage(phase), "act", "send_act", phase)
            tensors = [outputs] if torch.is_tensor(outputs) else list(outputs)
            self._queue_p2p(deepspeed.comm.isend, [b for _, b in self.pp_compress.encode(tensors, where)], stage)
            if not torch.is_grad_enabled():
                self.pipe_buffers["outputs"][buffer_id] = None

        def _exec_recv_activations(self, buffer_id: int, phase: int) -> None:
            stage = self._upstream_stage(phase)
            if self._recv_specs[phase] is None:
                meta = self._recv_tensor_meta(stage)
                metas = [meta] if torch.is_tensor(meta) else meta
                self._recv_specs[phase] = (torch.is_tensor(meta), [(t.shape, t.dtype) for t in metas])
            is_tensor, shapes = self._recv_specs[phase]
            specs = [TensorSpec(tuple(shape), dtype) for shape, dtype in shapes]
            where = self._at(self._model_stage(phase) - 1, "act", "recv_act", phase)
            self._post_recv("act", buffer_id, is_tensor, specs, where, stage)

        def _exec_send_grads(self, buffer_id: int, phase: int) -> None:
            inputs = self.pipe_buffers["inputs"][buffer_id]
            grads = [t.grad for t in ([inputs] if torch.is_tensor(inputs) else inputs) if t.is_floating_point()]
            if any(g is None for g in grads):
                raise RuntimeError(f"stage {self.stage_id}: a floating-point input received no gradient; cannot send "
                                   "it back")
            where = self._at(self._model_stage(phase) - 1, "grad", "send_grad", phase)
            self._queue_p2p(deepspeed.comm.isend, [b for _, b in self.pp_compress.encode(grads, where)],
                            self._upstream_stage(phase))
            self.pipe_buffers["inputs"][buffer_id] = None

        def _exec_recv_grads(self, buffer_id: int, phase: int) -> None:
            outputs = self.pipe_buffers["outputs"][buffer_id]
            specs = [TensorSpec(tuple(t.shape), t.dtype) for t in ([outputs] if torch.is_tensor(outputs) else outputs)
                     if t.is_floating_point()]
            where = self._at(self._model_stage(phase), "grad", "recv_grad", phase)
            self._post_recv("grad", buffer_id, torch.is_tensor(outputs), specs, where, self._downstream_stage(phase))

        def _post_recv(self, kind: str, buffer_id: int, is_tensor: bool, specs: list[TensorSpec], where: Where,
                       stage: int) -> None:
            plain = self.pp_compress.plain_buffers(specs, self.device)
            known: list[Any] = [None] * len(specs)
            for i, buf in plain:
                known[i] = buf
            floats = self.pp_compress.recv_buffers(specs, where, self.device, known)
            self._queue_p2p(deepspeed.comm.irecv, [b for _, b in plain + floats], stage)
            self._pp_pending.append((kind, buffer_id, is_tensor, specs, where, plain, floats))
            self.pipe_buffers["inputs" if kind == "act" else "grads"][buffer_id] = None  # filled after the commit

        def _exec_commit_p2p(self) -> None:
            super()._exec_commit_p2p()  # posts and waits for every queued op
            for kind, buffer_id, is_tensor, specs, where, plain, floats in self._pp_pending:
                known: list[Any] = [None] * len(specs)
                for i, buf in plain:
                    known[i] = buf.view(torch.bool) if specs[i].dtype == torch.bool else buf
                out = self.pp_compress.decode(specs, where, known, floats)
                if kind == "act":
                    for t in out:
                        t.requires_grad_(t.is_floating_point())
                    self.pipe_buffers["inputs"][buffer_id] = out[0] if is_tensor else tuple(out)
                else:
                    self.pipe_buffers["grads"][buffer_id] = out[0] if is_tensor else out
            self._pp_pending = []

        _INSTRUCTION_MAP = {
            **DualPipeVEngine._INSTRUCTION_MAP,
            schedule.SendActivation: _exec_send_activations,
            schedule.RecvActivation: _exec_recv_activations,
            schedule.SendGrad: _exec_send_grads,
            schedule.RecvGrad: _exec_recv_grads,
            schedule.CommitP2P: _exec_commit_p2p,
        }


def _ids(tensors: Any) -> Any:
    return None if torch.is_tensor(tensors) else sample_ids_of(list(tensors))


def initialize(model: PipelineModule, config: dict | str | None = None,
               compression: CompressionConfig | str | dict | None = None, **kwargs: Any) -> tuple:
    """Drop-in for deepspeed.initialize that returns a CompressedPipelineEngine (CompressedDualPipeVEngine for a
    DualPipeVModule)."""
    if not isinstance(model, PipelineModule):
        raise TypeError("pp_compress compresses pipeline traffic: model must be a deepspeed.pipe.PipelineModule, got "
                        f"{type(model).__name__}")
    TESTED.check(deepspeed.__version__)
    ds_config, cfg = resolve_config(config, compression)
    dualpipev = DualPipeVModule is not None and isinstance(model, DualPipeVModule)
    name, engine = (("DualPipeVEngine", CompressedDualPipeVEngine) if dualpipev
                    else ("PipelineEngine", CompressedPipelineEngine))
    saved = getattr(deepspeed, name)
    setattr(deepspeed, name, engine)  # deepspeed.initialize builds the engine class by this package-level name
    try:
        out = _stock_initialize()(model=model, config=ds_config, **kwargs)
    finally:
        setattr(deepspeed, name, saved)
    out[0].pp_compress_setup(cfg)
    return out


def jit_ops() -> list[Any]:
    """The op builders of what DeepSpeed JIT-builds when a job here starts (`deepspeed.init_distributed`): its CPU
    accelerator's shared-memory communication op; none where the accelerator's collectives need no build (NCCL)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder]


def check_build_locks() -> None:
    """Before `deepspeed.init_distributed`: a build lock of one of `jit_ops()` that no running build holds raises
    buildlock.StaleBuildLock, naming the file, where DeepSpeed would wait on it forever."""
    if not torch.distributed.is_initialized():
        for op in jit_ops():
            buildlock.check(op.name)


def prebuild() -> list[str]:
    """Build `jit_ops()` now (or find them built), so that no job pays for the build, nor is killed during it; their
    names. `python -m pp_compress.kernels` calls it where DeepSpeed is installed."""
    for op in jit_ops():
        buildlock.check(op.name)
        with environment_ninja():  # the ninja a job's launcher finds too: another one's log would rebuild it
            op.load(verbose=False)
    return [op.name for op in jit_ops()]


def check_args(args: argparse.Namespace, config: dict | str | None = None) -> CompressionConfig:
    """`runtime.check_args` (the compression that `--pp-compress` and the config section ask for, one message and exit 2
    on a bad value), then the build locks DeepSpeed's start would wait on (`check_build_locks`), before any work."""
    cfg = runtime.check_args(args, config)
    try:
        check_build_locks()
    except buildlock.StaleBuildLock as e:
        runtime.exit_once(f"pp_compress: {e}")
    return cfg


def enable() -> None:
    """One line for Megatron-DeepSpeed (or any script that calls `deepspeed.initialize` itself): from now on,
    `deepspeed.initialize(model=<PipelineModule>, ...)` whose DeepSpeed config (`args.deepspeed_config`, `config=`
    or `config_params=`, in DeepSpeed's own precedence) has a "pp_compress" section returns the compressed engine,
    configured from that section (a DualPipeVModule gets the compressed DualPipeV engine). Any other call runs stock
    DeepSpeed unchanged: without the section silently; with it, a model that is not a PipelineModule
    (DeepSpeedEngine) runs stock with a one-time warning that nothing is compressed. Calling it again does nothing;
    `disable()` restores the stock function."""
    if getattr(deepspeed.initialize, "_pp_compress_stock", None) is not None:
        return
    TESTED.check(deepspeed.__version__)
    check_build_locks()
    stock = deepspeed.initialize
    params = inspect.signature(stock)

    @functools.wraps(stock)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        bound = params.bind_partial(*args, **kwargs).arguments
        ds_args = bound.get("args")
        config = getattr(ds_args, "deepspeed_config", None) or bound.get("config") or bound.get("config_params")
        if SECTION not in load_json(config):
            return stock(*args, **kwargs)
        if not isinstance(bound.get("model"), PipelineModule):
            notice("not-pipeline", f"pp_compress: the DeepSpeed config has a \"{SECTION}\" section, but this model is "
                                   f"a {type(bound.get('model')).__name__}, not a PipelineModule: no pipeline traffic "
                                   "to compress, DeepSpeed runs it unchanged")
            return stock(*args, **kwargs)
        if getattr(ds_args, "deepspeed_config", None) is not None:  # DeepSpeed would read the file again, section too
            ds_args = copy.copy(ds_args)
            ds_args.deepspeed_config = None
        rest = {k: v for k, v in bound.items() if k not in ("args", "model", "config", "config_params")}
        return initialize(bound["model"], config=load_json(config), args=ds_args, **rest)

    hooked._pp_compress_stock = stock  # type: ignore[attr-defined]
    deepspeed.initialize = hooked


_NOTICED: set[str] = set()


def notice(key: str, message: str) -> None:
    """Say `message` once per process (a RuntimeWarning): pp_compress passing an engine through, not compressing."""
    if key not in _NOTICED:
        _NOTICED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


SHM_BUFFER = "deepspeed_allreduce_buffer"
"""The name prefix of DeepSpeed's CPU shared-memory allreduce buffers (deepspeed/ops/csrc/cpu/comm/shm.cpp)."""


def shm_buffer(rank: int) -> str:
    """The path of one rank's allreduce buffer for this job (its MASTER_ADDR and MASTER_PORT)."""
    return (f"/dev/shm/{SHM_BUFFER}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def finish(status: int = 0) -> Any:
    """`pp_compress.runtime.finish` for DeepSpeed jobs: after a barrier (every rank mapped every buffer when the
    process group started), unlink this rank's shared-memory allreduce buffer, which DeepSpeed leaves in /dev/shm
    otherwise: 69 MB per rank and run, until the machine's shared memory is full. Mappings outlive the name."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        try:
            os.unlink(shm_buffer(torch.distributed.get_rank()))
        except FileNotFoundError:  # no shm op (GPU, or ranks on several machines): nothing was created
            pass
    runtime.finish(status)


def disable() -> None:
    """Undo `enable()`."""
    deepspeed.initialize = _stock_initialize()


def _stock_initialize() -> Any:
    return getattr(deepspeed.initialize, "_pp_compress_stock", deepspeed.initialize)


def add_argparse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds --pp-compress SPEC (wins over the config's "pp_compress" section). The spec is validated while the command
    line is parsed: a bad one stops the job at once with one message. Validate the config section too right after
    parsing, with `check_args(args)`."""
    runtime.add_spec_argument(parser, 'the config\'s "pp_compress" section')
    return parser
