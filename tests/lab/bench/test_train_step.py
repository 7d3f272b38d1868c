"""benchmarks/train_step.py: the codec's share of a training step, every spec against the uncompressed one."""
import pytest

from pp_lab.bench import train_step


def test_a_quick_run_writes_each_spec_against_none(tmp_path, monkeypatch):
    out = tmp_path / "ts.md"
    monkeypatch.setattr("sys.argv", ["train_step.py", "--device", "cpu", "--dtype", "fp32", "--batch", "1", "--seq",
                                     "16", "--rounds", "1", "--warmup", "0", "--layers", "24", "--spec", "none",
                                     "--spec", "int8", "--out", str(out)])
    train_step.main()
    table = out.read_text()
    assert "| `none` |" in table and "| `int8` |" in table and "0.25" in table  # int8's wire bytes over raw


def test_none_is_required(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train_step.py", "--device", "cpu", "--spec", "int8"])
    with pytest.raises(SystemExit, match="--spec none is the reference"):
        train_step.main()
