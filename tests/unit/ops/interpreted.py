"""Import this package's Triton kernels under Triton's interpreter (TRITON_INTERPRET=1), for the tests that run them on
CPU tensors; skip the calling test module where this process already compiled them for a device."""
import importlib
import os
import sys

import pytest


def import_kernels(*names: str) -> None:
    """Import pp_compress.ops.<name> for each name with the interpreter on, the environment restored afterwards."""
    loaded = sys.modules.get("pp_compress.ops._triton_int_kernels")  # every kernel module imports its helpers
    if loaded is not None:
        from pp_compress.ops import triton_launch

        if not triton_launch.interpreting(loaded.encode):
            pytest.skip("the kernels were compiled for a device in this process; the interpreter cannot take them over",
                        allow_module_level=True)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, as their modules are imported
    try:
        for name in names:
            importlib.import_module(f"pp_compress.ops.{name}")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
