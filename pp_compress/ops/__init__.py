"""Compression operators: one small module per family, each pure (see ops/base.py).

Every module of this package is imported here, and each operator config registers itself when its class is
defined (`OpConfig.__init_subclass__`), so adding an operator is adding its module: no list to edit. Modules whose
names start with `_` are left out: they hold device kernels, imported by their operators where their compiler exists.
"""
import importlib
import pkgutil

from .base import REGISTRY, Compressor, Context, Layout, OpConfig, Payload, TensorSpec, layout_nbytes

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def op_configs() -> tuple[type[OpConfig], ...]:
    """The registered operator configs, in registration (module name) order."""
    return tuple(REGISTRY.values())


def example_specs() -> list[str]:
    """Every registered operator's EXAMPLES: what the contract and property tests run."""
    return [spec for cls in op_configs() for spec in cls.EXAMPLES]


__all__ = ["REGISTRY", "Compressor", "Context", "Layout", "OpConfig", "Payload", "TensorSpec", "example_specs",
           "layout_nbytes", "op_configs"]
