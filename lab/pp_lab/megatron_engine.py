"""The recipes' training loop on Megatron-Core (`recipes/pretrain.py --engine megatron`).

Megatron-Core's own `GPTModel` (its local layer spec: no Transformer Engine or Apex) in the lab GPT's sizes and
shape (RMSNorm or LayerNorm, SwiGLU or GELU, RoPE, grouped-query attention, untied output layer), its blocks laid
out as Megatron-Core can (evenly, else the first and the last stage hold the same fewer blocks: they also hold the
embedding and the output layer), trained by Megatron's own schedule (`get_forward_backward_func`: 1F1B), with `--tp`
tensor-parallel ranks per stage. What a Megatron-Core user adds to their own loop is the one call
`pp_compress.megatron.enable(spec)`; the loop itself (AdamW, logs, checkpoints with the compression state) is
lab/pp_lab/loop.py. One pipeline (x `--tp`): no data parallelism. Without CUDA, lab/pp_lab/megatron_cpu.py maps
Megatron-Core's few CUDA calls to the CPU.
"""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pp_lab import loop, megatron_cpu
from pp_lab.model import GPTConfig


def check(args: argparse.Namespace) -> None:
    """What this engine's recipes cannot do, refused before any work."""
    if importlib.util.find_spec("megatron") is None:
        raise SystemExit("--engine megatron needs megatron-core: pip install -e '.[megatron]'")
    if not args.untied:
        raise SystemExit("--engine megatron: tied embeddings need Megatron's embedding group all-reduce between the "
                         "first and the last stage, which this loop does not do; add --untied")
    bad = [f for f, on in (("--dualpipev", args.dualpipev), ("--subspace", getattr(args, "subspace", None) is not None),
                           ("--bottleneck", args.bottleneck is not None), ("--bf16", args.bf16), ("--sbh", args.sbh),
                           ("--optimizer muon", args.optimizer == "muon")) if on]
    if bad:
        raise SystemExit(f"--engine megatron does not support {', '.join(bad)}; use --engine deepspeed for them")


def device() -> torch.device:
    """The current CUDA device where there is one (Megatron-Core's own assumption), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def transformer_config(cfg: GPTConfig, stages: int, tp: int) -> Any:
    """Megatron's TransformerConfig for the lab GPT `cfg` at `stages` pipeline and `tp` tensor-parallel ranks."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    n = cfg.n_layer
    first = n // stages if n % stages == 0 else next(
        (f for f in range(1, n // 2) if stages > 2 and (n - 2 * f) % (stages - 2) == 0 and n - 2 * f > 0), None)
    if first is None:
        raise SystemExit(f"--stages {stages}: Megatron-Core cannot lay out {n} blocks over {stages} stages (evenly, or "
                         "with the first and the last stage holding the same fewer blocks)")
    uneven = n % stages != 0
    return TransformerConfig(
        num_layers=cfg.n_layer, hidden_size=cfg.d_model, num_attention_heads=cfg.n_head,
        num_query_groups=cfg.n_kv_head, ffn_hidden_size=cfg.ff, kv_channels=cfg.d_model // cfg.n_head,
        normalization="RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm", layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=cfg.mlp == "swiglu", activation_func=F.silu if cfg.mlp == "swiglu" else F.gelu,
        add_bias_linear=cfg.bias, init_method_std=cfg.init_std, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=stages, tensor_model_parallel_size=tp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,  # the same weights at every --tp
        num_layers_in_first_pipeline_stage=first if uneven else None,
        num_layers_in_last_pipeline_stage=first if uneven else None)


class _Engine:
    """This rank's part of Megatron-Core's GPTModel under its 1F1B schedule, as lab/pp_lab/loop.py drives it."""

    name, description = "megatron", "Megatron-Core, 1F1B"

    def __init__(self, model: nn.Module, args: argparse.Namespace, last: int, dev: torch.device) -> None:
        import pp_compress.megatron as ppm
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ppm = ppm  # (imported after megatron_cpu.install: it imports Megatron-Core)
        self.module, self.args, self.last, self.dev = model, args, last, dev
        self.is_last = parallel_state.is_pipeline_last_stage()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.run = get_forward_backward_func()

    def _forward(self, data: Iterator[Any], model: nn.Module) -> tuple[Any, Any]:
        (ids, _), labels = next(data)
        ids, labels = ids.to(self.dev), labels.to(self.dev)  # (B, T) each
        pos = torch.arange(ids.shape[1], device=self.dev).expand_as(ids)  # (B, T)
        out = model(ids, pos, None, labels=labels.clamp_min(0))  # last stage: per-token loss (B, T); else hidden

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            keep = (labels != -100).float()  # (B, T)
            loss = (per_token.float() * keep).sum() / keep.sum().clamp_min(1)
            return loss, {"loss": loss.detach().clone()}  # (the schedule divides `loss` in place)

        return out, loss_func

    def _schedule(self, batch: Any, forward_only: bool) -> float:
        (ids, sample_ids), labels = batch
        mb = self.args.micro_batch
        micro = [((ids[i:i + mb], sample_ids[i:i + mb]), labels[i:i + mb]) for i in range(0, len(ids), mb)]
        out = self.run(forward_step_func=self._forward, data_iterator=iter(micro), model=self.module,
                       num_microbatches=len(micro), seq_length=ids.shape[1], micro_batch_size=mb,
                       forward_only=forward_only)
        return float(torch.stack([o["loss"] for o in out]).mean()) if self.is_last else 0.0

    def step(self, batch: Any) -> float:
        return self._schedule(batch, forward_only=False)

    def evaluate(self, batches: Iterator[Any]) -> float:
        with torch.no_grad():
            return self._schedule(next(batches), forward_only=True)

    def clip(self, max_norm: float) -> None:
        loop.clip_(list(self.module.parameters()), max_norm,
                   owned=lambda p: getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0)

    def check(self) -> None:
        self.ppm.check()

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.ppm.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.ppm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ppm.load_state_dict(state)


def train(args: argparse.Namespace, cfg: GPTConfig, meta: dict[str, Any], train_ds: Any, val_ds: Any,
          batches_fn: Any, eval_batches_fn: Any) -> dict[str, Any]:
    """Train Megatron-Core's GPTModel in `cfg`'s sizes from scratch over --stages pipeline x --tp tensor ranks."""
    from pp_compress.runtime import check_args

    megatron_cpu.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import pp_compress.megatron as ppm

    world = dist.get_world_size()
    if world != args.stages * args.tp:
        raise SystemExit(f"--engine megatron runs one pipeline of --stages x --tp ({args.stages} x {args.tp}) "
                         f"processes, not {world}")
    compression = check_args(args)
    ppm.enable(compression)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.stages)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config(cfg, args.stages, args.tp)
    torch.manual_seed(args.seed)  # the CPU initialisation draws every weight whole: the same model at any --tp
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=cfg.vocab_size, max_sequence_length=args.seq_len,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_theta))
    dev = device()
    model.to(dev)
    last = (args.stages - 1) * args.tp  # the last stage's first tensor-parallel rank (Megatron's tp-first order)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        assert dist.get_rank() == last, (dist.get_rank(), last)
    engine = _Engine(model, args, last, dev)
    return loop.run(args, engine, compression, meta, train_ds, val_ds, batches_fn, eval_batches_fn, dev,
                    extra={"tp": args.tp, "megatron_core": ppm.package_info.__version__})
