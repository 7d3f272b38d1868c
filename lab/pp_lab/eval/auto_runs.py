"""Is `auto` at parity? Its quality runs (eval/study.py's AUTO_LONG, AUTO_SMOLLM2 and AUTO_MEGATRON) judged by the loss rule against
their testbed's baseline, with the bits they sent and the codecs they switched between (docs/choosing.md's block)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from pp_lab.eval import frontier
from pp_lab.eval.study import AUTO_LONG, AUTO_MEGATRON, AUTO_SMOLLM2, DECISIONS

PICK = re.compile(r"step (\d+): pp_compress auto: boundary (\d+) (\w+): .*?; (\w+)(?: \(|:)")
"""A decision line (pp_compress.auto.describe): step, boundary, direction, pick."""


def final_and_bytes(run: Path) -> tuple[float, dict[str, float], dict[str, float]] | None:
    """(final validation loss, mean wire bytes per step, mean raw bytes per step) per direction; None if unfinished."""
    if not (run / "summary.json").exists():
        return None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    final = json.loads((run / "summary.json").read_text())["final_val_loss"]
    wire = {d: sum(r[f"{d}_wire_bytes"] for r in train) / len(train) for d in ("act", "grad")}
    raw = {d: sum(r[f"{d}_raw_bytes"] for r in train) / len(train) for d in ("act", "grad")}
    return final, wire, raw


def switches(log: Path) -> dict[tuple[int, str], list[tuple[int, str]]]:
    """(boundary, direction) -> its decisions in order, (step, pick), each attempt's (a resumed run decides again)."""
    out: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        if m := PICK.match(line):
            out.setdefault((int(m[2]), m[3]), []).append((int(m[1]), m[4]))
    return out


def rows(results: Path) -> list[dict]:
    """One row per finished auto run under results/eval (long/, smollm2/ and megatron/)."""
    out = []
    for runs, bed in ((AUTO_LONG, frontier.TESTBEDS["long"]), (AUTO_SMOLLM2, frontier.TESTBEDS["smollm2"]),
                      (AUTO_MEGATRON, frontier.TESTBEDS["megatron"])):
        where = results / bed.results
        base, seed1 = final_and_bytes(where / bed.base), final_and_bytes(where / bed.seed1)
        for name, (spec, links) in runs.items():
            got = final_and_bytes(where / name)
            if got is None or base is None:
                continue
            final, wire, _ = got
            tol = frontier.tolerance(None if seed1 is None else abs(seed1[0] - base[0]))
            delta = final - base[0]
            bits = {d: 32 * wire[d] / base[2][d] for d in ("act", "grad")}  # against the baseline's dense fp32 bytes
            steps = json.loads((where / name / "summary.json").read_text())["steps"]
            out.append({"name": name, "model": bed.model, "spec": spec, "links": links, "final": final, "delta": delta,
                        "steps": steps, "where": bed.results,
                        "tolerance": tol, "verdict": None if tol is None else "parity" if delta <= tol else "worse",
                        "bits": bits, "switches": switches(where / name / DECISIONS)})
    return out


def block(results: Path) -> list[str]:
    """Markdown: the table of auto's quality runs, then each run's decisions per boundary and direction."""
    found = rows(results)
    if not found:
        return ["No `auto` quality run has finished yet (`python eval/study.py --protocol long --only auto-mixed`)."]
    out = ["| run | model | spec | links (PPC_BENCH_LINKS) | bits fwd / bwd | final val loss | vs baseline | tolerance | "
           "loss rule |", "|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        tol = "n/a" if r["tolerance"] is None else f"{r['tolerance']:.3f}"
        out.append(f"| {r['name']} | {r['model']} | `{r['spec']}` | `{r['links']}` | {r['bits']['act']:.2f} / "
                   f"{r['bits']['grad']:.2f} | {r['final']:.4f} | {r['delta']:+.4f} | {tol} | {r['verdict'] or 'n/a'} |")
    for r in found:
        out += ["", f"{r['name']}'s decisions per boundary and direction: the share of its {r['steps']} steps under each "
                f"pick, and how many times a round changed it (`results/eval/{r['where']}/{r['name']}/decisions.log` has "
                "every decision with its measured link):", "", "| boundary | direction | steps under each pick | changes |",
                "|---|---|---|---|"]
        for (b, d), picks in sorted(r["switches"].items()):
            share = shares(picks, r["steps"])
            out.append(f"| {b} | {d} | " + ", ".join(f"{p} {v:.0%}" for p, v in share.items()) + f" | {changes(picks)} |")
    return out


def shares(picks: list[tuple[int, str]], steps: int) -> dict[str, float]:
    """The share of steps 1..steps under each pick: a decision holds from its step to the next one (in step order)."""
    ordered = sorted(picks)
    out: dict[str, float] = {}
    for i, (step, pick) in enumerate(ordered):
        end = ordered[i + 1][0] if i + 1 < len(ordered) else steps + 1
        out[pick] = out.get(pick, 0.0) + max(end - max(step, 1), 0) / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def changes(picks: list[tuple[int, str]]) -> int:
    """How many decisions differ from the one before them (the first one is not a change)."""
    ordered = [p for _, p in sorted(picks)]
    return sum(a != b for a, b in zip(ordered, ordered[1:]))
