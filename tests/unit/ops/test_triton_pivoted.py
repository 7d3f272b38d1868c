"""The pivots-and-rotation kernels (ops/triton_pivoted.py, what `tile` runs around its integer codes) give the eager
reference's payloads and reconstructions bitwise, run by Triton's interpreter on CPU tensors (on a GPU the same
checks run compiled: tests/unit/ops/test_cuda.py)."""

import pytest
import torch

from tests.unit.ops.interpreted import (allowed_outcomes, assert_matches_reference, compiles_for_hopper,  # noqa: E402
                                        import_kernels, interpreter)  # noqa: F401 - the fixture applies here

import_kernels("_triton_pivoted_kernels")

import pp_compress as ppc  # noqa: E402
from pp_compress.ops import pivoted, triton_int, triton_pivoted  # noqa: E402

SPECS = ["tile:3.5", "tile:3:lo=2:hi=4:stoch", "tile:3.5:rot=false:pivots=0", "tile:2.5:lo=2:hi=3:size=32:pivots=2",
         "tile:4:lo=4:pivots=8", "tile:3.5:asym", "tile:3:lo=1:hi=4:size=16", "tile:8:lo=8:hi=8:stoch:scale=fp32"]
SHAPES = [(2, 3, 576), (4, 512), (3, 40), (2, 100)]


@pytest.fixture
def interpreted(monkeypatch):
    """pivoted.split and merge, and the int kernels of tile's parts (gathering and scattering their rows), take the
    device path for CPU tensors, where the interpreter runs the kernels."""
    calls = []

    def usable(like, d, size):
        calls.append(d)
        return like.numel() > 0 and triton_pivoted.supports(d, size)

    monkeypatch.setattr(triton_pivoted, "usable", usable)
    monkeypatch.setattr(triton_int, "usable", lambda like, last, bits, rot: like.numel() > 0
                        and triton_int.supports(last, bits, rot))
    return calls


def sample(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3  # shape
    x[..., 0, 5 % shape[-1]] = 400.0  # an attention-sink-like value in the first row: its pivot
    x[..., 0, 7 % shape[-1]] = -30.0  # a second outlier
    x[..., 1, :] *= 30  # a loud row
    x[..., -1, :] = 0.0  # an all-zero row: every pivot tied
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tile_through_the_device_kernels_is_the_eager_reference_bitwise(spec, dtype, interpreted):
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in SHAPES:
        assert_matches_reference(op, eager, sample(shape, dtype), ppc.Context(step=3, micro_batch=1))
    assert interpreted  # the kernels ran


@pytest.mark.parametrize("rot", [True, False])
@pytest.mark.parametrize("table,butterfly", [(False, "split"), (True, "split"), (True, "sum")])
def test_a_program_that_takes_several_rows_gives_the_same_bits(rot, table, butterfly, interpreted, monkeypatch):
    """Several rows per program (the rotation's signs computed once for them, or read from the message's table, and
    its butterfly spelled either way), the last program's rows partly past the end: the eager reference's tiles, pivots
    and rows still."""
    monkeypatch.setattr(triton_pivoted, "rows_per_program", lambda rows, rot: 3)
    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 0 if table else None)
    monkeypatch.setattr(triton_int, "BUTTERFLY", butterfly)
    ctx = ppc.Context(step=1)
    for shape in [(2, 3, 576), (4, 512), (2, 100)]:  # 6, 4 and 2 rows: whole and part programs
        x = sample(shape, torch.bfloat16)
        dm = pivoted.dims(shape, 64, 2, "t", "tile")
        want = pivoted.split(x, dm, 64, rot, ctx, "tile-rot", fused=False)
        got = pivoted.split(x, dm, 64, rot, ctx, "tile-rot", fused=True)
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        back = [pivoted.merge(got[0], got[1], dm, shape, x.dtype, rot, ctx, "tile-rot", fused) for fused in (True, False)]
        assert torch.equal(*back)


@pytest.mark.parametrize("bad", [[3], [3, 9]])
def test_under_nonfinite_allow_the_device_path_does_what_the_reference_does(bad, interpreted):
    """A lone NaN in a row is its pivot and travels exactly; a second one spreads over its tile through the rotation
    and makes the tile's scale NaN, which the scale check refuses, on both paths alike."""
    x = sample((4, 128), torch.float32)
    x[1, bad] = float("nan")
    outcomes = allowed_outcomes(("tile:3.5:kernel=eager", "tile:3.5"), x)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:2] == (("ok", [[1, 3]]) if len(bad) == 1 else ("raised", outcomes[0][1]))


@pytest.mark.parametrize("bits,rot,stoch", [(8, 0, False), (4, 0, True), (3, 64, False)])
def test_the_int_kernels_gather_and_scatter_rows_as_indexing_does(bits, rot, stoch):
    """sym_encode of x's rows `rows` is sym_encode of x[rows]; sym_decode into out[rows] is that assignment."""
    x = sample((10, 64), torch.float32)
    rows = torch.tensor([7, 0, 3, 9, 2], dtype=torch.int64)
    key = 11 if stoch else None
    want = triton_int.sym_encode(x[rows], bits, torch.bfloat16, rot, 5, key)
    got = triton_int.sym_encode(x, bits, torch.bfloat16, rot, 5, key, rows=rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = torch.full((10, 64), -1.0)
    back = triton_int.sym_decode(*got, (5, 64), torch.float32, bits, rot, 5, into=(out, rows))
    assert back is out
    expected = torch.full((10, 64), -1.0)
    expected[rows] = triton_int.sym_decode(*want, (5, 64), torch.float32, bits, rot, 5)
    assert torch.equal(out, expected)


def test_which_rows_the_kernels_take():
    assert triton_pivoted.supports(576, 64) and triton_pivoted.supports(40, 64)  # one padded tile
    assert not triton_pivoted.supports(576, 48)  # tiles of 48 (rot=false): not a power of two
    assert not triton_pivoted.supports(2 * triton_pivoted.MAX_TILE, 64) and not triton_pivoted.supports(0, 64)
    assert not triton_pivoted.usable(torch.ones(2, 64), 64, 64)  # CPU tensors keep the CPU's kernels


COMPILE = """
import math
from pp_compress.ops import _triton_pivoted_kernels as K
from pp_compress.ops.triton_int import warps
from pp_compress.ops.triton_pivoted import block
from tests.unit.ops.interpreted import hopper_ptx as build

for dtype, d, size, k, rot, r in [("fp32", 2048, 64, 1, True, 4), ("bf16", 576, 64, 1, True, 1),
                                  ("fp16", 576, 16, 2, False, 1), ("bf16", 40, 64, 0, True, 1)]:
    tpr, t, logs = block(d, size)
    # the rotation's signs hashed or read from a table, its butterfly split or as sums
    for table, sums in [(False, False), (True, False), (True, True)] if rot else [(False, False)]:
        consts = {"D": d, "TPR": tpr, "T": t, "S": size, "LOGS": logs, "K": k, "ROT": rot, "INV": 1 / math.sqrt(size),
                  "R": r, "TABLE": table, "SUMS": sums}
        build(K.split, {"x_ptr": f"*{dtype}", "t_ptr": "*fp32", "vals_ptr": f"*{dtype}", "pos_ptr": "*i16",
                        "signs_ptr": "*fp32", "rkey": "i64", "rows": "i32"}, consts, warps(t, size))
        build(K.merge, {"t_ptr": "*fp32", "vals_ptr": f"*{dtype}", "pos_ptr": "*i16", "out_ptr": f"*{dtype}",
                        "signs_ptr": "*fp32", "rkey": "i64", "rows": "i32"}, consts, warps(t, size))
print("compiled")
"""


def test_the_kernels_compile_for_a_hopper_gpu_without_contractions():
    """The kernels compile for sm_90, with no fused multiply-add in their code (the rotation's IEEE roundings)."""
    compiles_for_hopper(COMPILE)
