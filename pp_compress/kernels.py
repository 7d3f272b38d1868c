"""Prebuild the fused CPU kernels before a job, so that no rank compiles them inside its first training step:

    python -m pp_compress.kernels                          # this CPU's build (PP_COMPRESS_KERNELS=native)
    PP_COMPRESS_KERNELS=baseline python -m pp_compress.kernels   # the scalar paths, for CPUs without AVX-512

It prints where the build is (cached under a name keyed by the instruction set it uses; see pp_compress.ops.fused).
"""
from __future__ import annotations

from .ops import fused


def main() -> None:
    ext = fused.kernels()
    if ext is None and fused.mode() != "0":
        raise SystemExit("pp_compress: the kernels could not be built (see the warning above)")
    print(f"PP_COMPRESS_KERNELS={fused.mode()}: {ext.__file__ if ext is not None else 'off'}")


if __name__ == "__main__":
    main()
