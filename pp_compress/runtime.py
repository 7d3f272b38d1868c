"""What every engine adapter needs besides compression, none of it specific to one engine: splitting an engine config
from its "pp_compress" section, checking that all ranks run the same compression, and the per-rank state file that
goes next to a checkpoint. (Operators never touch torch.distributed; this module is where the adapters do.)
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as tdist

from .config import CompressionConfig, parse_spec

SECTION = "pp_compress"
"""The key of the compression section in an engine's JSON config."""


def load_json(config: dict | str | None) -> dict:
    """An engine config as a dict (a JSON path is read), a copy."""
    if isinstance(config, str):
        with open(config) as f:
            return json.load(f)
    return dict(config or {})


def resolve_config(config: dict | str | None, compression: CompressionConfig | str | dict | None) -> tuple[dict, CompressionConfig]:
    """Split an engine config (dict or JSON path) into (the engine's part, CompressionConfig); `compression` wins over
    the config's "pp_compress" section."""
    rest = load_json(config)
    section = rest.pop(SECTION, None)
    chosen = compression if compression is not None else section
    if chosen is None:
        return rest, CompressionConfig()
    if isinstance(chosen, CompressionConfig):
        return rest, chosen
    if isinstance(chosen, str):
        return rest, parse_spec(chosen)
    if isinstance(chosen, dict):
        return rest, CompressionConfig.from_dict(chosen)
    raise TypeError(f"compression={chosen!r}; accepted: a spec string, a dict like the '{SECTION}' section, or CompressionConfig")


def check_same_config(cfg: CompressionConfig, group: Any = None) -> None:
    """Every rank must compress identically; a mismatch would corrupt silently, so stop everyone (a collective)."""
    digest = int.from_bytes(hashlib.blake2b(str(cfg).encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(every, mine, group=group)
    differ = [r for r, h in enumerate(every) if int(h) != digest]
    if differ:
        raise RuntimeError(f"pp_compress config differs across ranks: rank {tdist.get_rank()} runs {str(cfg)!r}, "
                           f"ranks {differ} run another; every rank must get the same --pp-compress / config section")


def state_file(checkpoint_dir: str, rank: int) -> str:
    """Where one rank's compression state (error feedback, importance vectors) lives inside a checkpoint folder."""
    return os.path.join(checkpoint_dir, f"pp_compress_rank{rank:05d}.pt")


def save_state(stage: Any, checkpoint_dir: str, rank: int) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save(stage.state_dict(), state_file(checkpoint_dir, rank))


def load_state(stage: Any, checkpoint_dir: str, rank: int) -> None:
    path = state_file(checkpoint_dir, rank)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: checkpoint was not written by pp_compress (or by another topology)")
    stage.load_state_dict(torch.load(path, weights_only=False))
