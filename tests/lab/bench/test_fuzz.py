"""benchmarks/fuzz.py: malformed messages of every registered operator are rejected by name or decode finite."""
import random

import torch

from pp_compress.ops import TensorSpec
from pp_lab.bench import fuzz


def test_every_operator_rejects_or_decodes_finite_what_a_peer_sends_malformed(tmp_path, monkeypatch):
    out = tmp_path / "fuzz.md"
    monkeypatch.setattr("sys.argv", ["fuzz.py", "--buffers", "24", "--per-op", "1", "--out", str(out)])
    fuzz.main()  # raises SystemExit when any outcome is wrong
    table = out.read_text()
    assert "| `vq:4` |" in table and "| `int8:rot` |" in table and "Wrong outcomes" not in table


def test_each_kind_of_malformation_changes_the_message_where_it_says():
    good = torch.arange(64, dtype=torch.uint8)
    layout = [TensorSpec((16,), torch.uint8), TensorSpec((12,), torch.float32)]
    rng = random.Random(0)
    for _ in range(20):
        bad = fuzz.malformed("fields", good, layout, rng)
        assert bad.numel() == good.numel() and not torch.equal(bad, good)
        flips = fuzz.malformed("flips", good, layout, rng)
        assert 1 <= int((flips != good).sum()) <= 8

