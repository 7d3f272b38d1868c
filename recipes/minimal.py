"""The README's "use it in your DeepSpeed job" example, runnable: a small MLP as a 2-stage PipelineModule.

    deepspeed --num_gpus 2 recipes/minimal.py --pp-compress safe
    deepspeed --num_gpus 2 recipes/minimal.py --deepspeed_config deepspeed_configs/cpu_gloo.json   # its section

It trains on random regression data for --steps steps, prints the loss and the compression table, and exits 0.
"""
import argparse

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from torch import nn

import pp_compress.deepspeed as ppd

parser = ppd.add_argparse_args(argparse.ArgumentParser(description=__doc__))  # --pp-compress SPEC
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--local_rank", type=int, default=-1)
deepspeed.add_config_arguments(parser)
args = parser.parse_args()
ppd.check_args(args)  # a bad spec or config section stops here, once, before any work

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
torch.manual_seed(0)
h = args.hidden
layers = [nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 1)]
model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "steps_per_print": args.steps,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
if args.deepspeed_config:
    config = args.deepspeed_config
engine, *_ = ppd.initialize(model=model, config=config, compression=args.pp_compress,
                            model_parameters=model.parameters())

data = [(torch.randn(8, h), torch.randn(8, 1)) for _ in range(4)]  # micro-batches of (input, target)
for step in range(args.steps):
    loss = engine.train_batch(iter(data))
print(engine.pp_compress_report())  # bytes on the wire per boundary and direction, ratio, relative error
if engine.is_last_stage():
    print(f"loss {float(loss):.4f}")
ppd.finish()  # barrier, remove DeepSpeed's /dev/shm buffers, tear the process group down, exit 0
