import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("fmt,rel", [("e4m3", 0.04), ("e5m2", 0.08)])
def test_fp8_error_and_one_byte_per_element(fmt, rel):
    x = torch.randn(8, 256) * 1000
    y, p = ppc.build(f"fp8:{fmt}").roundtrip(x)
    assert p.nbytes == x.numel() + 4
    assert float((y - x).norm() / x.norm()) < rel


def test_fp8_block_scales_follow_outliers():
    x = torch.randn(4096) * 1e-3
    x[:64] *= 1e5  # one block of outliers
    per_tensor = ppc.build("fp8").roundtrip(x)[0]
    per_block = ppc.build("fp8:per=block64").roundtrip(x)[0]
    tail = slice(64, None)
    assert (per_block[tail] - x[tail]).norm() < (per_tensor[tail] - x[tail]).norm() / 2


def test_fp8_never_saturates():
    x = torch.tensor([1e6, -3e5, 1.0])
    y = ppc.build("fp8:scale=bf16").roundtrip(x)[0]
    assert torch.isfinite(y).all() and float((y - x).abs().max() / 1e6) < 0.07
