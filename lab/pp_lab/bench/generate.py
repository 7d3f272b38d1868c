"""KV-cached pipelined generation (recipes/infer.py) per inference spec: greedy agreement with uncompressed
generation, bits per element of prefill and decode messages, time to first token and decode tokens/s; and whether
generation cost grows linearly in new tokens.

    python benchmarks/generate.py --checkpoint .cache/models/SmolLM2-135M-Instruct --corpus austen \\
        --prompts 64 --new 128 --out results/bench/generate_smollm2.md

Prompts are the first --prompt-tokens tokens of held-out sequences of --corpus. Every spec runs the same prompts as
one batch over --stages processes (CPU/gloo); agreement is measured against the uncompressed run of the same
command: the share of generated positions before a sequence's first divergent token, and the share of equal tokens.
min_numel=0 is added to every spec so that the decode messages (one position per sequence) are compressed too.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from pp_lab.paths import ROOT
from pp_lab import data
from pp_lab.launch import run_job

SPECS = ["int8", "int8:rot", "safe", "int4:rot", "tile:3.5", "topk:0.1"]


def infer(args: argparse.Namespace, prompts: Path, spec: str, new: int, out: Path, *extra: str) -> dict:
    rc, log = run_job(ROOT / "recipes/infer.py", args.stages, "--checkpoint", str(args.checkpoint), "--prompt-file",
                      str(prompts), "--max-new-tokens", str(new), "--pp-compress", spec, "--out", str(out), *extra,
                      launcher="deepspeed", timeout=3600)
    if rc != 0:
        raise SystemExit(f"recipes/infer.py failed for {spec!r}:\n{log[-3000:]}")
    return json.loads(out.read_text())


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of positions before each sequence's first divergence, share of equal tokens)."""
    before = equal = total = 0
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        before, equal, total = before + n, equal + sum(x == y for x, y in zip(a, b)), total + len(a)
    return before / total, equal / total


def bits(res: dict, phase: str) -> float | None:
    raw = sum(s["traffic"][phase][1] for s in res["per_stage"])
    n = sum(s["traffic"][phase][2] for s in res["per_stage"])
    return 8 * raw / n if n else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a recipe run or a transformers folder")
    ap.add_argument("--corpus", default="austen", choices=list(data.CORPORA))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--spec", action="append", default=None, help=f"repeatable (default: {' '.join(SPECS)})")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--teacher-forced", action="store_true",
                    help="instead: score held-out sequences of --prompt-tokens + --new tokens in one pass per spec: "
                         "top-1 agreement with uncompressed scoring and the perplexity delta")
    args = ap.parse_args()
    from pp_lab.kvcache import load_model

    _, tok, _ = load_model(args.checkpoint)
    val = data.lm_datasets(data.corpus_files(args.corpus), tok, args.prompt_tokens, data.VAL_FRACTION)[1]
    if len(val) < args.prompts:
        raise SystemExit(f"--prompts {args.prompts}: the held-out text of {args.corpus} has {len(val)} sequences")
    if args.teacher_forced:
        return teacher_forced(args, tok)
    texts = [tok.decode(val[i]["input_ids"]).replace("\n", " ") for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "prompts.txt").write_text("\n".join(texts) + "\n")
        ref = infer(args, work / "prompts.txt", "none", args.new, work / "none.json")
        half = infer(args, work / "prompts.txt", "none", args.new // 2, work / "half.json")
        rows = [("none", ref)] + [(s, infer(args, work / "prompts.txt", f"{s},min_numel=0", args.new, work / "s.json"))
                                  for s in (args.spec or SPECS)]
    cmd = " ".join(["python", "benchmarks/generate.py", *map(shlex.quote, sys.argv[1:])])
    lines = [f"# KV-cached pipelined generation: {args.checkpoint.name}", "", f"Command: `{cmd}`", "",
             f"{args.prompts} prompts of {args.prompt_tokens} tokens (held-out {args.corpus}) as one batch, {args.new} new "
             f"greedy tokens, {args.stages} stage processes on CPU/gloo.", "",
             "| --pp-compress | bits/elem prefill | bits/elem decode | positions before first divergence | equal tokens | "
             "time to first token s | decode tokens/s |", "|---|---|---|---|---|---|---|"]
    for spec, res in rows:
        before, equal = agreement(ref["new_tokens"], res["new_tokens"])
        lines.append(f"| `{spec}` | {bits(res, 'prefill'):.2f} | {bits(res, 'decode'):.2f} | {before:.1%} | {equal:.1%} | "
                     f"{res['time_to_first_token_s']:.2f} | {res['decode_tokens_per_s']:.1f} |")
    t_half, t_full = half["total_s"] - half["time_to_first_token_s"], ref["total_s"] - ref["time_to_first_token_s"]
    lines += ["", f"Linear cost: decoding {args.new // 2} tokens took {t_half:.1f} s, {args.new} tokens {t_full:.1f} s "
              f"({t_full / t_half:.2f}x for 2x the tokens; a recomputing generator grows quadratically)."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def teacher_forced(args: argparse.Namespace, tok: object) -> None:
    """Each spec scores the same held-out sequences in one pass: top-1 agreement and perplexity against uncompressed."""
    length = args.prompt_tokens + args.new
    val = data.lm_datasets(data.corpus_files(args.corpus), tok, length, data.VAL_FRACTION)[1]
    texts = [tok.decode(val[i]["input_ids"]).replace("\n", " ") for i in range(min(args.prompts, len(val)))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "texts.txt").write_text("\n".join(texts) + "\n")
        runs = [(spec, infer(args, work / "texts.txt", spec if spec == "none" else f"{spec},min_numel=0", 1,
                             work / "s.json", "--score")) for spec in ["none", *(args.spec or SPECS)]]
    ref = runs[0][1]
    cmd = " ".join(["python", "benchmarks/generate.py", *map(shlex.quote, sys.argv[1:])])
    lines = [f"# Teacher-forced scoring through the KV-cached pipeline: {args.checkpoint.name}", "", f"Command: `{cmd}`", "",
             f"{len(texts)} held-out {args.corpus} sequences of {length} tokens, scored in one pass (prefill) over "
             f"{args.stages} stage processes on CPU/gloo. Top-1 agreement: the share of positions whose most likely next "
             "token equals the uncompressed pass's.", "",
             "| --pp-compress | bits/elem | top-1 agreement | perplexity | delta vs none |", "|---|---|---|---|---|"]
    for spec, res in runs:
        pairs = [(a, b) for x, y in zip(ref["scored"]["top1"], res["scored"]["top1"]) for a, b in zip(x, y)]
        agree = sum(a == b for a, b in pairs) / len(pairs)
        lines.append(f"| `{spec}` | {bits(res, 'prefill'):.2f} | {agree:.1%} | {res['ppl']:.3f} | "
                     f"{res['ppl'] - ref['ppl']:+.3f} ({res['ppl'] / ref['ppl'] - 1:+.2%}) |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
