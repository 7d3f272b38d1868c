"""pp_compress: compress the traffic between pipeline-parallel stages (activations forward, activation-gradients
backward), with error feedback, for training and inference.

In a DeepSpeed pipeline job (see `pp_compress.deepspeed` for the whole story):

    import pp_compress.deepspeed as ppd
    engine, *_ = ppd.initialize(model=pipeline_module, config=ds_config, compression="safe")
    ppd.enable()          # or: one line for Megatron-DeepSpeed, the config's "pp_compress" section decides

Specs and presets:

    import pp_compress as ppc
    cfg = ppc.parse_spec("act=int8,grad=int3:stoch")    # CompressionConfig; str(cfg) round-trips
    cfg = ppc.parse_spec("safe")                        # a preset: ppc.PRESETS names what each stands for
    ppc.CompressionConfig.from_dict({"activations": "int8", "gradients": "int8"})   # the JSON section

One call per message, for a transport of your own (pack on one side, unpack on the other):

    send, recv = ppc.Codec("safe"), ppc.Codec("safe")
    buf, n = send.pack(x); y = recv.unpack(buf, x.shape, x.dtype)

One operator on its own:

    op = ppc.build("topk:0.1+ef")
    p = op.compress(x); y = op.decompress(p); p.nbytes; op.wire_layout(x.shape, x.dtype)

In process (simulation, inference-time compression of a transformers model):

    bounds = ppc.insert_boundaries(model, after=[2, 5, 8], cfg="act=int8,grad=int8")

Importing this package needs torch alone: it never imports deepspeed. Wire internals (`pp_compress.wire`,
`pp_compress.pipe`, `pp_compress.ops.base`) are importable from their modules.
"""
from .codec import Codec
from .boundary import CompressionBoundary, compressed_boundary, find_blocks, insert_boundaries, set_sample_ids
from .config import BoundaryOverride, CompressionConfig, CompressorSpec, build, parse_op, parse_spec
from .feedback import AQSGD, EF, EF21
from .ops.base import Compressor, Context, Payload
from .presets import PRESETS

__version__ = "0.1.0"

__all__ = [
    "AQSGD", "EF", "EF21", "PRESETS", "BoundaryOverride", "Codec", "CompressionBoundary", "CompressionConfig",
    "Compressor", "CompressorSpec", "Context", "Payload", "build", "compressed_boundary", "find_blocks",
    "insert_boundaries", "parse_op", "parse_spec", "set_sample_ids",
]
