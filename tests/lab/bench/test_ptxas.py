"""benchmarks/ptxas.py: the operators' device kernels, recorded from their own launch code and compiled for sm_90
without a GPU; a kernel that spills is seen, and the preset kernels do not spill."""
from __future__ import annotations

import importlib.util

import pytest

from tests.unit.ops.interpreted import compiles_for_hopper

# Not imported here: Triton decides at import whether its own library functions run under the interpreter, and the
# interpreter tests (tests/unit/ops/test_triton_*.py) need them to.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SCRIPT = """
import importlib.util, pathlib, tempfile
import torch
from pp_lab.bench.ptxas import launches_of, ptxas_path, resources

ptxas = ptxas_path()
src = pathlib.Path(tempfile.mkdtemp()) / "centre.py"  # Triton reads a kernel's source from its file
src.write_text('''import triton
import triton.language as tl

@triton.jit
def centre(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)  # (N,) live across the sum: N / 32 values per thread of one warp
    tl.store(y_ptr + i, x - tl.sum(x, axis=0))
''')
spec = importlib.util.spec_from_file_location("centre", src)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
centre = module.centre

sig = {"x_ptr": "*fp32", "y_ptr": "*fp32"}
fits, spills = (resources(centre, sig, {"N": n}, 1, ptxas) for n in (1024, 16384))
assert fits["spill_stores"] == fits["spill_loads"] == 0, fits
assert spills["spill_stores"] > 0 and spills["spill_loads"] > 0, spills

found = launches_of("vq:4", (2, 2048), torch.float32)
assert [(side, k.__name__) for side, k, *_ in found] == [("encode", "prepare"), ("encode", "search"), ("decode", "decode")]
side, kernel, sig, const, warps = found[0]
assert sig["x_ptr"] == "*fp32" and sig["rkey"] in ("i32", "i64") and const["D"] == 2048 and const["K"] == 1 and const["ROT"]
assert fits["instructions"] > 0 and fits["shuffles"] > 0, fits  # a one-warp sum: shuffles
for spec, shape, dtype in (("vq:4", (8, 1024, 2048), torch.float32), ("int8:rot", (16, 576), torch.bfloat16)):
    for side, kernel, sig, const, warps in launches_of(spec, shape, dtype):
        r = resources(kernel, sig, const, warps, ptxas)
        assert r["spill_stores"] == r["spill_loads"] == 0, (spec, shape, dtype, kernel.__name__, r)

# the sign table: one more launch per side, and a decoder with fewer instructions per thread
from pp_compress.ops import triton_int
triton_int.SIGN_TABLE_ROWS = None  # every program hashes (by default a message this size reads the table)
decoders = [launch[1:] for launch in launches_of("int8:rot", (8192, 2048), torch.float32) if launch[0] == "decode"]
hashed = resources(*decoders[0], ptxas)
triton_int.SIGN_TABLE_ROWS = 0
found = launches_of("int8:rot", (8192, 2048), torch.float32)
assert [(side, k.__name__) for side, k, *_ in found] == [("encode", "sign_table"), ("encode", "encode"),
                                                         ("decode", "sign_table"), ("decode", "decode")]
table = resources(*found[3][1:], ptxas)
assert table["instructions"] < hashed["instructions"], (table, hashed)
print("compiled")
"""


def test_spills_are_seen_and_the_preset_kernels_have_none() -> None:
    compiles_for_hopper(SCRIPT)
