"""One rank of KV-cached pipelined generation (pp_compress.generate) of the recipe's tiny GPT, on CPU/gloo.

Rank 0 also generates every prompt alone by recomputing the whole sequence for each new token (the uncompressed
reference). Writes <out>/rank<R>.json: tokens, reference tokens, traffic and timings.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

from pp_compress.generate import PipelineGenerator
from pp_lab.kvcache import CachedStage
from pp_lab.model import GPT, GPTConfig

ap = argparse.ArgumentParser()
ap.add_argument("--spec", default="none")
ap.add_argument("--new", type=int, default=12)
ap.add_argument("--context", type=int, default=64)
ap.add_argument("--prompt-len", type=int, default=0, help="one prompt of this many tokens instead of the mixed set")
ap.add_argument("--out", required=True)
args = ap.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=97, n_layer=4, n_head=4, n_kv_head=2, d_model=64, init_std=0.3)  # large weights: the
model = GPT(cfg).eval()  # greedy tokens vary (a small-init random model repeats one token)
g = torch.Generator().manual_seed(1)
lengths = [args.prompt_len] if args.prompt_len else [5, 9, 3, 9]
prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]
gen = PipelineGenerator(CachedStage(model, rank, world), rank, world, hidden=(cfg.d_model, torch.float32),
                        compression=args.spec, context=args.context)
result = {"rank": rank}
try:
    result["tokens"] = gen.generate(prompts if rank == 0 else None, args.new)
    result["stats"] = gen.stats()
except ValueError as e:
    result["error"] = str(e)
if args.spec == "none" and "error" not in result:  # a stop token: the third token sequence 0 generated
    stop = result["tokens"][0][2]
    result["stop"] = stop
    result["stopped"] = gen.generate(prompts if rank == 0 else None, args.new, stop_token=stop)
if args.spec == "none" and "error" not in result:  # teacher-forced scoring of prompt + generated tokens: the tokens
    seqs = [p + t for p, t in zip(prompts, result["tokens"])]  # just generated are each position's top-1
    top1, logprob, real = gen.score(seqs if rank == 0 else None)
    result["scored_top1"] = [row[m].tolist() for row, m in zip(top1, real)]
    result["scored_logprob"] = [row[m].tolist() for row, m in zip(logprob, real)]
if rank == 0 and "error" not in result:
    ref = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(args.new):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
            ref.append(ids[0, len(p):].tolist())
    result["reference"] = ref
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
