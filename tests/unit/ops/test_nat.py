import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("spec,dtype,bits_per_element", [
    ("nat", torch.float32, 9.0), ("nat", torch.bfloat16, 9.0), ("nat", torch.float16, 6.0), ("nat", torch.float64, 12.0),
    ("nat:bits=4", torch.float32, 4 + 16 / 1024),  # one int16 top exponent per row of 1024
    ("nat:bits=3:per=block64", torch.bfloat16, 3 + 16 / 64),
    ("nat:bits=2:per=tensor", torch.float16, 2 + 16 / (64 * 1024)),
])
def test_bits_per_element_is_sign_plus_exponent(spec, dtype, bits_per_element):
    x = torch.randn(64, 1024).to(dtype)
    p = ppc.build(spec).compress(x)
    assert p.nbytes * 8 / x.numel() == pytest.approx(bits_per_element, rel=1e-12)


@pytest.mark.parametrize("spec", ["nat", "nat:bits=5", "nat:bits=3:per=block16", "nat:bits=2"])
def test_outputs_are_signed_powers_of_two_next_to_the_input(spec):
    x = torch.randn(8, 64, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)
    y, _ = ppc.build(spec).roundtrip(x, ppc.Context(step=3))
    nz = y != 0
    assert torch.equal(y[nz].abs().log2(), y[nz].abs().log2().round())  # powers of two
    assert (torch.sign(y[nz]) == torch.sign(x[nz])).all()
    if spec == "nat":  # full range: one of the two neighbouring powers, never zero
        assert nz.all()
        a = x.abs().log2().floor()
        assert ((y.abs() == 2**a) | (y.abs() == 2 ** (a + 1))).all()


def test_powers_of_two_and_zeros_pass_exactly():
    x = torch.tensor([[1.0, -2.0, 0.25, 0.0, -0.0, 2.0**-126, 2.0**127, -(2.0**100)]])
    assert torch.equal(ppc.build("nat").roundtrip(x)[0], x)
    x = torch.tensor([[2.0**20, -2.0, 0.0, 2.0**-100, 2.0**-106]])  # bits=8: 127 powers ending at the top 2^20
    assert torch.equal(ppc.build("nat:bits=8:per=tensor").roundtrip(x)[0], x)


def _exact_var(x, bits, dim):
    """Variance of each coordinate's rounding, from the rule in ops/nat.py (x float64 and nonzero): between the two
    neighbouring powers (2^(a+1) - |x|)(|x| - 2^a); below the group's lowest power p, |x| (p - |x|)."""
    y = x.abs()
    a = y.log2().floor()
    var = (2 ** (a + 1) - y) * (y - 2**a)
    if bits:
        top = y.log2().ceil().amax(dim=dim, keepdim=True)
        p = 2 ** (top - (2 ** (bits - 1) - 2))
        var = torch.where(y < p, y * (p - y), var)
    return var


@pytest.mark.parametrize("spec,bits,dim", [("nat", 0, 1), ("nat:bits=4", 4, 1), ("nat:bits=2", 2, 1),
                                           ("nat:bits=3:per=channel", 3, 0)])
def test_unbiased(spec, bits, dim):
    """E[C(x)] = x, including values below the range of the narrow forms (rounded to 0 or the lowest power)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen, dtype=torch.float64) * torch.logspace(-2, 1, 32, dtype=torch.float64)
    op = ppc.build(spec)
    n = 4000
    mean = sum(op.roundtrip(x, ppc.Context(step=i))[0] for i in range(n)) / n
    se = (_exact_var(x, bits, dim) / n).sqrt()  # standard error of each mean
    exact = se == 0
    assert torch.equal(mean[exact], x[exact])
    z = (mean - x)[~exact] / se[~exact]
    assert float(z.abs().max()) < 5.5  # 128 entries: |z| > 5.5 has probability ~5e-6 under the normal limit
    assert abs(float(z.mean())) < 5 / z.numel() ** 0.5


def test_variance_matches_the_paper_and_stays_within_nine_eighths():
    """Var of C_nat(x) = (2^(a+1) - |x|)(|x| - 2^a) <= x^2 / 8, so E||C(x)||^2 <= 9/8 ||x||^2."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, generator=gen, dtype=torch.float64)
    op = ppc.build("nat")
    n = 2000
    draws = torch.stack([op.roundtrip(x, ppc.Context(step=i))[0] for i in range(n)])  # (n, 2, 256)
    lo = 2 ** x.abs().log2().floor()
    exact = (2 * lo - x.abs()) * (x.abs() - lo)  # (2, 256)
    assert (exact <= x**2 / 8 + 1e-15).all()
    emp = draws.var(0)
    assert float((emp.sum() - exact.sum()).abs() / exact.sum()) < 0.03
    second = float((draws**2).sum(dim=(1, 2)).mean() / (x**2).sum())
    assert 1.0 < second <= 9 / 8


def test_narrow_forms_trade_range_for_bits():
    """nat:bits=b keeps 2^(b-1) - 1 powers below each group's top; below that only 0 or the lowest power."""
    x = torch.tensor([[16.0, 3.0, 1.0, 0.3, 0.01]], dtype=torch.float64)
    y, _ = ppc.build("nat:bits=3").roundtrip(x, ppc.Context(step=5))  # powers 16, 8, 4 (and 0)
    assert set(y.abs().flatten().tolist()) <= {0.0, 4.0, 8.0, 16.0}
    assert y[0, 0] == 16.0


def test_top_binade_rounding_up_is_a_named_error_not_inf():
    x = torch.full((1, 64), 3.0e38)  # in [2^127, 2^128): rounds up to 2^128 with probability 0.76
    with pytest.raises(FloatingPointError, match="boundary3.grad"):
        ppc.build("nat").roundtrip(x, ppc.Context(name="boundary3.grad"))


def test_the_receiver_needs_no_random_numbers():
    x = torch.randn(4, 100)
    ctx = ppc.Context(step=9)
    p = ppc.build("nat:bits=4").compress(x, ctx)
    assert torch.equal(ppc.build("nat:bits=4").decompress(p, ppc.Context(step=1234)), ppc.build("nat:bits=4").decompress(p, ctx))


@pytest.mark.parametrize("bad,token", [("nat:bits=1", "bits=1"), ("nat:bits=9", "bits=9"),
                                       ("nat:per=block64", "needs bits"), ("nat:bits=4:per=col", "per='col'")])
def test_bad_specs_name_the_value(bad, token):
    with pytest.raises(ValueError, match=token):
        ppc.build(bad)
