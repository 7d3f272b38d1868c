"""pp_compress for DeepSpeed pipeline jobs: compressed activations and activation-gradients between stages.

Three ways in, all with the same spec grammar (`pp_compress.parse_spec`):

1. `initialize`, a drop-in for `deepspeed.initialize` with a `PipelineModule`:

       import pp_compress.deepspeed as ppd
       parser = ppd.add_argparse_args(argparse.ArgumentParser())    # --pp-compress SPEC, checked while parsing
       deepspeed.add_config_arguments(parser)
       args = parser.parse_args()
       ppd.check_args(args)          # the config's "pp_compress" section too, before any work: one message, exit 2
                                     # (and a build lock a killed build left, which DeepSpeed's start would wait on)
       engine, optimizer, _, _ = ppd.initialize(model=pipe_module, config=args.deepspeed_config,
                                                compression=args.pp_compress,      # None: the config's section
                                                model_parameters=pipe_module.parameters())
       engine.train_batch(data_iter)
       engine.pp_compress_stats()    # per boundary and direction: raw / wire bytes, ratio, relative error
       ppd.finish()                  # barrier, remove DeepSpeed's /dev/shm buffers, tear the process group down, exit 0

2. `enable()`, one line for Megatron-DeepSpeed or any script that calls `deepspeed.initialize` itself: a pipeline
   whose DeepSpeed config has a "pp_compress" section gets the compressed engine; everything else runs stock.

3. The config section alone, with either of the above:

       "pp_compress": {"activations": "nf6", "gradients": "int3:stoch", "warmup_steps": 0, "min_numel": 1024}

   or a preset: `"pp_compress": "safe"` / `--pp-compress safe` (see `pp_compress.presets`).

Keys of the section (`CompressionConfig`): activations, gradients, eval, warmup_steps, min_numel, seed, nonfinite,
error_every, batch_dim (1 for Megatron's [seq, batch, hidden]), boundaries. Unknown keys are errors.

The engine also saves and loads its compression state with DeepSpeed checkpoints, checks at start that every rank
runs the same config, and logs its statistics every `steps_per_print` steps. Only
`pp_compress/integrations/deepspeed.py` imports deepspeed; this module is its public face.
"""
try:
    import deepspeed  # noqa: F401 - only to say what is missing, before the adapter's own imports
except ModuleNotFoundError as e:
    if e.name != "deepspeed":
        raise
    raise ModuleNotFoundError("pp_compress.deepspeed needs DeepSpeed, which is not installed: "
                              "pip install 'pp_compress[deepspeed]'", name="deepspeed") from None

from .integrations.deepspeed import (CompressedPipelineEngine, add_argparse_args, check_args, disable, enable, finish,
                                     initialize, prebuild)
from .runtime import resolve_config

__all__ = ["CompressedPipelineEngine", "add_argparse_args", "check_args", "disable", "enable", "finish", "initialize",
           "prebuild", "resolve_config"]
