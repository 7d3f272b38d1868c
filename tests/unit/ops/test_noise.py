"""Counter-based noise (ops/noise.py): splitmix64's values, uniform, keyed by the Context, and what the fused kernel
draws in place."""
import pytest
import torch
from scipy import stats

import pp_compress as ppc
from pp_compress.ops import fused
from pp_compress.ops.noise import uniform

M64 = (1 << 64) - 1


def splitmix64_uniform(key: int, i: int) -> float:
    """The published splitmix64 step in Python integers (no wrapping tricks), top 24 bits over 2**24."""
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return ((z ^ (z >> 31)) >> 40) / 2**24


@pytest.mark.parametrize("key", [0, 1, 12345, (1 << 63) - 1])
def test_torch_int64_arithmetic_gives_splitmix64(key):
    u = uniform((7, 9), key)
    assert u.dtype == torch.float32 and u.shape == (7, 9)
    assert u.view(-1).tolist() == [splitmix64_uniform(key, i) for i in range(63)]


def test_uniform_on_zero_one():
    u = uniform((200_000,), 7).double()
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]  # neighbours are not correlated
    assert abs(float(lag)) < 0.01


def test_the_context_keys_the_stream():
    a, b = ppc.Context(step=1), ppc.Context(step=2)
    assert torch.equal(a.uniform((64,), torch.device("cpu"), "int"), a.uniform((64,), torch.device("cpu"), "int"))
    assert not torch.equal(a.uniform((64,), torch.device("cpu"), "int"), b.uniform((64,), torch.device("cpu"), "int"))
    assert not torch.equal(a.uniform((64,), torch.device("cpu"), "int"), a.uniform((64,), torch.device("cpu"), "nf"))


def test_the_fused_kernel_rounds_with_the_same_draws():
    """int<b>:stoch in the kernel (noise drawn in place) equals floor(x / s + u) with ctx.uniform's u."""
    x = torch.randn(6, 64)
    ctx = ppc.Context(step=3)
    codes, scale = fused.kernels().sym_encode(x, 8, 0, ctx.noise_key("int"))
    s = x.abs().amax(1, keepdim=True) / 127
    ref = torch.floor(x / s + ctx.uniform(x.shape, x.device, "int")).clamp(-127, 127)
    assert torch.equal(codes.view(torch.int8).view(6, 64).float(), ref)
