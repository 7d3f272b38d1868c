"""results/eval/RESULTS.md and its plots from the quality study's runs (eval/study.py).

    python eval/report.py                  # copies runs/study_long/* to results/eval/long/, runs/study/* to results/eval/
    python eval/report.py --from-results   # rebuilds from the copies in results/eval alone

The copies keep the measured data in the repository (runs/ is not tracked). Every number in RESULTS.md,
the verdicts on the paper's findings included, is computed here from those logs by the rules written
next to each finding; nothing is typed in by hand. The long study (1,000 steps) is the headline, with the
frontier (eval/frontier.py -> results/eval/frontier.json); the short 120-step study follows as history.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from pp_lab.docblock import markers, update_readme
from pp_lab.paths import RESULTS, ROOT
import pp_compress as ppc
from pp_lab.eval import auto_runs, epochs, frontier
from pp_compress.presets import PRESETS
from pp_lab.eval.findings import LEVELS, Findings, continued, findings_compared, finetuning, verdicts
from pp_lab.eval.study import (COMMON, MC_COMMON, FINDINGS_RUNS, FINETUNE, FT_COMMON, FT_EP_COMMON, FT_EPOCHS, LOGS, LONG, LONG_COMMON,
                        SETTINGS, SM_COMMON, SMOLLM2)

KEEP = (*LOGS, "infer_none.json")
GROUPS = {
    "quantization": ["base", "int8", "act-int4_grad-int8", "act-int2"],
    "rotation": ["base", "int8", "act-int4_grad-int8", "act-int4rot_grad-int8", "act-int3_grad-int8", "act-int3rot_grad-int8",
                 "act-int4rot_grad-int4rotstoch", "act-int2", "act-int2rot"],
    "topk-both": ["base"] + [f"topk{r}" for r in LEVELS],
    "topk-act": ["base"] + [f"act-topk{r}" for r in LEVELS],
    "topk-grad": ["base"] + [f"grad-topk{r}" for r in LEVELS],
    "feedback": ["base", "topk0.1", "topk0.1+ef", "topk0.1+ef21", "topk0.1+aqsgd"],
    "matched-bytes": ["base", "topk0.1", "randk0.13", "lowrank10"],
    "subspace": ["base", "int8", *(f"subspace{k}{t}" for k in (48, 24, 12) for t in ("", "-int8"))],
    "seed-operators": ["base", "int8", "act-int8_grad-nat", "act-int8_grad-nat4", "act-int8_grad-int4stoch", "act-topk0.2",
                       "act-topk0.2row", "act-mdtopk0.2", "act-mdtopk0.2wg", "act-mdtopk0.2gw", "act-mdtopk0.2st"],
}
LONG_GROUPS = {"frontier": [n for n in LONG if n not in FINDINGS_RUNS],
               "topk-both": GROUPS["topk-both"], "feedback": GROUPS["feedback"]}


def load(run: Path, settings: dict[str, str] | None = None) -> dict[str, Any] | None:
    if not (run / "summary.json").exists():
        return None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    wire = sum(r["act_wire_bytes"] + r["grad_wire_bytes"] for r in train) / len(train)
    raw = sum(r["act_raw_bytes"] + r["grad_raw_bytes"] for r in train) / len(train)
    spec = (settings or {**SETTINGS, **FINETUNE}).get(run.name, "?")
    out = {"name": run.name, "spec": spec, "val_loss": evals[-1]["val_loss"], "evals": evals, "train": train, "wire": wire,
           "ratio": raw / wire, "steps": train[-1]["step"]}
    if (run / "infer_none.json").exists():
        out["val_loss_plain_inference"] = math.log(json.loads((run / "infer_none.json").read_text())["val_ppl"])
    return out


def curves(runs: dict[str, dict], where: Path, groups: dict[str, list[str]], what: str = "4-stage pipeline, small GPT"
           ) -> list[str]:
    """One validation-curve plot per group with at least two runs measured -> <where>/<group>.png; returns the groups."""
    where.mkdir(parents=True, exist_ok=True)
    made = []
    for group, names in groups.items():
        present = [n for n in names if n in runs]
        if len(present) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, n in enumerate(present):
            ev, ratio = runs[n]["evals"], runs[n]["ratio"]
            ax.plot([e["tokens"] for e in ev], [e["val_loss"] for e in ev], "o-", color=f"C{i}", label=f"{n} ({ratio:.1f}x)")
        ax.set(xlabel="tokens", ylabel="validation loss", title=f"{group}: {what}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(where / f"{group}.png", dpi=110)
        plt.close(fig)
        made.append(group)
    return made


def quality_vs_bytes(runs: dict[str, dict], where: Path) -> str:
    """The short study's final loss against wire bytes per step -> <where>/quality_vs_bytes.png; returns the stem."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, r in runs.items():
        ax.scatter(r["wire"] / 1e6, r["val_loss"], color="C3" if "grad" in n else "C0" if "act" in n else "C2")
        ax.annotate(n, (r["wire"] / 1e6, r["val_loss"]), fontsize=6)
    ax.set(xscale="log", xlabel="wire MB per step (all boundaries, both directions)", ylabel="final validation loss",
           title="quality vs traffic (green: both directions, blue: act only, red: grad only)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(where / "quality_vs_bytes.png", dpi=110)
    plt.close(fig)
    return "quality_vs_bytes"


def base_step_at(base: dict, loss: float) -> str:
    """The step at which the base run's validation curve reached `loss` (linear between its evaluations): how many
    base steps a run's final loss is worth. "<first" when base was already there at its first evaluation."""
    ev = [(e["step"], e["val_loss"]) for e in base["evals"]]
    if loss >= ev[0][1]:
        return f"<{ev[0][0]}"
    for (s0, l0), (s1, l1) in zip(ev, ev[1:]):
        if l1 <= loss <= l0:
            return f"{s0 + (l0 - loss) / (l0 - l1) * (s1 - s0):.0f}" if l0 != l1 else f"{s1}"
    return f">{ev[-1][0]}" if loss < ev[-1][1] else f"{ev[-1][0]}"


def table(runs: dict[str, dict], names: dict[str, str], base_name: str) -> list[str]:
    base = runs.get(base_name)
    lines = ["| setting | --pp-compress | wire ratio | wire MB/step | final val loss | delta vs base | val loss, inference uncompressed "
             "| base reached this loss at step |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        if n in runs:
            r = runs[n]
            delta = f"{r['val_loss'] - base['val_loss']:+.3f}" if base else ""
            plain = f"{r['val_loss_plain_inference']:.3f}" if "val_loss_plain_inference" in r else ""
            at = base_step_at(base, r["val_loss"]) if base else ""
            lines.append(f"| {n} | `{r['spec']}` | {r['ratio']:.2f}x | {r['wire'] / 1e6:.2f} | {r['val_loss']:.3f} | {delta} | "
                         f"{plain} | {at} |")
    return lines


def copy_runs(runs: Path, results: Path) -> None:
    for run in sorted(runs.glob("*/")):
        if (run / "summary.json").exists():
            (results / run.name).mkdir(parents=True, exist_ok=True)
            for f in KEEP:
                if (run / f).exists():
                    shutil.copy(run / f, results / run.name / f)


README_START, README_END = markers("frontier")


def frontier_block(rows: list[dict]) -> list[str]:
    return [*frontier.table(rows), "", "**Headline.** " + " ".join(frontier.headline(rows))]


USER_SETTINGS = ("safe", "int8", "act=nf6,grad=int3:stoch", "aggressive", "act=nf5,grad=nf2:stoch",
                 "act=tile:3.5,grad=tile:3:stoch", "topk:0.1")
"""The settings docs/choosing.md's table shows: the presets, per-row int8, the former `safe` and the former
`aggressive` (chosen on the small GPT, worse on SmolLM2), the 3.6-bit tile setting, and the paper's TopK 10%."""


def presets_block(rows: list[dict]) -> list[str]:
    """One line per setting a user picks from: its bits against fp32 and bf16 and its verdicts, from the frontier."""
    out = ["| `--pp-compress` | stands for | bits/elem fwd / bwd (avg) | fewer bytes than fp32 / bf16 | model | "
           "final loss vs uncompressed (tolerance) | parity: loss / lm-eval |", "|---|---|---|---|---|---|---|"]
    for name in USER_SETTINGS:
        spec = str(ppc.parse_spec(name))
        same = [r for r in rows if str(ppc.parse_spec(r["spec"])) == spec and not r["options"]]
        # the small GPT's rows first, then each model's seeds in order: a verdict at the edge shows on every seed
        for r in sorted(same, key=lambda r: (r.get("model", "small GPT") != "small GPT", r["seed"])):
            lm = r["parity"]["lm_eval"] or "not run"
            seed = f", seed {r['seed']}" if r["seed"] else ""
            out.append(f"| `{name}` | `{PRESETS.get(name, name)}` | {r['bits_fwd']:.2f} / {r['bits_bwd']:.2f} "
                       f"({r['bits_avg']:.2f}) | {32 / r['bits_avg']:.1f}x / {16 / r['bits_avg']:.1f}x | "
                       f"{r.get('model', 'small GPT')}{seed} | {r['delta']:+.3f} ({r['tolerance']:.3f}) | "
                       f"{r['parity']['loss_rule']} / {lm} |")
    return out


def epochs_block(rows: list[dict]) -> list[str]:
    return epochs.table(rows, "ft-ep-base")


def epochs_section(ftep: dict[str, dict], rel: Path, results: Path, readme: Path | None) -> list[str]:
    """Multi-epoch finetuning (AQ-SGD's regime) -> results/eval/finetune_epochs.json, its table and curves."""
    rows = epochs.rows(ftep, FT_EPOCHS, "ft-ep-base", FT_EP_COMMON)
    (results / "finetune_epochs.json").write_text(json.dumps(rows, indent=1))
    if readme is not None:
        update_readme(readme, "finetune-epochs", epochs_block(rows))
    made = curves(ftep, rel / "plots" / "long", {"finetune-epochs": list(FT_EPOCHS)}, "SmolLM2-135M, 8 epochs of 32 sequences")
    n = int(epochs.flag(FT_EP_COMMON, "--train-sequences"))
    return ["### Multi-epoch finetuning: AQ-SGD's deltas (`results/eval/finetune_epochs.json`)", "",
            f"`recipes/finetune.py {' '.join(FT_EP_COMMON)} --pp-compress SPEC`: SmolLM2-135M-Instruct on {n} sequences of "
            f"Jane Austen for {rows[0]['epochs']:.0f} epochs of {rows[0]['steps_per_epoch']} steps, so every sample comes "
            f"back {rows[0]['epochs'] - 1:.0f} times. AQ-SGD sends a sample's first visit raw (or, with "
            "`+aqsgd:first=OP`, compressed by OP) and every later visit as a compressed delta to "
            "what the receiver already holds: its bits are split at the end of the first epoch. int4 without AQ-SGD is "
            "the control at the same bits. Eight epochs of 32 sequences overfit: validation loss turns up after the "
            "first epochs while training loss keeps falling, so the loss rule judges the best validation loss (the "
            "checkpoint a user keeps), with the rule's 0.02-nat floor as tolerance (this protocol has no second "
            "seed); the final validation and training losses are shown too. Validation: the mean loss of the held-out batches, "
            f"every {epochs.flag(FT_EP_COMMON, '--eval-every')} steps, uncompressed (`eval=none`: what compressed training "
            "did to the model, not int4 at inference).", "", *epochs_block(rows), "",
            *[f"![{m}]({(rel / 'plots' / 'long' / (m + '.png')).relative_to(rel).as_posix()})" for m in made], ""]


def e2e_commands(paths: list[Path]) -> list[str]:
    """The commands that made e2e.py's result files (the first line of each .md)."""
    return [p.with_suffix(".md").read_text().splitlines()[0].removeprefix("Command: ") for p in paths
            if p.with_suffix(".md").exists()]


SM_E2E = ("python benchmarks/e2e.py --recipe finetune --stages 4 --steps 5 --link none --link 25mbit --link 5mbit@20ms "
          "--spec none --spec int8:rot --spec int8 --spec act=vq:4,grad=vq:3 --out results/bench/e2e_smollm2")
"""The command that measures SmolLM2's step times over the links (the smollm2 testbed's e2e file)."""


def smollm2_block(rows: list[dict], results: Path) -> list[str]:
    """The SmolLM2 testbed's frontier with time to target per link, each run served uncompressed too, and how they
    were made."""
    out = [f"`recipes/finetune.py {' '.join(SM_COMMON)} --seed S --pp-compress SPEC` from SmolLM2-135M-Instruct "
           f"(`make models`): {len(rows)} of {len(SMOLLM2)} settings measured (`python eval/study.py --protocol "
           "smollm2`, resumable; logs in `results/eval/smollm2/<setting>/`). Validation: 16 x 4 x 128 held-out tokens "
           "every 25 steps, through the run's own compression (its `eval`, else its `act` spec). Bits per element are "
           "the wire bits per fp32 element (the runs' dtype); a bf16 run sends the same codes: 16 / bits fewer bytes.",
           "", *frontier.table(rows), ""]
    commands = e2e_commands(frontier.TESTBEDS["smollm2"].e2e_paths())
    if not commands:
        out.append(f"Step time per link: not measured yet (`{SM_E2E}`).")
    else:
        out += ["Step time per link, measured on SmolLM2's own 4-stage pipeline "
                f"({'; '.join(commands)}), each setting side by side with the "
                "uncompressed run over the same link; speedup = the uncompressed step time / the setting's. The runs are "
                "untied, so the links carry pipeline traffic only: the tied embedding's gradient all-reduce between the first "
                "and the last stage is 113 MB a step, 4x the uncompressed pipeline traffic, and no pipeline compression "
                "touches it. Every run here follows the same 200-step cosine schedule and the loss rule compares their final "
                "checkpoints, so a setting at parity reaches that quality in the same steps, and its wall-clock speedup is its "
                "step-time speedup; the strict time to target above is 'never' for every run but the baseline, because the "
                "schedule, not the compression, decides where each curve ends. r = (uncompressed step time over the link - "
                "unthrottled) / unthrottled.", "", *frontier.step_table(rows)]
    plain = [(r, json.loads(f.read_text())) for r in rows if (f := results / r["name"] / "infer_none.json").exists()]
    base = next((math.log(p["val_ppl"]) for r, p in plain if r["name"] == frontier.TESTBEDS["smollm2"].base), None)
    if base is not None:
        out += ["", "Served uncompressed (`recipes/infer.py --data austen --micro-batch 4 --ppl-batches 16 --pp-compress "
                "none` on the final checkpoint, the baseline's the same way: what training with compression did to the "
                "model, without compression at inference; these batches are another sample of the held-out text than the runs' "
                "validation, so compare within a column):", "",
                "| setting | final val loss, its own compression | served uncompressed | delta vs the baseline served so |",
                "|---|---|---|---|"]
        out += [f"| {r['name']} | {r['final_val_loss']:.3f} | {math.log(p['val_ppl']):.3f} | "
                f"{math.log(p['val_ppl']) - base:+.3f} |" for r, p in plain]
    return out


def megatron_block(rows: list[dict[str, Any]]) -> list[str]:
    """docs/results.md's Megatron-Core block: the loss rule's table of its study (eval/study.py --protocol megatron)."""
    return [f"Every run: `recipes/pretrain.py {' '.join(MC_COMMON)} --seed S --pp-compress SPEC` (Megatron-Core's own "
            "GPTModel in the small GPT's sizes under its own 1F1B schedule, 2 pipeline stages on CPU/gloo, the recipe's "
            "Shakespeare data; `python eval/study.py --protocol megatron`, resumable). Logs: "
            "`results/eval/megatron/<setting>/`. Bits per element are counted at the transport against the baseline's "
            "dense fp32 tensors; the loss rule as above (tolerance: twice the seed-to-seed gap, at least 0.02 nats). "
            "`auto` over an emulated link that changes: docs/choosing.md.", "", *frontier.table(rows)]


def long_section(long: dict[str, dict], short: dict[str, dict], ft: dict[str, dict], ftep: dict[str, dict],
                 args: argparse.Namespace) -> list[str]:
    rel = args.out.parent
    every = frontier.build(args.results / "long", args.e2e, args.results / "frontier.json")
    rows = frontier.of_model(every)
    if args.readme is not None:
        update_readme(args.readme, "frontier", frontier_block(rows))
        update_readme(args.summary, "presets", presets_block(every))
        update_readme(args.summary, "auto-quality", auto_runs.block(args.results))
    made = frontier.plot(rows, rel / "plots" / "long")
    made += curves(long, rel / "plots" / "long", LONG_GROUPS)
    sm_results = args.results / frontier.TESTBEDS["smollm2"].results
    sm_runs = {n: r for n in SMOLLM2 if (r := load(sm_results / n, SMOLLM2))}
    columns = (Findings(short), Findings(long), finetuning(ft, ftep), continued(sm_runs))
    if args.readme is not None:
        update_readme(args.readme, "findings", verdicts(*columns))
        if (sm_results / frontier.TESTBEDS["smollm2"].base).exists():
            sm_bed = frontier.TESTBEDS["smollm2"]
            measured = [p for p in sm_bed.e2e_paths() if p.exists()]  # its block says where none are, and the command
            sm = frontier.of_model(frontier.build(sm_results, measured, args.results / "frontier.json", sm_bed),
                                   sm_bed.model)
            update_readme(args.readme, "frontier-smollm2", smollm2_block(sm, sm_results))
        mc_bed = frontier.TESTBEDS["megatron"]
        if (args.results / mc_bed.results / mc_bed.base).exists():
            mc = frontier.of_model(frontier.build(args.results / mc_bed.results, [], args.results / "frontier.json",
                                                  mc_bed), mc_bed.model)
            update_readme(args.readme, "frontier-megatron", megatron_block(mc))
    cmds = e2e_commands(args.e2e)
    return ["## The long study: 1,000 steps (the headline)", "",
            f"Every run: `recipes/pretrain.py {' '.join(LONG_COMMON)} --pp-compress SPEC` (plus the setting's own options) — "
            f"the same model, data and pipeline as the short study below, 2.0M tokens (1.3 epochs), 5% of every file "
            f"held out, validation on 128 x 4 x 128 held-out tokens every 50 steps. {len(long)} of {len(LONG)} settings "
            "measured (`python eval/study.py --protocol long`, resumable). Logs: `results/eval/long/<setting>/`.", "",
            "### The frontier (`results/eval/frontier.json`)", "",
            "Time to target = steps to reach the baseline's final validation loss (interpolated on the validation curve) x "
            "the setting's step time over the link, measured by `benchmarks/e2e.py` on the same 4-stage pipeline "
            f"({'; then '.join(cmds)}; untied embeddings, so the links carry pipeline traffic only; a setting takes its step "
            "times from the first of these runs that measured it, against that run's own uncompressed rows). "
            "Speedup = the baseline's time to target / the setting's. r = (uncompressed step time over the link - "
            "unthrottled) / unthrottled. Bits per element count wire bits against the dense fp32 boundary tensors. "
            "The loss rule: final loss at most the baseline's plus the tolerance (twice the seed-to-seed gap, at least "
            "0.02 nats), as for the findings below; lm-eval: eval/parity.py's non-inferiority verdict (below). "
            "base-seed1's own row shows how much of a steps-to-target difference the seed alone makes.", "",
            *frontier.table(rows), "", "**Headline.** " + " ".join(frontier.headline(rows)), "",
            *[f"![{m}]({(rel / 'plots' / 'long' / (m + '.png')).relative_to(rel).as_posix()})" for m in made], "",
            "### The paper's six findings, re-judged", "", *findings_compared(*columns),
            *(epochs_section(ftep, rel, args.results, args.readme) if ftep else []),
            "### All long-study settings", "", *table(long, LONG, "base"), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "study")
    ap.add_argument("--long-runs", type=Path, default=ROOT / "runs" / "study_long")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--e2e", type=Path, nargs="+", default=frontier.TESTBEDS["long"].e2e_paths(),
                    help="the small GPT's e2e.py CSVs (eval/frontier.py)")
    ap.add_argument("--out", type=Path, default=RESULTS / "RESULTS.md")
    ap.add_argument("--from-results", action="store_true", help="rebuild from results/eval only")
    ap.add_argument("--readme", type=Path, default=ROOT / "docs" / "results.md",
                    help="whose frontier, findings and finetuning blocks to rewrite")
    ap.add_argument("--summary", type=Path, default=ROOT / "docs" / "choosing.md", help="whose presets block to rewrite")
    ap.add_argument("--no-readme", dest="readme", action="store_const", const=None, help="rewrite neither")
    args = ap.parse_args()
    if not args.from_results:
        copy_runs(args.runs, args.results)
        copy_runs(args.long_runs, args.results / "long")
    every = {r["name"]: r for r in (load(p) for p in sorted(args.results.glob("*/"))) if r}
    runs = {n: r for n, r in every.items() if n in SETTINGS}
    ft = {n: r for n, r in every.items() if n in FINETUNE}
    long = {n: r for n in LONG if (r := load(args.results / "long" / n, LONG))}
    ftep = {n: r for n in FT_EPOCHS if (r := load(args.results / "long" / n, FT_EPOCHS))}
    if "base" not in runs:
        raise SystemExit(f"no baseline run in {args.results}: run `python eval/study.py --only base` first")
    where = args.out.parent / "plots"
    made = [*curves(runs, where, GROUPS), *curves(ft, where, {"finetune": list(FINETUNE)}, "SmolLM2-135M finetuning, 2 stages"),
            quality_vs_bytes(runs, where)]
    rel = args.out.parent
    parity = args.results / "parity.md"
    long_parity = args.results / "long" / "parity.md"
    lines = ["# Quality study: compression on the real 4-stage DeepSpeed pipeline", "",
             "Generated by `python eval/report.py` from the runs of `python eval/study.py --protocol long` (the headline) and "
             "`python eval/study.py` (the short 120-step study, kept as history). 4 stage processes on CPU/gloo, the "
             "`small` GPT (4.2M parameters), Shakespeare with an 8192-token BPE, micro-batch 4 x seq 128, 4 micro-batches "
             "per step, fp32, the same seed, data order and validation batches for every setting. Validation loss is "
             "measured through the pipeline with the run's own inference compression (the activation spec).", ""]
    if "base" in long:
        lines += long_section(long, runs, ft, ftep, args)
        if long_parity.exists():
            lines += ["### lm-eval non-inferiority of the long study's final checkpoints (eval/parity.py)", "",
                      long_parity.read_text(), ""]
    lines += ["## History: the short study (120 steps)", "",
              f"Every run: `recipes/pretrain.py {' '.join(COMMON)} --pp-compress SPEC` ({len(runs)} of {len(SETTINGS)} settings "
              "measured), 2% of every file held out, validation on 32 x 4 x 128 tokens. The last column of the tables "
              "re-evaluates the final checkpoint with no compression at all (`recipes/infer.py --pp-compress none`, same "
              "batches). Logs: `results/eval/<setting>/`. At 120 steps (245k tokens) the models are still learning "
              "unigram statistics; the long study above supersedes these verdicts.", "",
              "### Findings of the paper at 120 steps", "", *Findings(runs).lines(),
              "### All pretraining settings", "", *table(runs, SETTINGS, "base"), ""]
    if ft:
        lines += ["### Finetuning SmolLM2-135M-Instruct", "",
                  f"`recipes/finetune.py {' '.join(FT_COMMON)} --pp-compress SPEC` (`make models` first): Jane Austen's "
                  "novels, SmolLM2's tokenizer, validation loss on 8 x 2 x 128 held-out tokens.", "",
                  *table(ft, FINETUNE, "ft-base"), ""]
    lines += ["### Plots (120 steps)", "", *[f"![{m}]({(rel / 'plots' / (m + '.png')).relative_to(rel).as_posix()})" for m in made], ""]
    if parity.exists():
        lines += ["### lm-eval parity of the 120-step checkpoints (the old rule: parity unless significantly worse)", "",
                  parity.read_text().replace("# Parity report", "", 1), ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
