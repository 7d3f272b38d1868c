"""pp_lab.bench.bottleneck_gap: each bottleneck row's gap to the baseline along training, from committed logs."""
import json
import sys

import pytest

from pp_lab.bench import bottleneck_gap


def write(path, evals):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "train", "step": s, "loss": 9.0} for s in evals] + \
        [{"kind": "eval", "step": s, "val_loss": v} for s, v in evals.items()]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")


def test_the_table_gives_each_started_rows_gap_and_the_share_of_its_start_closed(tmp_path, monkeypatch):
    results, out = tmp_path / "smollm2", tmp_path / "gap"
    write(results / "sm-base" / "metrics.jsonl", {25: 3.5, 50: 3.4, 100: 3.3, 200: 3.2})
    write(out.with_suffix(".start.jsonl"), {0: 4.0, 1: 4.0})  # as measure_start leaves it: nothing is run again
    write(results / "sm-bn1-x" / "metrics.jsonl", {0: 4.5, 25: 3.9, 50: 3.7, 100: 3.5, 200: 3.45})
    write(results / "sm-bn2-x" / "metrics.jsonl", {0: 4.1, 25: 3.7, 200: 3.3})
    write(results / "sm-bn3-nostart" / "metrics.jsonl", {25: 3.6, 200: 3.3})
    write(results / "sm-bn4-long" / "metrics.jsonl", {0: 4.1, 200: 3.3, 600: 3.1})
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(out), "--results", str(results)])
    monkeypatch.setattr(bottleneck_gap, "ROOT", tmp_path)
    bottleneck_gap.main()
    md = out.with_suffix(".md").read_text()
    assert "| sm-bn1-x | +0.500 | +0.400 | +0.300 | +0.200 | +0.250 | 50% |" in md
    assert "| sm-bn2-x | +0.100 | +0.200 |  |  | +0.100 | 0% |" in md  # steps it did not evaluate stay empty
    assert "nostart" not in md and "long" not in md  # no step 0; another schedule
    assert "(`gap.start.jsonl`: 4.0000)" in md


def test_no_comparable_row_is_an_error(tmp_path, monkeypatch):
    results, out = tmp_path / "smollm2", tmp_path / "gap"
    write(results / "sm-base" / "metrics.jsonl", {25: 3.5, 200: 3.2})
    write(out.with_suffix(".start.jsonl"), {0: 4.0})
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(out), "--results", str(results)])
    with pytest.raises(SystemExit, match="no bottleneck row with a step-0 evaluation and 200 steps"):
        bottleneck_gap.main()


def test_the_long_protocol_compares_bottleneck_and_subspace_rows_from_scratch(tmp_path, monkeypatch):
    results, out = tmp_path / "long", tmp_path / "gap_long"
    write(results / "base" / "metrics.jsonl", {50: 6.0, 100: 5.5, 300: 5.0, 600: 4.7, 1000: 4.5})
    write(results / "bn48-int8" / "metrics.jsonl", {50: 6.2, 100: 5.7, 300: 5.2, 600: 4.9, 1000: 4.7})
    write(results / "subspace48-int8" / "metrics.jsonl", {50: 6.1, 300: 5.1, 1000: 4.6})
    write(results / "bn12-vq4" / "metrics.jsonl", {50: 6.5, 300: 5.6})  # still running: another length
    write(results / "int8" / "metrics.jsonl", {50: 6.0, 1000: 4.5})  # not a row of the bottleneck study
    monkeypatch.setattr(sys, "argv", ["x", "--protocol", "long", "--out", str(out), "--results", str(results)])
    monkeypatch.setattr(bottleneck_gap, "ROOT", tmp_path)
    bottleneck_gap.main()
    md = out.with_suffix(".md").read_text()
    assert "| bn48-int8 | +0.200 | +0.200 | +0.200 | +0.200 | +0.200 |" in md
    assert "| subspace48-int8 | +0.100 |  | +0.100 |  | +0.100 |" in md
    assert "bn12-vq4" not in md and "| int8 " not in md and "share" not in md
    assert not out.with_suffix(".start.jsonl").exists()  # nothing is evaluated from scratch
    assert "Muon" not in md  # no Muon baseline committed: no second table


def test_the_long_protocols_muon_rows_are_measured_against_the_muon_baseline_too(tmp_path, monkeypatch):
    results, out = tmp_path / "long", tmp_path / "gap_long"
    steps = (50, 100, 300, 600, 1000)
    write(results / "base" / "metrics.jsonl", dict(zip(steps, (6.0, 5.5, 5.0, 4.7, 4.5))))
    write(results / "muon-base" / "metrics.jsonl", dict(zip(steps, (5.9, 5.4, 4.9, 4.6, 4.4))))
    write(results / "bn96-muon-vq4" / "metrics.jsonl", dict(zip(steps, (6.0, 5.6, 5.0, 4.7, 4.5))))
    write(results / "bn96-vq4" / "metrics.jsonl", dict(zip(steps, (6.1, 5.6, 5.1, 4.8, 4.6))))
    write(results / "muon-vq1.5" / "metrics.jsonl", dict(zip(steps, (6.4, 5.9, 5.4, 5.1, 4.9))))  # the codec alone
    monkeypatch.setattr(sys, "argv", ["x", "--protocol", "long", "--out", str(out), "--results", str(results)])
    monkeypatch.setattr(bottleneck_gap, "ROOT", tmp_path)
    bottleneck_gap.main()
    first, muon = out.with_suffix(".md").read_text().split("Against the Muon baseline")
    assert "| muon-vq1.5 | +0.500 | +0.500 | +0.500 | +0.500 | +0.500 |" in muon and "- muon-vq1.5: never" in muon
    assert "| muon-base | -0.100 | -0.100 | -0.100 | -0.100 | -0.100 |" in first  # Muon's own gain over AdamW
    assert "| bn96-muon-vq4 | +0.000 | +0.100 | +0.000 | +0.000 | +0.000 |" in first
    assert "| bn96-muon-vq4 | +0.100 | +0.200 | +0.100 | +0.100 | +0.100 |" in muon
    assert "bn96-vq4 " not in muon and "muon-base |" not in muon
    assert "tolerance" not in muon  # no second seed yet
    assert "- muon-base: step 800" in muon and "- bn96-muon-vq4: step 1000" in muon  # AdamW's final loss, 4.5
    write(results / "muon-base-seed1" / "metrics.jsonl", dict(zip(steps, (5.9, 5.4, 4.9, 4.6, 4.45))))
    bottleneck_gap.main()
    first, muon = out.with_suffix(".md").read_text().split("Against the Muon baseline")
    assert "Its tolerance is 0.100" in muon and "| muon-base-seed1 | -0.100 |" in first
