"""Multi-epoch finetuning, AQ-SGD's regime (issue 17): bits on the wire in the first epoch and in the later ones.

AQ-SGD sends a sample's first visit raw (or compressed: `+aqsgd:first=`) and every later visit as a compressed delta
to what the receiver already holds, so its cost and its gain both depend on the epoch: this module splits a run's
logged traffic at the end of the first epoch and sets the final loss against uncompressed finetuning of the same samples.
"""
from __future__ import annotations

from typing import Any

from pp_lab.eval import frontier


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a recipe's argument list."""
    if name not in args:
        raise KeyError(f"{name} is not among the arguments {args}")
    return args[args.index(name) + 1]


def steps_per_epoch(args: list[str]) -> int:
    """Optimizer steps per pass over --train-sequences (finetune.py: micro-batch x grad-accum sequences a step)."""
    per_step = int(flag(args, "--micro-batch")) * int(flag(args, "--grad-accum"))
    n = int(flag(args, "--train-sequences"))
    if n % per_step:
        raise ValueError(f"--train-sequences {n} is not a whole number of steps of {per_step} sequences")
    return n // per_step


def bits(train: list[dict[str, Any]], direction: str, first: bool, epoch_steps: int, elem_bits: int = 32) -> float:
    """Wire bits per element of one direction ("act" or "grad") over the first epoch's logged rows, or the later ones.
    A row holds per-step means over its logging interval, so the interval must divide the epoch."""
    rows = [r for r in train if (r["step"] <= epoch_steps) == first]
    raw = sum(r[f"{direction}_raw_bytes"] for r in rows)
    return elem_bits * sum(r[f"{direction}_wire_bytes"] for r in rows) / raw if raw else float("nan")


def rows(runs: dict[str, dict[str, Any]], names: dict[str, str], base_name: str, args: list[str]) -> list[dict[str, Any]]:
    """One row per measured setting: bits fwd/bwd in epoch 1 and epochs 2+, best and final validation loss, final
    training loss, and the loss rule on the best validation loss. Several epochs of a small set overfit: validation
    loss turns up after a few epochs, so its final value rewards whatever slows memorising; the best one is the
    checkpoint a user keeps (early stopping). This protocol has no second seed: the tolerance is the rule's floor."""
    epoch_steps = steps_per_epoch(args)
    every = int(flag(args, "--log-every"))
    if epoch_steps % every:
        raise ValueError(f"--log-every {every} must divide the epoch ({epoch_steps} steps) to split the traffic at its end")
    base, tol = runs.get(base_name), frontier.MIN_TOLERANCE
    best = {n: min(e["val_loss"] for e in r["evals"]) for n, r in runs.items()}
    out = []
    for name in (n for n in names if n in runs):
        r = runs[name]
        delta = best[name] - best[base_name] if base else None
        out.append({"name": name, "spec": r["spec"], "steps_per_epoch": epoch_steps, "epochs": r["steps"] / epoch_steps,
                    **{f"bits_{d}_{part}": bits(r["train"], d, part == "first", epoch_steps)
                       for d in ("act", "grad") for part in ("first", "later")},
                    "best_val_loss": best[name], "final_val_loss": r["val_loss"], "final_train_loss": r["train"][-1]["loss"],
                    "delta": delta, "tolerance": tol, "loss_rule": "baseline" if name == base_name else None if delta is None
                    else "parity" if delta <= tol else "worse"})
    return out


def run_bits(row: dict[str, Any]) -> float:
    """Bits per element over the whole run, both directions averaged: one epoch at the first-visit bits, the rest at
    the later ones (every epoch carries the same samples)."""
    e = row["epochs"]
    return sum((row[f"bits_{d}_first"] + (e - 1) * row[f"bits_{d}_later"]) / e for d in ("act", "grad")) / 2


def table(rows: list[dict[str, Any]], base_name: str) -> list[str]:
    """The rows as a markdown table."""
    out = ["| setting | --pp-compress | bits fwd / bwd, epoch 1 | bits fwd / bwd, epochs 2+ (avg) | bits over the run, avg | "
           f"best val loss | delta vs {base_name} | final val loss | final train loss | loss rule (best val) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        later = (r["bits_act_later"] + r["bits_grad_later"]) / 2
        delta = "" if r["delta"] is None else f"{r['delta']:+.3f}"
        out.append(f"| {r['name']} | `{r['spec']}` | {r['bits_act_first']:.2f} / {r['bits_grad_first']:.2f} | "
                   f"{r['bits_act_later']:.2f} / {r['bits_grad_later']:.2f} ({later:.2f}) | {run_bits(r):.2f} | {r['best_val_loss']:.3f} | "
                   f"{delta} | {r['final_val_loss']:.3f} | {r['final_train_loss']:.3f} | {r['loss_rule'] or ''} |")
    return out
