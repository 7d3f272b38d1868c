"""The recipes' training loop on torch.distributed.pipelining (`recipes/pretrain.py --engine torch`).

The same GPT layers, cut where DeepSpeed cuts them (`model.stage_cuts`), one stage per process (on this process's
accelerator where there is one, else the CPU), each a
`pp_compress.torch_pipelining.CompressedPipelineStage` driven by torch's 1F1B schedule. What a torchtitan-style
user adds to their own loop is the stage class and its `compression=` argument; everything else here is a plain
loop: AdamW with the recipes' warm-up + cosine schedule, gradient clipping over the whole pipeline, metrics.jsonl
and the compression table as lab/pp_lab/train.py writes them. Checkpoints (--save-every, --resume) are one file per
rank, <out>/ckpt/global_step<N>/rank<r>.pt: the stage's weights, the optimizer and LR schedule, and the stage's
compression state (`pp_compress_state_dict`), written atomically and read with `weights_only=True`; `latest` names
the newest complete one, as in DeepSpeed's layout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from pp_lab.bottleneck import Basis
from pp_lab.model import GPTConfig, layer, layers, lm_loss, stage_cuts
from pp_lab.train import Logger, evaluate_batches, gather_digests, prune_checkpoints, rss_mb


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


def train(args: argparse.Namespace, cfg: GPTConfig, meta: dict[str, Any], train_ds: Any, val_ds: Any,
          batches_fn: Any, eval_batches_fn: Any, bases: dict[int, Basis] | None = None,
          checkpoint: Path | None = None) -> dict[str, Any]:
    """Train over torch.distributed.pipelining: from scratch, or from a transformers `checkpoint` (each rank keeps
    its stage's layers); `bases`: the bottleneck's initial Basis per cut, if cfg has one."""
    from pp_compress.runtime import check_args
    from pp_compress.stats import format_table
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
    opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warm = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm))))
    args.out.mkdir(parents=True, exist_ok=True)
    main = rank == 0
    ckpt = args.out / "ckpt"
    if main and args.overwrite and not args.resume:  # check_args let an earlier run through only with --overwrite
        for name in ("metrics.jsonl", "metrics.csv", "summary.json", "run.json"):
            (args.out / name).unlink(missing_ok=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.barrier()
    start = load(ckpt, rank, mod, opt, sched, stage, dev) if args.resume else 0
    log = Logger(args.out, main, start)
    if main and start == 0:
        (args.out / "run.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model": meta,
                                                       "pp_compress": str(compression), "engine": "torch",
                                                       "world": world, "stages": args.stages}, indent=1))
    it = batches_fn(train_ds, args.micro_batch * args.grad_accum, args.seed, skip=start)
    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len

    def evaluate() -> float:
        return _from_last(evaluate_batches(
            lambda: eval_batches_fn(val_ds, args.micro_batch * args.grad_accum), args.eval_batches,
            lambda batches: _eval(schedule, stage, next(batches), dev)), args.stages, dev)

    val_loss = math.nan
    if args.eval_at_start and start == 0:  # where the run starts from (a bottleneck's initialisation, say)
        val_loss = evaluate()
        log.write({"kind": "eval", "step": 0, "tokens": 0, "val_loss": val_loss,
                   "val_ppl": math.exp(min(val_loss, 50))})
    bar = tqdm(total=args.steps, initial=start, disable=not main, dynamic_ncols=True, unit="step")
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        (ids, sample_ids), labels = next(it)
        losses: list[Tensor] = []
        opt.zero_grad()
        inputs = (ids.to(dev), sample_ids.to(dev)) if stage.is_first else ()
        schedule.step(*inputs, target=labels.to(dev) if stage.is_last else None, losses=losses)
        stage.pp_compress_check()  # the step's deferred non-finite verdicts (on an accelerator), read once
        clip_(mod, 1.0)
        opt.step()
        sched.step()
        loss = _from_last(float(torch.stack(losses).detach().mean()) if stage.is_last else 0.0, args.stages, dev)
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            log.write({"kind": "train", "step": step, "tokens": step * tokens_per_step, "loss": loss,
                       "lr": sched.get_last_lr()[0], "step_s": (now - t0) / args.log_every,
                       "tokens_per_s": args.log_every * tokens_per_step / (now - t0), "rss_mb": rss_mb()})
            bar.set_postfix(loss=f"{loss:.3f}")
            t0 = now
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            val_loss = evaluate()
            log.write({"kind": "eval", "step": step, "tokens": step * tokens_per_step, "val_loss": val_loss,
                       "val_ppl": math.exp(min(val_loss, 50))})
            t0 = time.perf_counter()
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save(ckpt, step, rank, mod, opt, sched, stage, args.keep_checkpoints)
            t0 = time.perf_counter()
    bar.close()
    log.close()
    stats: list[dict] = [{}] * world
    dist.all_gather_object(stats, stage.pp_compress_stats())
    merged = {k: v for rows in stats for k, v in rows.items() if v["calls"]}
    summary = {"final_val_loss": val_loss, "steps": args.steps, "pp_compress": str(compression), "engine": "torch",
               "stats": merged}
    if args.digest:
        summary["digest"] = gather_digests(mod.state_dict(), opt.state_dict(), stage.pp_compress_state_dict(),
                                           sched.state_dict())
    if main:
        print(f"pp_compress {compression} (torch.distributed.pipelining, 1F1B):\n{format_table(dict(sorted(merged.items())))}",
              file=sys.stderr)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: final val loss {val_loss:.4f}; metrics in {args.out / 'metrics.jsonl'}", file=sys.stderr)
    return summary


def save(ckpt: Path, step: int, rank: int, mod: nn.Module, opt: Any, sched: Any, stage: Any, keep: int) -> None:
    """This rank's checkpoint at `step`, written to a temporary file and renamed; once every rank has written its
    own, rank 0 points `latest` at it (also by a rename) and prunes the older ones."""
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": mod.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "pp_compress": stage.pp_compress_state_dict()}
    tmp = folder / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (ckpt / "latest.tmp").write_text(folder.name)
        os.replace(ckpt / "latest.tmp", ckpt / "latest")
        prune_checkpoints(ckpt, keep)
    dist.barrier()


def load(ckpt: Path, rank: int, mod: nn.Module, opt: Any, sched: Any, stage: Any, dev: torch.device) -> int:
    """Restore this rank from the checkpoint `latest` names, onto `dev`; returns its step."""
    if not (ckpt / "latest").exists():
        raise SystemExit(f"--resume: no checkpoint in {ckpt}")
    path = ckpt / (ckpt / "latest").read_text().strip() / f"rank{rank}.pt"
    state = torch.load(path, weights_only=True, map_location=dev)
    mod.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    stage.load_pp_compress_state_dict(state["pp_compress"])
    return int(state["step"])


def _eval(schedule: Any, stage: Any, batch: Any, dev: torch.device) -> float:
    (ids, sample_ids), labels = batch
    losses: list[Tensor] = []
    schedule.eval(*((ids.to(dev), sample_ids.to(dev)) if stage.is_first else ()),
                  target=labels.to(dev) if stage.is_last else None, losses=losses)
    return float(torch.stack(losses).mean()) if stage.is_last else 0.0


def _from_last(value: float, stages: int, dev: torch.device) -> float:
    """The last stage's number on every rank (through `dev`: NCCL reduces accelerator tensors only)."""
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.broadcast(t, src=stages - 1)
    return float(t)


def clip_(mod: nn.Module, max_norm: float) -> None:
    """Clip the gradients of the whole pipeline to `max_norm` (each rank holds one stage's: one all-reduce)."""
    grads = [p.grad for p in mod.parameters() if p.grad is not None]
    dev = next(mod.parameters()).device
    sq = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.float64,
                                                                                                  device=dev)
    dist.all_reduce(sq)
    scale = max_norm / (float(sq.sqrt()) + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
