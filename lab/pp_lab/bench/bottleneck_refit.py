"""Is a trained bottleneck's subspace still the right one for the body it was trained with?

    python benchmarks/bottleneck_refit.py runs/study_smollm2/sm-bn288-calib384-vq4 \
        --out results/bench/bottleneck_refit_smollm2.md

Loads a finetune run with a bottleneck (its DeepSpeed checkpoint, as `recipes/infer.py` serves it) and evaluates, on
held-out sequences of its corpus, side by side in one process, no codec on the codes:
- the run as trained;
- the same body with every bottleneck re-fitted to it: the principal subspace (with the run's token table, a new one
  fitted the same way) of the hidden states that now reach each encoder, on the first `--calib` training sequences,
  one cut after another so that each cut sees the cuts before it re-fitted;
- the same body with the bottlenecks taken out (the hidden state crosses whole);
- the pretrained model the run started from, with and without its initial bottleneck (the basis the run began with,
  fitted the same way on the pretrained model).
If the re-fitted subspace is much better than the trained one, the body moved away from the subspace during training
faster than the encoder and decoder followed it.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from pp_lab import data
from pp_lab.bottleneck import Basis, Moments, embedding_of, principal_bases, token_rows
from pp_lab.kvcache import load_model
from pp_lab.model import GPT, lm_loss
from pp_lab.paths import BENCH


def evaluate(model: nn.Module, ids: Tensor, labels: Tensor) -> float:
    """Mean next-token loss over `ids` (N, T), 4 sequences a batch."""
    with torch.no_grad():
        losses = [float(lm_loss(model(i), y)) for i, y in zip(ids.split(4), labels.split(4), strict=True)]
    return sum(losses) / len(losses)


def encoder_moments(model: GPT, cut: int, ids: Tensor) -> Moments:
    """The moments of the hidden states that reach block `cut`'s encoder (every token but the sinks), with their
    token embeddings beside them when the run has a token table."""
    block, cfg = model.layers[cut + 1], model.cfg
    emb = embedding_of(list(model.layers)) if cfg.bottleneck_tokens else None
    stats = Moments(cfg.d_model, tokens=emb is not None)

    def take(_: nn.Module, args: tuple) -> None:
        h, tok = args[0], args[1] if len(args) > 1 else None  # (B, T, d), (B, T) or None
        e = None if emb is None else token_rows(torch.nn.functional.embedding(tok.long(), emb), cfg.bottleneck_sink, 1)
        stats.add(token_rows(h.detach(), cfg.bottleneck_sink, 1), e)

    hook = block.encoder.register_forward_pre_hook(take)
    try:
        with torch.no_grad():
            for batch in ids.split(4):
                model(batch)
    finally:
        hook.remove()
    return stats


def set_basis(model: GPT, cut: int, basis: Basis) -> None:
    """Block `cut`'s encoder and block `cut + 1`'s decoder as `basis` (its orthogonal projection for a PCA basis)."""
    model.layers[cut + 1].encoder.set_basis(basis)
    model.layers[cut + 2].decoder.set_basis(basis)


def refit(model: GPT, ids: Tensor) -> None:
    """Every bottleneck re-fitted to the body, one cut after another (each sees the earlier ones re-fitted)."""
    cfg = model.cfg
    emb = embedding_of(list(model.layers)) if cfg.bottleneck_tokens else None
    for cut in cfg.bottleneck_after:
        stats = encoder_moments(model, cut, ids)
        set_basis(model, cut, principal_bases({cut: stats}, cfg.bottleneck, emb)[cut])


def without_bottleneck(model: GPT) -> GPT:
    """The same body with the bottlenecks taken out."""
    cfg = dataclasses.replace(model.cfg, bottleneck=None, bottleneck_after=(), bottleneck_tokens=False)
    plain = GPT(cfg).eval()
    for mine, theirs in zip(plain.layers, model.layers, strict=True):
        state = {k: v for k, v in theirs.state_dict().items() if not k.startswith(("encoder.", "decoder."))}
        mine.load_state_dict(state)
    return plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finetune run directory with a bottleneck (run.json, ckpt/)")
    ap.add_argument("--calib", type=int, default=384, help="training sequences the subspaces are fitted on")
    ap.add_argument("--sequences", type=int, default=64, help="held-out sequences evaluated")
    ap.add_argument("--out", type=Path, default=BENCH / "bottleneck_refit_smollm2.md")
    args = ap.parse_args()
    if args.calib < 1 or args.sequences < 1:
        ap.error(f"--calib {args.calib}, --sequences {args.sequences}; accepted: numbers of sequences >= 1")
    torch.set_num_threads(1)
    model, tok, seq_len = load_model(args.run)
    cfg, record = model.cfg, data.run_record(args.run)
    if cfg.bottleneck is None:
        raise SystemExit(f"{args.run} has no bottleneck (its model has bottleneck=None)")
    fraction = data.run_val_fraction(args.run) or 0.05
    corpus = record["args"]["data"]
    train_ds, val_ds = data.lm_datasets(data.corpus_files(corpus), tok, seq_len, fraction)
    calib = train_ds.with_format("torch", columns=["input_ids"])[: args.calib]["input_ids"]  # (N, T)
    val = val_ds.with_format("torch", columns=["input_ids", "labels"])[: args.sequences]
    ids, labels = val["input_ids"], val["labels"]
    rows = [("as trained", evaluate(model, ids, labels))]
    print(f"{rows[-1][0]}: {rows[-1][1]:.4f}", flush=True)
    rows.append(("the bottlenecks taken out", evaluate(without_bottleneck(model), ids, labels)))
    print(f"{rows[-1][0]}: {rows[-1][1]:.4f}", flush=True)
    refit(model, calib)
    rows.append(("re-fitted to the trained body", evaluate(model, ids, labels)))
    print(f"{rows[-1][0]}: {rows[-1][1]:.4f}", flush=True)
    base = record["model"].get("base_checkpoint")
    if base:
        pre = GPT(dataclasses.replace(cfg, bottleneck=None, bottleneck_after=(), bottleneck_tokens=False), base).eval()
        rows.append(("the pretrained model", evaluate(pre, ids, labels)))
        start = GPT(cfg, base).eval()
        refit(start, calib)
        rows.append(("the pretrained model with its initial bottleneck", evaluate(start, ids, labels)))
        print("\n".join(f"{n}: {x:.4f}" for n, x in rows[-2:]), flush=True)
    lines = ["# A trained bottleneck against one re-fitted to its body", "",
             f"Command: `{shlex.join(['python', 'benchmarks/bottleneck_refit.py', *sys.argv[1:]])}` (k = "
             f"{cfg.bottleneck} of d = {cfg.d_model}, cuts after blocks "
             f"{', '.join(str(c + 1) for c in cfg.bottleneck_after)}, token table: {cfg.bottleneck_tokens}; "
             f"{args.sequences} held-out sequences of {seq_len} tokens of {corpus}; subspaces fitted on the first "
             f"{args.calib} training sequences; no codec on the codes).", "",
             "| model | validation loss | against the run as trained |", "|---|---|---|",
             *[f"| {n} | {x:.4f} | {x - rows[0][1]:+.4f} |" for n, x in rows], ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
