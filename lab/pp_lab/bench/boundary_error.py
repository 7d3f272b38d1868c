"""Bits per element and relative error of operators on a trained recipe run's own boundary tensors.

The run's final checkpoint runs, in one process, over held-out text of its corpus. At every stage cut (as DeepSpeed
places them for --stages) it takes what the pipeline would send: the activation forward and d(mean next-token loss)
/ d(activation) backward. Each spec compresses each tensor once; the table gives wire bits per element and
||x - x_hat|| / ||x|| averaged over the cuts. Use it to choose a spec for your own model before training with it.

    python benchmarks/boundary_error.py --run runs/study_long/base --stages 4   # -> results/bench/boundary_error_base.md
    python benchmarks/boundary_error.py --run .cache/models/SmolLM2-135M-Instruct --corpus austen --stages 4 \
        --out results/bench/boundary_error_smollm2.md     # a transformers folder (make models) on a corpus

Each cut's error is also listed on its own (--per-cut), since a LLaMA model's outlier channels grow with depth.
Relative error over a whole tensor is a poor guide where one token (an attention sink) holds most of its norm: what
decides is what an error does to the loss. --loss adds, per cut, the held-out loss with only that cut's activation
replaced by its round trip (the rest of the model runs forward from there), then with every cut's replaced as the
pipeline would, each minus the loss without compression.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pp_lab.paths import ROOT
import pp_compress as ppc
from pp_lab.eval.lm import load_model, stage_cuts
from pp_lab.bench.op_table import describe, markdown
from pp_lab import data, model as gpt

SPECS = ["int8", "int8:rot", "tile:3.5", "tile:3", "tile:4:lo=4", "tile:3.5:pivots=0", "tile:3.5:rot=false",
         "tile:3.5:asym", "tile:3:lo=2:hi=4", "tile:2.5:lo=2:hi=3", "tile:3:stoch", "tile:2:lo=2:hi=2:stoch", "vq:4", "vq:3.5", "vq:3", "vq:2.5", "vq:2",
         "vq:3:dim=1", "vq:2:dim=1", "vq:2:dim=4", "vq:1.5:dim=4", "int5", "int4", "int4:asym", "int4:rot", "int4:per=block64", "int4:per=block32", "int4:stoch",
         "int3", "int3:stoch", "int3:per=block32", "int2:stoch", "int6", "nf6", "nf5", "nf4", "nf4:per=block64", "nf4:per=block32", "nf4:stoch",
         "nf3", "nf3:stoch", "nf2:stoch", "nf:48", "nf:40", "nf:7:stoch", "nf:6:stoch", "nf:5:stoch", "nf:3:stoch", "nat:bits=4", "fp8", "topk:0.3:per=row>int8", "lowrank:8"]


Codec = Callable[[torch.Tensor], torch.Tensor]
LossWith = Callable[[dict[int, Codec]], float]
"""{cut: round trip} -> the held-out loss with those cuts' activations sent through their round trips, in order (a
later cut's activation is computed from what the earlier ones received, as in the pipeline)."""


def boundary_tensors(run: Path, corpus: str, frac: float, stages: int, rows: int,
                     seq: int) -> tuple[list[torch.Tensor], list[torch.Tensor], LossWith, float]:
    """(activations, activation-gradients) at each stage cut, on `rows` x `seq` held-out tokens of `corpus` (the
    last `frac` of every file), with the loss as a function of the cuts' activations, and the loss itself."""
    model, tok, trained_seq = load_model(run)
    val = data.lm_datasets(data.corpus_files(corpus), tok, min(seq, trained_seq), frac)[1]
    batch = val.select(range(min(rows, len(val))))
    ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])  # (rows, seq) each
    cuts, acts, outs = set(int(c) for c in stage_cuts(model.cfg, stages)), [], []
    x = ids
    for i, layer in enumerate(model.layers):
        x = layer(x)
        if i in cuts:
            h = x[0] if isinstance(x, tuple) else x  # (rows, seq, d), or (seq, rows, d) for the sbh layout
            h.retain_grad()
            acts.append(h)
            outs.append((i, x))
    loss = gpt.lm_loss(x, labels)
    loss.backward()

    @torch.no_grad()
    def loss_with(codecs: dict[int, Codec]) -> float:
        at = {outs[c][0]: f for c, f in codecs.items()}  # layer index -> the round trip of what it sends
        i, y = outs[min(codecs)]
        for j, layer in enumerate(model.layers[i:], start=i):
            y = layer(y) if j > i else y
            if j in at:
                y = (at[j](y[0]), *y[1:]) if isinstance(y, tuple) else at[j](y)
        return gpt.lm_loss(y, labels).item()

    return [a.detach() for a in acts], [a.grad for a in acts], loss_with, loss.item()


def row(spec: str, tensors: list[torch.Tensor], per_cut: bool = False,
        loss: tuple[LossWith, float] | None = None) -> list[str]:
    """Bits and error of one spec; with `loss` (loss_with, uncompressed loss), the loss increase with each cut's
    activation compressed alone, then with all of them."""
    op, errs, bits, deltas = ppc.build(spec), [], [], []
    codecs = {i: (lambda x, i=i: op.roundtrip(x, ppc.Context(boundary=i, seed=i))[0]) for i in range(len(tensors))}
    for i, t in enumerate(tensors):
        y, p = op.roundtrip(t, ppc.Context(boundary=i, seed=i))
        errs.append(((t - y).norm() / t.norm()).item())
        bits.append(p.nbytes * 8 / t.numel())
    if loss is not None:
        deltas = [loss[0]({i: f}) - loss[1] for i, f in codecs.items()] + [loss[0](codecs) - loss[1]]
    cells = [f"`{spec}`", f"{sum(bits) / len(bits):.3f}", f"{sum(errs) / len(errs):.4f}"]
    cells += [f"{e:.4f}" for e in errs] if per_cut else []
    return cells + [f"{d:+.4f}" for d in deltas]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a recipe run directory with a checkpoint, or a transformers folder")
    ap.add_argument("--stages", type=int, default=4, help="where the cuts are: as DeepSpeed partitions this many stages")
    ap.add_argument("--rows", type=int, default=16, help="held-out sequences")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--spec", action="append", default=None, help=f"repeatable (default: {' '.join(SPECS)})")
    ap.add_argument("--out", type=Path, default=None, help="default results/bench/boundary_error_<run name>.md")
    ap.add_argument("--corpus", default=None, help="held-out text to run (default: a pretraining run's own corpus; "
                                                   "needed for a transformers folder)")
    ap.add_argument("--per-cut", action="store_true", help="also one error column per cut")
    ap.add_argument("--loss", action="store_true", help="also, per cut, the held-out loss increase with only that "
                                                        "cut's activation compressed")
    args = ap.parse_args()
    record = data.run_record(args.run)
    if record is not None:
        if not (args.run / "ckpt" / "latest").exists():
            ap.error(f"--run {args.run}: a recipe run without a checkpoint (ckpt/latest)")
        corpus = args.corpus or record["args"].get("corpus")
        frac = data.run_val_fraction(args.run) or data.VAL_FRACTION
    elif (args.run / "config.json").exists():
        corpus, frac = args.corpus, data.VAL_FRACTION
    else:
        ap.error(f"--run {args.run}: neither a recipe run (run.json) nor a transformers folder (config.json)")
    if corpus not in data.CORPORA:
        ap.error(f"--corpus {corpus!r}: accepted: {', '.join(data.CORPORA)} (a finetuning run or a transformers folder "
                 "has no pretraining corpus of its own)")
    torch.manual_seed(0)
    acts, grads, loss_with, base_loss = boundary_tensors(args.run, corpus, frac, args.stages, args.rows, args.seq)
    specs = args.spec or SPECS
    cut_cols = [f"cut {i + 1}" for i in range(len(acts))] if args.per_cut else []
    header = ["spec", "bits/element", "rel. error, mean over cuts", *cut_cols]
    loss_cols = [*(f"loss +, cut {i + 1} only" for i in range(len(acts))), "loss +, all cuts"] if args.loss else []
    tables = [markdown(header + loss_cols, [row(s, acts, args.per_cut, (loss_with, base_loss) if args.loss else None)
                                            for s in specs]),
              markdown(header, [row(s, grads, args.per_cut) for s in specs])]
    loss_note = (f"\n\nThe loss columns: held-out loss with only that cut's activation compressed, then with every "
                 f"cut's, minus the loss without compression ({base_loss:.4f}), on the same tokens." if args.loss else "")
    command = " ".join(["python", "benchmarks/boundary_error.py", *sys.argv[1:]])
    cuts = ", ".join(f"after block {c}" for c in stage_cuts(load_model(args.run)[0].cfg, args.stages))
    text = (f"# Operators on the boundary tensors of {args.run.name}\n\nCommand: `{command}`\n\n"
            f"{len(acts)} cuts ({cuts}; layer 0 is the embedding), {args.rows} x {args.seq} held-out tokens of "
            f"{corpus}; torch {torch.__version__}\n\n"
            f"## Activations (forward)\n\nFirst cut: {describe(acts[0])}{loss_note}\n\n{tables[0]}\n\n"
            f"## Activation-gradients (backward)\n\nFirst cut: {describe(grads[0])}\n\n{tables[1]}\n")
    print(text)
    out = args.out or ROOT / "results" / "bench" / f"boundary_error_{args.run.name}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
