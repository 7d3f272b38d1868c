import json
import subprocess
import sys

import pytest

from pp_lab.bench.window_noise import comparisons
from tests.integration.launch import HANG_S, ROOT


def test_adjacent_windows_see_a_drift_that_alternate_steps_do_not():
    drift = {s: 1.0 + 0.01 * s for s in range(1, 41)}  # the machine slows by 1% of a step per step
    adjacent, alternate = comparisons(drift, window=10, first=1)
    assert len(adjacent) == 3 and len(alternate) == 4
    assert all(d > 0.05 for d in adjacent)  # a window later is slower: taken for a worse setting
    assert all(abs(d) < 0.01 for d in alternate)  # neighbours see the same drift
    arms = {s: 1.0 if s % 2 else 1.1 for s in range(1, 21)}  # every other step 10% slower
    assert comparisons(arms, window=10, first=1)[1] == [pytest.approx(1 / 1.1 - 1)] * 2


def test_the_command_writes_its_table_and_refuses_a_directory_without_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"kind": "train", "step": s, "step_s": 0.5})
                                                 for s in range(1, 44)))
    out = tmp_path / "noise.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/window_noise.py"), str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert "| adjacent windows (auto's trials) | 1 | 0.0% |" in out.read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/window_noise.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=HANG_S)
    assert bad.returncode != 0 and "no metrics.jsonl" in bad.stderr
