"""eval/: the lm-eval model reproduces the pipeline's numbers, and the parity command decides correctly."""
import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
from eval.lm import PPCompressLM, stage_cuts  # noqa: E402
from eval.parity import compare  # noqa: E402
from recipes import data  # noqa: E402
from recipes.model import GPTConfig, lm_loss  # noqa: E402
from tests.integration.launch import ROOT, run_job  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("run")
    rc, log = run_job(ROOT / "recipes/pretrain.py", 2, "--corpus", "fixture", "--model", "tiny", "--tokenizer", "bpe512",
                      "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "16", "--eval-batches", "2",
                      "--eval-every", "0", "--lr", "3e-3", "--log-every", "8",
                      "--pp-compress", "none", "--out", str(out), env={"PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf")})
    assert rc == 0, log[-3000:]
    return out, cache


def test_stage_cuts_match_deepspeed_type_block_partitioning():
    # 4 blocks over 2 stages: [emb, b0, b1] | [b2, b3, head, tied]; over 4 stages one block each
    assert stage_cuts(GPTConfig(n_layer=4), 2) == [2]
    assert stage_cuts(GPTConfig(n_layer=4), 4) == [1, 2, 3]


def test_lm_reproduces_the_pipelines_validation_loss(run_dir, monkeypatch):
    out, cache = run_dir
    monkeypatch.setattr(data, "CACHE", cache)
    lm = PPCompressLM(checkpoint=str(out), compress="none", stages=2)
    val = data.lm_datasets(data.corpus_files("fixture"), lm.tok, 32, 0.02)[1]
    batches = list(data.eval_batches(val, 2))[:4]  # pretrain's last eval: 2 pipeline batches x 2 micro-batches
    with torch.no_grad():
        losses = [float(lm_loss(lm.net(ids), labels)) for (ids, _), labels in batches]
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x][-1]["val_loss"]
    assert math.isclose(sum(losses) / len(losses), final, rel_tol=1e-5)


def test_parity_command_passes_identical_and_fails_broken_settings(run_dir, tmp_path):
    out, cache = run_dir
    env = {"PYTHONPATH": str(ROOT), "PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "eval/parity.py"), "--baseline", str(out), "--corpus", "fixture", "--stages", "2",
           "--limit", "30", "--out", str(tmp_path / "rep")]
    same = subprocess.run(cmd + ["--candidate", f"{out}@identity"], env=env, capture_output=True, text=True, timeout=600)
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    rows = json.loads((tmp_path / "rep.json").read_text())["candidates"][0]["metrics"]
    assert rows and all(r["delta"] == 0 and r["verdict"] == "parity" for r in rows.values())
    # a boundary that keeps one value in 500 wrecks the model: the bits-per-byte verdict must catch it
    broken = subprocess.run(cmd + ["--candidate", f"{out}@topk:0.002"], env=env, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "rep.json").read_text())["candidates"][0]["metrics"]
    assert broken.returncode == 1 and rows["ppc_fixture_ppl/bits_per_byte"]["verdict"] == "worse", broken.stdout[-3000:]


def test_lm_eval_cli_runs_the_local_tasks_with_our_model(run_dir, tmp_path):
    out, cache = run_dir
    env = {"PYTHONPATH": str(ROOT), "PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf"), "PATH": "/usr/bin:/bin"}
    tasks = tmp_path / "tasks"
    built = subprocess.run([sys.executable, str(ROOT / "eval/tasks.py"), "--corpus", "fixture", "--out", str(tasks)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    cli = subprocess.run([sys.executable, str(ROOT / "eval/lm.py"), "run", "--model", "pp_compress", "--model_args",
                          f"checkpoint={out},compress=int8,stages=2", "--tasks", "ppc_fixture_ppl", "ppc_fixture_nextline",
                          "--include_path", str(tasks), "--limit", "4", "--output_path", str(tmp_path / "res")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-3000:]
    res = json.loads(next((tmp_path / "res").rglob("results_*.json")).read_text())["results"]
    assert 0 < res["ppc_fixture_ppl"]["bits_per_byte,none"] < 20
    assert 0 <= res["ppc_fixture_nextline"]["acc,none"] <= 1


@pytest.mark.parametrize("base,cand,higher,verdict", [
    ([0, 1, 1, 0] * 25, [0, 1, 1, 0] * 25, True, "parity"),
    ([1.0] * 100, [0.0] * 50 + [1.0] * 50, True, "worse"),
    ([2.0 + 0.01 * i for i in range(100)], [2.0 + 0.01 * i + 0.3 for i in range(100)], False, "worse"),
    ([2.0 + 0.01 * i for i in range(100)], [2.0 + 0.01 * i - 0.3 for i in range(100)], False, "parity"),
])
def test_verdict_is_one_sided_two_standard_errors(base, cand, higher, verdict):
    assert compare(base, cand, higher, tol=0.005)["verdict"] == verdict


def test_unknown_model_args_are_an_error_naming_the_accepted_ones(run_dir):
    out, _ = run_dir
    with pytest.raises(ValueError, match=r"unknown pp_compress model_args \['compres'\]; accepted: checkpoint, compress"):
        PPCompressLM(checkpoint=str(out), compres="int8")
    PPCompressLM(checkpoint=str(out), stages=2, device="cpu", max_batch_size=None)  # lm-eval's own additions pass
