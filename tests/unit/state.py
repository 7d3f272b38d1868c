"""Helpers shared by the unit tests."""
from collections.abc import Iterator
from typing import Any

import torch


def state_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) state dict."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from state_tensors(v)
