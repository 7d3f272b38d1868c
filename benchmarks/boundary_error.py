"""Bits per element and relative error of operators on a trained recipe run's own boundary tensors.

The run's final checkpoint runs, in one process, over held-out text of its corpus. At every stage cut (as DeepSpeed
places them for --stages) it takes what the pipeline would send: the activation forward and d(mean next-token loss)
/ d(activation) backward. Each spec compresses each tensor once; the table gives wire bits per element and
||x - x_hat|| / ||x|| averaged over the cuts. Use it to choose a spec for your own model before training with it.

    python benchmarks/boundary_error.py --run runs/study_long/base --stages 4   # -> benchmarks/results/boundary_error_base.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import pp_compress as ppc  # noqa: E402
from eval.lm import load_model, stage_cuts  # noqa: E402
from op_table import describe, markdown  # noqa: E402
from recipes import data, model as gpt  # noqa: E402

SPECS = ["int8", "int5", "int4", "int4:asym", "int4:rot", "int4:per=block64", "int4:per=block32", "int4:stoch",
         "int3", "int3:stoch", "int3:per=block32", "int2:stoch", "int6", "nf6", "nf5", "nf4", "nf4:per=block64", "nf4:per=block32", "nf4:stoch",
         "nf3", "nf3:stoch", "nf2:stoch", "nf:48", "nf:40", "nf:7:stoch", "nf:6:stoch", "nf:5:stoch", "nf:3:stoch", "nat:bits=4", "fp8", "topk:0.3:per=row>int8", "lowrank:8"]


def boundary_tensors(run: Path, record: dict, stages: int, rows: int, seq: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(activations, activation-gradients) at each stage cut, on `rows` x `seq` held-out tokens of the run's corpus
    (`record`: the run's run.json)."""
    model, tok, trained_seq = load_model(run)
    corpus, frac = record["args"]["corpus"], data.run_val_fraction(run) or data.VAL_FRACTION
    val = data.lm_datasets(data.corpus_files(corpus), tok, min(seq, trained_seq), frac)[1]
    batch = val.select(range(min(rows, len(val))))
    ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])  # (rows, seq) each
    cuts, acts = set(int(c) for c in stage_cuts(model.cfg, stages)), []
    x = ids
    for i, layer in enumerate(model.layers):
        x = layer(x)
        if i in cuts:
            h = x[0] if isinstance(x, tuple) else x  # (rows, seq, d), or (seq, rows, d) for the sbh layout
            h.retain_grad()
            acts.append(h)
    gpt.lm_loss(x, labels).backward()
    return [a.detach() for a in acts], [a.grad for a in acts]


def row(spec: str, tensors: list[torch.Tensor]) -> list[str]:
    op, errs, bits = ppc.build(spec), [], []
    for i, t in enumerate(tensors):
        ctx = ppc.Context(boundary=i, seed=i)
        y, p = op.roundtrip(t, ctx)
        errs.append(((t - y).norm() / t.norm()).item())
        bits.append(p.nbytes * 8 / t.numel())
    return [f"`{spec}`", f"{sum(bits) / len(bits):.3f}", f"{sum(errs) / len(errs):.4f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a recipe run directory with a checkpoint")
    ap.add_argument("--stages", type=int, default=4, help="where the cuts are: as DeepSpeed partitions this many stages")
    ap.add_argument("--rows", type=int, default=16, help="held-out sequences")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--spec", action="append", default=None, help=f"repeatable (default: {' '.join(SPECS)})")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/boundary_error_<run name>.md")
    args = ap.parse_args()
    record = data.run_record(args.run)
    if record is None or not (args.run / "ckpt" / "latest").exists():
        ap.error(f"--run {args.run}: not a recipe run with a checkpoint (run.json and ckpt/latest)")
    if "corpus" not in record["args"]:
        ap.error(f"--run {args.run}: not a pretraining run (recipes/pretrain.py records its --corpus, whose held-out text "
                 "this reads)")
    torch.manual_seed(0)
    acts, grads = boundary_tensors(args.run, record, args.stages, args.rows, args.seq)
    specs = args.spec or SPECS
    header = ["spec", "bits/element", "rel. error, mean over cuts"]
    tables = [markdown(header, [row(s, ts) for s in specs]) for ts in (acts, grads)]
    command = " ".join(["python", "benchmarks/boundary_error.py", *sys.argv[1:]])
    text = (f"# Operators on the boundary tensors of {args.run.name}\n\nCommand: `{command}`\n\n"
            f"{len(acts)} cuts, {args.rows} x {args.seq} held-out tokens; torch {torch.__version__}\n\n"
            f"## Activations (forward)\n\nFirst cut: {describe(acts[0])}\n\n{tables[0]}\n\n"
            f"## Activation-gradients (backward)\n\nFirst cut: {describe(grads[0])}\n\n{tables[1]}\n")
    print(text)
    out = args.out or ROOT / "benchmarks" / "results" / f"boundary_error_{args.run.name}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
