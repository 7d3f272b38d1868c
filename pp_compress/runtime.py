"""What every engine adapter needs besides compression, none of it specific to one engine: splitting an engine config
from its "pp_compress" section, checking that all ranks run the same compression, and the per-rank state file that
goes next to a checkpoint. (Operators never touch torch.distributed; this module is where the adapters do.)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as tdist

from .config import CompressionConfig, parse_spec

SECTION = "pp_compress"
"""The key of the compression section in an engine's JSON config."""


def load_json(config: dict | str | None) -> dict:
    """An engine config as a dict (a JSON path is read, a .yaml or .yml path as YAML), a copy."""
    if not isinstance(config, str):
        return dict(config or {})
    with open(config) as f:
        if not config.endswith((".yaml", ".yml")):
            data = json.load(f)
        else:
            try:
                import yaml
            except ImportError as e:
                raise ValueError(f"{config}: reading YAML needs PyYAML (pip install pyyaml)") from e
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{config}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{config}: expected a mapping at the top, got {type(data).__name__}")
    return data


def resolve_config(config: dict | str | None,
                   compression: CompressionConfig | str | dict | None) -> tuple[dict, CompressionConfig]:
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
    raise TypeError(f"compression={chosen!r}; accepted: a spec string, a dict like the '{SECTION}' section, or "
                    "CompressionConfig")


def launch_rank() -> int:
    """This process's global rank as the launcher set it (RANK; torchrun and the deepspeed launcher both set it),
    readable before torch.distributed starts; 0 without a launcher."""
    return int(os.environ.get("RANK", "0"))


QUIET_EXIT_DELAY_S = 5.0
"""How long the ranks that do not print `exit_once`'s message wait before exiting: launchers stop every rank as soon as
one fails (the deepspeed launcher, torchrun), and rank 0 must have printed by then."""


def exit_once(message: str, status: int = 2) -> NoReturn:
    """Stop every rank of a job that cannot start, with one message: rank 0 prints it, the others exit quietly (each
    would print the same text) a moment later, all with `status`. Before any process-group work, so no collective can
    hang."""
    if launch_rank() == 0:
        print(f"error: {message}", file=sys.stderr)
    else:
        time.sleep(QUIET_EXIT_DELAY_S)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(status)


def spec_arg(value: str) -> str:
    """argparse `type=` of --pp-compress: the spec is parsed when the command line is, so a bad one stops the job in its
    first second with one message (`exit_once`; argparse's usage block would repeat on every rank). Returns the text
    unchanged."""
    try:
        parse_spec(value)
    except ValueError as e:
        exit_once(f"--pp-compress {value!r}: {e}")
    return value


def add_spec_argument(parser: Any, over: str) -> None:
    """Add `--pp-compress SPEC` to `parser` (or an argument group of it), checked as the command line is parsed
    (`spec_arg`); `over`: what it wins over, for its help."""
    parser.add_argument("--pp-compress", dest="pp_compress", default=None, metavar="SPEC", type=spec_arg,
                        help=f"e.g. safe, int8 or 'act=int8,grad=int3:stoch'; wins over {over}")


def check_args(args: argparse.Namespace, config: dict | str | None = None) -> CompressionConfig:
    """The compression a parsed command line asks for: `--pp-compress` (args.pp_compress) over the "pp_compress" section
    of `config`, else of `--deepspeed_config` (args.deepspeed_config). Call it right after parse_args, before building
    anything: a missing file, bad JSON or a bad section stops the job with one message (`exit_once`)."""
    if config is None:
        config = getattr(args, "deepspeed_config", None)
    try:
        return resolve_config(config, getattr(args, "pp_compress", None))[1]
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as e:
        where = f" (config {config})" if isinstance(config, str) else ""
        exit_once(f"pp_compress{where}: {e}")


def finish(status: int = 0) -> NoReturn:
    """End a finished distributed job cleanly: wait for every rank, tear the process group down, flush, and end the
    process without running C++ destructors. gloo's threads can abort a rank at exit ("terminate called without an
    active exception", SIGABRT) after all its work is done, which turns a finished run into a failed job; extra process
    groups (tensor parallelism, DeepSpeed's grid) made it happen even after destroy_process_group. Write and close
    every output before calling it: nothing runs after it."""
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


STATE_FORMAT = 1
"""The version of the per-rank state file's layout: {"format", "config", "ops"} of tensors, numbers and strings."""


def state_bytes(stage: Any) -> bytes:
    """One rank's (or one stage's) compression state, serialized as the state file holds it, for a checkpoint format
    that stores bytes (torchtitan's)."""
    buf = io.BytesIO()
    torch.save(_versioned(stage), buf)
    return buf.getvalue()


def _versioned(stage: Any) -> dict[str, Any]:
    return {"format": STATE_FORMAT, **stage.state_dict()}


def save_state(stage: Any, checkpoint_dir: str, rank: int) -> None:
    """Write one rank's compression state atomically: to a temporary file beside it, then renamed over it, so a crash
    mid-write leaves the previous file (or none), never a truncated one."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = state_file(checkpoint_dir, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(_versioned(stage), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_state(stage: Any, checkpoint_dir: str, rank: int) -> None:
    """Read one rank's compression state (`save_state`'s file)."""
    path = state_file(checkpoint_dir, rank)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: checkpoint was not written by pp_compress (or by another "
                                "topology)")
    with open(path, "rb") as f:
        load_state_bytes(stage, f.read(), path)


def load_state_bytes(stage: Any, data: bytes, name: str) -> None:
    """Restore what `state_bytes` wrote (`name`: where it came from, for errors). It is untrusted input (checkpoints are
    copied and downloaded): it is read with `weights_only=True`, which builds tensors, numbers, strings and containers
    and never runs code, and its layout and config are checked; any failure is one error that names `name`."""
    if not isinstance(data, bytes):
        raise ValueError(f"{name}: expected pp_compress state bytes, got {type(data).__name__}")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - pickle's errors name opcodes and globals, not what is wrong with the file
        raise ValueError(f"{name}: not a pp_compress state file that can be read safely ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}); it may be corrupt, truncated or hold code") from None
    if (not isinstance(state, dict) or not isinstance(state.get("config"), str)
            or not isinstance(state.get("ops"), dict)):
        keys = " with keys " + str(sorted(map(str, state))) if isinstance(state, dict) else ""
        raise ValueError(f"{name}: not a pp_compress state file (expected a dict with 'config' and 'ops'); got "
                         f"{type(state).__name__}{keys}")
    if state.get("format", STATE_FORMAT) != STATE_FORMAT:  # files before the format field have this layout too
        raise ValueError(f"{name}: state format {state['format']!r}; this pp_compress reads format {STATE_FORMAT}")
    try:
        stage.load_state_dict({k: v for k, v in state.items() if k != "format"})
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{name}: {e}") from None
