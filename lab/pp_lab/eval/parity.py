"""Does a compression setting keep the model as good as the uncompressed one? One command, offline.

    python eval/parity.py --baseline runs/study/base \
        --candidate runs/study/topk0.1 --candidate runs/study/topk0.1+ef@none --out eval/parity/topk

A candidate is CHECKPOINT[@SPEC]: a recipe run directory (or transformers folder) evaluated with
inference-time compression SPEC at the stage boundaries; without @SPEC, the compression it was trained
with (its `eval`, else its `act` spec). The baseline runs as given (default @none). Every model answers the
same local lm-eval tasks (eval/tasks.py), and the report (<out>.md, <out>.json) gives per task and metric:
the baseline, the candidate, the delta and its standard error, and a verdict.

Verdict: non-inferiority. Documents are paired (the same ones for both models), so the uncertainty of the
mean delta is that of the per-document differences d (candidate - baseline, signed so that positive is
worse): SE = std(d) / sqrt(n). The candidate passes a metric when the one-sided upper confidence bound
mean(d) + t_{conf, n-1} * SE (Student's t, scipy.stats; --confidence, default 95%) lies within the margin:
  bits_per_byte        1% of the baseline (--margin-rel)
  ll (last-word log-likelihood, nats)   log(1.05): the last word's perplexity may rise by at most 5% (--margin-ll)
  acc, acc_norm        1 point absolute (--margin-acc)
The last-word margin is wider because one word's log-likelihood is far noisier per document than a whole
passage's bits per byte: with the ~1,000 documents the held-out text yields, a 1% margin would fail a second seed
of the baseline itself (its upper bound lands above 1%; results/eval/RESULTS.md shows the seed replicate's row), so it
could not tell compression from chance. The margins were set on that replicate, before any candidate was judged.
So a candidate must show that it is not worse by more than the margin; too few documents fail, they never
pass by default. A multiple-choice accuracy whose baseline does not beat chance (exact binomial test, 1%) says
nothing about either model: it is reported as "at chance" and does not gate. The exit code is 1 if any candidate
is worse on any metric.
Per-document values: acc / acc_norm (0 or 1), lastword perplexity -> per-document log-likelihood, ppl ->
per-document bits per byte.

The tasks are built from the held-out tail of every file of --corpus: the baseline run's validation
fraction less a 0.5% margin (eval/tasks.py), so a run trained with --val-fraction 0.05 gets ~3x the
documents of one trained with 0.02.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from pp_lab.eval.lm import PPCompressLM
from pp_lab.eval.tasks import CHANCE, KINDS, build, held_out_fraction, task_dir
from pp_lab import data

HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "ll": True, "bits_per_byte": False}
RELATIVE = {"bits_per_byte"}  # margin relative to the baseline's mean; ll's is log(1 + margin_ll) nats; acc's absolute


def trained_spec(checkpoint: Path) -> str:
    record = data.run_record(checkpoint)
    if record is None:
        return "none"
    import pp_compress as ppc

    cfg = ppc.parse_spec(record["pp_compress"])
    return str(cfg.spec_for(0, "act", training=False))


def per_doc(task: str, samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-document values of the metrics the verdict uses, in document order."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    if task.endswith("_ppl"):
        return {"bits_per_byte": [-s["bits_per_byte"][0] / s["bits_per_byte"][1] / math.log(2) for s in rows]}
    if task.endswith("_lastword"):
        return {"acc": [float(s["acc"]) for s in rows], "ll": [float(s["perplexity"]) for s in rows]}
    return {m: [float(s[m]) for s in rows] for m in ("acc", "acc_norm") if m in rows[0]}


def cache_key(checkpoint: Path, spec: str, tasks: list[str], where: Path, stages: int, limit: int | None) -> str:
    """What an evaluation depends on: the checkpoint (its files' names, sizes and times), the spec, the documents."""
    h = hashlib.sha256(json.dumps([str(checkpoint.resolve()), spec, tasks, stages, limit]).encode())
    weights = [*checkpoint.glob("*.json"), *checkpoint.glob("*.safetensors"), *checkpoint.glob("ckpt/**/*")]
    for f in sorted(p for p in weights if p.is_file() and p.name not in ("summary.json", "infer_none.json")):
        st = f.stat()
        h.update(f"{f.relative_to(checkpoint)}:{st.st_size}:{st.st_mtime_ns}".encode())
    for t in tasks:
        h.update((where / f"{t}.jsonl").read_bytes())
    return h.hexdigest()[:24]


def evaluate(checkpoint: Path, spec: str, tasks: list[str], where: Path, stages: int, limit: int | None,
             cache: Path | None = None) -> dict[str, dict[str, list[float]]]:
    """Per-document values per task and metric; reused from `cache` when nothing it depends on changed."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    hit = cache / f"{cache_key(checkpoint, spec, tasks, where, stages, limit)}.json" if cache else None
    if hit is not None and hit.exists():
        print(f"{checkpoint}@{spec}: cached ({hit})", file=sys.stderr)
        return json.loads(hit.read_text())
    lm = PPCompressLM(checkpoint=str(checkpoint), compress=spec, stages=stages)
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(where), include_defaults=False),
                                  limit=limit, bootstrap_iters=0, log_samples=True)
    out = {t: per_doc(t, res["samples"][t]) for t in tasks}
    if hit is not None:
        hit.parent.mkdir(parents=True, exist_ok=True)
        hit.write_text(json.dumps(out))
    return out


def documents(tasks: list[str], where: Path) -> dict[str, str]:
    """What identifies each task's documents: a hash of its JSONL."""
    return {t: hashlib.sha256((where / f"{t}.jsonl").read_bytes()).hexdigest()[:16] for t in tasks}


def scored_baseline(path: Path, rec: dict[str, Any], tasks: list[str], where: Path, stages: int,
                    limit: int | None) -> dict[str, dict[str, list[float]]]:
    """The baseline's per-document values from an earlier report's <out>.docs.json (`rec`, read from `path`), for
    exactly these documents."""
    if (rec["stages"], rec["limit"]) != (stages, limit):
        raise SystemExit(f"{path} was scored with --stages {rec['stages']} --limit {rec['limit']}, not --stages {stages} "
                         f"--limit {limit}: pass the same ones (or the baseline's checkpoint)")
    docs = documents(tasks, where)
    for t in tasks:
        if rec["documents"].get(t) != docs[t]:
            have = ", ".join(f"{k} ({v})" for k, v in rec["documents"].items())
            raise SystemExit(f"{path} has no values for task {t}'s documents ({docs[t]}); it has {have}. The corpus, its "
                             "held-out fraction and the tasks must be those it was scored on")
    return {t: rec["baseline"]["values"][t] for t in tasks}


def margin_for(metric: str, baseline_mean: float, rel: float, acc: float, ll: float = 0.05) -> float:
    """How much worse (in the metric's units, positive = worse) a candidate may be."""
    if metric in RELATIVE:
        return rel * abs(baseline_mean)
    if metric == "ll":
        return math.log1p(ll)
    if metric in ("acc", "acc_norm"):
        return acc
    raise ValueError(f"no margin rule for metric {metric!r}; known: {', '.join(HIGHER_IS_BETTER)}")


def above_chance(base: list[float], chance: float, alpha: float = 0.01) -> bool:
    """Does the baseline's accuracy beat a uniform guess (one-sided exact binomial test at `alpha`)?"""
    from scipy import stats

    return stats.binomtest(round(sum(base)), len(base), chance, alternative="greater").pvalue < alpha


def compare(base: list[float], cand: list[float], higher: bool, margin: float, confidence: float = 0.95,
            chance: float | None = None) -> dict[str, Any]:
    """Paired non-inferiority: parity when the one-sided upper bound of the mean worsening is <= margin. An accuracy
    whose baseline does not beat chance (`chance` given) measures nothing: it is reported, verdict "at chance", and
    does not gate."""
    from scipy import stats

    if len(base) != len(cand) or len(base) < 2:
        raise ValueError(f"need the same >= 2 documents for both models, got {len(base)} and {len(cand)}")
    n = len(base)
    worse = [(b - c) if higher else (c - b) for b, c in zip(base, cand)]
    mean_w = sum(worse) / n
    se = math.sqrt(sum((x - mean_w) ** 2 for x in worse) / (n - 1) / n)
    bound = mean_w + float(stats.t.ppf(confidence, n - 1)) * se
    return {"n": n, "baseline": sum(base) / n, "candidate": sum(cand) / n, "delta": sum(c - b for b, c in zip(base, cand)) / n,
            "se": se, "worse_by": mean_w, "bound": bound, "margin": margin,
            "verdict": "at chance" if chance is not None and not above_chance(base, chance) else
            "parity" if bound <= margin else "worse"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True,
                    help="CHECKPOINT[@SPEC], or an earlier report's <out>.docs.json (its baseline's per-document values)")
    ap.add_argument("--candidate", action="append", required=True, help="CHECKPOINT[@SPEC], repeatable")
    ap.add_argument("--corpus", default="shakespeare")
    ap.add_argument("--stages", type=int, default=4, help="where the boundaries are (as in training)")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    ap.add_argument("--task", action="append", choices=KINDS, default=None,
                    help="repeatable: only these tasks (default all four), e.g. all documents of one task that a "
                         "limited run left undecided")
    ap.add_argument("--margin-rel", type=float, default=0.01, help="bits/byte and perplexity margin, relative (0.01 = 1%%)")
    ap.add_argument("--margin-acc", type=float, default=0.01, help="accuracy margin, absolute (0.01 = 1 point)")
    ap.add_argument("--margin-ll", type=float, default=0.05, help="last-word perplexity margin, relative (0.05 = 5%%)")
    ap.add_argument("--confidence", type=float, default=0.95, help="one-sided confidence of the upper bound")
    ap.add_argument("--out", type=Path, required=True, help="report path without suffix")
    ap.add_argument("--cache", type=Path, default=data.CACHE / "parity",
                    help="per-model results are kept here and reused while checkpoint, spec and documents are unchanged")
    ap.add_argument("--no-cache", action="store_true")
    args = ap.parse_args()
    cache = None if args.no_cache else args.cache

    def parse(arg: str, default: str | None) -> tuple[Path, str]:
        path, _, spec = arg.partition("@")
        return Path(path), spec or default or trained_spec(Path(path))

    scores = Path(args.baseline) if args.baseline.endswith(".docs.json") else None
    if scores is not None:  # an earlier report's per-document values: the baseline as it was scored there
        rec = json.loads(scores.read_text())
        base_path, base_spec, frac = Path(rec["baseline"]["checkpoint"]), rec["baseline"]["compress"], rec["held_out_fraction"]
    else:
        base_path, base_spec = parse(args.baseline, "none")
        frac = held_out_fraction(base_path)
    where = task_dir(frac)
    tasks = [t for t in build(args.corpus, where, frac=frac) if args.task is None or t.rsplit("_", 1)[-1] in args.task]
    base = (scored_baseline(scores, rec, tasks, where, args.stages, args.limit) if scores is not None
            else evaluate(base_path, base_spec, tasks, where, args.stages, args.limit, cache))
    command = shlex.join(["python", "eval/parity.py", *sys.argv[1:]])
    report: dict[str, Any] = {"command": command, "baseline": {"checkpoint": str(base_path), "compress": base_spec,
                                                             **({"scores": str(scores)} if scores else {})},
                              "held_out_fraction": frac,
                              "rule": {"kind": "non-inferiority", "confidence": args.confidence, "margin_rel": args.margin_rel,
                                       "margin_acc": args.margin_acc, "margin_ll": args.margin_ll}, "candidates": []}
    failed = False
    docs: dict[str, Any] = {"held_out_fraction": frac, "stages": args.stages, "limit": args.limit,
                            "documents": documents(tasks, where),
                            "baseline": {"checkpoint": str(base_path), "compress": base_spec, "values": base}, "candidates": []}
    for arg in args.candidate:
        path, spec = parse(arg, None)
        cand = evaluate(path, spec, tasks, where, args.stages, args.limit, cache)
        rows = {f"{t}/{m}": compare(base[t][m], cand[t][m], HIGHER_IS_BETTER[m],
                                    margin_for(m, sum(base[t][m]) / len(base[t][m]), args.margin_rel, args.margin_acc, args.margin_ll),
                                    args.confidence, CHANCE.get(t.rsplit("_", 1)[-1]) if m.startswith("acc") else None)
                for t in tasks for m in base[t]}
        failed |= any(r["verdict"] == "worse" for r in rows.values())
        report["candidates"].append({"checkpoint": str(path), "compress": spec, "metrics": rows})
        docs["candidates"].append({"checkpoint": str(path), "compress": spec, "values": cand})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".docs.json").write_text(json.dumps(docs))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Parity report (non-inferiority)\n\nCommand: `{command}`\n\nBaseline: `{base_path}` evaluated with `{base_spec}`"
             f"{f' (its per-document values from `{scores}`)' if scores else ''}; tasks from the held-out "
             f"{frac:.1%} of every file. A candidate passes a metric when the one-sided {args.confidence:.0%} upper confidence bound "
             f"of its paired mean worsening is within the margin ({args.margin_rel:.0%} relative on bits/byte, "
             f"{args.margin_ll:.0%} on the last word's perplexity, {100 * args.margin_acc:g} point on accuracy). 'worse by' and 'bound' are positive when the candidate is worse.\n",
             "| candidate | compress | task/metric | n | baseline | candidate | delta | worse by | bound | margin | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["candidates"]:
        for k, r in c["metrics"].items():
            lines.append(f"| `{c['checkpoint']}` | `{c['compress']}` | {k} | {r['n']} | {r['baseline']:.4f} | {r['candidate']:.4f} | "
                         f"{r['delta']:+.4f} | {r['worse_by']:+.4f} | {r['bound']:+.4f} | {r['margin']:.4f} | {r['verdict']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
