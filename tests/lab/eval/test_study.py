"""eval/study.py: a fresh checkout resumes the SmolLM2 study after what already landed in results/eval."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pp_lab.eval import study


def test_landed_smollm2_settings_are_not_trained_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results" / "eval" / "smollm2"
    for name, files in (("sm-base", ("summary.json", "infer_none.json")), ("sm-safe", ("summary.json",))):
        (results / name).mkdir(parents=True)
        for f in files:
            (results / name / f).write_text("{}")
    monkeypatch.setattr(study, "ROOT", tmp_path)
    monkeypatch.setattr(study, "RESULTS", tmp_path / "results" / "eval")
    assert study.landed("sm-base") and not study.landed("sm-safe")  # no uncompressed evaluation yet: not landed
    trained: list[str] = []

    def run_job(recipe: Path, nproc: int, *args: str, timeout: float) -> tuple[int, str]:
        trained.append(args[args.index("--out") + 1])
        return 1, "stopped here"  # a failed run: the study logs it and goes on to the next setting

    monkeypatch.setattr(study, "run_job", run_job)
    monkeypatch.setattr(sys, "argv", ["study.py", "--protocol", "smollm2", "--only", "sm-base,sm-safe",
                                      "--runs", str(tmp_path / "runs")])
    study.main()
    assert trained == [str(tmp_path / "runs" / "sm-safe")]
    # an hour-long run says where its progress shows before it starts
    assert f"running, its log grows in {tmp_path / 'runs' / 'sm-safe' / 'metrics.jsonl'}" in capsys.readouterr().out


def test_retrain_trains_landed_settings_again_and_keeps_their_committed_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results" / "eval" / "smollm2" / "sm-base"
    results.mkdir(parents=True)
    (results / "summary.json").write_text(json.dumps({"final_val_loss": 3.3454}))
    (results / "infer_none.json").write_text("{}")
    monkeypatch.setattr(study, "ROOT", tmp_path)
    monkeypatch.setattr(study, "RESULTS", tmp_path / "results" / "eval")

    def run_job(recipe: Path, nproc: int, *args: str, timeout: float) -> tuple[int, str]:
        out = Path(args[args.index("--out") + 1])  # training writes the run's summary, inference its own file
        if recipe.name == "infer.py":
            out.write_text("{}")
        else:
            out.mkdir(parents=True)
            (out / "summary.json").write_text(json.dumps({"final_val_loss": 3.3471}))
        return 0, ""

    monkeypatch.setattr(study, "run_job", run_job)
    monkeypatch.setattr(sys, "argv", ["study.py", "--protocol", "smollm2", "--only", "sm-base", "--retrain",
                                      "--runs", str(tmp_path / "runs")])
    study.main()
    assert (tmp_path / "runs" / "sm-base" / "infer_none.json").exists()
    assert json.loads((results / "summary.json").read_text())["final_val_loss"] == 3.3454  # the committed log stays
    assert "final validation loss 3.3471, committed 3.3454 (+0.0017)" in capsys.readouterr().out
