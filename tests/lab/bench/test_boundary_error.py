"""benchmarks/boundary_error.py on a real (tiny) checkpoint: both directions measured, errors ordered by bits."""
import re
import subprocess
import sys

from tests.integration.launch import HANG_S, ROOT


def _run(tiny_run, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """boundary_error.py on the tiny run's 2-stage cut, 4 x 32 tokens -> (the process, its markdown)."""
    run, cache = tiny_run
    out = tmp_path / "t.md"
    env = {"PYTHONPATH": str(ROOT), "PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf"), "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks/boundary_error.py"), "--run", str(run), "--stages", "2", "--rows", "4",
           "--seq", "32", *args, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, out.read_text()


def test_boundary_error_on_a_trained_run(tiny_run, tmp_path):
    _, text = _run(tiny_run, tmp_path, "--spec", "int8", "--spec", "int4", "--spec", "int4:per=block32")
    assert re.search(r"1 cuts \(after block \d+; layer 0 is the embedding\), 4 x 32 held-out tokens of fixture", text)
    fwd, bwd = text.split("## Activation-gradients")
    for part in (fwd, bwd):
        rows = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"\| `(\S+)`\s*\| ([\d.]+)\s*\| ([\d.]+)", part)}
        assert set(rows) == {"int8", "int4", "int4:per=block32"}
        assert rows["int8"][0] > rows["int4:per=block32"][0] > rows["int4"][0]  # bits
        assert 0 < rows["int8"][1] < rows["int4:per=block32"][1] < rows["int4"][1]  # a nonzero gradient, finer scales help
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/boundary_error.py"), "--run", str(tmp_path)],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=HANG_S)
    assert bad.returncode == 2 and "neither a recipe run (run.json) nor a transformers folder" in bad.stderr


def test_boundary_error_loss_columns(tiny_run, tmp_path):
    """--loss: uncompressed replacement costs exactly nothing, and coarser codes cost more loss."""
    _, text = _run(tiny_run, tmp_path, "--spec", "none", "--spec", "int8", "--spec", "int2", "--loss")
    fwd, bwd = text.split("## Activation-gradients")
    assert "loss +, cut 1 only" in fwd and "loss +, all cuts" in fwd and "loss +" not in bwd
    deltas = {m[0]: (float(m[1]), float(m[2]))
              for m in re.findall(r"\| `(\S+)`\s*\|[^\n]*\| ([+-][\d.]+)\s*\| ([+-][\d.]+)\s*\|\n", fwd)}
    assert deltas["none"] == (0.0, 0.0)
    assert abs(deltas["int8"][0]) < deltas["int2"][0]
    assert all(alone == every for alone, every in deltas.values())  # one cut: every cut is that cut
