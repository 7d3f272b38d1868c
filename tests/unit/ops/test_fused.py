"""The fused CPU kernels give the eager reference's codes, scales and reconstructions bitwise (every width, dtype and
shape they take), and the shapes they do not take run the reference."""
import os
import subprocess
import sys

import pytest
import torch

import pp_compress as ppc
from pp_compress.ops import fused

SPECS = ["int8", "int7", "int6", "int5", "int4", "int3", "int2", "int4:per=block64", "int8:scale=fp16",
         "int3:stoch", "int8:stoch", "int2:stoch:per=block32", "int4:rot:stoch", "tile:3:stoch",
         "int3:scale=fp32", "nf8", "nf6", "nf5", "nf4", "nf3", "nf2", "nf4:per=block32", "nf6:scale=fp16", "nf5:scale=fp32",
         "int4:rot", "tile:3.5", "int8:rot", "int8:rot:stoch", "int3:rot:per=block64", "int4:rot=8:per=block64:stoch",
         "int8:rot:per=block32", "int2:rot=8", "int6:rot:scale=fp32", "vq:4", "vq:2.5", "vq:3:dim=1", "vq:2:dim=4",
         "vq:2:dim=1:size=8"]
SHAPES = [(4, 128, 576), (3, 64), (2, 5, 16), (1, 8), (16, 40)]


def test_the_kernels_build_here():
    assert fused.kernels() is not None  # the machine this project runs on has a C++ compiler


def test_kernels_off_runs_the_reference_without_a_warning(monkeypatch, recwarn):
    monkeypatch.setenv("PP_COMPRESS_KERNELS", "0")
    x = torch.randn(4, 64)
    assert fused.kernels() is None and not fused.usable(x, 64)
    assert ppc.build("int8")._fused_size((4, 64), x) == 0
    assert torch.equal(ppc.build("int8").roundtrip(x)[0], ppc.build("int8:kernel=eager").roundtrip(x)[0])
    assert not [w for w in recwarn if "pp_compress" in str(w.message)]


def test_a_bad_kernels_setting_names_the_accepted_values(monkeypatch):
    monkeypatch.setenv("PP_COMPRESS_KERNELS", "avx")
    with pytest.raises(ValueError, match="PP_COMPRESS_KERNELS='avx'; accepted: native, baseline, asan, 0"):
        fused.kernels()


def test_a_lock_left_by_a_killed_build_stops_the_job_with_its_name_instead_of_a_wait(tmp_path, monkeypatch):
    """Not the eager reference's quiet fallback: the build did not fail, a file is in its way (tests/unit/
    test_buildlock.py has the check itself; torch 2.14 and later cannot be blocked so: its lock dies with its holder,
    and this torch's build goes ahead)."""
    from pp_compress import buildlock

    if not buildlock.waits_on_lock_file():
        monkeypatch.setattr(fused, "_STATE", {})
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        lock = buildlock.lock_path(fused.build_name(fused.FLAGS[fused.mode()]))
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        fused.kernels()  # builds (a minute) through the leftover file
        return

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(fused, "_STATE", {})
    lock = buildlock.lock_path(fused.build_name(fused.FLAGS[fused.mode()]))
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    with pytest.raises(buildlock.StaleBuildLock, match=f"rm '{lock}'"):
        fused.kernels()


def test_the_build_runs_the_ninja_beside_the_interpreter_whatever_path_says(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").touch()
    monkeypatch.setattr(sys, "executable", str(fake / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with fused.environment_ninja():
        assert os.environ["PATH"] == f"{fake}{os.pathsep}/usr/bin:/bin"
    assert os.environ["PATH"] == "/usr/bin:/bin"
    (fake / "ninja").unlink()  # none beside it: PATH as it is
    with fused.environment_ninja():
        assert os.environ["PATH"] == "/usr/bin:/bin"


def test_builds_are_keyed_by_the_instruction_set_they_use():
    native, baseline = fused.build_name(fused.FLAGS["native"]), fused.build_name(fused.FLAGS["baseline"])
    assert native != baseline and native == fused.build_name(fused.FLAGS["native"])


@pytest.mark.skipif(os.environ.get("PP_COMPRESS_KERNELS") == "baseline", reason="this run is the baseline build")
def test_the_baseline_build_is_bitwise_the_eager_reference_too():
    """The scalar paths (what a CPU without AVX-512 or BMI2 runs): this file's bitwise tests on the baseline build,
    in a process of their own (`python -m pp_compress.kernels` compiles it first, as a user would prebuild)."""
    env = {**os.environ, "PP_COMPRESS_KERNELS": "baseline"}
    built = subprocess.run([sys.executable, "-m", "pp_compress.kernels"], env=env, capture_output=True, text=True)
    assert built.returncode == 0 and "PP_COMPRESS_KERNELS=baseline: " in built.stdout, built.stderr[-2000:]
    assert fused.build_name(fused.FLAGS["baseline"]) in built.stdout
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                        "bitwise or midpoint or reference"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


@pytest.fixture
def two_threads():
    """The kernels split their groups over torch's intra-op threads (the largest shape takes two chunks with two), and
    `make test` runs one thread per worker: the bitwise tests run with two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fused_is_bitwise_the_eager_reference(spec, dtype, two_threads):
    fast, ref = ppc.build(spec), ppc.build(spec + ":kernel=eager")
    for shape in SHAPES:
        g = torch.Generator().manual_seed(len(shape))
        x = (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 10).to(dtype)
        x.view(-1)[3] = 0.0
        if x.shape[0] > 1:
            x[1] = 0  # an all-zero row: scale 0
        ctx = ppc.Context(step=2)
        p, q = fast.compress(x, ctx), ref.compress(x, ctx)
        assert [t.dtype for t in p.tensors] == [t.dtype for t in q.tensors]
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors)), (spec, shape, dtype)
        assert torch.equal(fast.decompress(p, ctx), ref.decompress(q, ctx)), (spec, shape, dtype)


@pytest.mark.parametrize("spec,shape", [("int4", (3, 5)), ("nf4:per=block64", (3, 50)), ("int8:per=channel", (4, 64)),
                                        ("nf6:stoch", (2, 64)), ("int4:asym", (2, 64)), ("int1:stoch", (2, 64))])
def test_what_the_kernels_do_not_take_runs_the_reference(spec, shape):
    op = ppc.build(spec)
    assert op._fused_size(shape, torch.empty(0)) == 0
    x = torch.randn(shape)
    assert torch.equal(op.roundtrip(x)[0], ppc.build(spec + ":kernel=eager").roundtrip(x)[0])


def test_the_fused_path_is_taken_where_it_applies():
    assert ppc.build("int8")._fused_size((4, 128, 576), torch.empty(0)) == 576
    assert ppc.build("nf6:per=block64")._fused_size((4, 128, 576), torch.empty(0)) == 64
    assert ppc.build("int8:kernel=eager")._fused_size((4, 128, 576), torch.empty(0)) == 0
    # int<b>:rot in one pass: groups and rotation blocks of which one divides the other
    assert ppc.build("int8:rot")._fused_rot_size((4, 128, 576), torch.empty(0), 64) == 576
    assert ppc.build("int4:rot=128:per=block64")._fused_rot_size((4, 128, 1024), torch.empty(0), 128) == 64
    assert ppc.build("int4:rot:per=block48")._fused_rot_size((4, 128, 576), torch.empty(0), 64) == 0
    assert ppc.build("int8:rot:kernel=eager")._fused_rot_size((4, 128, 576), torch.empty(0), 64) == 0


def test_bad_kernel_names_the_accepted_values():
    with pytest.raises(ValueError, match="kernel='cuda'; accepted: fused, eager"):
        ppc.parse_op("int8:kernel=cuda")



@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_nf_codes_at_and_beside_every_midpoint_match_the_reference(bits):
    # the binary search over midpoints in registers (up to 64 levels) and the gathers beyond: a value exactly on a
    # midpoint goes down (bucketize, right=False), one ulp above goes up
    from pp_compress.ops.nf import _table
    _, mid = _table(2**bits, torch.device("cpu"))
    row = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0)),
                     torch.tensor([1.0, -1.0])])
    row = torch.cat([row, row.new_zeros(-len(row) % 16 + 16)])  # whole rows of 16 plus a tail the scalar loop takes
    x = torch.stack([row, -row])  # (2, size): absmax 1 on both rows, so u = x exactly under an fp32 scale
    spec = f"nf{bits}:scale=fp32"
    fast, ref = ppc.build(spec), ppc.build(spec + ":kernel=eager")
    assert fast._fused_size(tuple(x.shape), x) == x.shape[1]
    assert torch.equal(fast.compress(x, ppc.Context()).tensors[0], ref.compress(x, ppc.Context()).tensors[0])


@pytest.mark.parametrize("call", ["sym_decode", "nf_decode", "rot_sym_decode"])
def test_a_decode_kernel_refuses_codes_shorter_than_its_sizes_say(call):
    """The kernels read codes from a peer: a call whose buffer is shorter than groups x size x bits is refused before
    any read (under AddressSanitizer such a read was a heap-buffer-overflow, benchmarks/sanitize.sh)."""
    k = fused.kernels()
    codes, scales, like = torch.zeros(64, dtype=torch.uint8), torch.ones(2), torch.empty(0)
    args = {"sym_decode": (codes, scales, 8, 4096, like), "nf_decode": (codes, scales, torch.ones(16), 4, 4096, like),
            "rot_sym_decode": (codes, scales, torch.ones(4096), 64, 8, 4096, like)}[call]
    with pytest.raises(RuntimeError, match=rf"{call}: 64 bytes of codes for 2 groups of 4096 codes"):
        getattr(k, call)(*args)
