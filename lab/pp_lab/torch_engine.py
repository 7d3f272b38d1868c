"""The recipes' training loop on torch.distributed.pipelining (`recipes/pretrain.py --engine torch`).

The same GPT layers, cut where DeepSpeed cuts them (`model.stage_cuts`), one stage per process (on this process's
accelerator where there is one, else the CPU), each a
`pp_compress.torch_pipelining.CompressedPipelineStage` driven by torch's 1F1B schedule. What a torchtitan-style
user adds to their own loop is the stage class and its `compression=` argument; the loop itself (optimizer, logs,
checkpoints with the stage's compression state) is lab/pp_lab/loop.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pp_lab import loop
from pp_lab.bottleneck import Basis
from pp_lab.model import GPTConfig, layer, layers, lm_loss, stage_cuts


class Stage(nn.Module):
    """Consecutive layers of the GPT as one pipeline stage; the flow between layers is (hidden, sample_ids)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *flow: Tensor) -> Any:
        x: Any = flow if len(flow) > 1 else flow[0]
        for part in self.parts:
            x = part(x)
        return x


def check(args: argparse.Namespace) -> None:
    """What this engine's recipes cannot do, refused before any work."""
    if not args.untied:
        raise SystemExit("--engine torch: tied embeddings need a gradient all-reduce between the first and the last "
                         "stage, which this loop does not do; add --untied")
    bad = [f for f, on in (("--dualpipev", args.dualpipev), ("--tp", args.tp > 1),
                           ("--subspace", getattr(args, "subspace", None) is not None), ("--bf16", args.bf16),
                           ("--sbh", args.sbh), ("--optimizer muon", args.optimizer == "muon")) if on]
    if bad:
        raise SystemExit(f"--engine torch does not support {', '.join(bad)}; use --engine deepspeed for them")


def device() -> torch.device:
    """This process's accelerator (the one `train.init_distributed` selected), else the CPU."""
    if torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


class _Engine:
    """One stage of torch's 1F1B schedule, as lab/pp_lab/loop.py drives it."""

    name, description = "torch", "torch.distributed.pipelining, 1F1B"

    def __init__(self, stage: Any, schedule: Any, mod: nn.Module, last: int, dev: torch.device) -> None:
        self.stage, self.schedule, self.module, self.last, self.dev = stage, schedule, mod, last, dev

    def step(self, batch: Any) -> float:
        (ids, sample_ids), labels = batch
        losses: list[Tensor] = []
        inputs = (ids.to(self.dev), sample_ids.to(self.dev)) if self.stage.is_first else ()
        self.schedule.step(*inputs, target=labels.to(self.dev) if self.stage.is_last else None, losses=losses)
        return float(torch.stack(losses).detach().mean()) if self.stage.is_last else 0.0

    def evaluate(self, batches: Iterator[Any]) -> float:
        (ids, sample_ids), labels = next(batches)
        losses: list[Tensor] = []
        self.schedule.eval(*((ids.to(self.dev), sample_ids.to(self.dev)) if self.stage.is_first else ()),
                           target=labels.to(self.dev) if self.stage.is_last else None, losses=losses)
        return float(torch.stack(losses).mean()) if self.stage.is_last else 0.0

    def clip(self, max_norm: float) -> None:
        loop.clip_(list(self.module.parameters()), max_norm)

    def check(self) -> None:
        self.stage.pp_compress_check()  # the step's deferred non-finite verdicts (on an accelerator), read once

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.stage.pp_compress_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.stage.pp_compress_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage.load_pp_compress_state_dict(state)


def train(args: argparse.Namespace, cfg: GPTConfig, meta: dict[str, Any], train_ds: Any, val_ds: Any,
          batches_fn: Any, eval_batches_fn: Any, bases: dict[int, Basis] | None = None,
          checkpoint: Path | None = None) -> dict[str, Any]:
    """Train over torch.distributed.pipelining: from scratch, or from a transformers `checkpoint` (each rank keeps
    its stage's layers); `bases`: the bottleneck's initial Basis per cut, if cfg has one."""
    from pp_compress.runtime import check_args
    from pp_compress.torch_pipelining import CompressedPipelineStage
    from torch.distributed.pipelining import Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.stages:
        raise SystemExit(f"--engine torch runs one pipeline: start --stages ({args.stages}) processes, not {world}")
    compression = check_args(args)
    bounds = [0, *(c + 1 for c in stage_cuts(cfg, args.stages)), cfg.n_layer + 2]  # embedding, blocks, head (untied)
    lo, hi = bounds[rank], bounds[rank + 1]
    if checkpoint is None:  # the same random numbers on every rank: each builds them all and keeps its own slice
        parts = layers(cfg, None, bases)[lo:hi]
    else:  # every weight comes from the checkpoint: each rank loads only its own layers
        parts = [layer(cfg, i, checkpoint, bases) for i in range(lo, hi)]
    dev = device()
    mod = Stage(parts).to(dev)
    stage = CompressedPipelineStage(mod, rank, args.stages, dev, compression=compression)  # shapes are inferred
    # from the first micro-batch (torch's dynamic mode)
    schedule = Schedule1F1B(stage, n_microbatches=args.grad_accum, loss_fn=lm_loss)
    engine = _Engine(stage, schedule, mod, args.stages - 1, dev)
    return loop.run(args, engine, compression, meta, train_ds, val_ds, batches_fn, eval_batches_fn, dev)
