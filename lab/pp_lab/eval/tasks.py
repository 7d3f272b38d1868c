"""Local lm-eval tasks from held-out text of a corpus (offline; no hub).

    python eval/tasks.py --corpus shakespeare        # -> .cache/eval_tasks/ (YAML + JSONL, absolute paths)
    python eval/lm.py run --model pp_compress --model_args checkpoint=runs/x --tasks ppc_shakespeare_ppl --include_path .cache/eval_tasks

Held-out text = the last F of the characters of every file of the corpus, F = the run's --val-fraction
less 0.5% (1.5% by default; 4.5% for the long study's 5%). Pretraining holds out the last --val-fraction of
every file's tokens (recipes/data.py), so these passages were never trained on (the 0.5% margin absorbs
the varying characters per token; `check_held_out` verifies it for a tokenizer).

    ppc_<corpus>_ppl        loglikelihood_rolling over passages of ~1,000 characters: word/byte perplexity, bits/byte
    ppc_<corpus>_nextline   multiple choice: three lines of verse/prose, which of 4 lines comes next (1 true,
                            3 drawn from other held-out places); acc, acc_norm; chance = 0.25
    ppc_<corpus>_wordorder  multiple choice: after two lines, which of 4 versions of the next line is the real one
                            (each other version swaps one pair of neighbouring words); acc; chance = 0.25. Local
                            word order is what small models learn first, so they score clearly above chance here,
                            and a single swap keeps it from being trivially easy (full shuffles are)
    ppc_<corpus>_lastword   LAMBADA-style: a passage without its last word; is the word the greedy
                            continuation (acc), and its perplexity
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

from pp_lab import data

HELD_OUT = {"fixture": 0.3}  # per corpus, overriding F. The committed fixture is tiny: its tasks overlap training
MARGIN = 0.005
DEFAULT = round(data.VAL_FRACTION - MARGIN, 6)
DEFAULT_DIR = data.CACHE / "eval_tasks"
CHANCE = {"nextline": 0.25, "wordorder": 0.25}  # accuracy of a uniform guess, per multiple-choice task


def held_out_fraction(checkpoint: Path) -> float:
    """F for a run directory: its --val-fraction less the margin (DEFAULT for a transformers folder)."""
    vf = data.run_val_fraction(checkpoint)
    if vf is None:
        return DEFAULT
    frac = round(vf - MARGIN, 6)
    if frac <= 0:
        raise ValueError(f"{checkpoint}: --val-fraction {vf} leaves no held-out text (need > {MARGIN})")
    return frac


def task_dir(frac: float) -> Path:
    """One folder per F: lm-eval finds tasks by name, so differently sized sets must not share a folder."""
    return DEFAULT_DIR if frac == DEFAULT else DEFAULT_DIR.with_name(f"eval_tasks_{frac:g}")


def held_out(corpus: str, frac: float = DEFAULT) -> list[str]:
    """The held-out tail of every file."""
    texts = [f.read_text(encoding="utf-8") for f in data.corpus_files(corpus)]
    frac = HELD_OUT.get(corpus, frac)
    return [t[len(t) - round(len(t) * frac):] for t in texts]


def check_held_out(corpus: str, tokenizer: Any, val_fraction: float = 0.02) -> None:
    """Raise if any held-out passage starts before the pretraining validation split of that file."""
    for f in data.corpus_files(corpus):
        text = f.read_text(encoding="utf-8")
        start = len(text) - round(len(text) * HELD_OUT.get(corpus, val_fraction - MARGIN))
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        before = len(tokenizer(text[:start], add_special_tokens=False)["input_ids"])
        if before < n - round(n * val_fraction):
            raise ValueError(f"{f.name}: held-out text starts at token {before}, inside the training part (< {n - round(n * val_fraction)})")


def _lines(tails: list[str]) -> list[list[str]]:
    return [[ln.strip() for ln in t.splitlines() if len(ln.strip().split()) >= 3] for t in tails]


def _swaps(line: str, rng: random.Random, k: int) -> list[str] | None:
    """k variants of the line, each with one pair of neighbouring words swapped (None if the line has too few words)."""
    words = line.split()
    spots = [i for i in range(len(words) - 1) if words[i] != words[i + 1]]
    if len(words) < 5 or len(spots) < k:
        return None
    out = []
    for i in rng.sample(spots, k):
        w = list(words)
        w[i], w[i + 1] = w[i + 1], w[i]
        out.append(" ".join(w))
    return out if len(set(out)) == k and line not in out else None


KINDS = ("ppl", "nextline", "wordorder", "lastword")
"""The four tasks of a corpus, named ppc_<corpus>_<kind>."""


def build(corpus: str, out: Path, seed: int = 0, frac: float = DEFAULT) -> list[str]:
    """Write the four tasks' JSONL + YAML into `out`; returns the task names."""
    rng = random.Random(seed)
    tails = held_out(corpus, frac)
    out.mkdir(parents=True, exist_ok=True)
    ppl = []
    for t in tails:
        body = t[t.find("\n") + 1:]  # start at a line boundary
        ppl += [{"text": body[i:i + 1000]} for i in range(0, len(body) - 300, 1000)]
    lines_by_file = _lines(tails)
    pool = [ln for lines in lines_by_file for ln in lines]
    nextline, wordorder, lastword = [], [], []
    for lines in lines_by_file:
        for i in range(0, len(lines) - 4, 4):
            ctx, true = "\n".join(lines[i:i + 3]), lines[i + 3]
            wrong = rng.sample([ln for ln in pool if ln != true], 3)
            label = rng.randrange(4)
            nextline.append({"context": ctx + "\n", "choices": wrong[:label] + [true] + wrong[label:], "label": label})
            words = re.sub(r"[^\w\s']+$", "", "\n".join(lines[i:i + 4])).split(" ")
            if len(words) > 8 and words[-1].isalpha():
                lastword.append({"context": " ".join(words[:-1]), "target": words[-1]})
        for i in range(2, len(lines)):  # every line is an item: its accuracy differences are rare, so n must be large
            variants = _swaps(lines[i], rng, 3)
            if variants is not None:
                label = rng.randrange(4)
                wordorder.append({"context": "\n".join(lines[i - 2:i]) + "\n",
                                  "choices": variants[:label] + [lines[i]] + variants[label:], "label": label})
    rows = {"ppl": ppl, "nextline": nextline, "wordorder": wordorder, "lastword": lastword}
    assert tuple(rows) == KINDS
    specs = {
        "ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]},
        "nextline": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                     "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        "wordorder": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                      "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
        "lastword": {"output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": " {{target}}",
                     "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]},
    }
    names = []
    for kind, docs in rows.items():
        name = f"ppc_{corpus}_{kind}"
        path = (out / f"{name}.jsonl").resolve()
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
                "test_split": "test", **specs[kind], "metadata": {"version": 1.0}}
        (out / f"{name}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML
        names.append(name)
        print(f"{name}: {len(docs)} documents -> {path}", file=sys.stderr)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="shakespeare", choices=data.CORPORA)
    ap.add_argument("--val-fraction", type=float, default=DEFAULT + MARGIN, help="the runs' --val-fraction")
    ap.add_argument("--out", type=Path, default=None, help="default: the folder eval/parity.py uses for this fraction")
    ap.add_argument("--check-tokenizer", default=None, help="a tokenizer folder: verify the held-out text was not trained on")
    a = ap.parse_args()
    frac = round(a.val_fraction - MARGIN, 6)
    build(a.corpus, a.out or task_dir(frac), frac=frac)
    if a.check_tokenizer:
        check_held_out(a.corpus, data.load_tokenizer(a.check_tokenizer), a.val_fraction)
        print("held-out text lies inside the validation split for this tokenizer", file=sys.stderr)


if __name__ == "__main__":
    main()
