"""The soak benchmark end to end at a small size: DualPipeV (2 ranks), one SIGKILL of a random rank at a random
step, a resume, and the digest of the uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed.runtime.pipe.dualpipev", reason="DualPipeV came with DeepSpeed 0.19.7")
from tests.integration.launch import HANG_S, ROOT  # noqa: E402


def test_a_killed_and_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/soak.py"), "--engine", "dualpipev",
                           "--dualpipev-steps", "160", "--save-every", "40", "--log-every", "10",
                           "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--timeout", "300"],
                          env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'lab'}"}, capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "out" / "dualpipev.json").read_text())
    [kill] = result["kills"]
    assert kill["exit"] != 0 and kill["resumes_from"].startswith("global_step") and 0 <= kill["rank"] < 2
    assert result["equal"] and len(result["ref_digest"]) == 2
    assert [r["step"] for r in result["ref_metrics"]] == list(range(10, 161, 10))
    table = (tmp_path / "out" / "soak.md").read_text()
    assert "| dualpipev | 2 | 160 |" in table and "| yes | 32 |" in table and (tmp_path / "out" / "soak.png").exists()
