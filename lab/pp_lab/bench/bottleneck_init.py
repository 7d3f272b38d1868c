"""What a learned boundary bottleneck costs a pretrained model before any training, and what codecs cost on its codes.

    python benchmarks/bottleneck_init.py    # -> results/bench/bottleneck_init_smollm2.md (`make models` first)

SmolLM2-135M-Instruct cut as the SmolLM2 study cuts it (4 stages: after blocks 8, 16 and 23), every cut replaced at
once by its PCA-initialised bottleneck (pp_lab/bottleneck.py: the first 24 training sequences of Austen by default,
the sink token in full, d / k tokens' codes to a row), evaluated on held-out sequences in one process: the validation
loss with no codec on the codes and through each codec (the in-process boundary, pp_compress.insert_boundaries), next
to the model without a bottleneck in the same run. A second table gives each codec's bits per element of the dense fp32
tensor from its exact wire layout, with the codes in rows of k values and in rows of d.

    python benchmarks/bottleneck_init.py --init pca --init fisher --fisher-damping 1 --per-cut --codec int8:rot \
        --out results/bench/bottleneck_init_fisher_smollm2.md

compares the inits (pp_lab/bottleneck.py: the principal subspace, and the loss-weighted one at each damping), and
with --per-cut also gives each cut's bottleneck alone (no codec), the other cuts left as they are.

    python benchmarks/bottleneck_init.py --calib 24 --calib 96 --calib 384 --tokens --codec int8:rot \
        --out results/bench/bottleneck_init_calib_tokens_smollm2.md

compares calibration sizes (the first N training sequences; the moments of one pass serve every k) and, with
--tokens, each init with and without a token table (pp_lab/bottleneck.py: each token's hidden state predicted from
its id, the code carrying the rest).

    python benchmarks/bottleneck_init.py --k 288 --calib 384 --codec vq:4 --sink-codec vq:4 --sink-codec int8:rot \
        --sequences 64 --out results/bench/bottleneck_init_sink_smollm2.md

adds, for each codec on the codes, the sink token through each --sink-codec as well: in process the sink passes
exactly, while a pipeline sends it through its codec too (it is at least min_numel values at the study's sizes).

    python benchmarks/bottleneck_init.py --k 288 --k 144 --calib 384 --tokens --grad-energy --codec vq:4 \
        --out results/bench/bottleneck_init_grad_energy_smollm2.md

adds what each bottleneck passes back of the loss's gradient at each cut (`grad_energy`): the layers before a cut
learn only from what it passes.

    python benchmarks/bottleneck_init.py --k 288 --k 144 --calib 384 --tokens --grad-energy --codec vq:4 \
        --init pca --init blend --grad-weight 0.25 --grad-weight 0.5 --grad-weight 1 \
        --out results/bench/bottleneck_init_blend_smollm2.md

compares the principal subspace with the blended one at each weight (pp_lab/bottleneck.py: the top of the hidden
state's covariance plus w times the loss gradient's second moment): what each costs the model, and what each passes
back.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch
from torch import Tensor

import pp_compress as ppc
from pp_lab import data
from pp_lab.bottleneck import FROM_DATA, TUNING, WITH_GRADS, Basis, data_bases, embedding_of, hidden_moments
from pp_lab.convert import DEFAULT_OUT
from pp_lab.model import GPT, GPTConfig, id_dtype, lm_loss, stage_cuts
from pp_lab.paths import BENCH


def grad_energy(basis: Basis, grad: Tensor) -> float:
    """The share of the loss gradient's energy that a bottleneck passes back to the layers before its cut: with G the
    sum of g g^T over the calibration tokens (g the gradient at the hidden state, the model without a bottleneck) and
    B = W_e^T W_d^T the bottleneck's backward map, tr(B G B^T) / tr(G). 1 for the identity; for an orthonormal basis
    U the share of G in U's span."""
    back = basis.enc.double().T @ basis.dec.double().T  # (d, d): W_e^T W_d^T
    return float(torch.trace(back @ grad @ back.T) / torch.trace(grad))


class SinkThrough(torch.nn.Module):
    """A block with a bottleneck's encoder, whose sink token (its output's second tensor) crosses a boundary."""

    def __init__(self, block: torch.nn.Module, boundary: ppc.CompressionBoundary) -> None:
        super().__init__()
        self.block, self.boundary = block, boundary

    def forward(self, x: object) -> tuple:
        code, sink, *rest = self.block(x)
        return (code, self.boundary(sink), *rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--k", type=int, action="append", default=None, help="code widths (default 288, 144, 72, 36)")
    ap.add_argument("--codec", action="append", default=None, help="specs on the codes (default int8:rot, vq:4)")
    ap.add_argument("--sequences", type=int, default=16, help="held-out sequences of 128 tokens evaluated")
    ap.add_argument("--init", action="append", choices=FROM_DATA, default=None, help="default: pca")
    ap.add_argument("--fisher-damping", type=float, action="append", default=None,
                    help=f"fisher: each (default {TUNING['fisher']:g})")
    ap.add_argument("--grad-weight", type=float, action="append", default=None,
                    help=f"blend: each (default {TUNING['blend']:g})")
    ap.add_argument("--per-cut", action="store_true", help="also each cut's bottleneck alone (no codec)")
    ap.add_argument("--calib", type=int, action="append", default=None,
                    help="training sequences of 128 tokens the init is computed on: each (default 24)")
    ap.add_argument("--tokens", action="store_true", help="each init also with a token table")
    ap.add_argument("--sink-codec", action="append", default=[],
                    help="each codec on the codes also with the sink token through this spec (a pipeline's way)")
    ap.add_argument("--grad-energy", action="store_true",
                    help="also the share of the loss gradient's energy each bottleneck passes back at each cut (the "
                         "calibration pass then takes the loss's gradients for every init)")
    ap.add_argument("--out", type=Path, default=BENCH / "bottleneck_init_smollm2.md")
    args = ap.parse_args()
    if args.fisher_damping and "fisher" not in (args.init or []):
        ap.error(f"--fisher-damping {args.fisher_damping} applies to --init fisher only")
    if any(not d > 0 for d in args.fisher_damping or []):
        ap.error(f"--fisher-damping {args.fisher_damping}; accepted: numbers > 0")
    if args.grad_weight and "blend" not in (args.init or []):
        ap.error(f"--grad-weight {args.grad_weight} applies to --init blend only")
    if any(not w > 0 for w in args.grad_weight or []):
        ap.error(f"--grad-weight {args.grad_weight}; accepted: numbers > 0 (0 is --init pca)")
    if any(n < 1 for n in args.calib or []):
        ap.error(f"--calib {args.calib}; accepted: numbers of sequences >= 1")
    torch.set_num_threads(1)
    ks, codecs = args.k or [288, 144, 72, 36], args.codec or ["int8:rot", "vq:4"]
    tuning = {"fisher": args.fisher_damping or [TUNING["fisher"]], "blend": args.grad_weight or [TUNING["blend"]]}
    inits = [(how, t) for how in args.init or ["pca"] for t in tuning.get(how, [None])]
    cfg = GPTConfig.from_hf(args.checkpoint)
    tok = data.load_tokenizer(str(args.checkpoint))
    train_ds, val_ds = data.lm_datasets(data.corpus_files("austen"), tok, 128, 0.05)
    sizes = args.calib or [24]
    calib = train_ds.with_format("torch", columns=["input_ids", "labels"])[:max(sizes)]  # (N, 128)
    val = val_ds.with_format("torch", columns=["input_ids", "labels"])[: args.sequences]
    plain = GPT(cfg, args.checkpoint).eval()
    cuts = tuple(int(c) - 1 for c in stage_cuts(cfg, 4))

    def loss_with(k: int, at: tuple[int, ...], bases: dict, codec: str, sink: str | None = None) -> float:
        bn = dataclasses.replace(cfg, bottleneck=k, bottleneck_after=at, bottleneck_group=cfg.d_model // k,
                                 bottleneck_tokens=bases[at[0]].tokens is not None)
        model = GPT(bn, args.checkpoint, {c: bases[c] for c in at}).eval()
        for j, c in enumerate(at if sink else ()):
            model.layers[c + 1] = SinkThrough(model.layers[c + 1], ppc.CompressionBoundary(f"{sink},min_numel=0", j))
        if codec != "none":
            ppc.insert_boundaries(model, after=[c + 1 for c in at], cfg=f"{codec},min_numel=0", blocks=model.layers)
            model.eval()
        with torch.no_grad():
            return float(lm_loss(model(val["input_ids"]), val["labels"])) - base

    with torch.no_grad():
        base = float(lm_loss(plain(val["input_ids"]), val["labels"]))
    rows, energy = [], []
    tables = [False, True] if args.tokens else [False]
    layers, emb = list(plain.layers), embedding_of(list(plain.layers))
    grads = args.grad_energy or any(how in WITH_GRADS for how, _ in inits)
    for n in sizes:  # one pass per size serves every init, k, table and parameter (with gradients if one needs them)
        ids, labels = calib["input_ids"][:n].split(4), calib["labels"][:n].split(4)
        moments = hidden_moments(layers, cuts, 1, list(zip(ids, labels)) if grads else ids, tokens=args.tokens,
                                 loss=lm_loss if grads else None)
        for k in ks:
            for how, t in inits:
                for table in tables:
                    bases = data_bases(how, moments, k, emb if table else None, t)
                    label = how if t is None else f"{how}, {'damping' if how == 'fisher' else 'weight'} {t:g}"
                    name = label + (" + tokens" if table else "")
                    losses = [loss_with(k, cuts, bases, codec) for codec in ["none", *codecs]]
                    losses += [loss_with(k, cuts, bases, codec, sink) for codec in codecs for sink in args.sink_codec]
                    if args.per_cut:
                        losses += [loss_with(k, (c,), bases, "none") for c in cuts]
                    print(f"k={k} {name} calib={n}: " + " ".join(f"{x:+.3f}" for x in losses), flush=True)
                    rows.append(f"| {k} | {name} | {n} | " + " | ".join(f"{x:+.3f}" for x in losses) + " |")
                    if args.grad_energy:
                        shares = [grad_energy(bases[c], moments[c].grad) for c in cuts]
                        energy.append(f"| {k} | {name} | {n} | " + " | ".join(f"{x:.3f}" for x in shares) + " |")
    bits = []
    for codec in codecs:
        op = ppc.build(codec)
        cells = [op.wire_nbytes((4, 128 * k // w, w), torch.float32) * 8 / (4 * 128 * cfg.d_model)
                 for k in ks for w in (k, cfg.d_model)]
        bits.append(f"| `{codec}` | " + " | ".join(f"{b:.2f}" for b in cells) + " |")
    id_bits = torch.iinfo(id_dtype(cfg.vocab_size)).bits
    lines = ["# A learned bottleneck on SmolLM2-135M before training", "",
             f"Command: `{shlex.join(['python', 'benchmarks/bottleneck_init.py', *sys.argv[1:]])}` "
             f"({args.sequences} held-out sequences of 128 tokens of "
             f"Austen, cuts after blocks {', '.join(str(c + 1) for c in cuts)}, all replaced at once; the model without "
             f"a bottleneck: {base:.3f}).", "",
             "Validation loss minus the model's without a bottleneck (in process the sink token passes exactly; a "
             "pipeline sends it through the codec too):", "",
             "| k | init | calibration sequences | no codec | " + " | ".join(f"`{c}` on the codes" for c in codecs)
             + "".join(f" | `{c}` on the codes, `{s}` on the sink" for c in codecs for s in args.sink_codec)
             + "".join(f" | block {c + 1}'s cut alone" for c in cuts if args.per_cut) + " |",
             "|---|---|---|" + "---|" * (1 + len(codecs) * (1 + len(args.sink_codec))
                                          + (len(cuts) if args.per_cut else 0)),
             *rows, "",
             *(["Share of the loss gradient's energy at each cut that the bottleneck passes back to the layers before "
                "it (tr(B G B^T) / tr(G), B = W_e^T W_d^T its backward map, G the sum of g g^T over the calibration "
                "tokens' gradients in the model without a bottleneck; 1 = all of it):", "",
                "| k | init | calibration sequences | " + " | ".join(f"block {c + 1}'s cut" for c in cuts) + " |",
                "|---|---|---|" + "---|" * len(cuts), *energy, ""] if args.grad_energy else []),
             "Bits per element of the dense fp32 tensor (the codes of 128 tokens of 4 sequences; the sink token not "
             "counted), codes in rows of k or of d = 576:", "",
             "| codec | " + " | ".join(f"k={k}, rows of {w}" for k in ks for w in (k, cfg.d_model)) + " |",
             "|---|" + "---|" * (2 * len(ks)), *bits, "",
             *([f"A token table adds the token ids beside the codes: {id_bits} bits a token, "
                f"{id_bits / cfg.d_model:.3f} bits per element.", ""] if args.tokens else [])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
