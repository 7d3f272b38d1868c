import math

import pytest
import torch
from scipy.linalg import hadamard as dense_hadamard

from pp_compress.ops import hadamard


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_fwht_equals_the_dense_orthonormal_hadamard(n):
    x = torch.randn(3, 5, 2 * n, dtype=torch.float64).float()
    h = torch.tensor(dense_hadamard(n), dtype=torch.float64) / math.sqrt(n)
    ref = (x.double().reshape(-1, n) @ h).reshape(x.shape)
    assert torch.allclose(hadamard.fwht(x, n).double(), ref, atol=1e-5)


@pytest.mark.parametrize("n,last", [(64, 192), (256, 1024), (8, 24)])
def test_the_chunked_cpu_path_matches_one_shot_and_inverts_exactly(n, last, monkeypatch):
    """More rows than one chunk: the signs must line up with each row in every chunk."""
    x = torch.randn(700, last, generator=torch.Generator().manual_seed(0))
    y = hadamard.rotate(x, n, 5)
    assert x.numel() > 2 * hadamard._CHUNK // 4 or n == 8
    monkeypatch.setattr(hadamard, "_CHUNK", 1 << 40)  # one shot
    assert torch.allclose(hadamard.rotate(x, n, 5), y, atol=1e-6)
    monkeypatch.setattr(hadamard, "_CHUNK", 3 * last)  # tiny chunks, several rows each
    assert torch.allclose(hadamard.rotate(x, n, 5), y, atol=1e-6)
    assert torch.allclose(hadamard.unrotate(y, n, 5), x, atol=1e-5)
    # orthogonal: norms of every block survive
    assert torch.allclose(y.reshape(-1, n).norm(dim=1), x.reshape(-1, n).norm(dim=1), rtol=1e-5)


def test_rotation_spreads_an_outlier_channel_over_its_block():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x[:, 7] = 100.0
    y = hadamard.rotate(x, 256, 0)
    assert float(x.abs().amax(1).mean() / x.pow(2).mean(1).sqrt().mean()) > 15  # absmax / rms: the outlier
    assert float(y.abs().amax(1).mean() / y.pow(2).mean(1).sqrt().mean()) < 4  # a gaussian-like row


def test_block_choice_and_errors():
    assert [hadamard.auto_block(d) for d in (192, 576, 768, 4096, 6, 7)] == [64, 64, 256, 256, 2, 1]
    hadamard.check_block(64, (2, 192), "b0.act")
    with pytest.raises(ValueError, match=r"b0\.act.*block 128.*\(2, 192\).*accepted for this shape: 2, 4, 8, 16, 32, 64"):
        hadamard.check_block(128, (2, 192), "b0.act")
    with pytest.raises(ValueError, match="odd last dim"):
        hadamard.check_block(1, (3, 5), "b0.act")


@pytest.mark.parametrize("n", [8, 16, 32, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_fused_kernel_is_bitwise_the_eager_butterfly(n, dtype):
    # in registers up to 256, in an L1 buffer beyond; signs before (rotate) or after (unrotate); fp32 or x's dtype out
    for last in (n, 3 * n):
        x = (torch.randn(37, last, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
        x[0, 1] = 1e30 if dtype != torch.float16 else 6e4
        d = hadamard.signs(last, 1, x.device)
        for signs, after in ((d, False), (d, True), (None, False)):
            for out in (torch.float32, dtype):
                a = hadamard.fwht(x, n, signs, after, out, fused=True)
                b = hadamard.fwht(x, n, signs, after, out, fused=False)
                assert a.dtype == b.dtype == out and a.shape == x.shape
                assert torch.equal(a, b), (n, dtype, last, after, out)


@pytest.mark.parametrize("n", [2, 8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_accelerator_product_equals_the_butterfly_to_rounding(n, dtype):
    # the path CUDA takes (tests/unit/ops/test_cuda.py runs it there), checked here on CPU
    x = (torch.randn(37, 3 * n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    d = hadamard.signs(3 * n, 1, x.device)
    before = x.clone()
    for signs, after in ((d, False), (d, True), (None, False)):
        for out in (torch.float32, dtype):
            a = hadamard.fwht_gemm(x, n, signs, after, out)
            b = hadamard.fwht(x, n, signs, after, out, fused=False)
            assert a.dtype == out and a.shape == x.shape and torch.equal(x, before)  # x is never written
            assert torch.allclose(a.float(), b.float(), rtol=1e-2 if out != torch.float32 else 1e-5, atol=1e-5)
    y = hadamard.fwht_gemm(x, n, d)
    assert torch.allclose(hadamard.fwht_gemm(y, n, d, after=True), x.float(), rtol=1e-5, atol=1e-4)  # its own inverse


def test_the_signs_are_counter_based_and_balanced():
    """Position i's sign is a function of (key, i) alone: the same on every device, and a prefix of a longer draw."""
    d = hadamard.signs(4096, 7, torch.device("cpu"))
    assert set(d.unique().tolist()) == {-1.0, 1.0} and abs(float(d.mean())) < 0.05
    assert torch.equal(hadamard.signs(100, 7, torch.device("cpu")), d[:100])
    assert not torch.equal(hadamard.signs(4096, 8, torch.device("cpu")), d)


@pytest.mark.parametrize("key", [0, 7, 12345678901234567, 2**63 - 1])
def test_the_compiled_signs_are_the_torch_reference_bitwise(key):
    from pp_compress.ops import fused, noise

    if fused.kernels() is None:
        pytest.skip("the fused CPU kernels are not built here (PP_COMPRESS_KERNELS=0)")
    for n in (0, 1, 576, 4096):
        got = hadamard.signs(n, key, torch.device("cpu"))
        assert got.dtype == torch.float32 and torch.equal(got, noise.signs(n, key, "cpu")), (n, key)
        assert torch.equal(hadamard.signs(n, key, torch.device("cpu"), fused=False), got)
