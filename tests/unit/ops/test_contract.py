"""The operator contract, checked for every operator, dtype and a spread of shapes."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pp_compress as ppc
from pp_compress.ops.base import layout_nbytes
from pp_compress.wire import from_buffer, to_buffer
from tests.conftest import DTYPES, FEEDBACK_SPECS, OP_SPECS

SHAPES = [(4, 16, 32), (2, 3, 5), (1, 64), (7,), (3, 1, 1, 8)]


def _ctx(**kw):
    ids = torch.arange(kw.pop("batch", 1))
    return ppc.Context(sample_ids=ids, **kw)


def _refuses(spec, shape):
    """`rot` needs a block that divides the last dim: other shapes must be refused with a ValueError naming them."""
    first = ppc.CompressorSpec.parse(spec).ops[0]
    try:
        return hasattr(first, "rot_block") and first.rot != "off" and not first.rot_block(tuple(shape), "check")
    except ValueError:
        return True


def test_every_registered_operator_has_examples_that_parse_canonically():
    from pp_compress.ops import op_configs

    assert {c.NAME for c in op_configs()} >= {"identity", "int", "fp8", "topk", "randk", "lowrank"}
    for cls in op_configs():
        for spec in cls.EXAMPLES:
            cfg = ppc.parse_op(spec)
            assert type(cfg) is cls and ppc.parse_op(str(ppc.CompressorSpec((cfg,)))) == cfg, spec


@pytest.mark.parametrize("spec", OP_SPECS + FEEDBACK_SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shape_dtype_device_and_exact_bytes(spec, dtype):
    op = ppc.build(spec)
    for shape in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        ctx = _ctx(batch=shape[0])
        if _refuses(spec, shape):
            with pytest.raises(ValueError, match=r"\(2, 3, 5\)|\(7,\)|\(1, 64\)"):
                op.compress(x, ctx)
            continue
        layout = op.wire_layout(x.shape, x.dtype, ctx)
        p = op.compress(x, ctx)
        y = op.decompress(p, ctx)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
        assert p.layout == layout, (spec, shape)
        assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors) == layout_nbytes(layout)
        assert torch.isfinite(y.float()).all()


@pytest.mark.parametrize("spec", OP_SPECS)
def test_flat_buffer_roundtrip_decodes_identically(spec):
    op = ppc.build(spec)
    x = torch.randn(4, 16, 32)
    ctx = _ctx(batch=4)
    p = op.compress(x, ctx)
    buf = to_buffer(p)
    assert buf.dtype == torch.uint8 and buf.numel() == p.nbytes
    q = from_buffer(buf.clone(), op.wire_layout(x.shape, x.dtype, ctx), x.shape, x.dtype)
    assert torch.equal(op.decompress(q, ctx), op.decompress(p, ctx))


@pytest.mark.parametrize("spec", OP_SPECS)
def test_empty_tensor(spec):
    op = ppc.build(spec)
    for shape in [(0, 8, 4), (0,)]:
        x = torch.empty(shape)
        y, p = op.roundtrip(x)
        assert y.shape == x.shape and p.layout == op.wire_layout(x.shape, x.dtype)


@pytest.mark.parametrize("spec", OP_SPECS)
def test_zeros_stay_zero(spec):
    x = torch.zeros(2, 8, 16)
    y, _ = ppc.build(spec).roundtrip(x)
    assert torch.equal(y, x)


@pytest.mark.parametrize("spec", ["identity", "topk:1.0", "topk:1.0:index=index", "randk:1.0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_forms_are_bitwise(spec, dtype):
    x = torch.randn(3, 10, 12).to(dtype)
    y, _ = ppc.build(spec).roundtrip(x)
    assert torch.equal(y, x)


def test_non_float_input_is_a_type_error():
    with pytest.raises(TypeError, match="only floating-point"):
        ppc.build("int8").compress(torch.ones(4, dtype=torch.int64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_policy(bad):
    x = torch.randn(2, 8)
    x[1, 3] = bad
    ctx = ppc.Context(name="boundary3.grad")
    with pytest.raises(FloatingPointError, match="boundary3.grad"):
        ppc.build("int8").compress(x, ctx)
    y, _ = ppc.build("topk:1.0", nonfinite="allow").roundtrip(x, ctx)
    assert torch.equal(y.isnan(), x.isnan()) and torch.equal(y.isinf(), x.isinf())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_has_nonfinite_is_exact_also_when_the_sum_overflows(dtype):
    from pp_compress.ops.base import has_nonfinite

    # finite values whose sum overflows the dtype
    big = torch.full((70_000,), 60_000.0, dtype=dtype) if dtype == torch.float16 else torch.full((16,), 3e38, dtype=dtype)
    assert not bool(torch.isfinite(big.sum())) and not has_nonfinite(big)
    assert not has_nonfinite(torch.randn(3, 5).to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for x in (torch.randn(3, 5).to(dtype), big.clone()):
            x.view(-1)[7] = bad
            assert has_nonfinite(x), (dtype, bad)
    pair = torch.tensor([float("inf"), float("-inf"), 1.0], dtype=dtype)  # sums to NaN
    assert has_nonfinite(pair)


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(OP_SPECS),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    scale=st.sampled_from([1e-6, 1.0, 1e4]),
)
def test_property_any_shape_and_magnitude(spec, shape, scale):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * scale
    op = ppc.build(spec)
    ctx = _ctx(batch=shape[0])
    if _refuses(spec, shape):
        with pytest.raises(ValueError, match="rot"):
            op.roundtrip(x, ctx)
        return
    layout = op.wire_layout(x.shape, x.dtype, ctx)
    y, p = op.roundtrip(x, ctx)
    assert p.layout == layout and y.shape == x.shape
    # No operator makes the reconstruction larger than a small multiple of the input.
    assert float(y.norm()) <= 40 * float(x.norm()) + 1e-12


def test_operators_are_deterministic_given_context():
    x = torch.randn(4, 32)
    for spec in ["randk:0.1", "int4:stoch", "lowrank:2:method=svd"]:
        a = ppc.build(spec).roundtrip(x, ppc.Context(step=3))[0]
        b = ppc.build(spec).roundtrip(x, ppc.Context(step=3))[0]
        c = ppc.build(spec).roundtrip(x, ppc.Context(step=4))[0]
        assert torch.equal(a, b) and not torch.equal(a, c), spec
