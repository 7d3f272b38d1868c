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

    def run_job(recipe: Path, nproc: int, *args: str, timeout: float, env: dict[str, str] | None = None,
                log_file: Path | None = None) -> tuple[int, str]:
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

    def run_job(recipe: Path, nproc: int, *args: str, timeout: float, env: dict[str, str] | None = None,
                log_file: Path | None = None) -> tuple[int, str]:
        out = Path(args[args.index("--out") + 1])  # training writes the run's summary, inference its own file
        if recipe.name == "infer.py":
            out.write_text("{}")
        else:
            out.mkdir(parents=True, exist_ok=True)  # the study made it for the run's log
            (out / "summary.json").write_text(json.dumps({"final_val_loss": 3.3471}))
        return 0, ""

    monkeypatch.setattr(study, "run_job", run_job)
    monkeypatch.setattr(sys, "argv", ["study.py", "--protocol", "smollm2", "--only", "sm-base", "--retrain",
                                      "--runs", str(tmp_path / "runs")])
    study.main()
    assert (tmp_path / "runs" / "sm-base" / "infer_none.json").exists()
    assert json.loads((results / "summary.json").read_text())["final_val_loss"] == 3.3454  # the committed log stays
    assert "final validation loss 3.3471, committed 3.3454 (+0.0017)" in capsys.readouterr().out


def test_auto_runs_go_through_their_emulated_links_and_keep_their_decisions(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(study, "ROOT", tmp_path)
    calls: list[tuple[Path, tuple[str, ...], dict[str, str] | None]] = []
    decision = ("step 21: pp_compress auto: boundary 1 act: link 0.000625 GB/s, 20.8 ms; aggressive "
                "(act=vq:4,grad=vq:3): 112 ms per message expected against 650 ms dense (83% saved)")

    def run_job(script: Path, nproc: int, *args: str, timeout: float, env: dict[str, str] | None = None,
                log_file: Path | None = None) -> tuple[int, str]:
        calls.append((script, args, env))
        assert log_file is not None
        with open(log_file, "a") as f:  # as the job writes it
            f.write(f"[rank1]: {decision}\nsome other line\n")
        return 1, ""  # cut off: the next attempt appends its own

    monkeypatch.setattr(study, "run_job", run_job)
    monkeypatch.setattr(sys, "argv", ["study.py", "--protocol", "long", "--only", "auto-mixed", "--runs", str(tmp_path / "runs")])
    study.main()
    study.main()
    script, args, env = calls[0]
    assert script == study.THROTTLE and args[0].endswith("recipes/pretrain.py")
    assert args[args.index("--pp-compress") + 1] == "auto:max=aggressive:model=small-gpt"
    assert env == {"PPC_BENCH_LINKS": study.AUTO_LONG["auto-mixed"][1], "PPC_BENCH_P2P": "deepspeed"}
    log = (tmp_path / "runs" / "auto-mixed" / study.DECISIONS).read_text().splitlines()
    assert log == [f"# links {study.AUTO_LONG['auto-mixed'][1]}", "# attempt 1", decision, "# attempt 2", decision]
    assert (tmp_path / "runs" / "auto-mixed" / study.TRAIN_LOG).read_text().count(study.ATTEMPT) == 2


def test_every_auto_run_is_in_its_protocols_order_once() -> None:
    for protocol, runs in (("long", study.AUTO_LONG), ("smollm2", study.AUTO_SMOLLM2),
                           ("megatron", study.AUTO_MEGATRON)):
        order = study.PROTOCOLS[protocol][0]
        assert all(order.count(name) == 1 for name in runs)


def _flag(args: list[str], name: str) -> str | None:
    """The last value given to `name` (the recipe's argparse keeps the last one)."""
    at = [i for i, a in enumerate(args) if a == name]
    return args[at[-1] + 1] if at else None


def test_every_bottleneck_row_runs_once_with_its_variant():
    order, _ = study.PROTOCOLS["smollm2"]
    rows = [n for n in order if n.startswith("sm-bn")]
    assert len(rows) == len(set(rows)) == len(study.BOTTLENECK_ORDER)
    for name in rows:
        recipe, nproc, args, spec = study.job(name, "smollm2")
        assert recipe == "finetune.py" and nproc == 4 and spec == study.SMOLLM2[name]
        k = int(name.split("-")[1][2:])
        assert _flag(args, "--bottleneck") == str(k) and _flag(args, "--bottleneck-group") == str(576 // k)
        calib384 = any(f"-{v}-" in name for v in ("calib384", "tokens"))
        assert _flag(args, "--bottleneck-calib") == ("384" if calib384 else "24")
        assert ("--bottleneck-tokens" in args) == ("-tokens-" in name)
        assert ("--bottleneck-frozen" in args) == ("-frozen-" in name)
        assert _flag(args, "--steps") == ("600" if "-long-" in name else "200")
        assert "--eval-at-start" in args
    assert "sm-bn288-tokens-long-vq4" in rows  # a token table, 384 sequences, 600 steps


def test_the_from_scratch_bottleneck_rows_train_the_small_gpt_with_a_random_init():
    order, _ = study.PROTOCOLS["long"]
    rows = [n for n in order if n.startswith("bn")]
    assert len(rows) == len(set(rows)) == len(study.LONG_BOTTLENECK) > 0
    for name, seed in (("muon-base", "0"), ("muon-base-seed1", "1")):  # Muon's own baseline and its second seed
        muon = study.job(name, "long")
        assert muon[3] == "none" and _flag(muon[2], "--optimizer") == "muon" and _flag(muon[2], "--bottleneck") is None
        assert _flag(muon[2], "--seed") == seed
    for name in rows:
        recipe, nproc, args, spec = study.job(name, "long")
        assert recipe == "pretrain.py" and nproc == 4 and spec == study.LONG[name]
        k = int(name.split("-")[0][2:])
        assert _flag(args, "--model") == "small" and _flag(args, "--steps") == "1000"
        group = int(_flag(args, "--bottleneck-group"))  # d / k tokens a row, or the most that divide seq 128
        assert _flag(args, "--bottleneck") == str(k) and 128 % group == 0 and group <= 192 // k
        assert group == 192 // k or 128 % (192 // k)
        assert _flag(args, "--bottleneck-init") is None  # pretrain.py's default from scratch: random orthonormal
        assert ("--bottleneck-tokens" in args) == ("-tokens-" in name)
        assert ("--bottleneck-frozen" in args) == ("-frozen-" in name)
        assert _flag(args, "--bottleneck-lr-scale") == ("0.1" if "-lr01-" in name else None)
        assert _flag(args, "--bottleneck-residual") == ("192" if "-res-" in name else None)
        assert _flag(args, "--optimizer") == ("muon" if "-muon-" in name else None)
        sink0 = "-sink0-" in name  # no token in full; else the first one, through the codec as the code
        assert (_flag(args, "--bottleneck-sink") == "0") == sink0 and spec.endswith(",min_numel=0") != sink0
    assert study.job("bn48-sink0-int8", "long")[3] == study.LONG["subspace48-int8"] == "int8"  # its control's codec
    assert "bn48-tokens-sink0-int8" in rows and "bn12-vq4" in rows and "bn96-res-vq4" in rows
    alone, runs = study.PROTOCOLS["long-bottleneck"]
    assert [n for n in alone if n.startswith("bn")] == rows and runs == study.PROTOCOLS["long"][1]
    for name, optimizer in (("muon-vq1.5", "muon"), ("vq1.5", None)):  # the codec alone at the bottleneck's bytes
        assert name in alone
        _, _, args, spec = study.job(name, "long")
        assert spec == "vq:1.5" and _flag(args, "--optimizer") == optimizer and _flag(args, "--bottleneck") is None
    assert alone.index("muon-base") < alone.index("bn96-frozen-muon-vq4")  # the baseline its rows are measured by
    assert all(study.job(n, "long-bottleneck") == study.job(n, "long") for n in rows)
