"""Compression operators: one small module per family, each pure (see ops/base.py)."""
from .base import Compressor, Context, Layout, OpConfig, Payload, TensorSpec, layout_nbytes
from .cast import CastConfig
from .fp8 import Fp8Config
from .lowrank import LowRankConfig
from .quant import IntQuantConfig
from .randk import RandKConfig
from .topk import TopKConfig

OP_CONFIGS: tuple[type[OpConfig], ...] = (CastConfig, IntQuantConfig, Fp8Config, TopKConfig, RandKConfig, LowRankConfig)

__all__ = ["OP_CONFIGS", "CastConfig", "Compressor", "Context", "Fp8Config", "IntQuantConfig", "Layout",
           "LowRankConfig", "OpConfig", "Payload", "RandKConfig", "TensorSpec", "TopKConfig", "layout_nbytes"]
