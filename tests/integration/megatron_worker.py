"""One rank of Megatron-Core's own pipeline schedules on CPU/gloo, launched by the tests.

A chain of tanh(Linear) chunks, one per pipeline rank (or --vpp per rank, interleaved as Megatron lays them out:
chunk v * pp + r on rank r), [seq, batch, hidden] between stages, trained with SGD through `get_forward_backward_func()`
for --steps steps, then one forward-only (evaluation) call. Writes <out>/rank<R>.json (with --variant, variants.py):
the last stage's losses, every step's gradient sums, the evaluation loss and pp_compress's statistics.

Megatron-Core assumes CUDA in three places; the shim below (tests only) maps them to the CPU: receive buffers and
shape tensors on `torch.cuda.current_device()`, `torch.cuda.synchronize()`, and factory calls with `device="cuda"`
(schedules.py's `total_num_tokens`).
"""
import argparse

import torch
import torch.distributed as dist
import variants
from torch import nn

torch.cuda.current_device = lambda: torch.device("cpu")
torch.cuda.synchronize = lambda *a, **k: None


class CpuFactories(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


CpuFactories().__enter__()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import pp_compress.megatron as ppm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--vpp", type=int, default=0, help="virtual pipeline chunks per rank (the interleaved schedule)")
ap.add_argument("--spec", default=None, help="pp_compress spec; omitted = stock Megatron-Core")
ap.add_argument("--no-batch", action="store_true", help="batch_p2p_comm off (Megatron's separate isend/irecv)")
ap.add_argument("--variable", action="store_true",
                help="variable_seq_lengths: micro-batches of 17, 16, 15, 17, ... positions")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--hidden", type=int, default=32)
ap.add_argument("--save", default=None, help="after --steps steps, save the compression state here, restart the "
                "session (enable again, load) and run --steps more")
args, VARIANTS = variants.parse_args(ap)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world,
                                         virtual_pipeline_model_parallel_size=args.vpp or None)
SEQ, MBS, MB = 16, 4, 2 * world  # micro-batches a step: a multiple of the pipeline size, as interleaving wants


class Chunk(nn.Module):
    """Chunk `index` of `count`: the first reads the batch, the others what the previous chunk sent."""

    def __init__(self, index: int, count: int, config: TransformerConfig) -> None:
        super().__init__()
        torch.manual_seed(100 + index)  # the same weights whichever rank builds it
        self.lin, self.index, self.count, self.config = nn.Linear(args.hidden, args.hidden), index, count, config
        self.input_tensor, self.model_type = None, ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        return torch.tanh(self.lin(x if self.index == 0 else self.input_tensor))  # [seq, batch, hidden]


def batches(seed: int):
    """Micro-batches (x, y) of [seq, batch, hidden]; with --variable each has its own length."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(args.hidden, args.hidden, generator=torch.Generator().manual_seed(1)) / args.hidden**0.5
    for i in range(10**6):
        seq = SEQ + 1 - i % 3 if args.variable else SEQ
        x = torch.randn(seq, MBS, args.hidden, generator=g)
        yield x, torch.tanh(x @ w)


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
    if args.spec is None:
        ppm.disable()
    else:
        ppm.enable(args.spec + ",min_numel=0")
    chunks = args.vpp or 1
    config = TransformerConfig(num_layers=world * chunks, hidden_size=args.hidden, num_attention_heads=1,
                               pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=args.vpp or None,
                               pipeline_dtype=torch.float32, batch_p2p_comm=not args.no_batch,
                               variable_seq_lengths=args.variable,
                               moe_token_dispatcher_type="alltoall")  # (no MoE here: the one variable lengths allow)
    models = [Chunk(v * world + rank, chunks * world, config) for v in range(chunks)]
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
    result["stats"] = ppm.stats() if args.spec else {}
    return result


variants.write(train, args, VARIANTS, rank)
variants.end()
