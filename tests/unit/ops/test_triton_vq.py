"""The vq kernels (ops/triton_vq.py) give the eager reference's payloads and reconstructions bitwise, run by Triton's
interpreter on CPU tensors (on a GPU the same checks run compiled: tests/unit/ops/test_cuda.py)."""

import pytest
import torch

from tests.unit.ops.interpreted import (allowed_outcomes, assert_matches_reference, compiles_for_hopper, errors,  # noqa: E402
                                        import_kernels, interpreter)  # noqa: F401 - the fixture applies here

import_kernels("_triton_vq_kernels")

import pp_compress as ppc  # noqa: E402
from pp_compress.ops import triton_int, triton_vq, vq  # noqa: E402
from pp_compress.ops.deferred import Flag  # noqa: E402

SPECS = ["vq:4", "vq:3", "vq:2.5", "vq:2:dim=4", "vq:1.5:dim=4", "vq:3:dim=1", "vq:4:pivots=3", "vq:4:pivots=0",
         "vq:4:rot=false", "vq:2:scale=fp16", "vq:3:size=128:scale=fp32", "vq:4:size=16"]
SHAPES = [(2, 3, 576), (4, 512), (3, 40), (2, 100)]


@pytest.fixture
def interpreted(monkeypatch):
    """The operator takes the device path for CPU tensors, where the interpreter runs the kernels."""
    monkeypatch.setattr(triton_vq, "usable", lambda like, d, size, dim, bits: like.numel() > 0
                        and triton_vq.supports(d, size, dim, bits))


def sample(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3  # shape
    x[..., 0, 5 % shape[-1]] = 40.0  # an outlier channel in the first row: its pivot
    x[..., 0, 7 % shape[-1]] = -30.0  # and a second one: without rotation, a vector beyond the search's grid
    x[..., 1, :] *= 30  # a loud row
    x[..., -1, :] = 0.0  # an all-zero row: every tile's scale 0, every pivot tied
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_kernels_are_the_eager_reference_bitwise(spec, dtype, interpreted):
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    c = op.config
    checked = 0
    for shape in SHAPES:
        if not triton_vq.supports(shape[-1], c.size, c.dim, c.code_bits):
            continue
        x = sample(shape, dtype)
        assert op._on_device(x) and not eager._on_device(x)
        assert_matches_reference(op, eager, x, ppc.Context(step=3, micro_batch=1))
        checked += 1
    assert checked >= 2  # every spec meets at least two of the shapes


@pytest.mark.parametrize("spec", ["vq:4", "vq:2:dim=4", "vq:4:rot=false:pivots=3"])
def test_a_program_that_takes_several_rows_gives_the_same_bits(spec, interpreted, monkeypatch):
    """Several rows per program in prepare and decode (the rotation's signs computed once for them), the last
    program's rows partly past the end: the eager reference's bits still."""
    monkeypatch.setattr(triton_vq, "rows_per_program", lambda rows, rot: 3)
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in [(2, 3, 576), (4, 512), (2, 100)]:  # 6, 4 and 2 rows: whole and part programs
        assert_matches_reference(op, eager, sample(shape, torch.bfloat16), ppc.Context(step=3, micro_batch=1))


@pytest.mark.parametrize("spec", ["vq:4", "vq:2:dim=4"])
@pytest.mark.parametrize("rows_per_program", [1, 3])
@pytest.mark.parametrize("butterfly", ["split", "sum"])
def test_signs_read_from_a_table_and_the_butterfly_as_sums_give_the_same_bits(spec, rows_per_program, butterfly,
                                                                             interpreted, monkeypatch):
    """The rotation's signs computed once per message (triton_int's `sign_table`) and read by every program of
    prepare and decode, the butterfly spelled either way (triton_int.BUTTERFLY): the eager reference's bits still."""
    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 0)
    monkeypatch.setattr(triton_int, "BUTTERFLY", butterfly)
    monkeypatch.setattr(triton_vq, "rows_per_program", lambda rows, rot: rows_per_program)
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in [(2, 3, 576), (2, 100)]:  # a row of whole tiles, and one padded to them
        assert_matches_reference(op, eager, sample(shape, torch.bfloat16), ppc.Context(step=3, micro_batch=1))


@pytest.mark.parametrize("spec", ["vq:4:rot=false", "vq:3", "vq:2:dim=4", "vq:3:dim=1"])
def test_the_pruned_search_gives_the_exhaustive_codes(spec):
    op = ppc.build(spec)
    c = op.config
    x = sample((3, 256), torch.float32, seed=4)
    cb, flag = vq.codebook(c.dim, c.code_bits), Flag(torch.zeros(2, dtype=torch.int32), 0, FloatingPointError, str)
    grid = vq.kernel_grid(c.dim, c.code_bits, x.device)
    codes = [triton_vq.encode(x, cb, vq.max_coord(c.dim, c.code_bits), c.size, c.dim, c.code_bits, c.pivots, c.rot,
                              5, torch.bfloat16, None, flag, g)[0] for g in (grid, None)]
    assert torch.equal(*codes) and flag.buf.tolist() == [0, 0]
    if not c.rot:  # the second outlier lies beyond the grid: its block took the exhaustive search
        v = x[0, :64].clone()
        v[5] = 0
        assert float(v.abs().max() / v.square().mean().sqrt()) > -grid.lo


def test_which_rows_the_kernels_take():
    assert triton_vq.supports(576, 64, 2, 8) and triton_vq.supports(40, 64, 2, 6)  # one padded tile
    assert triton_vq.supports(576, 16, 4, 8) and not triton_vq.supports(576, 16, 4, 6)  # 4 codes per tile: no whole word
    assert not triton_vq.supports(576, 48, 2, 8)  # tiles of 48 (rot=false): not a power of two
    assert not triton_vq.supports(2 * triton_vq.MAX_TILE, 64, 2, 8) and not triton_vq.supports(0, 64, 2, 8)


def test_the_reference_scale_sums_in_the_kernels_order():
    t = torch.randn(5, 48, dtype=torch.float64)
    assert torch.allclose(vq.tree_sum(t), t.sum(1))  # zero-padded to 64
    t = torch.tensor([[1.0, 2.0**-24, -1.0, 2.0**-24]])  # (1 + -1) + (2^-24 + 2^-24); left to right gives 2^-24
    assert vq.tree_sum(t).item() == 2.0**-23


def test_pivots_take_the_lowest_position_among_equal_magnitudes():
    x = torch.zeros(2, 64)
    x[0, [9, 3, 40]] = torch.tensor([-7.0, 7.0, 7.0])
    p = ppc.build("vq:4:pivots=2:kernel=eager").compress(x)
    assert p.tensors[3].tolist() == [3, 9, 0, 1] and p.tensors[2].tolist() == [7.0, -7.0, 0.0, 0.0]


@pytest.mark.parametrize("deferred", [False, True])
def test_a_non_finite_input_is_reported_like_the_reference(deferred, interpreted):
    x = sample((4, 64), torch.float32)
    x[1, 3] = float("inf")
    want, got = errors(("vq:4:kernel=eager", "vq:4"), lambda op, ctx: op.compress(x, ctx), deferred)
    # the kernel's verdict, not a scan of x: the same error without the reference's count of bad values
    assert want.startswith(got) and "input has NaN/Inf values at step 2" in got


def test_a_scale_that_overflows_is_reported_like_the_reference(interpreted):
    x = torch.full((2, 64), 1e5)  # a tile's RMS of 1e5 overflows fp16 scales
    want, got = errors(("vq:4:scale=fp16:pivots=0:kernel=eager", "vq:4:scale=fp16:pivots=0"),
                       lambda op, ctx: op.compress(x, ctx), step=6)
    assert want.startswith(got) and "outermost point overflows" in got


@pytest.mark.parametrize("bad", [[3], [3, 9], [3, 70]])
def test_under_nonfinite_allow_the_device_path_does_what_the_reference_does(bad, interpreted):
    """A lone NaN in a row is its pivot and travels exactly; a second one in the row makes a tile's scale NaN, which
    the scale check refuses either way."""
    x = sample((4, 128), torch.float32)
    x[1, bad] = float("nan")
    outcomes = allowed_outcomes(("vq:4:kernel=eager", "vq:4"), x)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ("ok" if len(bad) == 1 else "raised")


def test_a_decoded_non_finite_value_is_reported_like_the_reference(interpreted):
    op, eager, ctx = ppc.build("vq:4"), ppc.build("vq:4:kernel=eager"), ppc.Context(step=4)
    p = op.compress(sample((4, 64), torch.float16), ctx)
    codes, scale, *pivots = p.tensors
    bad = ppc.ops.Payload((codes, scale.clone().index_fill_(0, torch.tensor([2]), float("inf")), *pivots), p.shape,
                          p.dtype)
    want, got = errors(("vq:4:kernel=eager", "vq:4"), lambda o, c: o.decompress(bad, c), step=4)
    assert want.startswith(got) and "decoded finite input to NaN/Inf at step 4" in got
    assert op.screens_output(p) and not eager.screens_output(p)


COMPILE = """
import math
from pp_compress.ops import _triton_vq_kernels as K
from pp_compress.ops import vq
from pp_compress.ops.triton_int import warps
from pp_compress.ops.triton_pivoted import block
from pp_compress.ops.triton_vq import SEARCH_BLOCK, SEARCH_WARPS
from tests.unit.ops.interpreted import hopper_ptx as build

for dtype, d, size, dim, bits, k, rot, r in [("fp32", 2048, 64, 2, 8, 1, True, 4), ("bf16", 576, 64, 2, 6, 1, True, 1),
                                             ("fp16", 576, 16, 4, 8, 2, False, 1), ("bf16", 40, 64, 1, 3, 0, True, 1),
                                             ("bf16", 2048, 64, 2, 6, 1, True, 4)]:
    tpr, t, logs = block(d, size)
    common = {"D": d, "TPR": tpr, "T": t, "S": size, "LOGS": logs}
    prep = {"x_ptr": f"*{dtype}", "v_ptr": "*fp32", "scale_ptr": "*bf16", "vals_ptr": f"*{dtype}", "pos_ptr": "*i16",
            "flag_in_ptr": "*i32", "flag_ovf_ptr": "*i32", "signs_ptr": "*fp32", "rkey": "i64", "slot_in": "i32",
            "slot_ovf": "i32", "rows": "i32"}
    # the rotation's signs hashed or read from a table, its butterfly split or as sums
    variants = [(False, False), (True, False), (True, True)] if rot else [(False, False)]
    for table, sums in variants:
        build(K.prepare, prep, {**common, "CBMAX": vq.max_coord(dim, bits), "K": k, "ROT": rot,
                                "INV": 1 / math.sqrt(size), "FLAG_IN": True, "R": r, "TABLE": table, "SUMS": sums},
              warps(t, size))
    g = vq.search_grid(dim, bits)
    search = {"v_ptr": "*fp32", "cb_ptr": "*fp32", "cand_ptr": "*u8", "codes_ptr": "*u8", "n": "i32"}
    for grid in [{"CELLS": g.cells, "KC": g.candidates.shape[1], "LO": g.lo, "INV_H": g.inv_h},
                 {"CELLS": 0, "KC": 0, "LO": 0.0, "INV_H": 0.0}]:
        build(K.search, search, {"B": SEARCH_BLOCK, "DIM": dim, "POINTS": 2**bits, "CBITS": bits, **grid}, SEARCH_WARPS)
    dec = {"codes_ptr": "*u8", "cb_ptr": "*fp32", "scale_ptr": "*bf16", "vals_ptr": f"*{dtype}", "pos_ptr": "*i16",
           "out_ptr": f"*{dtype}", "flag_ptr": "*i32", "signs_ptr": "*fp32", "rkey": "i64", "slot": "i32",
           "rows": "i32"}
    for table, sums in variants:
        build(K.decode, dec, {**common, "DIM": dim, "CBITS": bits, "K": k, "ROT": rot, "INV": 1 / math.sqrt(size),
                              "FLAG": True, "R": r, "TABLE": table, "SUMS": sums}, warps(t, size))
print("compiled")
"""


def test_the_kernels_compile_for_a_hopper_gpu_without_contractions():
    """The kernels compile for sm_90, with no fused multiply-add, approximate division or approximate square root in
    their code."""
    compiles_for_hopper(COMPILE)
