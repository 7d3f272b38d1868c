"""tile:<avg>: exact bytes of the tile allocation, the allocation's round trip, exact pivots, unbiased `stoch`."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import layout_nbytes
from pp_compress.ops.tile import TileQuantConfig


def _sinky(rows: int = 24, d: int = 576, seed: int = 0) -> torch.Tensor:
    """A residual stream like SmolLM2's: one attention-sink value ~1000x the rest, one outlier channel ~50x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g)
    x[0, 17] = 26600.0
    x[:, 100] *= 50
    return x


@pytest.mark.parametrize("spec,hi_share", [("tile:3.5", 0.5), ("tile:3:lo=2:hi=4", 0.5), ("tile:3.25", 0.25),
                                            ("tile:4:lo=4", 1.0), ("tile:3:lo=3:hi=3", 1.0), ("tile:3", 0.0)])
def test_wire_bytes_follow_from_shape_and_config(spec, hi_share):
    op = ppc.build(spec)
    c = op.config
    shape = (2, 12, 576)
    rows, tiles = 24, 24 * 9
    n_hi = round(tiles * hi_share)
    n_lo = tiles - n_hi
    bitmap = -(-tiles // 8) if 0 < n_hi < tiles else 0
    codes = -(-n_hi * 64 * c.hi // 8) + -(-n_lo * 64 * c.lo // 8)
    expected = bitmap + codes + 2 * tiles + rows * (4 + 2)  # bf16 scale per tile; fp32 pivot + int16 position per row
    p = op.compress(torch.randn(shape))
    assert p.nbytes == expected == layout_nbytes(op.layout(shape, torch.float32))


def test_the_allocation_travels_and_gives_the_widest_tiles_the_high_bits():
    x = _sinky()
    op = ppc.build("tile:3.5:rot=false:pivots=0")
    p = op.compress(x)
    high = torch.tensor([(p.tensors[0][i // 8] >> (i % 8)) & 1 for i in range(24 * 9)], dtype=torch.bool)
    spread = 2 * x.reshape(-1, 64).abs().amax(dim=1)  # (tiles,)
    assert int(high.sum()) == 108 and float(spread[high].min()) >= float(spread[~high].max())
    y = op.decompress(p)
    err = (y - x).reshape(-1, 64).abs().amax(dim=1)  # (tiles,) a tile's error is at most half its step
    step = spread / torch.where(high, 14.0, 6.0) * 1.02  # symmetric: levels -L..L, L = 7 or 3; bf16 scale rounded up
    assert bool((err <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_of_equal_spread_get_the_high_bits_by_position(dtype):
    """Ties between tiles' ranges (frequent in bf16) go to the earlier tile, on every device and path: a device kernel's
    payload can then be compared with the eager reference's bitwise, and tile choice never depends on topk's
    implementation."""
    x = torch.ones(6, 128, dtype=dtype)  # 12 tiles of 64, all of the same range
    x[4, :64] = 3.0  # the 9th tile is the widest
    p = ppc.build("tile:3.5:rot=false:pivots=0").compress(x)
    high = [bool((p.tensors[0][i // 8] >> (i % 8)) & 1) for i in range(12)]
    assert high == [True] * 5 + [False] * 3 + [True] + [False] * 3


def test_pivots_travel_exactly_and_free_their_tile():
    x = _sinky()
    with_pivot, without = ppc.build("tile:3.5"), ppc.build("tile:3.5:pivots=0")
    y, _ = with_pivot.roundtrip(x)
    z, _ = without.roundtrip(x)
    assert float(y[0, 17]) == 26600.0
    tile = torch.ones(64, dtype=torch.bool)  # the sink's tile, but the sink
    tile[17] = False
    assert float((y - x)[0, :64][tile].norm()) < 0.2 * float((z - x)[0, :64][tile].norm())  # no longer drowned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pivots_keep_the_input_dtype(dtype):
    x = _sinky().to(dtype) if dtype != torch.float16 else _sinky().clamp(-6e4, 6e4).to(dtype)
    p = ppc.build("tile:3.5").compress(x)
    assert p.tensors[-2].dtype == dtype and p.tensors[-1].dtype == torch.int16


def test_rotation_lowers_the_error_on_outlier_channels():
    x = _sinky()
    x[0, 17] = 1.0  # no sink: the outlier channel alone
    rot = (ppc.build("tile:3.5:pivots=0").roundtrip(x)[0] - x).norm()
    plain = (ppc.build("tile:3.5:pivots=0:rot=false").roundtrip(x)[0] - x).norm()
    assert float(rot) < float(plain)


@pytest.mark.parametrize("spec", ["tile:3.5:stoch:scale=fp32", "tile:2.5:lo=2:hi=3:stoch:asym:scale=fp32:size=16"])
def test_stochastic_rounding_is_unbiased_through_pivots_rotation_and_allocation(spec):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    x[1, 5] = 40.0  # a pivot
    x[:, 9] *= 8  # an outlier channel
    op = ppc.build(spec)
    n = 2000
    mean = sum(op.roundtrip(x, ppc.Context(step=i))[0].double() for i in range(n)) / n
    step = x.double().norm(dim=1, keepdim=True) / 1.0  # one code's error is below a row's norm over its levels
    z = (mean - x.double()) / (step / n**0.5)
    assert float(z.abs().max()) < 5
    assert float(mean[1, 5]) == 40.0


@pytest.mark.parametrize("bad,match", [("tile", "needs a value"), ("tile:5", r"outside \[lo, hi\]"),
                                       ("tile:3:lo=4:hi=3", "lo <= hi"), ("tile:3:size=48", "power of two"),
                                       ("tile:3.5:pivots=9", "0..8"), ("tile:3.5:hi=9", "1..8")])
def test_bad_specs_name_the_accepted_values(bad, match):
    with pytest.raises(ValueError, match=match):
        ppc.parse_op(bad)


def test_canonical_spec_round_trips():
    cfg = ppc.parse_op("tile:3.5:asym:stoch:rot=false")
    assert isinstance(cfg, TileQuantConfig) and ppc.parse_op(str(ppc.CompressorSpec((cfg,)))) == cfg
    assert str(ppc.CompressorSpec((ppc.parse_op("tile:3.5"),))) == "tile:3.5"
