"""DeepSpeed's own TestPipeModuleSequential (tests/unit/pipe/test_pipe_module.py, adapted in pipe_module_worker.py):
a 2-stage PipelineModule's eval_batch output equals the sequential model's, stock and with pp_compress enabled.
(torch.compile variants are left out: minutes of CPU compile per case.)"""
import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import HANG_S, run_job  # noqa: E402

WORKER = Path(__file__).with_name("pipe_module_worker.py")


@pytest.mark.parametrize("activation_checkpoints", [False, True])
# `identity` is left out: test_deepspeed_features.py holds it bitwise to stock, with activation checkpointing too
@pytest.mark.parametrize("spec,atol", [(None, 1e-4), ("int8", 2e-3)], ids=["stock", "pp_compress-int8"])
def test_pipe_module_sequential(tmp_path, spec, atol, activation_checkpoints):
    args = ["--out", str(tmp_path)] + (["--spec", spec] if spec else []) + \
        (["--activation-checkpoints"] if activation_checkpoints else [])
    rc, log = run_job(WORKER, 2, *args, timeout=HANG_S)
    assert rc == 0, log[-4000:]
    res = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(res) == 2
    for r in res:  # upstream: torch.allclose(base_output, pipe_output, atol=1e-4); int8 at a stated atol
        assert all(abs(a - b) <= atol for a, b in zip(r["base"], r["pipe"])), (r["base"], r["pipe"])
        assert r["engine"] == ("PipelineEngine" if spec is None else "CompressedPipelineEngine")
