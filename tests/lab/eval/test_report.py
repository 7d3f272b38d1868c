"""eval/report.py: RESULTS.md + plots from run logs."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from pp_lab.eval import report


def write_run(where: Path, name: str, losses: list[float], raw: float, wire: float) -> None:
    (where / name).mkdir(parents=True)
    rows = [{"kind": "train", "step": i, "tokens": 100 * i, "loss": v, "act_raw_bytes": raw, "act_wire_bytes": wire,
             "grad_raw_bytes": raw, "grad_wire_bytes": wire} for i, v in enumerate(losses, 1)]
    rows += [{"kind": "eval", "step": i, "tokens": 100 * i, "val_loss": v} for i, v in enumerate(losses, 1)]
    (where / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (where / name / "summary.json").write_text(json.dumps({"final_val_loss": losses[-1]}))


def test_results_md_from_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = tmp_path / "results"
    write_run(res, "base", [6.0, 5.0], 1000.0, 1000.0)
    write_run(res, "int8", [6.0, 5.01], 1000.0, 250.0)
    write_run(res, "not-a-setting", [1.0], 1.0, 1.0)  # ignored
    (res / "int8" / "infer_none.json").write_text(json.dumps({"val_ppl": math.exp(5.02)}))
    out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(sys, "argv", ["report.py", "--from-results", "--results", str(res), "--out", str(out)])
    report.main()
    text = out.read_text()
    assert "| int8 | `int8` | 4.00x | 0.00 | 5.010 | +0.010 | 5.020 |" in text
    assert "2 of" in text and "not-a-setting" not in text
    assert (tmp_path / "plots" / "quantization.png").stat().st_size > 0
    assert (tmp_path / "plots" / "quality_vs_bytes.png").stat().st_size > 0


def test_no_baseline_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_run(tmp_path / "results", "int8", [5.0], 1.0, 1.0)
    monkeypatch.setattr(sys, "argv", ["report.py", "--from-results", "--results", str(tmp_path / "results"),
                                      "--out", str(tmp_path / "R.md")])
    with pytest.raises(SystemExit, match="no baseline run"):
        report.main()


def test_long_study_is_the_headline_with_the_frontier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = tmp_path / "results"
    write_run(res, "base", [6.0, 5.0], 1000.0, 1000.0)  # the short study (history)
    write_run(res, "base-seed1", [6.0, 5.02], 1000.0, 1000.0)
    write_run(res / "long", "base", [6.0, 5.0, 4.0], 1000.0, 1000.0)
    write_run(res / "long", "base-seed1", [6.0, 5.0, 4.02], 1000.0, 1000.0)
    write_run(res / "long", "int8", [5.5, 4.5, 3.99], 1000.0, 250.0)  # reaches 4.0 just before its last evaluation
    write_run(res / "long", "ft-ep-base", [3.0] * 16, 1000.0, 1000.0)  # multi-epoch finetuning: 2 epochs of 8 steps
    write_run(res / "long", "ft-ep-act-int4+aqsgd", [3.01] * 16, 1000.0, 125.0)
    e2e = tmp_path / "e2e.csv"
    rows = ["mode,link,rate_mbit,latency_ms,spec,step_s"]
    for link, rate, none_s, int8_s in (("none", 0, 1.0, 1.0), ("2mbit", 2, 11.0, 3.0)):
        rows += [f"netns+tbf,{link},{rate},0,none,{none_s}", f"netns+tbf,{link},{rate},0,int8,{int8_s}"]
    e2e.write_text("\n".join(rows) + "\n")
    out = tmp_path / "RESULTS.md"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.README_START}\nold table\n{report.README_END}\nafter\n"
                      + "\n".join(report.markers("finetune-epochs")) + "\n" + "\n".join(report.markers("findings")) + "\n")
    summary = tmp_path / "SUMMARY.md"
    summary.write_text("\n".join([*report.markers("presets"), *report.markers("auto-quality")]) + "\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "--from-results", "--results", str(res), "--out", str(out), "--e2e", str(e2e),
                                      "--readme", str(readme), "--summary", str(summary)])
    report.main()
    text = out.read_text()
    block = readme.read_text()
    assert "No `auto` quality run has finished yet" in summary.read_text()  # its block, written before any run lands
    assert "old table" not in block and block.startswith("# x\n\nbefore\n") and f"{report.README_END}\nafter\n" in block
    start, end = report.markers("finetune-epochs")
    assert block.split(start, 1)[1].split(end, 1)[0].strip().startswith("| setting | --pp-compress | bits fwd / bwd, epoch 1")
    assert "| speedup 2mbit (r=10.0) |" in block and "**Headline.**" in block
    start, end = report.markers("findings")
    assert block.split(start, 1)[1].split(end, 1)[0].strip().startswith("| finding | small GPT pretraining, 120 steps | small GPT pretraining, 1,000 steps | SmolLM2-135M finetuning")
    assert text.index("## The long study") < text.index("## History: the short study")
    assert "| speedup 2mbit (r=10.0) |" in text
    steps = 2 + 0.5 / 0.51  # int8 crosses 4.0 between step 2 (4.5) and 3 (3.99)
    assert f"| 8.00 / 8.00 (8.00) | 4.00x | 3.990 | -0.010 (0.040) | parity / not run | {steps:.0f} | — | {3 * 11.0 / (steps * 3.0):.2f}x |" in text
    assert "| 1. Gradients are more sensitive than activations | not measured | not measured |" in text
    data = json.loads((res / "frontier.json").read_text())
    assert [r["name"] for r in data] == ["base", "base-seed1", "int8"]
    assert (tmp_path / "plots" / "long" / "speedup_vs_r.png").stat().st_size > 0
    assert text.index("## The long study") < text.index("### Multi-epoch finetuning") < text.index("## History")
    assert "| ft-ep-act-int4+aqsgd | `act=int4+aqsgd,grad=int8,eval=none` | 4.00 / 4.00 | 4.00 / 4.00 (4.00) |" in text
    assert [r["name"] for r in json.loads((res / "finetune_epochs.json").read_text())] == ["ft-ep-base", "ft-ep-act-int4+aqsgd"]
    assert (tmp_path / "plots" / "long" / "finetune-epochs.png").stat().st_size > 0
    assert not (tmp_path / "plots" / "long" / "quality_vs_bytes.png").exists()  # the short study's plot only


def test_readme_blocks_are_the_committed_results() -> None:
    """docs/choosing.md's presets table and docs/results.md's frontier, finetuning and findings tables are rendered from
    results/eval, never typed in."""
    rows = json.loads((report.RESULTS / "frontier.json").read_text())
    start, end = report.markers("presets")
    summary = (report.ROOT / "docs" / "choosing.md").read_text().split(start, 1)[1].split(end, 1)[0].strip()
    assert summary == "\n".join(report.presets_block(rows)).strip() and "| `safe` |" in summary
    text = (report.ROOT / "docs" / "results.md").read_text()
    block = text.split(report.README_START, 1)[1].split(report.README_END, 1)[0]
    assert block.strip() == "\n".join(report.frontier_block(report.frontier.of_model(rows))).strip()
    start, end = report.markers("finetune-epochs")
    rows = json.loads((report.RESULTS / "finetune_epochs.json").read_text())
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == "\n".join(report.epochs_block(rows)).strip()
    start, end = report.markers("findings")  # the findings' verdicts, as eval/report.py wrote them into RESULTS.md
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table.count("\n") == 7 and table in (report.RESULTS / "RESULTS.md").read_text()


def test_smollm2_block_is_the_committed_results_and_serves_uncompressed_too(tmp_path: Path) -> None:
    """docs/results.md's SmolLM2 block is rendered from results/eval; a run with an uncompressed evaluation
    (infer_none.json) gets a row in the served-uncompressed table."""
    rows = report.frontier.of_model(json.loads((report.RESULTS / "frontier.json").read_text()),
                                    "SmolLM2-135M")
    results = report.RESULTS / "smollm2"
    start, end = report.markers("frontier-smollm2")
    text = (report.ROOT / "docs" / "results.md").read_text()
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == "\n".join(report.smollm2_block(rows, results)).strip()
    for name, loss in (("sm-base", 3.2), ("sm-tile3.5_grad-tile3stoch", 3.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "infer_none.json").write_text(json.dumps({"val_ppl": math.exp(loss)}))
    block = report.smollm2_block(rows, tmp_path)
    assert "| sm-base | 3.345 | 3.200 | +0.000 |" in block and "--protocol smollm2" in block[0]
    assert "| sm-tile3.5_grad-tile3stoch | 3.393 | 3.250 | +0.050 |" in block

