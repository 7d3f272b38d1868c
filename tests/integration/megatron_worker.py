"""One rank of Megatron-Core's own pipeline schedules on CPU/gloo, launched by the tests.

A chain of tanh(Linear) chunks, one per pipeline rank (or --vpp per rank, interleaved as Megatron lays them out:
chunk v * pp + r on rank r), [seq, batch, hidden] between stages, trained with SGD through `get_forward_backward_func()`
for --steps steps, then one forward-only (evaluation) call. Writes <out>/rank<R>.json (with --variant, variants.py):
the last stage's losses, every step's gradient sums, the evaluation loss and pp_compress's statistics.

Megatron-Core assumes CUDA in a few places; lab/pp_lab/megatron_cpu.py maps them to the CPU (the lab's, never the
library's).
"""
import argparse
import functools
import shlex
import sys
import types

import torch
import torch.distributed as dist
import variants
from pp_lab import megatron_cpu
from torch import nn

megatron_cpu.install()  # Megatron-Core's CUDA calls on the CPU (before it is imported)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import pp_compress.megatron as ppm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--vpp", type=int, default=0, help="virtual pipeline chunks per rank (the interleaved schedule)")
ap.add_argument("--spec", default=None, help="pp_compress spec; omitted = stock Megatron-Core")
ap.add_argument("--lm-args", default=None, help="a Megatron-LM command line's pp_compress options: parsed by a parser "
                "that pp_compress.megatron.add_arguments extended, and served as megatron.training.get_args() is")
ap.add_argument("--no-batch", action="store_true", help="batch_p2p_comm off (Megatron's separate isend/irecv)")
ap.add_argument("--overlap", action="store_true", help="overlap_p2p_comm: the interleaved schedule waits for its "
                "messages later (wait_on_reqs=False, handles)")
ap.add_argument("--variable", action="store_true",
                help="variable_seq_lengths: micro-batches of 17, 16, 15, 17, ... positions")
ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (each chunk then a column- and a "
                "row-parallel linear layer)")
ap.add_argument("--sp", action="store_true", help="sequence parallel: what crosses a stage is the rank's sequence shard")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--hidden", type=int, default=32)
ap.add_argument("--save", default=None, help="after --steps steps, save the compression state here, restart the "
                "session (enable again, load) and run --steps more")
args, VARIANTS = variants.parse_args(ap)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
PP = world // args.tp
parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=PP,
                                         virtual_pipeline_model_parallel_size=args.vpp or None)
TP_RANK, PP_RANK = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
SEQ, MBS, MB = 16, 4, 2 * PP  # micro-batches a step: a multiple of the pipeline size, as interleaving wants


class Chunk(nn.Module):
    """Chunk `index` of `count`: the first reads the batch, the others what the previous chunk sent."""

    def __init__(self, index: int, count: int, config: TransformerConfig) -> None:
        super().__init__()
        torch.manual_seed(100 + index)  # the same weights whichever rank builds it
        self.index, self.count, self.config = index, count, config
        self.input_tensor, self.model_type = None, ModelType.encoder_or_decoder
        if args.tp == 1:
            self.lin = nn.Linear(args.hidden, args.hidden)
        else:  # Megatron's own tensor-parallel layers (weights drawn whole on the CPU, then split)
            from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            init = functools.partial(nn.init.normal_, std=0.2)
            self.up = ColumnParallelLinear(args.hidden, 2 * args.hidden, config=config, init_method=init, bias=True,
                                           gather_output=False)
            self.down = RowParallelLinear(2 * args.hidden, args.hidden, config=config, init_method=init, bias=True,
                                          input_is_parallel=True, skip_bias_add=False)

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        x = x if self.index == 0 else self.input_tensor  # [seq, batch, hidden] (with --sp: this rank's seq shard)
        if args.tp == 1:
            return torch.tanh(self.lin(x))
        return torch.tanh(self.down(torch.tanh(self.up(x)[0]))[0])


def batches(seed: int):
    """Micro-batches (x, y) of [seq, batch, hidden]; with --variable each has its own length."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(args.hidden, args.hidden, generator=torch.Generator().manual_seed(1)) / args.hidden**0.5
    for i in range(10**6):
        seq = SEQ + 1 - i % 3 if args.variable else SEQ
        x = torch.randn(seq, MBS, args.hidden, generator=g)
        y = torch.tanh(x @ w)
        if args.sp:  # each tensor-parallel rank holds its part of the sequence
            x, y = (t.chunk(args.tp)[TP_RANK] for t in (x, y))
        yield x, y


def forward_step(data_iterator, model):
    x, y = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = ((output - y) ** 2).mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def train(variant: argparse.Namespace) -> dict:
    global args
    args = variant
    if args.lm_args is not None:  # as Megatron-LM's pretrain() does with its extra_args_provider
        lm = ppm.add_arguments(argparse.ArgumentParser()).parse_args(shlex.split(args.lm_args))
        sys.modules["megatron.training"] = types.SimpleNamespace(get_args=lambda: lm)  # (not in megatron-core)
    elif args.spec is None:
        ppm.disable()
    else:
        ppm.enable(args.spec + ",min_numel=0")
    chunks = args.vpp or 1
    config = TransformerConfig(num_layers=PP * chunks, hidden_size=args.hidden, num_attention_heads=args.tp,
                               pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=args.vpp or None,
                               tensor_model_parallel_size=args.tp, sequence_parallel=args.sp,
                               use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, batch_p2p_comm=not args.no_batch,
                               overlap_p2p_comm=args.overlap,
                               variable_seq_lengths=args.variable,
                               moe_token_dispatcher_type="alltoall")  # (no MoE here: the one variable lengths allow)
    models = [Chunk(v * PP + PP_RANK, chunks * PP, config) for v in range(chunks)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    fb = get_forward_backward_func()
    step_args = dict(forward_step_func=forward_step, model=models if args.vpp else models[0], num_microbatches=MB,
                     seq_length=SEQ, micro_batch_size=MBS)
    result = {"rank": rank, "losses": [], "grads": []}
    for step in range(2 * args.steps if args.save else args.steps):
        if args.save and step == args.steps:  # a new session, as a resumed job would start one
            ppm.save(args.save)
            ppm.disable()
            ppm.enable(args.spec + ",min_numel=0")
            ppm.load(args.save)
        its = [batches(100 + step) for _ in models]
        opt.zero_grad()
        out = fb(data_iterator=its if args.vpp else its[0], forward_only=False, **step_args)
        result["grads"].append([float(p.grad.double().sum()) for m in models for p in m.parameters()])
        opt.step()
        result["losses"] += [float(o["loss"]) for o in out]
    with torch.no_grad():
        its = [batches(7) for _ in models]
        out = fb(data_iterator=its if args.vpp else its[0], forward_only=True, **step_args)
    result["eval"] = [float(o["loss"]) for o in out]
    result["stats"] = ppm.stats() if args.spec or args.lm_args else {}
    return result


variants.write(train, args, VARIANTS, rank)
variants.end()
