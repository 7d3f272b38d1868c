"""The configs of `--module pp_compress.torchtitan --config NAME`: every config function of torchtitan's own model
registries (`torchtitan.models.<model>.config_registry`), with a `pp_compress` section added. NAME is looked up by its
leading words: `llama3_debugmodel` in `torchtitan.models.llama3`, `deepseek_v3_16b` in `torchtitan.models.deepseek_v3`.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import torchtitan.models

from .trainer import CompressedTrainer


def __getattr__(name: str) -> Callable[[], CompressedTrainer.Config]:
    stock = _stock(name)
    if stock is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def config() -> CompressedTrainer.Config:
        return CompressedTrainer.Config.of(stock())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name} with a pp_compress section."
    return config


def __dir__() -> list[str]:
    """The config names on offer (torchtitan lists them when --config names none of them): those of the models whose
    dependencies are installed."""
    names = []
    for info in pkgutil.iter_modules(torchtitan.models.__path__):
        try:
            module = _registry(info.name)
        except ImportError:
            continue  # flux needs transformers, say: not on offer here
        if module is not None:
            names += [n for n, v in vars(module).items()
                      if n.startswith(f"{info.name}_") and callable(v) and not n.startswith("_")]
    return sorted(names)


def _stock(name: str) -> Callable[[], object] | None:
    """torchtitan's config function `name`, from the registry of the model its leading words name."""
    if name.startswith("_"):
        return None
    words = name.split("_")
    for i in range(1, len(words)):
        module = _registry("_".join(words[:i]))
        fn = getattr(module, name, None) if module is not None else None
        if callable(fn):
            return fn
    return None


def _registry(model: str) -> object | None:
    try:
        return importlib.import_module(f"torchtitan.models.{model}.config_registry")
    except ModuleNotFoundError as e:
        if e.name in (f"torchtitan.models.{model}", f"torchtitan.models.{model}.config_registry"):
            return None  # no such model, or no configs
        raise  # the model exists, and something it imports is missing: say so
