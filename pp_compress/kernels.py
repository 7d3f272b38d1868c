"""Prebuild what a job would otherwise compile in its first step, so that no rank compiles inside a job (where a
timeout could kill the build mid-way):

    python -m pp_compress.kernels                          # this CPU's build (PP_COMPRESS_KERNELS=native)
    PP_COMPRESS_KERNELS=baseline python -m pp_compress.kernels   # the scalar paths, for CPUs without AVX-512

It builds the fused CPU kernels (cached under a name keyed by the instruction set they use; see
pp_compress.ops.fused) and, where DeepSpeed is installed, the ops DeepSpeed JIT-builds when a job starts on this
accelerator (its CPU shared-memory communication op; pp_compress.deepspeed.prebuild), and prints where each is.
"""
from __future__ import annotations

import importlib.util

from .ops import fused


def main() -> None:
    ext = fused.kernels()
    if ext is None and fused.mode() != "0":
        raise SystemExit("pp_compress: the kernels could not be built (see the warning above)")
    print(f"PP_COMPRESS_KERNELS={fused.mode()}: {ext.__file__ if ext is not None else 'off'}")
    if importlib.util.find_spec("deepspeed") is not None:
        from .integrations.deepspeed import prebuild

        print(f"DeepSpeed's ops: {', '.join(prebuild()) or 'none to build on this accelerator'}")


if __name__ == "__main__":
    main()
