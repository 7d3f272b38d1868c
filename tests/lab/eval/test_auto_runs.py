"""lab/pp_lab/eval/auto_runs.py: auto's quality runs judged by the loss rule, with their bits and decisions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pp_lab.eval import auto_runs, frontier
from pp_lab.eval.study import DECISIONS


def fake_run(where: Path, final: float, act_wire: float, grad_wire: float, decisions: str = "") -> None:
    where.mkdir(parents=True)
    rows = [{"kind": "train", "step": s, "act_wire_bytes": act_wire, "grad_wire_bytes": grad_wire,
             "act_raw_bytes": 1000.0, "grad_raw_bytes": 1000.0} for s in (1, 2)]
    (where / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (where / "summary.json").write_text(json.dumps({"final_val_loss": final, "steps": 40}))
    if decisions:
        (where / DECISIONS).write_text(decisions)


def test_rows_judge_by_the_loss_rule_and_count_bits_against_the_baseline(tmp_path: Path) -> None:
    long = tmp_path / frontier.TESTBEDS["long"].results
    fake_run(long / "base", 4.50, 1000, 1000)
    fake_run(long / "base-seed1", 4.53, 1000, 1000)  # seed gap 0.03: tolerance 0.06
    fake_run(long / "auto-mixed", 4.55, 250, 125, decisions=(
        "# attempt --overwrite\n"
        "step 1: pp_compress auto: boundary 1 act: link 6.9 GB/s, 0.287 ms; none: 0.344 ms per message expected\n"
        "step 21: pp_compress auto: boundary 1 act: link 0.000625 GB/s, 20.8 ms; aggressive (act=vq:4,grad=vq:3): 1 ms\n"))
    (row,) = auto_runs.rows(tmp_path)
    assert row["verdict"] == "parity" and abs(row["delta"] - 0.05) < 1e-9 and abs(row["tolerance"] - 0.06) < 1e-9
    assert row["bits"] == {"act": 8.0, "grad": 4.0}
    assert row["switches"] == {(1, "act"): [(1, "none"), (21, "aggressive")]}
    text = "\n".join(auto_runs.block(tmp_path))
    assert "| auto-mixed | small GPT |" in text and "| parity |" in text
    assert "| 1 | act | none 50%, aggressive 50% | 1 |" in text  # none for steps 1..20, aggressive for 21..40


def test_shares_and_changes_follow_the_decisions_in_step_order():
    picks = [(61, "int8"), (1, "none"), (21, "int8"), (81, "none")]  # a resumed attempt's lines come after
    assert auto_runs.shares(picks, 100) == pytest.approx({"none": 0.4, "int8": 0.6})
    assert auto_runs.changes(picks) == 2  # none -> int8 (21), int8 again (61) is no change, -> none (81)


def test_a_run_past_the_tolerance_is_worse_and_an_unfinished_one_is_not_listed(tmp_path: Path) -> None:
    long = tmp_path / frontier.TESTBEDS["long"].results
    fake_run(long / "base", 4.50, 1000, 1000)
    fake_run(long / "base-seed1", 4.50, 1000, 1000)  # tolerance at its floor, 0.02
    fake_run(long / "auto-mixed", 4.53, 1000, 1000)
    (tmp_path / "smollm2" / "sm-auto-mixed").mkdir(parents=True)  # started, no summary yet
    (row,) = auto_runs.rows(tmp_path)
    assert row["verdict"] == "worse"
    assert auto_runs.block(tmp_path / "nothing") == [
        "No `auto` quality run has finished yet (`python eval/study.py --protocol long --only auto-mixed`)."]
