"""The DeepSpeed shim's pure parts; the engine itself runs in tests/integration (multi-process, gloo)."""
import pytest

pytest.importorskip("deepspeed")  # the library's other tests run without it (a torch-only environment)
from pp_compress.integrations.deepspeed import partition_view  # noqa: E402


@pytest.mark.parametrize("shape,parts,rank,batch_dim,view", [
    ((8, 3, 4), 2, 1, 1, ((4, 3, 4), 1)),  # [s, b, h] split along s: whole sequence positions, batch dim kept
    ((3, 8, 4), 2, 0, 0, ((12, 4), None)),  # [b, s, h] with an odd batch: rows of h, no whole samples
    ((4, 8, 4), 2, 1, 0, ((2, 8, 4), 0)),  # [b, s, h]: whole samples
    ((5, 3, 4), 2, 0, 1, ((30,), None)),  # halves of 30: 7.5 rows of 4, so only the flat slice fits
])
def test_partition_view_keeps_the_most_structure(shape, parts, rank, batch_dim, view):
    from deepspeed.runtime.utils import partition_uniform
    numel = 1
    for s in shape:
        numel *= s
    offsets = partition_uniform(numel, parts)
    meta = [len(shape), *shape, parts, rank, *offsets]
    got = partition_view(meta, batch_dim)
    length = offsets[rank + 1] - offsets[rank]
    n = 1
    for s in got[0]:
        n *= s
    assert n == length and got == view
