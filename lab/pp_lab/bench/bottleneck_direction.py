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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR
from torch import Tensor, nn
from tqdm import tqdm

from pp_lab import data, train
from pp_lab.bench.bottleneck_gap import evals
from pp_lab.bottleneck import Basis, Decoder, Encoder, calibrate
from pp_lab.convert import DEFAULT_OUT
from pp_lab.eval.study import SM_COMMON
from pp_lab.model import GPT, GPTConfig, lm_loss, stage_cuts
from pp_lab.paths import BENCH, ROOT

ROUTES: dict[str, str] = {
    "none": "no bottleneck (the baseline)",
    "both": "the bottleneck, fixed at its init, forward and backward",
    "forward": "the hidden state projected forward; its gradient passes back whole",
    "backward": "the hidden state passes forward whole; its gradient is projected back (W_e^T W_d^T g)",
    "trained": "the bottleneck forward and backward, trained with the model (as the study's rows)",
    "late": "no bottleneck for the first --late-at steps, then `both` from the PCA of the adapted model",
    "fade": "`trained` beside a bypass that fades: p + a (h - p), a from 1 down to 0 over the first --fade steps",
}
"""Where each cut's bottleneck acts, by route name."""
MODES = ("both", "forward", "backward", "trained", "fade")
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
        d, trainable = basis.mu.shape[0], route in ("trained", "fade")
        self.enc = Encoder(d, k, 1, 1, basis, trainable)
        self.dec = Decoder(d, k, 1, basis, trainable)
        self.route = route
        self.bypass = 1.0 if route == "fade" else 0.0  # the `fade` route's share a of h that passes beside the code

    def forward(self, h: Tensor, ids: Tensor) -> Tensor:
        p = self.dec(*self.enc(h, ids), ids)  # (B, T, d): the bottleneck's reconstruction
        if self.route == "forward":
            return h + (p - h).detach()  # the value of p, the gradient of h
        if self.route == "backward":
            return h.detach() + (p - p.detach())  # the value of h, the gradient through p
        if self.bypass > 0:  # what the code misses, partly passed around it (a full-width residual on the wire)
            return p + self.bypass * (h - p)
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


@dataclass(frozen=True)
class Plan:
    """How each route trains and is measured (main's arguments)."""

    k: int
    """Code width."""
    steps: int
    """Optimizer steps per route."""
    late_at: int
    """The `late` route's steps without a bottleneck."""
    fade: int
    """The `fade` route's steps over which its bypass goes from 1 to 0."""
    every: int
    """Evaluate (bypass at 0) every this many steps, and keep the route's state there to resume from (0: never)."""
    state_dir: Path
    """Where a route's state between evaluations is kept (deleted when the route ends)."""


def bypass_at(step: int, fade: int) -> float:
    """The `fade` route's bypass at `step` (0-based): 1 at step 0, falling linearly to 0 at step `fade`."""
    return max(0.0, 1.0 - step / fade)


def measure(route: str, cfg: GPTConfig, ckpt: Path | None, bases: dict[int, Basis] | None, plan: Plan,
            ds: tuple[Any, Any], sa: argparse.Namespace,
            fit: Callable[[list[nn.Module]], dict[int, Basis]]) -> dict[str, Any]:
    """Train `plan.steps` steps with `route` at every cut; the validation loss before (unless SAME_START), every
    `plan.every` steps and after. `fit(layers)` gives the bases of a model's hidden states (the `late` route's, at
    step `plan.late_at`). A route stopped part-way resumes from its last evaluation."""
    torch.manual_seed(sa.seed)
    model = GPT(cfg, ckpt)
    k = plan.k
    routes = nn.ModuleDict({str(c): Route(b, k, route) for c, b in (bases or {}).items()} if route in MODES else {})
    at = {int(c): r for c, r in routes.items()}
    holder = nn.ModuleList([model, routes])
    ds_cfg = train.ds_config(sa, 1)
    opt_cfg, sched = ds_cfg["optimizer"]["params"], ds_cfg["scheduler"]["params"]
    opt = torch.optim.AdamW(train.param_groups(holder, sa.lr, 1.0), lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                            weight_decay=opt_cfg["weight_decay"])
    schedule = WarmupCosineLR(opt, **sched)  # DeepSpeed's own, stepped after each optimizer step as its engine does
    train_ds, val_ds = ds

    def set_bypass(a: float) -> None:
        for r in at.values():
            r.bypass = a

    def val_loss(through: dict[int, Route] = at) -> float:
        """The loss as the route would serve: no bypass."""
        kept = {c: r.bypass for c, r in through.items()}
        set_bypass(0.0)
        model.eval()
        with torch.no_grad():
            loss = train.evaluate_batches(lambda: data.eval_batches(val_ds, sa.micro_batch), sa.eval_batches,
                                          lambda it: sum(float(lm_loss(run(model, through, x), y))
                                                         for x, y in (next(it) for _ in range(sa.grad_accum)))
                                          / sa.grad_accum)
        model.train()
        for c, r in through.items():
            r.bypass = kept[c]
        return loss

    out: dict[str, Any] = {"route": route, "steps": plan.steps, "k": k, "curve": {}}
    if route == "fade":
        out["fade"] = plan.fade
    state = plan.state_dir / f"{route}.pt"
    it, losses, first = data.batches(train_ds, sa.micro_batch, sa.seed), [], 0
    if route != "late" and state.exists():  # the late route's refit changes its modules: it starts again
        saved = torch.load(state, weights_only=True)
        if saved["plan"] != (plan.k, plan.steps, plan.fade, plan.every):
            raise SystemExit(f"{state} holds a route stopped under --k/--steps/--fade/--every {saved['plan']}, not "
                             f"{(plan.k, plan.steps, plan.fade, plan.every)}: rerun with those, or delete it")
        holder.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        schedule.load_state_dict(saved["schedule"])
        out, losses, first = saved["out"], saved["losses"], saved["step"]
        for _ in range(first * sa.grad_accum):  # the same micro-batches from here on
            next(it)
        print(f"{route}: resumed at step {first} from {state}")
    elif route not in SAME_START:
        out["start"] = val_loss()
    t0 = time.perf_counter()
    for step in tqdm(range(first, plan.steps), desc=route, unit="step", initial=first, total=plan.steps):
        if route == "late" and step == plan.late_at:  # fixed, so that the optimizer's groups stay as they are
            at.update({c: Route(b, k, "both") for c, b in fit(list(model.layers)).items()})
            out["late_at"] = plan.late_at
        if route == "fade":
            set_bypass(bypass_at(step, plan.fade))
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
        if plan.every and (step + 1) % plan.every == 0 and step + 1 < plan.steps:
            out["curve"][str(step + 1)] = val_loss()
            if route != "late":
                state.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": holder.state_dict(), "opt": opt.state_dict(), "schedule": schedule.state_dict(),
                            "out": out, "losses": losses, "step": step + 1,
                            "plan": (plan.k, plan.steps, plan.fade, plan.every)}, state.with_suffix(".tmp"))
                state.with_suffix(".tmp").replace(state)  # a crash while saving keeps the previous state
    step_s = (time.perf_counter() - t0) / max(1, plan.steps - first)
    out.update(train_loss=losses, lr=opt.param_groups[0]["lr"], step_s=step_s, end=val_loss())
    if route == "none" and bases:  # what the initial bottleneck costs the model that trained without one
        out["end_projected"] = val_loss({c: Route(b, k, "both") for c, b in bases.items()})
    state.unlink(missing_ok=True)
    return out


def table(rows: dict[str, dict[str, Any]], steps: int, command: str) -> str:
    """The markdown: each route's loss before and after, and its gap to the route `none`'s."""
    start = {r: rows[SAME_START.get(r, r)].get("start") for r in rows if SAME_START.get(r, r) in rows}
    base = rows.get("none")
    lines = [f"# Which direction of the bottleneck opens its gap (SmolLM2-135M, {steps} steps in one process)", "",
             f"Command: `{command}`. Validation loss on the study's batches; the gap is each route's loss minus the "
             "route `none`'s at the same step (the model trained in the same way without a bottleneck).", "",
             "| route | what it does | before training | gap | after | gap | gap opened |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        s, e = start.get(name), row["end"]
        gap0 = None if s is None or base is None else s - base["start"]
        gap1 = None if base is None else e - base["end"]
        cells = [f"{s:.3f}" if s is not None else "", f"{gap0:+.3f}" if gap0 is not None else "", f"{e:.3f}",
                 f"{gap1:+.3f}" if gap1 is not None else "",
                 f"{gap1 - gap0:+.3f}" if gap0 is not None and gap1 is not None else ""]
        late = f" (--late-at {row['late_at']})" if "late_at" in row else ""
        late += f" (--fade {row['fade']})" if "fade" in row else ""
        lines.append(f"| `{name}` | {ROUTES[name]}{late} | " + " | ".join(cells) + " |")
    if base is not None and "end_projected" in base and "both" in start:
        lines += ["", f"The model trained without a bottleneck, evaluated through each cut's initial bottleneck: "
                  f"{base['end_projected']:.3f}, {base['end_projected'] - base['end']:+.3f} from itself (the same "
                  f"bottleneck cost the pretrained model {start['both'] - base['start']:+.3f})."]
    return "\n".join(lines) + "\n"


def route_curve(row: dict[str, Any]) -> dict[int, float]:
    """step -> validation loss of a route measured along the way (its evaluations and its end)."""
    return {int(s): v for s, v in row["curve"].items()} | {row["steps"]: row["end"]}


def curve_table(rows: dict[str, dict[str, Any]], against: dict[str, dict[int, float]]) -> str:
    """The markdown of the loss along training (bypass at 0) of the routes evaluated on the way, beside study runs'
    losses at the same steps (the harness trains as the study does), and each one's gap to `none` where it has one."""
    curves = {f"`{n}`": route_curve(r) for n, r in rows.items() if r.get("curve")}
    if not curves:
        return ""
    steps = sorted({s for c in curves.values() for s in c})
    curves |= {f"{n} (study run)": {s: c[s] for s in steps if s in c} for n, c in against.items()}
    base = against.get("none") or (route_curve(rows["none"]) if rows.get("none", {}).get("curve") else None)
    head = "| | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = ["", "Validation loss along training, with any bypass at 0 (as the route would serve); in brackets the gap "
             "to `none` at the same step:", "", head, "|---" * (len(steps) + 1) + "|"]
    for name, c in curves.items():
        cells = [("" if s not in c else f"{c[s]:.3f}" + (f" ({c[s] - base[s]:+.3f})" if base and s in base else ""))
                 for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--k", type=int, default=288, help="code width (default 288 = d/2)")
    ap.add_argument("--calib", type=int, default=384, help="training sequences the PCA and token table are fitted on")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per route (the study's schedule)")
    ap.add_argument("--route", action="append", choices=list(ROUTES), default=None, help="default: every route")
    ap.add_argument("--late-at", type=int, default=10, help="the `late` route's steps without a bottleneck")
    ap.add_argument("--fade", type=int, default=50, help="the `fade` route's steps from bypass 1 down to 0")
    ap.add_argument("--every", type=int, default=0,
                    help="evaluate every this many steps, and keep each route's state there to resume from (0: never)")
    ap.add_argument("--against", action="append", default=[], metavar="NAME=METRICS",
                    help="a study run's metrics.jsonl to show beside the routes' curves (NAME `none`: the gaps' base)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: beside a study on the same cores more threads only contend)")
    ap.add_argument("--out", type=Path, default=BENCH / "bottleneck_direction_smollm2")
    args = ap.parse_args()
    if min(args.steps, args.calib, args.threads) < 1:
        ap.error(f"--steps {args.steps} --calib {args.calib} --threads {args.threads}; accepted: integers >= 1")
    if not 0 < args.late_at < args.steps:
        ap.error(f"--late-at {args.late_at}; accepted: 1..{args.steps - 1} (--steps {args.steps})")
    if not 0 < args.fade <= args.steps:
        ap.error(f"--fade {args.fade}; accepted: 1..{args.steps} (--steps {args.steps})")
    if not 0 <= args.every < args.steps:
        ap.error(f"--every {args.every}; accepted: 0..{args.steps - 1} (--steps {args.steps})")
    against = {}
    for item in args.against:
        name, _, path = item.partition("=")
        if not name or not Path(path).is_file():
            ap.error(f"--against {item!r}; accepted: NAME=PATH of an existing metrics.jsonl")
        against[name] = evals(Path(path))
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
                and r["k"] == args.k and r.get("late_at", args.late_at) == args.late_at
                and r.get("fade", args.fade) == args.fade and (not args.every or r.get("curve"))}
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
        plan = Plan(args.k, args.steps, args.late_at, args.fade, args.every,
                    ROOT / "runs" / "bottleneck_direction" / args.out.name)
        done[r] = measure(r, cfg, args.checkpoint, bases, plan, ds, sa, fit)
        with log.open("a") as f:
            f.write(json.dumps(done[r]) + "\n")
    command = shlex.join(["python", "benchmarks/bottleneck_direction.py", *sys.argv[1:]])
    md = table({r: done[r] for r in routes}, args.steps, command) + curve_table({r: done[r] for r in routes}, against)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
