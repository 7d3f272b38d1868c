"""The frontier (issue 17): for every setting of the long study, bits on the wire, quality, and time to target per link.

    python eval/frontier.py     # results/eval/long/* + results/bench/e2e_frontier.csv -> results/eval/frontier.json

Definitions (each computed here from logged numbers, nothing typed in):
- target: the baseline's (`base`, seed 0) final validation loss.
- steps to target: the first step at which a run's validation curve reaches the target, linear between its
  evaluations; None ("never") if it does not within the run.
- step time per link: benchmarks/e2e.py's measured mean step time of the same spec (and recipe options) on the
  same pipeline over that rate-limited link. With an uncompressed warm-up of W steps, the run's first W steps
  take the uncompressed step time.
- time to target = steps to target x step time; speedup = the baseline's time to target / the setting's, per link.
- comm/compute ratio of a link: r = (uncompressed step time over the link - unthrottled) / unthrottled.
- bits per element: wire bits per element of the dense boundary tensors (the baseline's raw bytes, fp32 = 32 bits),
  forward (activations) and backward (gradients), steady state (the last logged step, after any warm-up). A
  subspace run's k coordinates and token ids count against the dense d-wide tensor they replace. The wire ratio
  is the baseline's raw bytes per step / the run's wire bytes per step, averaged over the whole run.
- loss rule: parity when the final validation loss is at most the baseline's plus the tolerance: twice the
  seed noise floor |base - base-seed1| (one more seed's deviation from the baseline is as noisy as that gap), at
  least 0.02 nats (`tolerance`; eval/report.py's findings use the same rule). lm-eval rule: eval/parity.py's
  non-inferiority verdict (all metrics), where it was run.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

from pp_lab.paths import RESULTS, ROOT
import pp_compress as ppc
from pp_lab.eval.study import EXTRA, LONG, MEGATRON, SEEDS, SMOLLM2

MIN_TOLERANCE = 0.02  # nats: below this, differences are too small to matter for any user


def tolerance(seed_gap: float | None) -> float | None:
    """How much worse than the baseline a final loss may be and still count as no loss: 2 x the seed gap, >= 0.02."""
    return None if seed_gap is None else max(2 * seed_gap, MIN_TOLERANCE)


def steps_to_target(evals: list[tuple[int, float]], target: float) -> float | None:
    """First step where the validation curve (step, loss) reaches `target`, linear between evaluations."""
    prev: tuple[int, float] | None = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
        prev = (step, loss)
    return None


def comm_ratio(step_s_link: float, step_s_free: float) -> float:
    """r: the link's communication time per step over the compute time, for the uncompressed run."""
    return (step_s_link - step_s_free) / step_s_free


def time_to_target(steps: float | None, step_s: float, warmup: int = 0, warm_step_s: float | None = None) -> float | None:
    """Seconds to reach the target: `warmup` steps at `warm_step_s` (uncompressed), the rest at `step_s`."""
    if steps is None:
        return None
    warm = min(steps, warmup)
    return warm * (warm_step_s if warmup else 0.0) + (steps - warm) * step_s


RUN_LENGTH = {"--steps"}
"""Recipe options that set how long a run trains, not what a step costs: left out of the e2e key, so that a longer
run of a setting takes the step times measured for it."""


def e2e_key(spec: str, options: list[str]) -> str:
    """The spec (canonical, warm-up removed: e2e measures the steady state) plus the run's own recipe options, those
    that set the run's length (RUN_LENGTH, with their values) left out."""
    cfg = dataclasses.replace(ppc.parse_spec(spec), warmup_steps=0)
    kept = [o for i, o in enumerate(options) if o not in RUN_LENGTH and (i == 0 or options[i - 1] not in RUN_LENGTH)]
    return " ".join([str(cfg), *kept])


def load_e2e(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """link -> e2e key -> row, from benchmarks/e2e.py's CSV."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in csv.DictReader(path.open()):
        compress, *options = row["spec"].split()
        out.setdefault(row["link"], {})[e2e_key(compress, options)] = {
            "step_s": float(row["step_s"]), "rate_mbit": float(row["rate_mbit"]), "latency_ms": float(row["latency_ms"])}
    return out


def load_run(run: Path) -> dict[str, Any] | None:
    if not (run / "summary.json").exists():
        return None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [(r["step"], r["val_loss"]) for r in rows if r["kind"] == "eval"]
    last = train[-1]
    return {"evals": evals, "final": evals[-1][1], "wire": sum(r["act_wire_bytes"] + r["grad_wire_bytes"] for r in train) / len(train),
            "act_wire": last["act_wire_bytes"], "grad_wire": last["grad_wire_bytes"],
            "act_raw": last["act_raw_bytes"], "grad_raw": last["grad_raw_bytes"]}


def lm_eval_verdicts(paths: list[Path], serving: str | None = None) -> dict[str, str]:
    """Run name -> "parity" / "worse", from eval/parity.py reports: worse if any metric fails. Where several reports
    measured the same metric of a run, the one with the most documents decides (a full-task re-run over a 40-document
    one; on a tie the first listed). `serving`: only candidates evaluated with that compression count (None: any)."""
    best: dict[str, dict[str, tuple[int, str]]] = {}
    for path in paths:
        if not path.exists():
            continue
        for c in json.loads(path.read_text())["candidates"]:
            if serving is not None and c.get("compress") != serving:
                continue
            metrics = best.setdefault(Path(c["checkpoint"]).name, {})
            for name, m in c["metrics"].items():
                if m["n"] > metrics.get(name, (-1, ""))[0]:
                    metrics[name] = (m["n"], m["verdict"])
    return {run: "worse" if any(v == "worse" for _, v in metrics.values()) else "parity" for run, metrics in best.items()}


def link_times(e2e: dict[str, dict[str, dict[str, Any]]], key: str, steps: float | None, base_steps: float | None,
               warmup: int) -> dict[str, dict[str, Any]]:
    """Per link of one e2e run: the setting's step time, time to target and speedup, and the link's r, all against
    that run's own uncompressed rows (side by side)."""
    none_key = e2e_key("none", [])
    free = e2e.get("none", {}).get(none_key)
    links = {}
    for link, rows in e2e.items():
        mine, none = rows.get(key), rows.get(none_key)
        if mine is None or none is None:
            continue
        t = time_to_target(steps, mine["step_s"], warmup, none["step_s"])
        t_base = time_to_target(base_steps, none["step_s"])
        links[link] = {"rate_mbit": mine["rate_mbit"], "latency_ms": mine["latency_ms"],
                       "r": comm_ratio(none["step_s"], free["step_s"]) if free else None,
                       "step_s": mine["step_s"], "step_speedup": none["step_s"] / mine["step_s"],
                       "time_to_target_s": t, "speedup": t_base / t if t and t_base else None}
    return links


@dataclasses.dataclass(frozen=True)
class Testbed:
    """One quality study whose runs make frontier rows."""

    model: str
    """The model, as the rows' `model` field names it."""
    settings: dict[str, str]
    """Run name -> spec (eval/study.py)."""
    base: str
    """The uncompressed run."""
    seed1: str
    """The uncompressed run with another seed (the noise floor)."""
    results: str
    """Its folder under results/eval/."""
    parity: tuple[str, ...] = ("parity.json",)
    """Its lm-eval reports (eval/parity.py) under the results folder, as glob patterns; the most documents per metric
    decide."""
    serving: str | None = None
    """The compression the lm-eval verdicts were served with (None: the run's own, as each report says)."""
    e2e: tuple[str, ...] = ()
    """Its step times per link: benchmarks/e2e.py's CSVs under results/bench/ (a setting uses the first that
    measured it: later files hold settings added later)."""
    optimizers: tuple[tuple[str, str, str], ...] = ()
    """(optimizer, its uncompressed run, that run with another seed) for the runs trained with another optimizer than
    the baseline's (`--optimizer`): they are judged against their own optimizer's baseline and noise floor."""

    def e2e_paths(self) -> list[Path]:
        return [ROOT / "results" / "bench" / f"{name}.csv" for name in self.e2e]


TESTBEDS = {"long": Testbed("small GPT", LONG, "base", "base-seed1", "long",
                            # parity_int8rot, parity_vq: against a baseline re-trained from the same command (4.528
                            # vs 4.530)
                            ("parity.json", "parity_int8rot.json", "parity_vq.json"),
                            e2e=("e2e_frontier", "e2e_frontier_more", "e2e_frontier_nf"),
                            optimizers=(("muon", "muon-base", "muon-base-seed1"),)),
            # lm-eval on the trained checkpoints served uncompressed: what training with compression did to the model
            # (the loss rule already validates through the run's own compression); all documents of the tasks that
            # 40 could not decide, 40 of the others
            # step times of SmolLM2 itself over the links (untied, like the small GPT's: the links carry pipeline
            # traffic only; its tied embedding's all-reduce is 4x that traffic, which no pipeline compression touches)
            "smollm2": Testbed("SmolLM2-135M", SMOLLM2, "sm-base", "sm-base-seed1", "smollm2", ("parity_*.json",), "none",
                               e2e=("e2e_smollm2", "e2e_smollm2_bottleneck")),
            # the small GPT as Megatron-Core's GPTModel (issue 70): the loss rule only
            "megatron": Testbed("small GPT on Megatron-Core", MEGATRON, "mc-base", "mc-base-seed1", "megatron", ())}


def optimizer_of(options: list[str]) -> str:
    """The optimizer a run's recipe options train with (`--optimizer`; AdamW without it)."""
    return options[options.index("--optimizer") + 1] if "--optimizer" in options else "adamw"


def frontier(runs: dict[str, dict[str, Any]], e2e: list[dict[str, dict[str, dict[str, Any]]]], verdicts: dict[str, str],
             testbed: Testbed = TESTBEDS["long"]) -> list[dict[str, Any]]:
    """One row per run. `e2e` holds one or more e2e runs (link -> key -> row); a setting takes its step times from the
    first one that measured it. Bits per element are against the dense fp32 tensors the studies train with; the same
    codes and scales replace bf16 values in a bf16 run, so `x_bf16` is 16 / bits."""
    dense = runs[testbed.base]  # the bits are against its tensors, whatever the optimizer
    elem_bits = 32  # the study trains in fp32
    baselines = {"adamw": (testbed.base, testbed.seed1), **{o: (b, s) for o, b, s in testbed.optimizers}}
    out = []
    for name, r in runs.items():
        spec, options = testbed.settings[name], EXTRA.get(name, [])
        optimizer = optimizer_of(options)
        if optimizer not in baselines:
            raise ValueError(f"{name}: --optimizer {optimizer} has no baseline in the {testbed.model} testbed; "
                             f"accepted: {', '.join(baselines)}")
        base_name, seed1 = baselines[optimizer]
        base = runs.get(base_name)
        target = None if base is None else base["final"]
        floor = abs(runs[seed1]["final"] - target) if base is not None and seed1 in runs else None
        tol = tolerance(floor)
        base_steps = None if base is None else steps_to_target(base["evals"], target)
        warmup = ppc.parse_spec(spec).warmup_steps
        steps = None if base is None else steps_to_target(r["evals"], target)
        links = next((t for run in e2e if (t := link_times(run, e2e_key(spec, options), steps, base_steps, warmup))), {})
        delta = None if base is None else r["final"] - target
        fwd, bwd = elem_bits * r["act_wire"] / dense["act_raw"], elem_bits * r["grad_wire"] / dense["grad_raw"]
        out.append({"name": name, "model": testbed.model, "spec": spec, "options": options, "seed": SEEDS.get(name, 0),
                    "baseline": base_name, "bits_fwd": fwd, "bits_bwd": bwd, "bits_avg": (fwd + bwd) / 2,
                    "x_fp32": 64 / (fwd + bwd), "x_bf16": 32 / (fwd + bwd),
                    "wire_ratio": (dense["act_raw"] + dense["grad_raw"]) / r["wire"], "final_val_loss": r["final"],
                    "delta": delta, "noise_floor": floor, "tolerance": tol, "steps_to_target": steps,
                    "base_step_at_this_loss": None if base is None else steps_to_target(base["evals"], r["final"]),
                    "links": links,
                    "parity": {"loss_rule": None if base is None else loss_rule(delta, tol, r["evals"][-1][0],
                                                                                base["evals"][-1][0]),
                               "lm_eval": "baseline" if name == base_name else verdicts.get(name)}})
    return out


def loss_rule(delta: float, tol: float | None, steps: int, base_steps: int) -> str | None:
    """The loss rule's verdict on a run's final loss `delta` above the baseline's: parity or worse, None without a
    tolerance (one seed of the baseline), and "N steps: not comparable" for a run of other length than the baseline's
    (its steps to target are its result)."""
    if steps != base_steps:
        return f"{steps} steps: not comparable"
    return None if tol is None else ("parity" if delta <= tol else "worse")


def _fmt_steps(steps: float | None) -> str:
    return "never" if steps is None else f"{steps:.0f}"


def testbed_base(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The testbed's (AdamW) baseline among its rows."""
    return next(r for r in rows if r["name"] in {t.base for t in TESTBEDS.values()})


def link_order(rows: list[dict[str, Any]]) -> list[tuple[str, float | None]]:
    """(link, r) of every measured link but the unthrottled one, slowest link (largest r) last."""
    base = testbed_base(rows)
    links = [(k, v["r"]) for k, v in base["links"].items() if v["rate_mbit"] > 0]
    return sorted(links, key=lambda x: x[1] if x[1] is not None else -1)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The frontier as a markdown table: bits, quality, verdicts, steps and speedup to target per link."""
    links = link_order(rows)
    base = testbed_base(rows)["name"]
    head = ["setting", "--pp-compress", "bits/elem fwd / bwd (avg)", "wire ratio", "final val loss", "delta (tolerance)",
            "parity: loss / lm-eval", "steps to target", "baseline had this loss at step",
            *(f"speedup {k} (r={r:.1f})" if r is not None else f"speedup {k}" for k, r in links)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spec = " ".join([f"`{r['spec']}`", *r["options"]])
        floor = f" ({r['tolerance']:.3f})" if r["tolerance"] is not None else ""
        delta = "—" if r["delta"] is None else f"{r['delta']:+.3f}{floor}"
        if r.get("baseline", base) != base:  # judged against its own optimizer's baseline
            delta += f" vs {r['baseline']}"
        sp = [_cell(r["links"][k], col_r) if k in r["links"] else "" for k, col_r in links]
        out.append(f"| {r['name']} | {spec} | {r['bits_fwd']:.2f} / {r['bits_bwd']:.2f} ({r['bits_avg']:.2f}) | "
                   f"{r['wire_ratio']:.2f}x | {r['final_val_loss']:.3f} | {delta} | "
                   f"{r['parity']['loss_rule'] or ''} / {r['parity']['lm_eval'] or 'not run'} | {_fmt_steps(r['steps_to_target'])} | "
                   f"{_fmt_steps(r['base_step_at_this_loss']) if r['base_step_at_this_loss'] is not None else '—'} |"
                   + "".join(f" {c} |" for c in sp))
    return out


def step_table(rows: list[dict[str, Any]]) -> list[str]:
    """Step time per link of every measured setting and its speedup per step over the uncompressed run on the same
    link: the wall-clock ratio of runs of the same number of steps, which is what the loss rule compares (where a
    cosine schedule ends every run at its final loss, no run but the baseline may reach the strict target)."""
    links = link_order(rows)
    free = next((k for r in rows for k, v in r["links"].items() if v["rate_mbit"] == 0), None)
    cols = ([free] if free else []) + [k for k, _ in links]
    names = {free: "unlimited", **{k: k if r is None else f"{k} (r={r:.1f})" for k, r in links}}
    head = ["setting", "--pp-compress", "parity: loss / lm-eval", *(f"{names[k]}: step s (speedup)" for k in cols)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seen: set[str] = set()
    for r in rows:
        key = " ".join([r["spec"], *r["options"]])
        if not r["links"] or key in seen:  # one row per measured spec (seeds share their step times)
            continue
        seen.add(key)
        cells = [f"{r['links'][k]['step_s']:.2f} ({r['links'][k]['step_speedup']:.2f}x)" if k in r["links"] else ""
                 for k in cols]
        out.append(f"| {r['name']} | `{r['spec']}` | {r['parity']['loss_rule'] or ''} / {r['parity']['lm_eval'] or 'not run'} | "
                   + " | ".join(cells) + " |")
    return out


def _cell(link: dict[str, Any], column_r: float | None) -> str:
    """A speedup cell; with the link's own r where its e2e run (machine drift) differs from the column's by > 2%."""
    if not link["speedup"]:
        return "never"
    own = link["r"]
    drift = own is not None and column_r is not None and abs(own - column_r) > 0.02 * column_r
    return f"{link['speedup']:.2f}x" + (f" (r={own:.1f})" if drift else "")


def at_parity(r: dict[str, Any]) -> bool:
    """Both rules pass (lm-eval must have been run)."""
    return r["parity"]["loss_rule"] == "parity" and r["parity"]["lm_eval"] == "parity"


def _speeds(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['links'][k]['speedup']:.2f}x at r = {r['links'][k]['r']:.1f} ({k})" for k, _ in link_order(rows)
                     if k in r["links"] and r["links"][k]["speedup"] and r["links"][k]["r"] is not None)


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """The README headline: the setting with the fewest bits at parity on both rules, and the time-to-target speedups
    of the fewest-bits parity setting that reaches the target within the run."""
    parity = sorted((r for r in rows if r["wire_ratio"] > 1.01 and at_parity(r)), key=lambda r: r["bits_avg"])
    if not parity:
        return ["No compressed setting of the long study is at parity on both rules yet."]
    best = parity[0]
    out = [f"Best setting at parity (final loss within the tolerance and lm-eval non-inferior): `{best['spec']}`"
           f"{' ' + ' '.join(best['options']) if best['options'] else ''}: {best['bits_avg']:.2f} bits per element "
           f"({best['wire_ratio']:.2f}x fewer bytes than fp32), final loss {best['delta']:+.3f} vs the baseline "
           f"(tolerance {best['tolerance']:.3f}, twice the seed gap)."]
    reach = next((r for r in parity if r["steps_to_target"] is not None), None)
    if best["steps_to_target"] is None:
        at = best["base_step_at_this_loss"]
        out.append(f"It ends just above the baseline's final loss (the baseline had its loss at step {_fmt_steps(at)}), so by the "
                   "strict rule it never reaches the target and has no time-to-target speedup.")
    if reach is not None:
        out.append(f"Time to the baseline's final loss with `{reach['spec']}` (step {_fmt_steps(reach['steps_to_target'])}): "
                   f"{_speeds(reach, rows)}.")
    return out


def _save(fig: Any, ax: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows: list[dict[str, Any]], where: Path) -> list[str]:
    """quality_vs_bits.png and speedup_vs_r.png in `where`; returns their stems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tol = next((r["tolerance"] for r in rows if r["tolerance"] is not None), None)
    if tol is not None:
        ax.axhspan(-tol, tol, color="0.85", label=f"within the tolerance (2 x seed gap: +-{tol:.3f})")
    for r in (x for x in rows if x["delta"] is not None):  # each against its own optimizer's baseline
        ax.scatter(r["bits_avg"], r["delta"], color="C2" if r["parity"]["loss_rule"] == "parity" else "C3")
        ax.annotate(r["name"], (r["bits_avg"], r["delta"]), fontsize=6)
    ax.set(xscale="log", xlabel="bits per element on the wire (mean of forward and backward; fp32 = 32)",
           ylabel="final validation loss - baseline", title="quality vs bits (1,000 steps; green: within the tolerance)")
    _save(fig, ax, where / "quality_vs_bits.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    links = link_order(rows)
    for i, r in enumerate(x for x in rows if x["name"] != "base" and x["steps_to_target"] is not None):
        pts = [(rr, r["links"][k]["speedup"]) for k, rr in links if k in r["links"] and rr is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=f"C{i % 10}", label=r["name"])
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set(xscale="log", xlabel="comm/compute ratio r of the link (uncompressed run)",
           ylabel="time-to-target speedup vs uncompressed", title="wall-clock to the baseline's final loss")
    _save(fig, ax, where / "speedup_vs_r.png")
    return ["quality_vs_bits", "speedup_vs_r"]


def build(results: Path, e2e: list[Path], out: Path, testbed: Testbed = TESTBEDS["long"]) -> list[dict[str, Any]]:
    """frontier.json's rows of one testbed from its logs, the e2e step times and the parity report (if run); the rows
    of the other testbeds in `out` stay. Returns every row."""
    runs = {n: r for n in testbed.settings if (r := load_run(results / n))}
    if testbed.base not in runs:
        raise SystemExit(f"no baseline run in {results}: run eval/study.py's {testbed.base} first")
    missing = [str(p) for p in e2e if not p.exists()]
    if missing:
        raise SystemExit(f"no step times in {', '.join(missing)}: run benchmarks/e2e.py (its command heads each .md)")
    reports = [p for pattern in testbed.parity for p in sorted(results.glob(pattern)) if not p.name.endswith(".docs.json")]
    verdicts = lm_eval_verdicts(reports, testbed.serving)  # (a report's .docs.json holds its per-document values)
    rows = frontier(runs, [load_e2e(p) for p in e2e], verdicts, testbed)
    kept = [r for r in json.loads(out.read_text()) if r.get("model", "small GPT") != testbed.model] if out.exists() else []
    every = kept + rows
    out.write_text(json.dumps(every, indent=1))
    return every


def of_model(rows: list[dict[str, Any]], model: str = "small GPT") -> list[dict[str, Any]]:
    """The rows of one testbed (rows written before the model field are the small GPT's)."""
    return [r for r in rows if r.get("model", "small GPT") == model]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", choices=list(TESTBEDS), default="long")
    ap.add_argument("--results", type=Path, default=None, help="default results/eval/<the testbed's folder>")
    ap.add_argument("--e2e", type=Path, nargs="*", default=None,
                    help="e2e.py CSVs; a setting uses the first that measured it (default: the testbed's own)")
    ap.add_argument("--out", type=Path, default=RESULTS / "frontier.json")
    args = ap.parse_args()
    testbed = TESTBEDS[args.testbed]
    e2e = args.e2e if args.e2e is not None else testbed.e2e_paths()
    rows = build(args.results or RESULTS / testbed.results, e2e, args.out, testbed)
    print("\n".join(table(of_model(rows, testbed.model))))
    print(f"{len(rows)} settings -> {args.out}")


if __name__ == "__main__":
    main()
