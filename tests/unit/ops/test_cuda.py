"""The preset operators on a CUDA device (skipped without one): payloads stay on the device, their bytes match the
layout, and the codes equal the CPU reference's (the same IEEE divisions and roundings). On a GPU machine:
`python -m pytest tests/unit/ops/test_cuda.py && python benchmarks/ops.py --device cuda --presets --shape 4x1024x1024`."""
import pytest
import torch

import pp_compress as ppc
from pp_compress.ops.base import layout_nbytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PRESETS = ["int8", "nf6", "int3:stoch", "nf5", "nf2:stoch", "int4:rot", "tile:3.5", "topk:0.1", "vq:4", "vq:3"]


@pytest.mark.parametrize("spec", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_presets_on_cuda(spec, dtype):
    x = torch.randn(4, 128, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    op = ppc.build(spec)
    ctx = ppc.Context(step=1)
    p = op.compress(x.cuda(), ctx)
    assert all(t.is_cuda for t in p.tensors) and p.nbytes == layout_nbytes(op.layout(tuple(x.shape), dtype, ctx))
    y = op.decompress(p, ctx)
    assert y.is_cuda and y.dtype == dtype and y.shape == x.shape
    if "stoch" not in spec and "rot" not in spec and "tile" not in spec:  # deterministic without device random draws
        q = op.compress(x, ctx)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(p.tensors, q.tensors))


def test_vq_pruned_search_on_cuda_is_the_exhaustive_one():
    from pp_compress.ops import vq
    v = torch.randn(1 << 16, 2, generator=torch.Generator().manual_seed(1)).cuda() * 1.5
    cb = vq.codebook(2, 8, v.device)
    assert torch.equal(vq.nearest_pruned(v, cb, vq.search_grid(2, 8, v.device)).cpu(), vq.nearest(v.cpu(), cb.cpu()))
