"""The recipes' training loop for the engines whose step the lab writes itself (torch.distributed.pipelining,
Megatron-Core): the engine module builds its model and says how one step, one evaluation and one checkpoint go
(`Engine`); this loop does the rest as lab/pp_lab/train.py does it for DeepSpeed: AdamW with the recipes' warm-up +
cosine schedule, metrics.jsonl / metrics.csv and a progress bar on rank 0, evaluations, the compression table and
summary.json.

Checkpoints (--save-every, --resume) are one file per rank, <out>/ckpt/global_step<N>/rank<r>.pt: the rank's weights,
the optimizer and LR schedule, and its compression state, written atomically and read with `weights_only=True`;
`latest` names the newest complete one, as in DeepSpeed's layout.
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
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pp_compress.stats import merge_rows
from pp_lab.train import (
    Logger,
    evaluate_batches,
    gather_digests,
    prune_checkpoints,
    rss_mb,
    wire_rows,
    wire_totals,
)


class Engine(Protocol):
    """What the loop needs from an engine: its modules and compression, and one step and one evaluation."""

    name: str
    """How run.json, summary.json and the table name the engine ("torch", "megatron")."""
    description: str
    """The compression table's heading after the config (e.g. "torch.distributed.pipelining, 1F1B")."""
    module: nn.Module
    """This rank's part of the model: what the optimizer trains and a checkpoint holds."""
    last: int
    """The global rank whose losses are the pipeline's (broadcast from it to every rank)."""

    def step(self, batch: Any) -> float:
        """Forward and backward of one batch (its micro-batches); the mean loss on the last stage, else 0."""

    def evaluate(self, batches: Iterator[Any]) -> float:
        """The mean loss of one evaluation batch taken from `batches`, on the last stage, else 0."""

    def clip(self, max_norm: float) -> None:
        """Clip the gradients of the whole model (every rank's part) to `max_norm`."""

    def check(self) -> None:
        """Raise the step's deferred non-finite verdicts (read once per step)."""

    def stats(self) -> dict[str, dict[str, Any]]:
        """This rank's compression counters per link and direction."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


def run(args: argparse.Namespace, engine: Engine, compression: Any, meta: dict[str, Any], train_ds: Any, val_ds: Any,
        batches_fn: Any, eval_batches_fn: Any, dev: torch.device, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `engine` for args.steps steps (from the latest checkpoint with --resume); returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mod = engine.module
    opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
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
    start = load(ckpt, rank, mod, opt, sched, engine, dev) if args.resume else 0
    log = Logger(args.out, main, start)
    if main and start == 0:
        (args.out / "run.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model": meta,
                                                       "pp_compress": str(compression), "engine": engine.name,
                                                       "world": world, "stages": args.stages, **(extra or {})},
                                                      indent=1))
    it = batches_fn(train_ds, args.micro_batch * args.grad_accum, args.seed, skip=start)
    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len

    def evaluate() -> float:
        return from_last(evaluate_batches(lambda: eval_batches_fn(val_ds, args.micro_batch * args.grad_accum),
                                          args.eval_batches, engine.evaluate), engine.last, dev)

    val_loss = math.nan
    if args.eval_at_start and start == 0:  # where the run starts from (a bottleneck's initialisation, say)
        val_loss = evaluate()
        log.write({"kind": "eval", "step": 0, "tokens": 0, "val_loss": val_loss,
                   "val_ppl": math.exp(min(val_loss, 50))})
    bar = tqdm(total=args.steps, initial=start, disable=not main, dynamic_ncols=True, unit="step")
    t0, last = time.perf_counter(), {"step": start, **wire_totals(engine.stats())}  # bytes counted at the transport
    for step in range(start + 1, args.steps + 1):
        opt.zero_grad()
        loss = engine.step(next(it))
        engine.check()
        engine.clip(1.0)
        opt.step()
        sched.step()
        loss = from_last(loss, engine.last, dev)
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            now, totals = time.perf_counter(), wire_totals(engine.stats())
            row = {"kind": "train", "step": step, "tokens": step * tokens_per_step, "loss": loss,
                   "lr": sched.get_last_lr()[0], "step_s": (now - t0) / args.log_every,
                   "tokens_per_s": args.log_every * tokens_per_step / (now - t0), "rss_mb": rss_mb(),
                   **wire_rows(totals, last, step - last["step"])}
            log.write(row)
            bar.set_postfix(loss=f"{loss:.3f}", wire=f"{row['act_ratio']:.1f}x/{row['grad_ratio']:.1f}x")
            t0, last = now, {"step": step, **totals}
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            val_loss = evaluate()
            log.write({"kind": "eval", "step": step, "tokens": step * tokens_per_step, "val_loss": val_loss,
                       "val_ppl": math.exp(min(val_loss, 50))})
            t0 = time.perf_counter()
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save(ckpt, step, rank, mod, opt, sched, engine, args.keep_checkpoints)
            t0 = time.perf_counter()
    bar.close()
    log.close()
    stats: list[dict] = [{}] * world
    dist.all_gather_object(stats, engine.stats())
    merged = {k: v for k, v in merge_rows(stats).items() if v["calls"]}  # tensor-parallel ranks: summed
    summary = {"final_val_loss": val_loss, "steps": args.steps, "pp_compress": str(compression), "engine": engine.name,
               "stats": merged}
    if args.digest:
        summary["digest"] = gather_digests(mod.state_dict(), opt.state_dict(), engine.state_dict(), sched.state_dict())
    if main:
        from pp_compress.stats import format_table

        print(f"pp_compress {compression} ({engine.description}):\n{format_table(dict(sorted(merged.items())))}",
              file=sys.stderr)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: final val loss {val_loss:.4f}; metrics in {args.out / 'metrics.jsonl'}", file=sys.stderr)
    return summary


def save(ckpt: Path, step: int, rank: int, mod: nn.Module, opt: Any, sched: Any, engine: Engine, keep: int) -> None:
    """This rank's checkpoint at `step`, written to a temporary file and renamed; once every rank has written its
    own, rank 0 points `latest` at it (also by a rename) and prunes the older ones."""
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": mod.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "pp_compress": engine.state_dict()}
    tmp = folder / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (ckpt / "latest.tmp").write_text(folder.name)
        os.replace(ckpt / "latest.tmp", ckpt / "latest")
        prune_checkpoints(ckpt, keep)
    dist.barrier()


def load(ckpt: Path, rank: int, mod: nn.Module, opt: Any, sched: Any, engine: Engine, dev: torch.device) -> int:
    """Restore this rank from the checkpoint `latest` names, onto `dev`; returns its step."""
    if not (ckpt / "latest").exists():
        raise SystemExit(f"--resume: no checkpoint in {ckpt}")
    path = ckpt / (ckpt / "latest").read_text().strip() / f"rank{rank}.pt"
    state = torch.load(path, weights_only=True, map_location=dev)
    mod.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    engine.load_state_dict(state["pp_compress"])
    return int(state["step"])


def from_last(value: float, src: int, dev: torch.device) -> float:
    """Global rank `src`'s number on every rank (through `dev`: NCCL reduces accelerator tensors only)."""
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.broadcast(t, src=src)
    return float(t)


def clip_(params: list[nn.Parameter], max_norm: float, owned: Any = lambda p: True) -> None:
    """Clip the gradients of the whole model to `max_norm`: each rank sums the squares of the gradients it owns
    (`owned(p)`: a parameter replicated over tensor-parallel ranks is counted on one of them), one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    dev = params[0].device
    own = [p.grad for p in params if p.grad is not None and owned(p)]
    sq = torch.stack([g.double().pow(2).sum() for g in own]).sum() if own else torch.zeros((), dtype=torch.float64,
                                                                                          device=dev)
    dist.all_reduce(sq)
    scale = max_norm / (float(sq.sqrt()) + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
