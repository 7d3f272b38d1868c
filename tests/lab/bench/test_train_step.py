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
    assert "| step ms | host ms |" in table


def test_the_overhead_interval_comes_from_rounds_resampled_in_pairs():
    base = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0, 100.2, 99.8]
    point, low, high = train_step.overhead([b * 1.05 for b in base], base)  # 5% slower in every round
    assert point == pytest.approx(0.05) and low == pytest.approx(0.05) and high == pytest.approx(0.05)
    noisy = [b * (1.05 if i % 2 else 0.95) for i, b in enumerate(base)]  # half the rounds faster, half slower
    point, low, high = train_step.overhead(noisy, base)
    assert low < point < high and low <= -0.02 and high >= 0.02
    assert train_step.overhead([1.0, 2.0], [1.0, 1.0])[1] != train_step.overhead([1.0, 2.0], [1.0, 1.0])[1]  # nan: too few


def test_none_is_required(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train_step.py", "--device", "cpu", "--spec", "int8"])
    with pytest.raises(SystemExit, match="--spec none is the reference"):
        train_step.main()


def test_each_kernel_setting_is_a_row_of_its_own_and_holds_during_its_steps(tmp_path, monkeypatch):
    from pp_compress.ops import triton_int

    seen = []
    stepper = train_step.stepper

    def watched(*args):
        step = stepper(*args)
        return lambda: (seen.append(triton_int.SIGN_TABLE_ROWS), step())

    monkeypatch.setattr(train_step, "stepper", watched)
    out = tmp_path / "ts.md"
    monkeypatch.setattr("sys.argv", ["train_step.py", "--device", "cpu", "--dtype", "fp32", "--batch", "1", "--seq",
                                     "16", "--rounds", "1", "--warmup", "0", "--layers", "24", "--spec", "none",
                                     "--spec", "int8", "--sign-table-rows", "off", "--sign-table-rows", "0",
                                     "--out", str(out)])
    train_step.main()
    table = out.read_text()
    assert "| `int8 [signs hashed]` |" in table and "| `int8 [sign table from 0 rows]` |" in table
    assert "| `none` |" in table and "| `none [" not in table  # the reference runs once, under the defaults
    assert seen == [triton_int.SIGN_TABLE_ROWS, None, 0]  # one round: none, then each setting's own step
