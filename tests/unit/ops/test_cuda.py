"""The preset operators on a CUDA device (skipped without one): payloads stay on the device and their bytes match the
layout. Per-row quantizers send the CPU reference's codes (the same IEEE divisions and roundings). Rotating codecs
(`rot`, `tile`, `vq`) are held here to reconstructing as well as on CPU; their device kernels are held bitwise to the
eager reference on the same device further down. TopK may break ties among equal magnitudes (common in bf16) the
other way: it must keep the same magnitudes. On a GPU machine: `bash benchmarks/cuda_check.sh`."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import layout_nbytes
from pp_compress.ops.deferred import Deferred, Flag
from tests.unit.ops.interpreted import assert_matches_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PRESETS = ["int8", "nf6", "int3:stoch", "nf5", "nf2:stoch", "int4:rot", "tile:3.5", "topk:0.1", "vq:4", "vq:3"]
ROTATING = ("rot", "tile", "vq")


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double().cpu()).norm() / x.double().norm())


@pytest.mark.parametrize("spec", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_presets_on_cuda(spec, dtype):
    x = torch.randn(4, 128, 576, generator=torch.Generator().manual_seed(0)).to(dtype)  # (b, s, h)
    op = ppc.build(spec)
    ctx = ppc.Context(step=1)
    p = op.compress(x.cuda(), ctx)
    assert all(t.is_cuda for t in p.tensors) and p.nbytes == layout_nbytes(op.layout(tuple(x.shape), dtype, ctx))
    y = op.decompress(p, ctx)
    assert y.is_cuda and y.dtype == dtype and y.shape == x.shape
    if "stoch" in spec:  # device random draws: nothing to compare value for value
        return
    q = op.compress(x, ctx)
    if spec.startswith("topk"):
        kept = [t.float().abs().sort(dim=1).values for t in (p.tensors[0].cpu(), q.tensors[0])]  # (groups, k) each
        assert torch.equal(*kept)
    elif any(word in spec for word in ROTATING):
        on_cpu, on_cuda = rel_error(x, op.decompress(q, ctx)), rel_error(x, y)
        assert abs(on_cuda - on_cpu) <= 0.05 * on_cpu, (on_cuda, on_cpu)
    else:
        assert all(torch.equal(a.cpu(), b) for a, b in zip(p.tensors, q.tensors))


def test_vq_pruned_search_on_cuda_is_the_exhaustive_one():
    from pp_compress.ops import vq
    v = torch.randn(1 << 16, 2, generator=torch.Generator().manual_seed(1)).cuda() * 1.5
    cb = vq.codebook(2, 8, v.device)
    assert torch.equal(vq.nearest_pruned(v, cb, vq.search_grid(2, 8, v.device)).cpu(), vq.nearest(v.cpu(), cb.cpu()))


@pytest.mark.parametrize("n", [16, 64, 256])
def test_the_rotation_by_matrix_product_on_cuda_is_the_butterfly(n):
    from pp_compress.ops import hadamard
    x = torch.randn(64, 4 * n, generator=torch.Generator().manual_seed(n)).cuda()  # (rows, last)
    d = hadamard.signs(4 * n, 1, torch.device("cuda"))  # (last,)
    for after in (False, True):
        a, b = hadamard.fwht(x, n, d, after, fused=True), hadamard.fwht(x, n, d, after, fused=False)
        assert a.is_cuda and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["int8", "safe", "aggressive", "int4:rot", "nf6", "int3:stoch", "tile:3.5",
                                  "topk:0.5:index=bitmap", "int1", "safe:table+sums", "aggressive:table+sums"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deferred_message_never_waits_for_the_device(spec, dtype, monkeypatch):
    """With the non-finite checks deferred (what every engine does on a GPU), compress + decompress of a preset makes
    no synchronizing CUDA call after warm-up: torch's sync debug mode turns any into an error. Also `tile`, `topk`'s
    bitmap and `int1`, whose paths were made free of host reads without a GPU to check them on, and the presets with
    the rotation's signs from a table at every size and its butterfly as sums (`:table+sums`: the kernel settings
    triton_int.SIGN_TABLE_ROWS = 0 and BUTTERFLY = "sum"; by default, messages this small hash their signs)."""
    from pp_compress.ops import triton_int
    from pp_compress.ops.deferred import Deferred

    if spec.endswith(":table+sums"):
        spec = spec.removesuffix(":table+sums")
        monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 0)
        monkeypatch.setattr(triton_int, "BUTTERFLY", "sum")
    deferred = Deferred()
    cfg = ppc.parse_spec(spec)
    for direction in ("act", "grad"):
        op = cfg.spec_for(0, direction).build()
        x = torch.randn(4, 128, 576, device="cuda", dtype=dtype)
        for step in range(3):
            ctx = ppc.Context(direction=direction, step=step, deferred=deferred)
            torch.cuda.set_sync_debug_mode("error" if step == 2 else 0)
            try:
                op.decompress(op.compress(x, ctx), ctx)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    deferred.raise_pending()


@pytest.mark.parametrize("mode", ["greedy", "greedy_weighted", "weighted_greedy", "stochastic"])
def test_mdtopk_learns_and_sends_without_waiting_for_the_device(mode):
    """mdtopk's sender learns from the gradient that comes back (`observe`, its water-filling in one pass): no
    synchronizing CUDA call after warm-up, a zero gradient included."""
    op = ppc.build(f"mdtopk:0.1:mode={mode}")
    for step in range(3):
        x, g = torch.randn(4, 128, 576, device="cuda"), torch.randn(4, 128, 576, device="cuda")
        ctx = ppc.Context(step=step, deferred=Deferred())
        torch.cuda.set_sync_debug_mode("error" if step == 2 else 0)
        try:
            op.decompress(op.compress(x, ctx), ctx)
            op.observe(g if step else torch.zeros_like(g), ctx)
        finally:
            torch.cuda.set_sync_debug_mode(0)


TRITON_SPECS = ["int8", "int8:rot", "int8:stoch", "int4:rot", "int3:rot:stoch", "int6", "int2:stoch:scale=fp16",
                "int4:per=block64", "int8:per=block32:stoch",
                "vq:4", "vq:3", "vq:2:dim=4", "vq:3:dim=1:pivots=2", "vq:4:rot=false:scale=fp16",
                "nf4", "nf6", "nf8:scale=fp32", "nf2:stoch", "nf5:stoch:per=block64"]


@pytest.mark.parametrize("spec", TRITON_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 128, 576), (2, 64, 2048)])
def test_the_triton_kernels_are_the_eager_reference_on_cuda(spec, dtype, shape):
    """Compiled for the device, the kernels of ops/triton_int.py, triton_vq.py and triton_nf.py give the eager
    reference's payloads and reconstructions bitwise, as the interpreter does on CPU (tests/unit/ops/test_triton_*.py)."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3).to(device="cuda", dtype=dtype)
    x[..., 0, 5] = 40.0
    op, eager = ppc.build(spec), ppc.build(f"{spec}:kernel=eager")
    ctx = ppc.Context(step=5, micro_batch=2)
    assert op.screens_output(op.compress(x, ctx))  # the device kernels decode it (and so encoded it)
    assert_matches_reference(op, eager, x, ctx)


@pytest.mark.parametrize("spec", ["int8:rot", "int3:rot:stoch", "vq:4", "vq:2:dim=4", "tile:3.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table,butterfly", [(True, "split"), (False, "sum"), (True, "sum")])
def test_the_other_kernel_settings_are_the_eager_reference_on_cuda(spec, dtype, table, butterfly, monkeypatch):
    """With the rotation's signs computed once per message (triton_int.SIGN_TABLE_ROWS) and its butterfly as sums
    (BUTTERFLY), the compiled kernels still give the eager reference's payloads and reconstructions bitwise."""
    from pp_compress.ops import triton_int

    monkeypatch.setattr(triton_int, "SIGN_TABLE_ROWS", 0 if table else None)
    monkeypatch.setattr(triton_int, "BUTTERFLY", butterfly)
    x = (torch.randn(2, 64, 2048, generator=torch.Generator().manual_seed(4)) * 3).to(device="cuda", dtype=dtype)
    x[..., 0, 5] = 40.0
    op, eager = ppc.build(spec), ppc.build(f"{spec}:kernel=eager")
    assert_matches_reference(op, eager, x, ppc.Context(step=5, micro_batch=2))


@pytest.mark.parametrize("spec", ["tile:3.5", "tile:3:lo=2:hi=4:stoch", "tile:2.5:lo=2:hi=3:size=32:pivots=2",
                                  "tile:3.5:rot=false:pivots=0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_through_the_pivot_kernels_is_the_eager_reference_on_cuda(spec, dtype):
    """Compiled for the device, ops/triton_pivoted.py's kernels (tile's pivots and rotation) give the eager reference's
    payloads and reconstructions bitwise, as the interpreter does on CPU (tests/unit/ops/test_triton_pivoted.py)."""
    from pp_compress.ops import triton_pivoted

    x = (torch.randn(4, 128, 576, generator=torch.Generator().manual_seed(3)) * 3).to(device="cuda", dtype=dtype)
    x[..., 0, 5] = 400.0
    op, eager = ppc.build(spec), ppc.build(f"{spec}:kernel=eager")
    assert triton_pivoted.usable(x, 576, op.config.size)
    assert_matches_reference(op, eager, x, ppc.Context(step=5, micro_batch=2))


def test_the_triton_kernels_take_fp16_and_report_non_finite_rows():
    from pp_compress.ops import triton_int

    x = torch.randn(8, 512, device="cuda", dtype=torch.float16)
    op, eager, ctx = ppc.build("int8:rot"), ppc.build("int8:rot:kernel=eager"), ppc.Context()
    assert all(torch.equal(a, b) for a, b in zip(op.compress(x, ctx).tensors, eager.compress(x, ctx).tensors))
    x[3, 7] = float("nan")
    flag = Flag(torch.zeros(2, dtype=torch.int32, device="cuda"), 1, FloatingPointError, lambda: "bad")
    _, scale = triton_int.sym_encode(x, 8, torch.bfloat16, 256, 3, flag=flag)
    assert (~torch.isfinite(scale)).nonzero().flatten().tolist() == [3] and flag.buf.tolist() == [0, 1]


@pytest.mark.parametrize("spec", ["int8", "int8:rot", "int3:stoch"])
def test_the_launch_cache_keeps_misaligned_tensors_and_small_keys_apart(spec):
    """Compiled kernels are reused by a key of what Triton specializes on: a view 4 bytes off 16-byte alignment and
    keys below 2**31 (i32, not i64) must get their own kernels and still give the reference's bits."""
    from pp_compress.ops import triton_int

    op, eager = ppc.build(spec), ppc.build(f"{spec}:kernel=eager")
    flat = torch.randn(4 * 512 + 1, device="cuda")
    for x in (flat[:-1].view(4, 512), flat[1:].view(4, 512)):  # aligned, then 4 bytes off
        for seed in (0, 1, 2):  # noise keys vary; some runs meet small ones below
            ctx = ppc.Context(seed=seed, step=1)
            assert op._on_device(x, 512, op.config.rot_block((4, 512), "t")) and triton_int.available()
            want, got = eager.compress(x, ctx), op.compress(x, ctx)
            assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors)), (spec, x.data_ptr() % 16, seed)
            assert torch.equal(op.decompress(got, ctx), eager.decompress(want, ctx))
    x = flat[:-1].view(4, 512)
    sent = []
    for rkey in (5, 2**40):  # one kernel taking an i32 key, then an i64 one
        codes, scale = triton_int.sym_encode(x, 8, torch.bfloat16, 512, rkey)
        y = triton_int.sym_decode(codes, scale, (4, 512), torch.float32, 8, 512, rkey)
        assert float((y - x).norm() / x.norm()) < 0.01, rkey  # each decodes with its own signs
        sent.append(codes)
    assert not torch.equal(*sent)  # and the keys reached the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_screen_kernel_finds_nan_and_inf_on_the_device(dtype):
    from pp_compress.ops import triton_int

    x = torch.randn(3 * 4096 + 5, device="cuda").to(dtype)
    flag = Flag(torch.zeros(4, dtype=torch.int32, device="cuda"), 3, FloatingPointError, lambda: "bad")
    triton_int.screen(x, flag)
    assert flag.buf.tolist() == [0, 0, 0, 0]
    x[-2] = float("inf")
    triton_int.screen(x, flag)
    assert flag.buf.tolist() == [0, 0, 0, 1]
