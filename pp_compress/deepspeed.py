"""`pp_compress.deepspeed.initialize(...)`: see pp_compress/integrations/deepspeed.py (imports deepspeed)."""
from .integrations.deepspeed import CompressedPipelineEngine, add_argparse_args, disable, enable, initialize, resolve_config

__all__ = ["CompressedPipelineEngine", "add_argparse_args", "disable", "enable", "initialize", "resolve_config"]
