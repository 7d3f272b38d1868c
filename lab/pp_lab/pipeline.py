"""The recipe's GPT as a deepspeed.pipe.PipelineModule: the one place that assembles the model's layers (pp_lab.model)
and, with tensor parallelism, its tensor-parallel blocks (pp_lab.tp) into DeepSpeed's pipeline."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pp_lab import tp as tpmod
from pp_lab.bottleneck import Basis
from pp_lab.model import Block, Embedding, GPTConfig, Head, lm_loss, tied_logits


def pipeline_module(cfg: GPTConfig, num_stages: int, checkpoint: str | Path | None = None,
                    partition_method: str = "type:Block", activation_checkpoint_interval: int = 0, tp: int = 1,
                    bases: dict[int, Basis] | None = None, dualpipev: bool = False) -> Any:
    """The same layers as a deepspeed.pipe.PipelineModule; each stage builds (and loads) only its own. With tp > 1
    the blocks are Megatron-style tensor-parallel (lab/pp_lab/tp.py) over DeepSpeed's PP x TP x DP topology.
    `bases`: the bottleneck's initial Basis per cut, for a cfg with a bottleneck. `dualpipev`: a DualPipeVModule
    (DeepSpeed 0.19.7 and later), 2 x num_stages stages of a V over num_stages ranks."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    cls = PipelineModule
    if dualpipev:
        if tp > 1:
            raise ValueError("dualpipev with tensor parallelism is not supported; use tp=1")
        try:
            from deepspeed.runtime.pipe.dualpipev import DualPipeVModule as cls
        except ModuleNotFoundError:
            raise SystemExit("--dualpipev needs DeepSpeed 0.19.7 or later (its DualPipeV engine)") from None

    topology: dict[str, Any] = {"num_stages": num_stages}
    if tp > 1:
        if checkpoint is not None or cfg.bottleneck is not None:
            raise ValueError("a checkpoint or a bottleneck in tensor-parallel blocks is not supported; use tp=1")
        topology = {"topology": tpmod.topology(num_stages, tp)}
        group = tpmod.tp_group(topology["topology"])
        blocks = [LayerSpec(tpmod.TPBlock, cfg, i, group) for i in range(cfg.n_layer)]
    else:
        blocks = [LayerSpec(Block, cfg, i, checkpoint, bases) for i in range(cfg.n_layer)]
    if cfg.tie_embeddings:
        specs = [TiedLayerSpec("embed", Embedding, cfg, checkpoint), *blocks, LayerSpec(Head, cfg, checkpoint),
                 TiedLayerSpec("embed", Embedding, cfg, checkpoint, forward_fn=tied_logits)]
    else:
        specs = [LayerSpec(Embedding, cfg, checkpoint), *blocks, LayerSpec(Head, cfg, checkpoint)]
    return cls(layers=specs, loss_fn=lm_loss, partition_method=partition_method,
              activation_checkpoint_interval=activation_checkpoint_interval, **topology)
