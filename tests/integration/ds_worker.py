"""One rank of a small DeepSpeed pipeline on CPU/gloo, launched by torchrun from the tests.

Writes <out>/rank<R>.json: losses, bytes through deepspeed's p2p.send, pp_compress stats, step time; with --variant
(variants.py), {"variants": {name: that}}.
"""
import argparse
import importlib
import json
import os
import time

import torch
import variants
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--stages", type=int, default=2)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--spec", default=None, help="pp_compress spec; omitted = plain deepspeed.initialize")
ap.add_argument("--rank1-spec", default=None, help="rank 1 uses this spec instead (mismatch test)")
ap.add_argument("--bf16", action="store_true")
ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--ckpt", default=None, help="save after steps/2, continue, then resume a fresh engine and compare")
ap.add_argument("--ids", action="store_true", help="a pool of 16 samples; (x, sample_ids) flows through the stages")
ap.add_argument("--tp", type=int, default=0, help="the recipe's tiny GPT with Megatron-style tensor parallelism of this "
                "size ([seq, batch, hidden] between stages, random tokens); 0 = the MLP")
ap.add_argument("--no-partition", action="store_true", help="--tp: DeepSpeed's pipeline.pipe_partitioned/grad_partitioned "
                "off (every TP rank sends the whole tensor)")
ap.add_argument("--enable", action="store_true", help="pp_compress.deepspeed.enable(), then stock deepspeed.initialize("
                "args=...) with the spec as the JSON file's pp_compress section (no section without --spec)")
ap.add_argument("--mask", action="store_true", help="(x, bool mask) flows through the stages, and the module is named "
                "GPT2ModelPipe, so DeepSpeed sets has_attention_mask (it sends the mask as half)")
ap.add_argument("--dualpipev", action="store_true", help="a DualPipeVModule (DeepSpeed's DualPipeV engine)")
ap.add_argument("--eval-options", action="store_true", help="also eval_batch(return_logits=True, bcast_loss=False, "
                "num_micro_batches=2, reduce_output=None): its logits' sum on the last stage (compute_loss=False fails in "
                "stock DeepSpeed 0.19.8 after training: it adds the logits to the scalar total_loss)")
ap.add_argument("--act-ckpt", action="store_true", help="activation checkpointing (activation_checkpoint_interval=1)")
ap.add_argument("--reshape", action="store_true", help="(MBS, T, D) inputs, T = 8 for the first half of the steps and 4 "
                "after, with engine.reset_activation_shape() between")
ap.add_argument("--variable", action="store_true", help="(MBS, T, D) inputs with T = 8, 7, 6, 8, ... per micro-batch: "
                "each micro-batch its own length (PipelineModule(dynamic_shape=True)), so in 1F1B a gradient comes back "
                "for an earlier micro-batch of another length")
ap.add_argument("--pair", action="store_true", help="every stage sends two float tensors, (hidden, a side tensor "
                "made from it) and counts the backward passes through its first layer")
args, VARIANTS = variants.parse_args(ap)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
from deepspeed.runtime.pipe import p2p  # noqa: E402
try:
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule  # noqa: E402
except ModuleNotFoundError:  # DeepSpeed before 0.19.7 has no DualPipeV (the test that needs it is skipped there)
    DualPipeVModule = None

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip the 30-70 s shm JIT build (unused by p2p)
import pp_compress  # noqa: E402
import pp_compress.deepspeed as ppd  # noqa: E402

SENT = {"bytes": 0}
_send = p2p.send


def counting_send(tensor, dest_stage, async_op=False):
    SENT["bytes"] += tensor.numel() * tensor.element_size()
    return _send(tensor, dest_stage, async_op)


p2p.send = counting_send
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
D, H, MBS, GAS = 16, args.hidden, 4, 4
VOCAB, SEQ = 64, 16  # --tp


class OnHidden(nn.Module):
    """Applies a layer to the first tensor of (x, sample_ids) and passes the ids along (--ids)."""

    def __init__(self, kind, *a, last=False):
        super().__init__()
        self.mod, self.last = (nn.Linear(*a) if kind == "linear" else nn.GELU()), last

    def forward(self, x):
        if not isinstance(x, tuple):
            return self.mod(x)
        return self.mod(x[0]) if self.last else (self.mod(x[0]), x[1])


PASSES = {"backward": 0}


class Pair(nn.Module):
    """--pair: (h, side) -> (y, y[:, :2]) with y = linear(h + side's mean), so that both tensors a stage sends carry
    gradient back; the first layer takes x alone, the last returns y alone. Its weight's hook counts the backward
    passes through it."""

    def __init__(self, a, b, first=False, last=False, count=False):
        super().__init__()
        self.mod, self.first, self.last = nn.Linear(a, b), first, last
        if count:
            self.mod.weight.register_hook(lambda g: PASSES.__setitem__("backward", PASSES["backward"] + 1))

    def forward(self, x):
        h = x if self.first else x[0] + x[1].mean(-1, keepdim=True)  # (MBS, a)
        y = torch.tanh(self.mod(h))  # (MBS, b)
        return y if self.last else (y, y[:, :2] * 2)


class GPT2ModelPipe(PipelineModule):
    """DeepSpeed keys has_attention_mask on this class name (--mask)."""


def make_engine():
    torch.manual_seed(0)
    if args.tp:
        from pp_lab.model import GPTConfig
        from pp_lab.pipeline import pipeline_module

        model = pipeline_module(GPTConfig.preset("tiny", vocab_size=VOCAB, layout="sbh"), args.stages, tp=args.tp)
    elif args.pair:  # two layers per model stage (two stages per rank under DualPipeV), the first counting passes
        n = 2 * args.stages * (2 if args.dualpipev else 1)
        layers = [LayerSpec(Pair, D if i == 0 else H, D if i == n - 1 else H, first=i == 0, last=i == n - 1,
                            count=i % 2 == 0) for i in range(n)]
        model = (DualPipeVModule if args.dualpipev else PipelineModule)(
            layers=layers, num_stages=args.stages, loss_fn=nn.MSELoss(), partition_method="uniform")
    else:
        layers = [LayerSpec(OnHidden, "linear", D, H), LayerSpec(OnHidden, "gelu")]
        for _ in range(2 * args.stages - 2):
            layers += [LayerSpec(OnHidden, "linear", H, H), LayerSpec(OnHidden, "gelu")]
        layers += [LayerSpec(OnHidden, "linear", H, D, last=True)]
        cls = DualPipeVModule if args.dualpipev else GPT2ModelPipe if args.mask else PipelineModule
        model = cls(layers=layers, num_stages=args.stages, loss_fn=nn.MSELoss(), partition_method="uniform",
                    activation_checkpoint_interval=1 if args.act_ckpt else 0, dynamic_shape=args.variable)
    dp = world // (args.stages * max(args.tp, 1))
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS,
           "train_batch_size": MBS * GAS * dp, "steps_per_print": 10**9, "bf16": {"enabled": args.bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
    if args.no_partition:
        cfg["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if args.enable:  # the Megatron-DeepSpeed path: one line, then the script's own deepspeed.initialize
        ppd.enable()
        if args.spec:
            cfg["pp_compress"] = pp_compress.parse_spec(args.spec + ",min_numel=0").to_dict()
        path = os.path.join(args.out, f"ds_config_rank{rank}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        engine, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=path, local_rank=rank), model=model,
                                          model_parameters=model.parameters())
    elif args.spec is None:
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    else:
        spec = args.rank1_spec if (args.rank1_spec and rank == 1) else args.spec
        spec += "" if "min_numel" in spec else ",min_numel=0"  # the (4, 64) tensors here are below the default
        engine, *_ = ppd.initialize(model=model, config=cfg, compression=spec, model_parameters=model.parameters())
    if hasattr(engine, "pp_compress_self_check"):  # before the first batch, as train_batch would: its probes are not
        before = SENT["bytes"]                    # training traffic, so the byte counts below leave them out
        engine.pp_compress_self_check()
        SENT["bytes"] = before
    return engine


def data(seed, skip=0):
    if args.tp:
        yield from tokens(seed, skip)
        return
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(1)) / D**0.5
    pool = torch.randn(16, D, generator=torch.Generator().manual_seed(2))
    i = 0
    while True:
        ids = torch.randperm(16, generator=g)[:MBS]
        x = pool[ids] if args.ids else torch.randn(MBS, D, generator=g)
        if args.reshape:  # tokens: (MBS, T, D), T halves at the middle of training (see the loop)
            x = torch.randn(MBS, SHAPE["T"], D, generator=g)
        if args.variable:
            x = torch.randn(MBS, 8 - i % 3, D, generator=g)
        i += 1
        if i > skip:
            inp = x.bfloat16() if args.bf16 else x
            extra = (ids,) if args.ids else (x > 0,) if args.mask else ()
            yield ((inp, *extra) if extra else inp), torch.tanh(x @ w) * 2


def tokens(seed, skip=0):
    """--tp: next-token batches (MBS, SEQ) from a pool of 16 random sequences (and their pool ids with --ids)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(2))
    for i in range(10**9):
        ids = torch.randperm(16, generator=g)[:MBS]
        if i >= skip:
            seq = pool[ids]
            yield ((seq[:, :-1], ids) if args.ids else seq[:, :-1]), seq[:, 1:]


SHAPE = {"T": 8}


def train(variant: argparse.Namespace) -> dict:
    """Train the variant's engine from scratch: this rank's result."""
    global args, H
    args = variant
    SENT["bytes"], PASSES["backward"], SHAPE["T"], H = 0, 0, 8, args.hidden
    engine = make_engine()
    dp_id = engine.grid.data_parallel_id
    it = data(100 + dp_id)
    losses, t0 = [], time.perf_counter()
    steps = args.steps // 2 if args.ckpt else args.steps
    for step in range(steps):
        if args.reshape and step == steps // 2:
            SHAPE["T"] = 4
            engine.reset_activation_shape()
            it = data(200 + dp_id)
        losses.append(float(engine.train_batch(it)))
    step_time = (time.perf_counter() - t0) / steps
    sent_train = SENT["bytes"]
    result = {"rank": rank, "stage": engine.stage_id, "engine": type(engine).__name__, "dp": dp_id,
              "tp": engine.grid.get_slice_parallel_rank() if args.tp else 0, "losses": losses, "sent_bytes": sent_train,
              "step_time": step_time, "backward_passes": PASSES["backward"],
              "stats": engine.pp_compress_stats() if hasattr(engine, "pp_compress_stats") else {}}
    if args.ckpt:
        engine.save_checkpoint(args.ckpt)
        result["continued"] = [float(engine.train_batch(it)) for _ in range(args.steps - steps)]
        fresh = make_engine()
        fresh.load_checkpoint(args.ckpt)
        it2 = data(100 + dp_id, skip=steps * GAS)
        result["resumed"] = [float(fresh.train_batch(it2)) for _ in range(args.steps - steps)]
    result["eval"] = float(engine.eval_batch(data(7 + dp_id)))
    if args.eval_options:
        out, logits = engine.eval_batch(data(8 + dp_id), return_logits=True, bcast_loss=False, num_micro_batches=2,
                                        reduce_output=None)
        result["eval_logits_sum"] = float(logits.double().sum()) if torch.is_tensor(logits) else None
        result["eval_nobcast"] = None if out is None else [float(torch.as_tensor(o).double().sum()) for o in out]
    return result


variants.write(train, args, VARIANTS, rank)
ppd.finish()  # barrier, DeepSpeed's /dev/shm buffers removed, process group down, os._exit(0) (no C++ finalizers)
