"""One rank of a torch.distributed.pipelining job on CPU/gloo, launched by torchrun from the tests.

An MLP cut into stages (one per rank, or two per rank for the interleaved and V schedules), trained for --steps
schedule steps with SGD. Writes <out>/rank<R>.json: the losses (last stage), bytes this rank posted to isend, and
pp_compress stats; with --variant (variants.py), {"variants": {name: that}}.
"""
import argparse

import torch
import torch.distributed as dist
import variants
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

ap = argparse.ArgumentParser()
ap.add_argument("--schedule", default="GPipe", choices=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
ap.add_argument("--spec", default=None, help="pp_compress spec; omitted = the stock PipelineStage")
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--hidden", type=int, default=64)
args, VARIANTS = variants.parse_args(ap)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
SENT = {"bytes": 0}


def counting(fn):
    def wrapped(ops, *a, **kw):
        SENT["bytes"] += sum(p.tensor.numel() * p.tensor.element_size() for p in ops if p.op is dist.isend)
        return fn(ops, *a, **kw)
    return wrapped


schedules._batch_p2p = counting(schedules._batch_p2p)  # every schedule's p2p goes through it


def train(variant: argparse.Namespace) -> dict:
    """Train the variant's stages from scratch: this rank's result."""
    global args
    args = variant
    SENT["bytes"] = 0
    multi = args.schedule in ("Interleaved1F1B", "ZBVZeroBubble")
    n_stages = world * (2 if multi else 1)
    if args.schedule == "ZBVZeroBubble":
        mine = [rank, 2 * world - 1 - rank]  # the V: rank 0 holds the first and the last stage
    else:
        mine = [rank + k * world for k in range(2 if multi else 1)]
    stages = [make_stage(i, n_stages) for i in mine]
    loss_fn = nn.MSELoss()
    cls = {"GPipe": schedules.ScheduleGPipe, "1F1B": schedules.Schedule1F1B,
           "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
           "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble}[args.schedule]
    sched = cls(stages if multi else stages[0], n_microbatches=MB, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
    H = args.hidden
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H, 4, generator=torch.Generator().manual_seed(1)) / H**0.5
    x = torch.randn(B, T, H, generator=g)  # one batch, fitted step after step: the loss falls monotonically
    y = torch.tanh(x @ w)
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        out: list = []
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        sched.step(*([x] if has_first else []), target=y if has_last else None, losses=out)
        opt.step()
        if has_last:
            losses.append(float(torch.stack(out).mean()))
    stats = {}
    for s in stages:
        stats.update(s.pp_compress_stats() if hasattr(s, "pp_compress_stats") else {})
    return {"rank": rank, "losses": losses, "sent_bytes": SENT["bytes"], "stats": stats, "stages": mine,
            "engine": type(stages[0]).__name__}


def block(i: int, n_stages: int) -> nn.Module:
    torch.manual_seed(100 + i)  # the same weights whichever rank builds stage i
    layers = [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    if i == n_stages - 1:
        layers.append(nn.Linear(args.hidden, 4))
    return nn.Sequential(*layers)


def make_stage(i: int, n_stages: int) -> PipelineStage:
    mod = block(i, n_stages)
    example = torch.zeros(B // MB, T, args.hidden)
    if args.spec is None:
        return PipelineStage(mod, i, n_stages, torch.device("cpu"), input_args=example)
    from pp_compress.torch_pipelining import CompressedPipelineStage

    return CompressedPipelineStage(mod, i, n_stages, torch.device("cpu"), input_args=example,
                                   compression=args.spec + ",min_numel=0")


B, T, MB = 16, 8, 4
variants.write(train, args, VARIANTS, rank)
variants.end()
