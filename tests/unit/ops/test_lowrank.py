import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("method", ["power", "svd"])
def test_exact_on_low_rank_input(method):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 4, generator=g) @ torch.randn(3, 4, 48, generator=g)  # rank 4 per sample
    y, p = ppc.build(f"lowrank:4:method={method}").roundtrip(x)
    assert float((y - x).norm() / x.norm()) < 1e-4
    assert [t.shape for t in p.tensors] == [(3, 64, 4), (3, 48, 4)]


def test_svd_is_near_optimal_and_power_improves_with_warm_start():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 96, 8, generator=g) @ torch.randn(2, 8, 80, generator=g) + 0.05 * torch.randn(2, 96, 80, generator=g)
    u, s, vh = torch.linalg.svd(x)
    best = (u[:, :, :4] * s[:, None, :4]) @ vh[:, :4]
    opt = float((best - x).norm() / x.norm())
    svd = float((ppc.build("lowrank:4:method=svd:iters=2").roundtrip(x)[0] - x).norm() / x.norm())
    assert svd < opt * 1.05
    op = ppc.build("lowrank:4")
    errs = [float((op.roundtrip(x)[0] - x).norm() / x.norm()) for _ in range(10)]
    assert errs[-1] < errs[0] and errs[-1] < opt * 1.1
    assert set(op.state_dict()["warm"]) == {"b0.act.mb0"}


def test_warm_start_state_roundtrips():
    x = torch.randn(2, 16, 12)
    a = ppc.build("lowrank:2")
    a.roundtrip(x)
    b = ppc.build("lowrank:2")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.roundtrip(x)[0], b.roundtrip(x)[0])


def test_bad_rank():
    for bad in ["lowrank:0", "lowrank:x", "lowrank", "lowrank:2:method=qr"]:
        with pytest.raises(ValueError, match="lowrank"):
            ppc.build(bad)
