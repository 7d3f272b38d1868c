"""pp_compress for torch.distributed.pipelining (torchtitan's engine): a PipelineStage whose p2p carries payloads.

    from torch.distributed.pipelining import ScheduleGPipe
    from pp_compress.torch_pipelining import CompressedPipelineStage

    stage = CompressedPipelineStage(submodule, stage_index, num_stages, device, compression="safe")
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    schedule.step(x, target=y)               # as with PipelineStage
    stage.pp_compress_stats()                # per boundary and direction: raw / wire bytes, ratio, relative error

The four p2p hooks PipelineStage exposes to its schedules are overridden: `get_fwd_send_ops` /
`get_bwd_send_ops` encode what the stage sends into flat uint8 buffers (`StageCompression.encode`) and post those;
`get_fwd_recv_ops` / `get_bwd_recv_ops` post receives into buffers sized from the preallocated tensors' (shape,
dtype) (`StageCompression.recv_buffers`), and the payloads are decoded when the stage reads its inputs or gradients.
Boundary b lies between stage b and b + 1, as in every pp_compress engine; the spec grammar, the JSON section, the
config-agreement check and the statistics are the shared ones. Stages that a V-schedule places on one rank pass
tensors in memory: nothing crosses a wire there, so nothing is compressed. Not supported here (refused at
construction): `+aqsgd` (its sample ids would travel as a separate message) and DTensor stages.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import P2POp, batch_isend_irecv, irecv, isend
from torch.distributed.pipelining import PipelineStage

from .config import CompressionConfig
from .decide import begin_step
from .ops.base import TensorSpec
from .pipe import StageCompression
from .policy import Where
from .runtime import check_same_config, resolve_config
from .selfcheck import self_check
from .versions import EngineRange

TESTED = EngineRange("torch.distributed.pipelining", "2.13.0", "2.14.1",
                     ("2.13.0 (its CPU build) and 2.14.1 (its CUDA build) on CPU with gloo",),
                     "pip install torch==2.14.1")
"""The torch releases whose PipelineStage internals (`_retrieve_recv_*`, the receive-buffer caches) this adapter was
tested against."""


class CompressedPipelineStage(PipelineStage):
    """A PipelineStage whose activations and activation-gradients travel compressed (see the module docstring).

    `compression`: a spec string (`"act=int8,grad=int3:stoch"`, `"safe"`), a dict like the "pp_compress" JSON section,
    or a CompressionConfig; None = identity (bitwise the stock stage, with byte counters)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 *args: Any, compression: CompressionConfig | str | dict | None = None, **kwargs: Any) -> None:
        TESTED.check(torch.__version__)
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        _, cfg = resolve_config(None, compression)
        for spec in (cfg.activations, cfg.gradients, *(o for b in cfg.boundaries.values()
                                                       for o in (b.activations, b.gradients) if o)):
            if spec.feedback == "aqsgd":
                raise NotImplementedError(f"{spec}: +aqsgd needs sample ids in the tuple that crosses a boundary, "
                                          "which torch.distributed.pipelining stages do not carry; use +ef / +ef21 or "
                                          "none")
        check_same_config(cfg, self.group)
        ranks = dist.get_world_size(self.group)
        if cfg.auto and num_stages != ranks:
            raise NotImplementedError(f"{cfg.auto} with {num_stages} stages on {ranks} ranks: auto's link probes run "
                                      "between neighbouring stages one rank each; use one stage per rank, or a fixed "
                                      "setting such as safe")
        if stage_index < ranks:  # each rank's first stage: a chain over the ranks (see `_exchange`)
            self_check(stage_index, min(num_stages, ranks), self.device, self._exchange,
                       f"torch.distributed.pipelining {torch.__version__}")
        self.pp_compress = StageCompression(cfg, stage_index, num_stages)
        self.pp_compress_step = -1
        """Schedule steps run (each `Schedule.step` clears the stage's runtime state once)."""
        self._pending: dict[tuple[str, int], tuple[list[TensorSpec], Where, list[tuple[int, Tensor]]]] = {}
        """Posted receives not decoded yet: (direction, micro-batch) -> (specs, where, buffers)."""

    # --- bookkeeping --------------------------------------------------------------------------
    def clear_runtime_states(self) -> None:
        self.pp_compress_check()  # the previous step's verdicts, if the training loop did not read them
        super().clear_runtime_states()
        self.pp_compress_step += 1
        self._pending.clear()
        for line in begin_step(self.pp_compress.policy, self.stage_index, self.num_stages, self.device,  # every stage
                               self._exchange, self.pp_compress_step):
            print(f"[rank {dist.get_rank()}] {line}", file=sys.stderr, flush=True)

    def pp_compress_check(self) -> None:
        """Raise the first failed non-finite check of the messages so far (on an accelerator they are read here, not
        per message, so that the host never waits for the device mid-step); call it after each `Schedule.step`."""
        self.pp_compress.raise_pending()

    def _where(self, boundary: int, direction: str, chunk: int) -> Where:
        return Where(boundary, direction, max(self.pp_compress_step, 0), chunk, self.has_backward)

    def _exchange(self, ops: list[tuple[str, int, Tensor]]) -> None:
        """The start-up self-check's messages as the schedules send theirs: P2P ops, posted at once, then waited for.
        Only each rank's first stage (index < ranks) runs the check, over the chain of ranks: where a rank holds several
        stages (interleaved and V schedules), two stages' probes between the same pair of ranks could otherwise be
        matched the wrong way round, as untagged point-to-point messages match in posting order."""
        works = batch_isend_irecv([P2POp(isend if kind == "send" else irecv, buf, self._peer(peer), self.group)
                                   for kind, peer, buf in ops]) if ops else []
        for work in works:
            work.wait()

    def _peer(self, stage: int) -> int:
        return self._resolve_peer_global_rank(stage)

    def _to_tensor(self, arg: Any) -> Tensor:
        """The inputs torch's shape inference runs the stage on, zeroed where it would leave them uninitialised: a
        stage that receives token ids (a bottleneck's token table, say) looks them up, and uninitialised memory can
        hold ids out of any table's range."""
        t = super()._to_tensor(arg)
        if not isinstance(arg, Tensor):
            with torch.no_grad():
                t.zero_()
        return t

    # --- the four p2p hooks -------------------------------------------------------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[P2POp]:
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        dsts = {d for i in range(len(outputs)) for d in self.act_send_info[i] if d is not None}
        if not dsts:
            return []
        if dsts != {self.stage_index + 1}:
            raise NotImplementedError(f"stage {self.stage_index} sends to stages {sorted(dsts)}; pp_compress "
                                      "compresses the traffic of a linear pipeline (stage i to i + 1)")
        where = self._where(self.stage_index, "act", fwd_chunk_id)
        bufs = self.pp_compress.encode([t.detach() for t in outputs], where)
        return [P2POp(isend, buf, self._peer(self.stage_index + 1), self.group) for _, buf in bufs]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[P2POp]:
        infos = [i for i in self.args_recv_info[fwd_chunk_id] if not i.is_root_arg and i.buffer is not None]
        return self._post_recv(infos, "act", self.stage_index - 1, fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[P2POp]:
        if not self.has_backward or self.is_first:
            return []
        if self.grad_send_info is None:
            self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
        grads = [g for g, dst in zip(self.bwd_cache.pop(bwd_chunk_id), self.grad_send_info, strict=True)
                 if dst is not None and g is not None]
        if not grads:
            return []
        where = self._where(self.stage_index - 1, "grad", bwd_chunk_id)
        return [P2POp(isend, buf, self._peer(self.stage_index - 1), self.group)
                for _, buf in self.pp_compress.encode(grads, where)]

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[P2POp]:
        if not self.has_backward or self.is_last:
            return []
        infos = [i for i in self.grad_recv_info[bwd_chunk_id] if i.buffer is not None]
        return self._post_recv(infos, "grad", self.stage_index, bwd_chunk_id)

    def _post_recv(self, infos: list[Any], direction: str, boundary: int, chunk: int) -> list[P2POp]:
        """Receives for what crosses `boundary` in `direction`: buffers sized from the stock buffers' (shape, dtype)."""
        if not infos:
            return []
        peer = {"act": self.stage_index - 1, "grad": self.stage_index + 1}[direction]
        specs = [TensorSpec(tuple(i.buffer.shape), i.buffer.dtype) for i in infos]
        where = self._where(boundary, direction, chunk)
        plain = self.pp_compress.plain_buffers(specs, self.device)  # integer tensors travel first, as they are
        known: list[Tensor | None] = [None] * len(specs)
        for i, buf in plain:
            known[i] = buf
        floats = self.pp_compress.recv_buffers(specs, where, self.device, known)
        self._pending[(direction, chunk)] = (specs, where, plain + floats)
        return [P2POp(irecv, buf, self._peer(peer), self.group) for _, buf in plain + floats]

    # --- decoding where the stage reads what it received --------------------------------------
    def _decoded(self, direction: str, chunk: int, infos: list[Any]) -> None:
        """Replace the receive buffers of `infos` by the decoded tensors of a posted receive, if one is pending."""
        pending = self._pending.pop((direction, chunk), None)
        if pending is None:  # nothing was received over the wire (first stage, or a V-schedule's local pass)
            return
        specs, where, bufs = pending
        plain: list[Tensor | None] = [None] * len(specs)
        floats = []
        for i, buf in bufs:
            if specs[i].dtype.is_floating_point:
                floats.append((i, buf))
            else:
                plain[i] = buf
        for info, t in zip(infos, self.pp_compress.decode(specs, where, plain, floats), strict=True):
            info.buffer = t.detach()

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> Any:
        infos = [i for i in self.args_recv_info[fwd_chunk_id] if not i.is_root_arg and i.buffer is not None]
        self._decoded("act", fwd_chunk_id, infos)
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
        self._decoded("grad", bwd_chunk_id, [i for i in self.grad_recv_info[bwd_chunk_id] if i.buffer is not None])
        return super()._retrieve_recv_grads(bwd_chunk_id)

    # --- statistics and state -----------------------------------------------------------------
    def pp_compress_stats(self) -> dict[str, dict[str, Any]]:
        """This stage's counters per boundary and direction ("b0.act", "b0.grad", "b0.act_eval")."""
        return {k: v.as_dict() for k, v in self.pp_compress.stats.items() if v.calls or v.decompress_s}

    def pp_compress_state_dict(self) -> dict[str, Any]:
        """The compression state (error feedback) and step count, to save next to the model's checkpoint (e.g. with
        `pp_compress.runtime.save_state`)."""
        return {"step": self.pp_compress_step, **self.pp_compress.state_dict()}

    def load_pp_compress_state_dict(self, state: dict[str, Any]) -> None:
        self.pp_compress.load_state_dict({k: v for k, v in state.items() if k != "step"})
        self.pp_compress_step = int(state["step"])
