"""`recipes/pretrain.py --engine megatron`: Megatron-Core's own GPTModel and 1F1B schedule through
pp_compress.megatron, in real processes on CPU/gloo (lab/pp_lab/megatron_cpu.py maps its CUDA calls)."""
import importlib.util
import json
import math
import shutil

import pytest

from tests.integration.launch import ROOT, run_job
from tests.lab.test_recipes import TINY, ok, private_cache, rows  # noqa: F401 (the module's cache fixture)

# Megatron-Core imports triton, which the interpreter tests must import first: found here, imported in the jobs only
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
RECIPE = ROOT / "recipes/pretrain.py"


def test_megatron_core_pretrains_compressed_at_pp2_and_tp2_x_pp2(tmp_path):
    """It learns; its int8 traffic shrinks ~3.9x, counted at the transport in every logged row; with --tp 2 both
    tensor-parallel ranks of a stage send (twice the bytes); tied embeddings are refused before any work."""
    common = [*TINY, "--steps", "6", "--eval-every", "3", "--untied", "--engine", "megatron",
              "--pp-compress", "int8,min_numel=0"]
    ok(*run_job(RECIPE, 2, *common, "--out", str(tmp_path / "pp2")))
    train = rows(tmp_path / "pp2", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and train[-1]["loss"] < train[0]["loss"]
    assert all(3.5 < r["act_ratio"] < 4 and 3.5 < r["grad_ratio"] < 4 for r in train)
    summary = json.loads((tmp_path / "pp2" / "summary.json").read_text())
    assert summary["engine"] == "megatron" and math.isfinite(summary["final_val_loss"])
    assert 3.5 < summary["stats"]["b0.act"]["ratio"] < 4 and 3.5 < summary["stats"]["b0.grad"]["ratio"] < 4
    ok(*run_job(RECIPE, 4, *common, "--tp", "2", "--out", str(tmp_path / "tp2")))
    tp2 = rows(tmp_path / "tp2", "train")
    assert [r["act_raw_bytes"] for r in tp2] == [2 * r["act_raw_bytes"] for r in train]
    assert abs(tp2[0]["loss"] - train[0]["loss"]) < 1e-3  # the same weights, split over two ranks
    both = json.loads((tmp_path / "tp2" / "summary.json").read_text())["stats"]["b0.act"]
    assert both["calls"] == 2 * summary["stats"]["b0.act"]["calls"]  # each tensor-parallel rank's messages
    rc, log = run_job(RECIPE, 2, *TINY, "--engine", "megatron", "--out", str(tmp_path / "tied"))
    assert rc != 0 and "add --untied" in log and not (tmp_path / "tied" / "metrics.jsonl").exists()


def test_megatron_core_at_four_stages_resumes_bitwise_from_its_checkpoint(tmp_path):
    """4 stages (Megatron's own layout of the blocks), error feedback in both directions: a run resumed from its
    step-4 checkpoint ends with the uninterrupted run's weights, optimizer, schedule and compression state."""
    common = [*TINY, "--stages", "4", "--grad-accum", "4", "--steps", "8", "--eval-every", "0", "--untied",
              "--engine", "megatron", "--save-every", "4", "--keep-checkpoints", "0", "--digest",
              "--pp-compress", "act=int8:rot+ef21,grad=int4:rot+ef,min_numel=0"]
    ok(*run_job(RECIPE, 4, *common, "--out", str(tmp_path / "whole")))
    ckpt = tmp_path / "whole" / "ckpt"
    half = tmp_path / "half"
    shutil.copytree(ckpt / "global_step4", half / "ckpt" / "global_step4")
    (half / "ckpt" / "latest").write_text("global_step4")
    ok(*run_job(RECIPE, 4, *common, "--resume", "--out", str(half)))
    assert [r["step"] for r in rows(half, "train")] == [5, 6, 7, 8]
    whole, resumed = (json.loads((d / "summary.json").read_text())["digest"] for d in (tmp_path / "whole", half))
    assert len(whole) == 4 and whole == resumed
    stats = json.loads((half / "summary.json").read_text())["stats"]
    assert {k for k in stats if not k.endswith("_eval")} == {f"b{b}.{d}" for b in range(3) for d in ("act", "grad")}
