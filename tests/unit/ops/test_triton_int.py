"""The Triton kernels (ops/triton_int.py) give the eager reference's codes, scales and reconstructions bitwise, run by
Triton's interpreter on CPU tensors (on a GPU the same checks run compiled: tests/unit/ops/test_cuda.py)."""

import pytest
import torch

from tests.unit.ops.interpreted import (assert_matches_reference, compiles_for_hopper, errors, import_kernels,  # noqa: E402
                                        interpreter)  # noqa: F401 - the fixture applies here

import_kernels("_triton_int_kernels")

import pp_compress as ppc  # noqa: E402
from pp_compress.ops import triton_int, triton_launch  # noqa: E402
from pp_compress.ops.deferred import Deferred, Flag  # noqa: E402

SPECS = ["int8", "int8:rot", "int8:stoch", "int4", "int4:rot", "int3:rot:stoch", "int2:stoch", "int5:rot",
         "int6", "int7:rot=16", "int8:rot=2", "int8:scale=fp16", "int4:scale=fp32:rot"]
SHAPES = [(2, 3, 576), (4, 512), (3, 40), (1, 24)]


@pytest.fixture
def interpreted(monkeypatch):
    """The operators take the device path for CPU tensors, where the interpreter runs the kernels."""
    monkeypatch.setattr(triton_int, "usable", lambda like, last, bits, rot: like.numel() > 0
                        and triton_int.supports(last, bits, rot))


def sample(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3  # shape
    x[..., 0, 5 % shape[-1]] = 40.0  # an outlier channel in the first row
    x[..., -1, :] = 0.0  # an all-zero row: scale 0, codes 0
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_kernels_are_the_eager_reference_bitwise(spec, dtype, interpreted):
    eager = ppc.build(f"{spec}:kernel=eager")
    op = ppc.build(spec)
    checked = 0
    for shape in SHAPES:
        if op.config.rot not in ("off", "auto") and shape[-1] % int(op.config.rot):
            continue
        n = op.config.rot_block(shape, "test")
        if not triton_int.supports(shape[-1], op.config.bits, n):
            continue
        assert_matches_reference(op, eager, sample(shape, dtype), ppc.Context(step=3, micro_batch=1))
        checked += 1
    assert checked >= 2  # every spec meets at least two of the shapes


@pytest.mark.parametrize("spec", ["int8:per=block64", "int4:per=block32:stoch", "int3:per=block128:scale=fp16",
                                  "int6:per=block8", "int4:per=block64:rot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_block_codes_take_the_kernels_where_their_blocks_tile_the_tensor(spec, dtype, interpreted):
    """A block of the flattened tensor is a row of its own: where the blocks tile the tensor (and nothing rotates),
    the kernels take it, with the eager reference's bits; elsewhere the reference runs."""
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    block = int(op.config.per[5:])
    for shape in [(2, 3, 576), (4, 512), (3, 40), (3, 6)]:  # each block size meets shapes it tiles and one it does not
        x = sample(shape, dtype)
        if x.numel() // block > 128:  # the interpreter runs each program in Python: hundreds of them take a minute
            continue
        ctx = ppc.Context(step=3, micro_batch=1)
        assert op.screens_output(op.compress(x, ctx)) == (x.numel() % block == 0 and "rot" not in spec)
        assert_matches_reference(op, eager, x, ctx)


@pytest.mark.parametrize("spec", ["int8:rot", "int3:rot:stoch", "int4", "int8:scale=fp16"])
def test_a_program_that_takes_several_rows_gives_the_same_bits(spec, interpreted, monkeypatch):
    """Several rows per program (the rotation's signs computed once for them), the last program's rows partly past
    the end: the eager reference's bits still."""
    monkeypatch.setattr(triton_int, "rows_per_program", lambda rows, rot: 3)
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in [(2, 3, 576), (4, 512), (1, 24)]:  # 6, 4 and 1 rows: whole, part and mostly empty programs
        n = op.config.rot_block(shape, "test")
        if triton_int.supports(shape[-1], op.config.bits, n):
            assert_matches_reference(op, eager, sample(shape, torch.bfloat16), ppc.Context(step=3, micro_batch=1))


def test_rows_per_program(monkeypatch):
    monkeypatch.setattr(triton_int, "ROWS_PER_PROGRAM", 4)
    triton_int.rows_per_program.cache_clear()
    try:
        assert triton_int.rows_per_program(8 * 1024, 128) == 4  # a training tensor, rotated
        assert triton_int.rows_per_program(8 * 1024, 0) == 1  # no signs to share
        assert triton_int.rows_per_program(16, 128) == 1  # an inference message: every row its own program
    finally:
        triton_int.rows_per_program.cache_clear()


@pytest.mark.parametrize("spec", ["int8:rot", "int3:rot:stoch", "int7:rot=16", "int4:scale=fp32:rot"])
@pytest.mark.parametrize("rows_per_program", [1, 3])
@pytest.mark.parametrize("butterfly", ["split", "sum"])
def test_signs_read_from_a_table_and_the_butterfly_as_sums_give_the_same_bits(spec, rows_per_program, butterfly,
                                                                             interpreted, monkeypatch):
    """The rotation's signs computed once per message (`sign_table`) and read by every program, and the butterfly
    spelled either way (`BUTTERFLY`): the eager reference's codes, scales and outputs still, with one program per row
    and with several, signed zeros included."""
    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 0)
    monkeypatch.setattr(triton_int, "BUTTERFLY", butterfly)
    monkeypatch.setattr(triton_int, "rows_per_program", lambda rows, rot: rows_per_program)
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in [(2, 3, 576), (4, 512), (1, 48)]:
        if triton_int.supports(shape[-1], op.config.bits, op.config.rot_block(shape, "test")):
            x = sample(shape, torch.bfloat16)
            x[..., 0, :] = -0.0  # a row of negative zeros: each level's sums keep the reference's signs of zero
            assert_matches_reference(op, eager, x, ppc.Context(step=3, micro_batch=1))


@pytest.mark.parametrize("spec", ["int8:rot", "int4:rot:stoch", "int8:rot=2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_butterfly_as_sums_is_the_eager_reference_bitwise(spec, dtype, interpreted, monkeypatch):
    monkeypatch.setattr(triton_int, "BUTTERFLY", "sum")
    eager, op = ppc.build(f"{spec}:kernel=eager"), ppc.build(spec)
    for shape in [(2, 3, 576), (3, 40)]:
        if triton_int.supports(shape[-1], op.config.bits, op.config.rot_block(shape, "test")):
            assert_matches_reference(op, eager, sample(shape, dtype), ppc.Context(step=3, micro_batch=1))


def test_the_sign_table_holds_the_references_signs_and_is_made_only_where_asked(interpreted, monkeypatch):
    from pp_compress.ops import hadamard

    like = torch.empty(0)
    assert triton_int.sign_table(triton_int.SIGN_TABLE_ROWS - 1, 2048, 7, like) is None  # fewer rows: programs hash
    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", None)
    assert triton_int.sign_table(10**6, 2048, 7, like) is None  # off: every program hashes
    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 4096)
    assert triton_int.sign_table(4095, 2048, 7, like) is None
    for n in (2048, 1500, 8):  # whole and part programs of the table's kernel
        assert torch.equal(triton_int.sign_table(4096, n, 2**62 + 5, like), hadamard.signs(n, 2**62 + 5, "cpu", False))
    launched = []
    monkeypatch.setattr(triton_int, "launch", lambda kernel, *a: launched.append(kernel.__name__))
    x = torch.randn(4096, 64)
    triton_int.sym_encode(x, 8, torch.bfloat16)  # no rotation: no signs
    triton_int.sym_encode(x, 8, torch.bfloat16, rot=64, rot_key=3)
    assert launched == ["encode", "sign_table", "encode"]


def test_which_rows_the_kernels_take():
    assert triton_int.supports(576, 8, 64) and triton_int.supports(576, 4, 0) and triton_int.supports(37, 8, 0)
    assert not triton_int.supports(36, 4, 0)  # 36 codes of 4 bits: rows are not whole words of 8 codes
    assert not triton_int.supports(64, 4, 4)  # tile columns of 4: not whole words
    assert not triton_int.supports(64, 1, 0)  # int1 scales by the mean: the reference runs
    assert not triton_int.supports(triton_int.MAX_TILE * 2, 8, 0) and not triton_int.supports(0, 8, 0)
    assert triton_int.tile(576, 64) == (16, 64) and triton_int.tile(2048, 0) == (8, 256) and triton_int.tile(37, 0) == (64, 1)


def flag(slots=3, index=1):
    return Flag(torch.zeros(slots, dtype=torch.int32), index, FloatingPointError, lambda: "bad")


def test_a_non_finite_row_gets_a_non_finite_scale_and_sets_its_flag(interpreted):
    x = sample((4, 64), torch.float32)
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    f = flag()
    codes, scale = triton_int.sym_encode(x, 8, torch.bfloat16, 64, 11, None, f)
    assert torch.isfinite(scale).tolist() == [True, False, False, True] and f.buf.tolist() == [0, 1, 0]
    f = flag(index=2)
    triton_int.sym_encode(x[[0, 3]], 8, torch.bfloat16, 64, 11, None, f)
    assert f.buf.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 4096, 2 * 4096 + 3])
def test_the_screen_kernel_finds_any_nan_or_inf(dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) * 1000
    x[0] = torch.finfo(dtype).max  # the largest finite value is fine
    f = flag(index=0)
    triton_int.screen(x, f)
    assert f.buf.tolist() == [0, 0, 0]
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[-1] = bad  # in the last block, past the others
        f = flag(index=2)
        triton_int.screen(y, f)
        assert f.buf.tolist() == [0, 0, 1], (dtype, n, bad)


def test_deferred_checks_of_other_operators_take_the_screen_kernel(monkeypatch):
    monkeypatch.setattr(triton_int, "screens", lambda t: t.dtype in triton_int.EXPONENTS and t.is_contiguous())
    screened, screen = [], triton_int.screen
    monkeypatch.setattr(triton_int, "screen", lambda t, f: screened.append(t.dtype) or screen(t, f))
    op, deferred = ppc.build("bf16"), Deferred()
    x = sample((4, 64), torch.float32)
    ctx = ppc.Context(name="boundary1.act", step=2, deferred=deferred)
    op.decompress(op.compress(x, ctx), ctx)
    deferred.raise_pending()  # fine
    assert screened == [torch.float32, torch.float32]  # the sender's input, the receiver's output
    x[2, 2] = float("nan")
    op.compress(x, ctx)
    with pytest.raises(FloatingPointError, match=r"boundary1\.act: input has NaN/Inf values at step 2"):
        deferred.raise_pending()


def test_the_launch_cache_key_tells_apart_what_triton_specializes_on():
    """Two launches with one key must get one compiled kernel: the key is at least as fine as Triton's own
    specialization of the arguments (pointers: dtype and 16-byte alignment; do_not_specialize ints: their type)."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], base[2:], base.to(torch.bfloat16)[1:], base.to(torch.bfloat16)[8:],
               base.to(torch.uint8)[3:], base.to(torch.int8)]
    ints = [0, 1, 5, 16, 2**31 - 1, 2**31, 2**40, 2**63 - 1, 2**63]
    seen: dict = {}
    for t in tensors:
        ours = triton_launch.key(None, 0, 4, (t,), (), ())[4]
        assert seen.setdefault(ours, native(CUDABackend, t, False, True, True)) == native(CUDABackend, t, False, True, True)
    for v in ints:
        ours = triton_launch.key(None, 0, 4, (), (v,), ())[5]
        assert seen.setdefault(ours, native(CUDABackend, v, False, False, True)) == native(CUDABackend, v, False, False, True)
    assert len(seen) == 6 + 3  # fp32 and bf16 aligned or not, uint8 not, int8 aligned; i32, i64, u64


def test_a_non_finite_input_is_reported_like_the_reference(interpreted):
    x = sample((4, 64), torch.float32)
    x[1, 3] = float("inf")
    want, got = errors(("int8:rot:kernel=eager", "int8:rot"), lambda op, ctx: op.compress(x, ctx), step=0)
    # read off the kernel's scales, not a scan of x: the same error without the reference's count of bad values
    assert want.startswith(got) and "input has NaN/Inf values at step 0" in got


@pytest.mark.parametrize("spec", ["int8", "int4:rot"])
def test_a_decoded_non_finite_value_is_reported_like_the_reference(spec, interpreted):
    """A corrupt scale (or a reconstruction beyond the dtype's range) is caught by the decode kernel's own flag."""
    op, eager, ctx = ppc.build(spec), ppc.build(f"{spec}:kernel=eager"), ppc.Context(step=4)
    p = op.compress(sample((4, 64), torch.float16), ctx)
    bad = ppc.ops.Payload((p.tensors[0], p.tensors[1].clone().index_fill_(0, torch.tensor([2]), float("inf"))),
                          p.shape, p.dtype)
    want, got = errors((f"{spec}:kernel=eager", spec), lambda o, c: o.decompress(bad, c), step=4)
    assert want.startswith(got) and "decoded finite input to NaN/Inf at step 4" in got
    assert op.screens_output(p) and not eager.screens_output(p)


COMPILE = """
import math
from pp_compress.ops import _triton_int_kernels as K
from pp_compress.ops.triton_int import tile, warps
from tests.unit.ops.interpreted import hopper_ptx
for dtype, bits, rot, stoch, last, r in [("fp32", 8, 256, False, 2048, 4), ("bf16", 8, 128, False, 2048, 4),
                                         ("bf16", 8, 0, True, 576, 1), ("fp16", 4, 64, True, 576, 4), ("bf16", 3, 0, False, 40, 1)]:
    p, n = tile(last, rot)
    const = {"LAST": last, "P": p, "N": n, "BITS": bits, "ROT": bool(rot), "INV": 1 / math.sqrt(n), "LOGN": n.bit_length() - 1,
             "R": r}
    codes = "*i8" if bits == 8 else "*u8"
    enc = {"x_ptr": f"*{dtype}", "idx_ptr": "*i64", "codes_ptr": codes, "scale_ptr": "*bf16", "flag_ptr": "*i32",
           "signs_ptr": "*fp32", "rkey": "i64", "key": "i64", "slot": "i32", "rows": "i32"}
    dec = {"codes_ptr": codes, "scale_ptr": "*bf16", "idx_ptr": "*i64", "out_ptr": f"*{dtype}", "flag_ptr": "*i32",
           "signs_ptr": "*fp32", "rkey": "i64", "slot": "i32", "rows": "i32"}
    # tile's parts gather and scatter their rows; a rotation may read its signs from a table, and spell its
    # butterfly as sums
    for indexed, table, sums in [(False, False, False), (True, False, False)] + [(False, True, False),
                                                                                (False, True, True)] * bool(rot):
        ptx = hopper_ptx(K.encode, enc, {**const, "STOCH": stoch, "BUMP": 2.0**-7, "FLAG": True, "GATHER": indexed,
                                         "TABLE": table, "SUMS": sums}, warps(p, n))
        assert last < 576 or "ld.global.v4" in ptx, (dtype, bits)  # vector loads of x
        hopper_ptx(K.decode, dec, {**const, "FLAG": True, "SCATTER": indexed, "TABLE": table, "SUMS": sums},
                   warps(p, n))
hopper_ptx(K.sign_table, {"out_ptr": "*fp32", "rkey": "i64", "n": "i32"}, {"BLOCK": 1024}, 4)
for bits, exp in [("*i32", 0x7F800000), ("*i16", 0x7F80)]:
    hopper_ptx(K.screen, {"bits_ptr": bits, "flag_ptr": "*i32", "n": "i32", "slot": "i32"}, {"BLOCK": 4096, "EXP": exp}, 4)
print("compiled")
"""


def test_the_kernels_compile_for_a_hopper_gpu_without_contractions():
    """The kernels compile for sm_90 (what the interpreter cannot show), with no fused multiply-add and no
    approximate division in their code."""
    compiles_for_hopper(COMPILE)


@pytest.mark.parametrize("spec", ["int8", "int8:rot", "int4:rot", "int3:stoch"])
def test_malformed_messages_through_the_device_kernels_are_rejected_by_name_or_decode_finite(spec, interpreted):
    """benchmarks/fuzz.py's malformations, decoded by the device kernels (interpreted) on the receiver's path."""
    import random

    from pp_lab.bench.fuzz import KINDS, malformed, outcome

    send, recv = ppc.Codec(spec), ppc.Codec(spec)
    shape, rng = (2, 4, 64), random.Random(1)
    good, _ = send.pack(torch.randn(shape), step=3)
    layout = recv.op.wire_layout(shape, torch.float32)
    got = [outcome(recv, malformed(KINDS[i % 3], good, layout, rng), shape, torch.float32) for i in range(30)]
    assert all(g in ("rejected", "finite") for g in got), [g for g in got if g not in ("rejected", "finite")]


def test_under_nonfinite_allow_the_device_path_does_what_the_reference_does(interpreted):
    x = sample((4, 64), torch.float32)
    x[1, 3] = float("nan")
    outcomes = []
    for spec in ("int8:rot:kernel=eager", "int8:rot"):
        op = ppc.parse_spec(spec).spec_for(0, "act").build("allow")
        try:
            outcomes.append(("ok", torch.isfinite(op.decompress(op.compress(x, ppc.Context()), ppc.Context())).tolist()))
        except FloatingPointError as e:
            outcomes.append(("raised", str(e).replace(":kernel=eager", "")))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_error_sums_kernel_adds_the_squared_error_and_norm(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3 * 4096 + 7, generator=gen).to(dtype)
    y = (x.float() + 0.01 * torch.randn(x.shape, generator=gen)).to(dtype)
    acc = torch.zeros(2, dtype=torch.float64)
    triton_int.error_sums(x, y, acc)
    triton_int.error_sums(x, y, acc)  # accumulates
    want = torch.stack([((x.double() - y.double()) ** 2).sum(), (x.double() ** 2).sum()]) * 2
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=0)
