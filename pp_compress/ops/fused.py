"""The fused CPU kernels (pp_compress/csrc/*.cpp), built once per machine with torch's C++ extension tooling.

`kernels()` returns the compiled module, building it on first use (about 35 s), or None: then the operators run
their eager reference, which gives the same codes. Prebuild before a job, so that no rank compiles inside its first
training step:

    python -m pp_compress.kernels           # builds (or finds) this machine's kernels and prints where they are

`PP_COMPRESS_KERNELS` chooses the build:
- `native` (default): for this machine's vector units (`-march=native`, AVX-512 paths where the CPU has them);
- `baseline`: the architecture's baseline instruction set, the scalar paths (what a CPU without AVX-512 runs);
- `asan`: `native` under AddressSanitizer, for checks (`benchmarks/sanitize.sh`);
- `0`: no kernels; every operator runs its eager reference.

Each build is cached under a name keyed by the instruction-set features the compiler enables for its flags, so a
home directory shared by nodes with different CPUs never loads a build made for another CPU (which would die with
an illegal instruction that Python cannot catch). `usable(x, size)` says whether a tensor can take the fused path:
on CPU, groups of a multiple of 8 values.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch
from torch import Tensor

from .. import buildlock

SOURCES = [Path(__file__).resolve().parents[1] / "csrc" / name for name in ("fused.cpp", "vq.cpp")]
FLAGS: dict[str, list[str]] = {
    "native": ["-O3", "-march=native", "-ffp-contract=off"],
    "baseline": ["-O3", "-ffp-contract=off"],
    "asan": ["-O1", "-g", "-march=native", "-ffp-contract=off", "-fsanitize=address", "-fno-omit-frame-pointer"],
}
"""Compiler flags per build; no fused multiply-adds and no fast-math in any, so results are the reference's. `asan`
instruments every memory access (AddressSanitizer, for benchmarks/sanitize.sh): the process must preload the
compiler's libasan (`LD_PRELOAD=$(c++ -print-file-name=libasan.so)`), else the build does not load."""
LDFLAGS: dict[str, list[str]] = {"asan": ["-fsanitize=address"]}
MODES = (*FLAGS, "0")
"""The accepted values of PP_COMPRESS_KERNELS."""
_STATE: dict[str, ModuleType | None] = {}


def mode() -> str:
    """The build PP_COMPRESS_KERNELS asks for (default `native`); a value outside MODES is an error."""
    value = os.environ.get("PP_COMPRESS_KERNELS", "native")
    if value not in MODES:
        raise ValueError(f"PP_COMPRESS_KERNELS={value!r}; accepted: {', '.join(MODES)}")
    return value


def build_name(flags: list[str]) -> str:
    """The cache name of a build: the sources, the flags, the instruction-set macros the compiler defines for those
    flags on this machine (with -march=native, this CPU's features), and the torch installation it links against
    (two environments sharing a home directory would otherwise rebuild over each other's build)."""
    cxx = os.environ.get("CXX", "c++")
    macros = subprocess.run([cxx, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                            check=True).stdout
    h = hashlib.sha256()
    parts = [*(p.read_bytes() for p in SOURCES), " ".join(flags).encode(),
             "\n".join(sorted(macros.splitlines())).encode(),
             f"{torch.__version__} {Path(torch.__file__).parent}".encode()]
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return f"pp_compress_fused_{h.hexdigest()[:16]}"


def kernels() -> ModuleType | None:
    """The compiled kernels of PP_COMPRESS_KERNELS's build; None where it is `0`, or (with a one-time warning that
    says why) where they cannot be built."""
    which = mode()
    if which not in _STATE:
        _STATE[which] = None if which == "0" else _build(FLAGS[which], LDFLAGS.get(which, []))
    return _STATE[which]


@contextlib.contextmanager
def environment_ninja() -> Iterator[None]:
    """Within: the ninja installed beside this interpreter (pip's, a torch build dependency) comes first on PATH, if
    there is one. torch's build runs whichever ninja PATH finds, and two ninja versions do not read each other's build
    log: processes of one environment started with and without its bin/ on PATH (a venv's python run directly, or
    through a launcher that prepends it) would rebuild the same build each time the other one had built it."""
    here, path = Path(sys.executable).parent, os.environ.get("PATH", "")
    if not (here / "ninja").exists() or path.split(os.pathsep)[0] == str(here):
        yield
        return
    os.environ["PATH"] = f"{here}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _build(flags: list[str], ldflags: list[str]) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        name = build_name(flags)
        buildlock.check(name)  # a lock left by a killed build: one message naming it, never a wait forever
        with environment_ninja():
            return load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags, extra_ldflags=ldflags,
                        verbose=bool(os.environ.get("PP_COMPRESS_BUILD_VERBOSE")))
    except buildlock.StaleBuildLock:
        raise  # the build did not fail: the user has a file to delete
    except Exception as e:  # noqa: BLE001 - any build failure: say why, then the eager reference runs
        warnings.warn(f"pp_compress: the fused CPU kernels could not be built ({type(e).__name__}: {str(e)[:300]}); "
                      "the operators run their eager reference (same codes, slower); PP_COMPRESS_KERNELS=0 turns them "
                      "off without this warning", RuntimeWarning, stacklevel=3)
        return None


def usable(x: Tensor, size: int) -> bool:
    """Whether groups of `size` values of x can take the fused path (the kernels pack whole rows of 8 codes)."""
    return x.device.type == "cpu" and size % 8 == 0 and kernels() is not None

