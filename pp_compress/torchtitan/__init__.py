"""pp_compress for torchtitan: an extension package for torchtitan's `--module`, so that a torchtitan job compresses
what its pipeline stages send each other with one option.

    torchrun --nproc_per_node 8 -m torchtitan.train --module pp_compress.torchtitan --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 4 --pp_compress.compression safe

`--config` takes any config of torchtitan's own model registries (`llama3_debugmodel`, `llama3_8b`, `qwen3_1_7b`, ...;
`config_registry.py`) and adds a `pp_compress` section (`PPCompress`: `--pp_compress.compression SPEC`,
`--pp_compress.config_file FILE`). `CompressedTrainer` builds the model spec's pipeline stages as
`CompressedPipelineStage` (every torch.distributed.pipelining schedule torchtitan runs), checks the messages for
non-finite values after each step, logs the compression statistics with torchtitan's metrics (console, TensorBoard,
W&B), and keeps the compression state in torchtitan's checkpoints. See `trainer.py`.
"""
from .trainer import TESTED, CompressedTrainer, PPCompress

__all__ = ["TESTED", "CompressedTrainer", "PPCompress"]
