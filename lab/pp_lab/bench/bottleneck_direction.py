"""Which direction of a learned bottleneck opens its gap in the first steps of training: the forward projection of
the hidden state, or the projection of the gradient that the layers before each cut learn from (SmolLM2 study).

    python benchmarks/bottleneck_direction.py --out results/bench/bottleneck_direction_smollm2

SmolLM2-135M cut where the study cuts it (after blocks 8, 16 and 23) is trained in one process as the study trains it
(its micro-batches in the same order, its optimizer, learning-rate schedule and clipping: pp_lab.train's DeepSpeed
config from the study's arguments) for --steps steps, once per route (ROUTES) of each cut's bottleneck (the PCA of the
first --calib training sequences with a token table: the init of the study's `sm-bn288-tokens-*` rows), and
evaluated before and after on the study's validation batches. Resumable: each route's result is a line of
<out>.jsonl, which a later call reuses; <out>.md is the table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR
from torch import Tensor, nn
from tqdm import tqdm

from pp_lab import data, train
from pp_lab.bottleneck import Basis, Decoder, Encoder, calibrate
from pp_lab.convert import DEFAULT_OUT
from pp_lab.eval.study import SM_COMMON
from pp_lab.model import GPT, GPTConfig, lm_loss, stage_cuts
from pp_lab.paths import BENCH

ROUTES: dict[str, str] = {
    "none": "no bottleneck (the baseline)",
    "both": "the bottleneck, fixed at its init, forward and backward",
    "forward": "the hidden state projected forward; its gradient passes back whole",
    "backward": "the hidden state passes forward whole; its gradient is projected back (W_e^T W_d^T g)",
    "trained": "the bottleneck forward and backward, trained with the model (as the study's rows)",
    "late": "no bottleneck for the first --late-at steps, then `both` from the PCA of the adapted model",
}
"""Where each cut's bottleneck acts, by route name."""
MODES = ("both", "forward", "backward", "trained")
"""The routes that act from the first step (`Route`)."""
SAME_START = {"forward": "both", "trained": "both", "backward": "none", "late": "none"}
"""Routes whose forward pass before training is another route's: their step-0 loss is that route's."""


class Route(nn.Module):
    """One cut's bottleneck as a map of the hidden state h (B, T, d) and the token ids (B, T), with its gradient routed
    as `route` says (ROUTES)."""

    def __init__(self, basis: Basis, k: int, route: str) -> None:
        super().__init__()
        if route not in MODES:
            raise ValueError(f"route {route!r}; accepted: {', '.join(MODES)}")
        d, trainable = basis.mu.shape[0], route == "trained"
        self.enc = Encoder(d, k, 1, 1, basis, trainable)
        self.dec = Decoder(d, k, 1, basis, trainable)
        self.route = route

    def forward(self, h: Tensor, ids: Tensor) -> Tensor:
        p = self.dec(*self.enc(h, ids), ids)  # (B, T, d): the bottleneck's reconstruction
        if self.route == "forward":
            return h + (p - h).detach()  # the value of p, the gradient of h
        if self.route == "backward":
            return h.detach() + (p - p.detach())  # the value of h, the gradient through p
        return p


def run(model: GPT, routes: dict[int, Route], x: tuple[Tensor, Tensor]) -> Tensor:
    """Logits (B, T, V) of micro-batch x = (token ids, sample ids), each route applied after its block."""
    flow: Any = x
    for i, layer in enumerate(model.layers):
        flow = layer(flow)
        if i - 1 in routes:  # layer i is block i - 1
            flow = (routes[i - 1](flow[0], x[0]), *flow[1:])
    return flow


def study_args() -> argparse.Namespace:
    """The study's training arguments (SM_COMMON), parsed as its recipe parses them (nothing is written to --out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data")
    ap.add_argument("--val-fraction", type=float)
    return train.add_args(ap, steps=200, lr=1e-4).parse_args([*SM_COMMON, "--seed", "0", "--out", "unused"])


def measure(route: str, cfg: GPTConfig, ckpt: Path | None, bases: dict[int, Basis] | None, k: int, steps: int,
            ds: tuple[Any, Any], sa: argparse.Namespace, fit: Callable[[list[nn.Module]], dict[int, Basis]],
            late_at: int) -> dict[str, Any]:
    """Train `steps` steps with `route` at every cut; the validation loss before (unless SAME_START) and after.
    `fit(layers)` gives the bases of a model's hidden states (the `late` route's, at step `late_at`)."""
    torch.manual_seed(sa.seed)
    model = GPT(cfg, ckpt)
    routes = nn.ModuleDict({str(c): Route(b, k, route) for c, b in (bases or {}).items()} if route in MODES else {})
    at = {int(c): r for c, r in routes.items()}
    holder = nn.ModuleList([model, routes])
    ds_cfg = train.ds_config(sa, 1)
    opt_cfg, sched = ds_cfg["optimizer"]["params"], ds_cfg["scheduler"]["params"]
    opt = torch.optim.AdamW(train.param_groups(holder, sa.lr, 1.0), lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                            weight_decay=opt_cfg["weight_decay"])
    schedule = WarmupCosineLR(opt, **sched)  # DeepSpeed's own, stepped after each optimizer step as its engine does
    train_ds, val_ds = ds

    def val_loss(through: dict[int, Route] = at) -> float:
        model.eval()
        with torch.no_grad():
            loss = train.evaluate_batches(lambda: data.eval_batches(val_ds, sa.micro_batch), sa.eval_batches,
                                          lambda it: sum(float(lm_loss(run(model, through, x), y))
                                                         for x, y in (next(it) for _ in range(sa.grad_accum)))
                                          / sa.grad_accum)
        model.train()
        return loss

    out: dict[str, Any] = {"route": route, "steps": steps, "k": k}
    if route not in SAME_START:
        out["start"] = val_loss()
    it, losses, t0 = data.batches(train_ds, sa.micro_batch, sa.seed), [], time.perf_counter()
    for step in tqdm(range(steps), desc=route, unit="step"):
        if route == "late" and step == late_at:  # fixed, so that the optimizer's groups stay as they are
            at.update({c: Route(b, k, "both") for c, b in fit(list(model.layers)).items()})
            out["late_at"] = late_at
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(sa.grad_accum):  # the engine's mean over micro-batches
            x, y = next(it)
            loss = lm_loss(run(model, at, x), y) / sa.grad_accum
            loss.backward()
            total += float(loss.detach())
        nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], ds_cfg["gradient_clipping"])
        opt.step()
        schedule.step()
        losses.append(total)
    out.update(train_loss=losses, lr=opt.param_groups[0]["lr"], step_s=(time.perf_counter() - t0) / steps,
               end=val_loss())
    if route == "none" and bases:  # what the initial bottleneck costs the model that trained without one
        out["end_projected"] = val_loss({c: Route(b, k, "both") for c, b in bases.items()})
    return out


def table(rows: dict[str, dict[str, Any]], steps: int, command: str) -> str:
    """The markdown: each route's loss before and after, and its gap to the route `none`'s."""
    start = {r: rows[SAME_START.get(r, r)].get("start") for r in rows if SAME_START.get(r, r) in rows}
    base = rows.get("none")
    lines = [f"# Which direction of the bottleneck opens its gap (SmolLM2-135M, {steps} steps in one process)", "",
             f"Command: `{command}`. Validation loss on the study's batches; the gap is each route's loss minus the "
             "route `none`'s at the same step (the model trained in the same way without a bottleneck).", "",
             "| route | what it does | before training | gap | after | gap | gap opened |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        s, e = start.get(name), row["end"]
        gap0 = None if s is None or base is None else s - base["start"]
        gap1 = None if base is None else e - base["end"]
        cells = [f"{s:.3f}" if s is not None else "", f"{gap0:+.3f}" if gap0 is not None else "", f"{e:.3f}",
                 f"{gap1:+.3f}" if gap1 is not None else "",
                 f"{gap1 - gap0:+.3f}" if gap0 is not None and gap1 is not None else ""]
        late = f" (--late-at {row['late_at']})" if "late_at" in row else ""
        lines.append(f"| `{name}` | {ROUTES[name]}{late} | " + " | ".join(cells) + " |")
    if base is not None and "end_projected" in base and "both" in start:
        lines += ["", f"The model trained without a bottleneck, evaluated through each cut's initial bottleneck: "
                  f"{base['end_projected']:.3f}, {base['end_projected'] - base['end']:+.3f} from itself (the same "
                  f"bottleneck cost the pretrained model {start['both'] - base['start']:+.3f})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--k", type=int, default=288, help="code width (default 288 = d/2)")
    ap.add_argument("--calib", type=int, default=384, help="training sequences the PCA and token table are fitted on")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per route (the study's schedule)")
    ap.add_argument("--route", action="append", choices=list(ROUTES), default=None, help="default: every route")
    ap.add_argument("--late-at", type=int, default=10, help="the `late` route's steps without a bottleneck")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: beside a study on the same cores more threads only contend)")
    ap.add_argument("--out", type=Path, default=BENCH / "bottleneck_direction_smollm2")
    args = ap.parse_args()
    if min(args.steps, args.calib, args.threads) < 1:
        ap.error(f"--steps {args.steps} --calib {args.calib} --threads {args.threads}; accepted: integers >= 1")
    if not 0 < args.late_at < args.steps:
        ap.error(f"--late-at {args.late_at}; accepted: 1..{args.steps - 1} (--steps {args.steps})")
    torch.set_num_threads(args.threads)
    routes = args.route or list(ROUTES)
    for r in routes:
        if SAME_START.get(r, r) not in routes:
            ap.error(f"--route {r} takes its loss before training from --route {SAME_START[r]}: add it")
    sa = study_args()
    cfg = GPTConfig.from_hf(args.checkpoint)
    if not 1 <= args.k <= cfg.d_model:
        ap.error(f"--k {args.k}; accepted: 1..{cfg.d_model}")
    tok = data.load_tokenizer(str(args.checkpoint))
    ds = data.lm_datasets(data.corpus_files(sa.data), tok, sa.seq_len, sa.val_fraction)
    log = args.out.with_suffix(".jsonl")
    done = {}
    if log.exists():
        done = {r["route"]: r for r in map(json.loads, log.read_text().splitlines()) if r["steps"] == args.steps
                and r["k"] == args.k and r.get("late_at", args.late_at) == args.late_at}
    cuts = [int(c) - 1 for c in stage_cuts(cfg, sa.stages)]
    calib = ds[0].with_format("torch", columns=["input_ids"])[: args.calib]["input_ids"].split(4)  # (4, T) each

    def fit(layers: list[nn.Module]) -> dict[int, Basis]:
        """The study's init: the PCA of the hidden states after each cut, with a token table."""
        return calibrate(layers, cuts, args.k, 1, calib, tokens=True)

    bases = None
    if any(r not in done for r in routes):  # `none` too: its trained model is evaluated through the bottleneck
        bases = fit(list(GPT(cfg, args.checkpoint).eval().layers))
    log.parent.mkdir(parents=True, exist_ok=True)
    for r in routes:
        if r in done:
            print(f"{r}: kept from {log}")
            continue
        done[r] = measure(r, cfg, args.checkpoint, bases, args.k, args.steps, ds, sa, fit, args.late_at)
        with log.open("a") as f:
            f.write(json.dumps(done[r]) + "\n")
    command = shlex.join(["python", "benchmarks/bottleneck_direction.py", *sys.argv[1:]])
    md = table({r: done[r] for r in routes}, args.steps, command)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
