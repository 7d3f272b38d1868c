"""Generation and perplexity through the (compressed) DeepSpeed pipeline.

    deepspeed --num_gpus 2 recipes/infer.py --checkpoint runs/pretrain --prompt "ROMEO:" --data shakespeare
    deepspeed --num_gpus 2 recipes/infer.py --checkpoint runs/pretrain --pp-compress "eval=topk:0.1" ...

--checkpoint is a run directory of pretrain.py/finetune.py (DeepSpeed checkpoint in <dir>/ckpt) or a
LLaMA-family transformers folder. Inference-time compression is the spec's `eval` (else its `act`);
`--pp-compress none` runs uncompressed. Generation is KV-cached (pp_compress.generate): each stage keeps its
layers' cache, the prompts (left-padded, a batch) cross each boundary once, then one position per sequence per
new token; it prints time to first token, decode tokens/s, and where the time went (compute, wire,
(de)compression). Perplexity (--data) and --no-kv-cache run DeepSpeed's fixed-shape eval_batch (micro-batch,
seq-len), recomputing every position. Greedy unless --temperature > 0 (seeded). Writes --out as JSON if given.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from pp_lab import data, train
from pp_lab.model import GPTConfig
from pp_lab.pipeline import pipeline_module


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(engine, tokenizer, GPTConfig) for a recipe run directory or a transformers folder."""
    import pp_compress.deepspeed as ppd

    record = data.run_record(args.checkpoint)
    if record is not None:
        meta = record["model"]
        tok_name = meta.pop("tokenizer")
        meta.pop("base_checkpoint", None)
        cfg = GPTConfig(**meta)
        module = pipeline_module(cfg, args.stages)
    elif (args.checkpoint / "config.json").exists():
        tok_name, cfg = str(args.checkpoint), GPTConfig.from_hf(args.checkpoint)
        module = pipeline_module(cfg, args.stages, checkpoint=args.checkpoint)
    else:
        raise SystemExit(f"--checkpoint {args.checkpoint}: neither a recipe run (run.json) nor a transformers folder (config.json)")
    ds_cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "train_batch_size": args.micro_batch, "steps_per_print": 10**9, "bf16": {"enabled": bool(args.bf16)}}
    train.warn_if_slow_bf16(bool(args.bf16))
    engine, *_ = ppd.initialize(model=module, config=ds_cfg, compression=args.pp_compress)
    if record is not None:
        path, _ = engine.load_checkpoint(str(args.checkpoint / "ckpt"), load_module_only=True,
                                         load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise SystemExit(f"no DeepSpeed checkpoint in {args.checkpoint / 'ckpt'}")
    tok = data.load_tokenizer(args.tokenizer) if args.tokenizer else data.run_tokenizer(args.checkpoint, tok_name)
    return engine, tok, cfg


def perplexity(engine: Any, val_ds: Any, micro_batch: int, batches: int) -> float:
    it = data.eval_batches(val_ds, micro_batch)
    losses = [float(engine.eval_batch(it)) for _ in range(min(batches, len(val_ds) // micro_batch))]
    return math.exp(sum(losses) / len(losses))


def generate(engine: Any, tok: Any, prompts: list[str], args: argparse.Namespace) -> list[str]:
    """Greedy/temperature sampling, one full pipeline pass per new token (no KV cache: small and clear)."""
    import torch.distributed as dist

    if len(prompts) > args.micro_batch:
        raise SystemExit(f"{len(prompts)} prompts but --micro-batch {args.micro_batch}: raise --micro-batch")
    b, t = args.micro_batch, args.seq_len
    pad = tok.eos_token_id
    ids = torch.full((b, t), pad, dtype=torch.long)  # (B, T)
    lens = []
    for r in range(b):
        p = tok(prompts[r % len(prompts)], add_special_tokens=False)["input_ids"][: t - args.max_new_tokens]
        ids[r, : len(p)] = torch.tensor(p)
        lens.append(len(p))
    last = engine.grid.stage_to_global(engine.num_stages - 1)
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.max_new_tokens):
        batch = ((ids, torch.arange(b)), torch.zeros_like(ids))
        engine.total_loss = None  # DeepSpeed 0.19.8 keeps summing eval losses across eval_batch calls; logits can't add to them
        _, logits = engine.eval_batch(iter([batch]), return_logits=True, compute_loss=False)
        nxt = torch.zeros(b, dtype=torch.long)  # (B,)
        if engine.is_last_stage():
            rows = logits[torch.arange(b), torch.tensor(lens) - 1].float()  # (B, V)
            if args.temperature > 0:
                nxt = torch.multinomial(torch.softmax(rows / args.temperature, -1), 1, generator=gen)[:, 0]
            else:
                nxt = rows.argmax(-1)
        dist.broadcast(nxt, src=last)
        for r in range(b):
            if lens[r] < t:
                ids[r, lens[r]] = nxt[r]
                lens[r] += 1
    return [tok.decode(ids[r, : lens[r]].tolist()) for r in range(len(prompts))]


def generate_cached(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """KV-cached pipelined generation (pp_compress.generate): each stage process keeps its layers and their cache;
    prefill sends the prompts' hidden states once, each decode step one position per sequence."""
    import torch.distributed as dist
    from tqdm import tqdm

    from pp_compress.generate import PipelineGenerator
    from pp_lab.kvcache import CachedStage, load_model

    model, tok, trained_len = load_model(args.checkpoint)
    rank, stages = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model.to(dtype)
    context = args.context or trained_len
    gen = PipelineGenerator(CachedStage(model, rank, stages), rank, stages, hidden=(model.cfg.d_model, dtype),
                            compression=args.pp_compress, context=context)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts] if rank == 0 else None
    from pp_compress.ops.fused import kernels

    kernels()  # built (or loaded) before the clock starts: a first build takes about a minute
    if args.score:  # teacher-forced: each text in one pass, its own next tokens scored
        top1, logprob, real = gen.score(ids, pad_token=tok.eos_token_id or 0)
        every = [None] * stages
        dist.all_gather_object(every, gen.stats())
        nll = -float(logprob[real].double().mean())
        return {"scored": {"top1": [r[m].tolist() for r, m in zip(top1, real)],
                           "logprob": [r[m].tolist() for r, m in zip(logprob, real)]},
                "nll": nll, "ppl": math.exp(nll), "per_stage": every}
    bar = tqdm(total=args.max_new_tokens, disable=rank != 0, unit="tok", desc="generating")
    t0 = time.perf_counter()
    first: list[float] = []
    out = gen.generate(ids, args.max_new_tokens, stop_token=tok.eos_token_id if args.stop_at_eos else None,
                       temperature=args.temperature, seed=args.seed, pad_token=tok.eos_token_id or 0,
                       on_step=lambda s: (first.append(time.perf_counter() - t0) if s == 0 else None, bar.update(1)))
    bar.close()
    total = time.perf_counter() - t0
    steps = max(len(o) for o in out)
    every = [None] * stages
    dist.all_gather_object(every, gen.stats())
    return {"generations": [p + tok.decode(o) for p, o in zip(prompts, out)], "new_tokens": out,
            "time_to_first_token_s": first[0], "decode_tokens_per_s": len(out) * (steps - 1) / max(total - first[0], 1e-9),
            "total_s": total, "per_stage": every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--tokenizer", default=None, help="default: the run's / the checkpoint's")
    ap.add_argument("--prompt", action="append", default=[], help="repeatable")
    ap.add_argument("--prompt-file", type=Path, default=None, help="one prompt per line (generated as one batch)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--stop-at-eos", action="store_true", help="stop a sequence at the tokenizer's end-of-sequence token")
    ap.add_argument("--context", type=int, default=None,
                    help="positions the model may attend over (default: the run's --seq-len, 2048 for a transformers folder)")
    ap.add_argument("--score", action="store_true",
                    help="teacher-forced: score each prompt's own tokens in one pass (top-1 and log-probability per "
                         "position, perplexity) through the compressed pipeline instead of generating")
    ap.add_argument("--no-kv-cache", action="store_true",
                    help="generate through DeepSpeed's fixed-shape eval_batch, recomputing every position each token")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--data", default=None, help="corpus name or .txt/.jsonl path: report validation perplexity")
    ap.add_argument("--ppl-batches", type=int, default=16, help="micro-batches of validation text")
    ap.add_argument("--val-fraction", type=float, default=None,
                    help=f"the held-out tail of every file (default: the run's own --val-fraction, else {data.VAL_FRACTION})")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    import pp_compress.deepspeed as ppd

    ppd.add_argparse_args(ap)
    args = ap.parse_args()
    train.init_distributed()
    import torch.distributed as dist

    if dist.get_world_size() != args.stages:
        raise SystemExit(f"inference runs one pipeline: start --stages ({args.stages}) processes, not {dist.get_world_size()}")
    prompts = args.prompt + (args.prompt_file.read_text().splitlines() if args.prompt_file else [])
    engine = None
    if args.data or (prompts and args.no_kv_cache):
        engine, tok, cfg = load(args)
    result: dict[str, Any] = {"checkpoint": str(args.checkpoint), "pp_compress": str(ppd.check_args(args))}
    if args.data:
        trained = data.run_val_fraction(args.checkpoint)
        frac = args.val_fraction if args.val_fraction is not None else trained if trained is not None else data.VAL_FRACTION

        def val() -> Iterator:  # the run's own validation split: the same held-out text its evaluations used
            if args.data in data.CORPORA:
                return data.lm_datasets(data.corpus_files(args.data), tok, args.seq_len, frac)[1]
            return data.sft_datasets(Path(args.data), tok, args.seq_len, frac)[1]
        result["val_ppl"] = perplexity(engine, train.rank0_first(val), args.micro_batch, args.ppl_batches)
    if prompts and args.no_kv_cache:
        result["generations"] = generate(engine, tok, prompts, args)
    elif prompts:
        result.update(generate_cached(args, prompts))
    if engine is not None:
        result["stats"] = engine.pp_compress_stats()
    if dist.get_rank() == 0:
        for text in result.get("generations", []):
            print(f"--- {text}")
        if "ppl" in result:
            print(f"teacher-forced perplexity of the prompts: {result['ppl']:.3f} ({result['pp_compress']})")
        if "time_to_first_token_s" in result:
            t = {k: sum(s["timings"][k] for s in result["per_stage"]) for k in ("compute", "wire", "codec")}
            print(f"time to first token {result['time_to_first_token_s']:.3f} s, decode {result['decode_tokens_per_s']:.1f} "
                  f"tokens/s; summed over stages: compute {t['compute']:.2f} s, wire {t['wire']:.2f} s, "
                  f"(de)compression {t['codec']:.2f} s")
        if "val_ppl" in result:
            print(f"validation perplexity: {result['val_ppl']:.3f} ({result['pp_compress']})")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    train.finish()


if __name__ == "__main__":
    main()
