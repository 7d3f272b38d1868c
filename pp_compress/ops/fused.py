"""The fused CPU kernels (pp_compress/csrc/*.cpp), built once per machine with torch's C++ extension tooling.

`kernels()` returns the compiled module, building it on first use (about a minute; `make setup` builds it at
install time, and the build is cached under ~/.cache/torch_extensions). Where it cannot be built (no C++ compiler),
it warns once with the reason and returns None: the operators then run their eager reference, which gives the same
codes. `usable(x, size)` says whether a tensor can take the fused path: on CPU, groups of a multiple of 8 values.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType

from torch import Tensor

SOURCES = [Path(__file__).resolve().parents[1] / "csrc" / name for name in ("fused.cpp", "vq.cpp")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
"""Built for this machine's vector units; no fused multiply-adds and no fast-math, so results are the reference's."""
_STATE: dict[str, ModuleType | None] = {}


def kernels() -> ModuleType | None:
    """The compiled kernels, or None (with a one-time warning) where they cannot be built."""
    if "ext" not in _STATE:
        try:
            from torch.utils.cpp_extension import load

            _STATE["ext"] = load(name="pp_compress_fused", sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                                 verbose=bool(os.environ.get("PP_COMPRESS_BUILD_VERBOSE")))
        except Exception as e:  # noqa: BLE001 - any build failure: say why, then the eager reference runs
            _STATE["ext"] = None
            warnings.warn(f"pp_compress: the fused CPU kernels could not be built ({type(e).__name__}: {str(e)[:300]}); "
                          "the operators run their eager reference (same codes, slower)", RuntimeWarning, stacklevel=2)
    return _STATE["ext"]


def usable(x: Tensor, size: int) -> bool:
    """Whether groups of `size` values of x can take the fused path (the kernels pack whole rows of 8 codes)."""
    return x.device.type == "cpu" and size % 8 == 0 and kernels() is not None
