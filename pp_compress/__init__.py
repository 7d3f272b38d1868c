"""pp_compress: compress the traffic between pipeline-parallel stages.

    import pp_compress as ppc
    op = ppc.build("topk:0.1")
    p = op.compress(x); y = op.decompress(p); p.nbytes; op.wire_layout(x.shape, x.dtype)
    cfg = ppc.parse_spec("act=int8,grad=topk:0.1+ef")

Importing this package never imports deepspeed; the DeepSpeed shim is `pp_compress.integrations.deepspeed`.
"""
from .boundary import CompressionBoundary, compressed_boundary, find_blocks, insert_boundaries, set_sample_ids
from .config import BoundaryOverride, CompressionConfig, CompressorSpec, build, parse_op, parse_spec
from .feedback import AQSGD, EF, EF21
from .ops.base import Compressor, Context, Payload, TensorSpec, layout_nbytes
from .stats import DirectionStats
from .wire import from_buffer, to_buffer

__version__ = "0.1.0"

__all__ = [
    "AQSGD", "EF", "EF21", "BoundaryOverride", "CompressionBoundary", "CompressionConfig", "Compressor",
    "CompressorSpec", "Context", "DirectionStats", "Payload", "TensorSpec", "build", "compressed_boundary",
    "find_blocks", "from_buffer", "insert_boundaries", "layout_nbytes", "parse_op", "parse_spec",
    "set_sample_ids", "to_buffer",
]
