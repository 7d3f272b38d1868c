"""vq:<bits>: the shipped codebooks, exact bytes, exact pivots, and less error than the uniform grid at the same bits."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops import fused, vq
from pp_compress.ops.base import layout_nbytes

LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499}  # the N(0, 1) optimum (Max 1960)


def _gauss(n: int = 1 << 16, dim: int = 1, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", vq.DIMS)
@pytest.mark.parametrize("b", list(vq.CODE_BITS))
def test_every_codebook_ships_with_its_size(dim, b):
    cb = vq.codebook(dim, b)
    assert cb.shape == (2**b, dim) and cb.dtype == torch.float32 and bool(torch.isfinite(cb).all())
    assert len(set(map(tuple, cb.tolist()))) == 2**b  # distinct points


@pytest.mark.parametrize("b", [2, 3, 4, 5])
def test_the_scalar_codebooks_are_lloyd_max(b):
    v = _gauss()
    err = float((vq.codebook(1, b)[vq.nearest(v, vq.codebook(1, b)).long()] - v).pow(2).mean())
    assert err == pytest.approx(LLOYD_MAX_MSE[b], rel=0.03)


@pytest.mark.parametrize("code_bits,dim", [(4, 2), (6, 2), (8, 4), (6, 4)])
def test_vectors_beat_scalars_at_the_same_bits_per_element(code_bits, dim):
    """The reason for dim > 1: at bits/dim per element, points packed in the plane or 4-space fit the gaussian
    better than the best scalar levels (interpolated in log-MSE between whole bit widths)."""
    v = _gauss(dim=dim)
    cb = vq.codebook(dim, code_bits)
    err = float((cb[vq.nearest(v, cb).long()] - v).pow(2).mean())
    per = code_bits / dim
    lo, hi = int(per), -(-code_bits // dim)
    scalar = LLOYD_MAX_MSE[lo] if lo == hi else (LLOYD_MAX_MSE[lo] ** (hi - per) * LLOYD_MAX_MSE[hi] ** (per - lo))
    assert err < 0.97 * scalar


@pytest.mark.parametrize("spec,code_bits", [("vq:2.5", 5), ("vq:2:dim=4", 8), ("vq:3:dim=1", 3), ("vq:1:dim=2", 2)])
def test_wire_bytes_follow_from_shape_and_config(spec, code_bits):
    op = ppc.build(spec)
    shape = (2, 12, 576)
    rows, tiles = 24, 24 * 9
    expected = -(-rows * 576 // op.config.dim * code_bits // 8) + 2 * tiles + rows * (4 + 2)  # bf16 scales, pivots
    assert op.compress(torch.randn(shape)).nbytes == expected == layout_nbytes(op.layout(shape, torch.float32))


def test_pivots_travel_exactly():
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(0))
    x[3, 17] = 26600.0
    y = ppc.build("vq:2:pivots=1").roundtrip(x)[0]
    assert float(y[3, 17]) == 26600.0


def test_less_error_than_the_tile_grid_at_the_same_bits_on_outlier_rows():
    """Rows like SmolLM2's (a sink value, an outlier channel): after the same pivots and rotation, the gaussian
    codebook beats the uniform absmax grid at the same bits per element, and at half a bit fewer."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g)
    x[0, 17] = 26600.0
    x[:, 100] *= 50

    def rel(spec: str) -> float:
        return float((ppc.build(spec).roundtrip(x)[0] - x).norm() / x.norm())

    assert rel("vq:3:dim=1") < 0.9 * rel("tile:3:lo=3:hi=3")
    assert rel("vq:2.5") < rel("tile:3:lo=3:hi=3")
    assert rel("vq:2:dim=4") < 0.6 * rel("tile:2:lo=2:hi=2")


def test_the_receiver_decodes_what_the_sender_meant_on_any_context():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    op = ppc.build("vq:2.5")
    ctx = ppc.Context(step=5, boundary=1)
    p = op.compress(x, ctx)
    assert torch.equal(op.decompress(p, ctx), op.decompress(p, ppc.Context(step=5, boundary=1)))
    assert not torch.equal(op.decompress(p, ctx), op.decompress(p, ppc.Context(step=6, boundary=1)))  # signs differ


@pytest.mark.parametrize("bad,match", [
    ("vq:2:dim=3", r"vq dim=3; accepted: 1, 2, 4"),
    ("vq:2.3", r"vq bits=2.3 with dim=2 gives 4.6-bit codes; accepted bits for dim 2: 1, 1.5, 2, 2.5, 3, 3.5, 4"),
    ("vq:1:dim=1", r"vq bits=1 with dim=1 gives 1-bit codes; accepted bits for dim 1: 2, 3, 4, 5, 6, 7, 8"),
    ("vq:2:size=48", r"vq size=48; accepted: .*power of two with rotation"),
    ("vq:2:dim=4:size=6:rot=false", r"vq size=6; accepted: an integer >= 2 that 4 divides"),
    ("vq:2:pivots=9", r"vq pivots=9; accepted: 0..8"),
])
def test_bad_specs_name_the_accepted_values(bad, match):
    with pytest.raises(ValueError, match=match):
        ppc.parse_op(bad)


def test_canonical_spec_round_trips():
    for spec in vq.VectorQuantConfig.EXAMPLES:
        cfg = ppc.parse_op(spec)
        assert isinstance(cfg, vq.VectorQuantConfig) and ppc.parse_op(str(ppc.CompressorSpec((cfg,)))) == cfg
    assert str(ppc.CompressorSpec((ppc.parse_op("vq:2.5:dim=2"),))) == "vq:2.5"


def test_values_near_the_dtype_max_are_a_named_error():
    x = torch.randn(4, 64).sign() * torch.finfo(torch.float32).max / 2  # every tile's RMS is half the max
    with pytest.raises(FloatingPointError, match=r"b1\.act: vq:2\.5 .* torch\.float32"):
        ppc.build("vq:2.5").compress(x, ppc.Context(name="b1.act"))


def _hard_vectors(cb: torch.Tensor, grid: vq.Grid) -> torch.Tensor:
    """Vectors where a search can go wrong: the points themselves, midpoints between pairs (exact ties), the grid's
    cell edges, beyond the grid, zero, and gaussian samples at three spreads."""
    g = torch.Generator().manual_seed(cb.shape[0] * cb.shape[1])
    dim = cb.shape[1]
    pairs = torch.randint(0, cb.shape[0], (2, 4096), generator=g)
    edges = grid.lo + torch.randint(0, grid.cells + 1, (4096, dim), generator=g) / grid.inv_h
    spread = torch.randn(3 * 8192, dim, generator=g) * torch.tensor([0.5, 1.0, 2.5]).repeat_interleave(8192)[:, None]
    return torch.cat([cb, (cb[pairs[0]] + cb[pairs[1]]) / 2, edges, edges * 1.5, torch.zeros(1, dim), spread])


@pytest.mark.parametrize("dim", vq.DIMS)
@pytest.mark.parametrize("b", list(vq.CODE_BITS))
def test_the_pruned_search_finds_the_exhaustive_searchs_point(dim, b):
    """The grid's candidate lists never leave out the nearest point, and both searches break ties alike (the lowest
    index): the torch form (any device) and the CPU kernel give the reference's codes bitwise."""
    cb, grid = vq.codebook(dim, b), vq.search_grid(dim, b)
    v = _hard_vectors(cb, grid)
    ref = vq.nearest(v, cb)
    assert torch.equal(vq.nearest_pruned(v, cb, grid), ref)
    assert torch.equal(fused.kernels().vq_search(v, cb, grid.candidates, grid.lo, grid.inv_h, grid.cells), ref)
    ties = (cb[:1] + cb[1:2]) / 2  # equally far from points 0 and 1 (and perhaps others): the lowest index wins
    d = vq.distances(ties[:, None, :], cb[None])[0]
    assert int(vq.nearest(ties, cb)[0]) == int((d == d.min()).nonzero()[0])


def test_the_pruned_search_measures_a_few_points_per_vector():
    """What makes it fast: a cell's candidates are a few of the codebook's points (vq:4 has 256)."""
    assert vq.search_grid(2, 8).candidates.shape[1] <= 6 and vq.search_grid(1, 8).candidates.shape[1] <= 3
