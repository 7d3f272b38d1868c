# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0
# DeepSpeed Team
#
# Adapted from DeepSpeed's tests/unit/pipe/test_pipe_module.py (TestPipeModuleSequential.test), upstream commit
# edaa7221267243c7be7fb49c5d5f5c4fb97b4641, for pp_compress: the body runs as one torchrun rank (the project's
# launcher instead of DeepSpeed's DistributedTest harness), after `pp_compress.deepspeed.enable()` with a
# "pp_compress" section (--spec) in the config, and torch's Adam; the assertion is upstream's, with --atol/--rtol for
# lossy specs.
import argparse
import copy
import importlib
import json
import os

import torch
import torch.nn as nn

ap = argparse.ArgumentParser()
ap.add_argument("--spec", default=None, help="the config's pp_compress section; omitted = stock DeepSpeed")
ap.add_argument("--activation-checkpoints", action="store_true")
ap.add_argument("--out", required=True)
args = ap.parse_args()

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.utils import RepeatingLoader  # noqa: E402

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # unused by p2p; a 30-70 s build
import pp_compress.deepspeed as ppd  # noqa: E402

HIDDEN_DIM = 32
LAYERS = 8

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
sequential_model = torch.nn.Sequential(*[nn.Linear(HIDDEN_DIM, HIDDEN_DIM) for _ in range(LAYERS)],
                                       nn.Linear(HIDDEN_DIM, 1))
simple_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
                 # torch_adam (not upstream's): on a CPU DeepSpeed's fused Adam is a 60-130 s JIT build, and eval_batch
                 # never steps the optimizer
                 "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                                                          "weight_decay": 3e-7, "torch_adam": True}},
                 "pipeline": {"activation_checkpoint_interval": 1}}
if args.spec is not None:
    ppd.enable()
    simple_config["pp_compress"] = {"activations": args.spec, "gradients": args.spec, "min_numel": 0}
batch_input = torch.randn(1, HIDDEN_DIM)

base_model = copy.deepcopy(sequential_model)
base_input = batch_input.clone().detach()
base_output = base_model(base_input)
base_params = sum(p.numel() for p in base_model.parameters())

pipe_model = copy.deepcopy(sequential_model)
pipe_model = PipelineModule(layers=pipe_model, num_stages=2)
my_params = sum(p.numel() for p in pipe_model.parameters())
total_pipe_params = torch.LongTensor([my_params])
dist.all_reduce(total_pipe_params)
assert total_pipe_params.item() == base_params

pipe_model, _, _, _ = deepspeed.initialize(config=simple_config, model=pipe_model,
                                           model_parameters=[p for p in pipe_model.parameters()])
if args.activation_checkpoints:
    deepspeed.checkpointing.configure(None, deepspeed_config=pipe_model.config, partition_activations=True,
                                      contiguous_checkpointing=True, num_checkpoints=9)
if pipe_model.is_first_stage() or pipe_model.is_last_stage():
    dataset = [(base_input.clone().detach(), 0)]  # label 0 is meaningless
    data_iter = iter(RepeatingLoader(dataset))
else:
    data_iter = None
pipe_output = pipe_model.eval_batch(data_iter=data_iter)
with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "engine": type(pipe_model).__name__,
               "base": base_output.detach().double().flatten().tolist(),
               "pipe": pipe_output.detach().double().flatten().tolist()}, f)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
