import argparse
import csv
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.integration.launch import ROOT

from pp_lab import train
from pp_lab.train import warn_if_slow_bf16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CPUs")
def test_bf16_on_a_cpu_without_bf16_units_warns_and_names_the_fix():
    with pytest.warns(RuntimeWarning, match="drop --bf16"):
        warn_if_slow_bf16(True, cpuinfo="flags : fpu sse2 avx2 fma")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_slow_bf16(True, cpuinfo="flags : avx2 avx512f avx512_bf16")
        warn_if_slow_bf16(True, cpuinfo="flags : avx2 amx_bf16 amx_tile")
        warn_if_slow_bf16(False, cpuinfo="flags : fpu sse2")


def test_logger_on_resume_drops_the_rows_logged_after_the_checkpoint(tmp_path):
    # a run cut off at step 30 with its last checkpoint at 20: steps 21-30 run again on resume, so their rows go
    log = train.Logger(tmp_path, True)
    for step in (10, 20, 30):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
        log.write({"kind": "eval", "step": step, "val_loss": 2.0 / step})
    log.close()
    log = train.Logger(tmp_path, True, start=20)
    log.write({"kind": "train", "step": 30, "loss": 0.5})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 10), ("eval", 10), ("train", 20), ("eval", 20), ("train", 30)]
    assert rows[-1]["loss"] == 0.5
    csv_rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in csv_rows] == [10, 20, 30] and float(csv_rows[-1]["loss"]) == 0.5


def test_prune_checkpoints_keeps_the_newest_and_the_latest(tmp_path):
    prune_checkpoints = train.prune_checkpoints
    for s in (100, 200, 300, 1000):
        (tmp_path / f"global_step{s}").mkdir()
    (tmp_path / "latest").write_text("global_step1000")
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == ["global_step100", "global_step200"]  # by step, not by name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1000", "global_step300", "latest"]
    (tmp_path / "latest").write_text("global_step300")  # never the one `latest` names
    assert prune_checkpoints(tmp_path, 1) == [] and (tmp_path / "global_step300").is_dir()
    assert prune_checkpoints(tmp_path, 0) == []
    with pytest.raises(ValueError, match="--keep-checkpoints -1; accepted: 0"):
        prune_checkpoints(tmp_path, -1)


def test_the_demos_own_setting_gets_no_warning_and_a_worse_one_does():
    """`make demo` trains the small GPT with DEMO_SPEC: the note before the run comes from that spec's recorded verdict
    (pp_compress.presets), so the demo cannot warn against its own setting."""
    from pp_compress import parse_spec
    from pp_compress.advice import advice

    demo = next(line.split("?=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                if line.startswith("DEMO_SPEC"))
    args = argparse.Namespace(model="small")
    assert train.testbed(args) == "small GPT" and advice(parse_spec(demo), train.testbed(args)) is None
    assert "measured worse" in advice(parse_spec("topk:0.1"), train.testbed(args))


def test_the_testbed_of_a_run():
    ns = argparse.Namespace
    assert train.testbed(ns(model="small")) == "small GPT" and train.testbed(ns(model="tiny")) is None
    assert train.testbed(ns(checkpoint=None)) == "SmolLM2-135M"  # finetuning's default checkpoint
    assert train.testbed(ns(checkpoint=Path("runs/x"))) is None


def test_the_state_digest_changes_with_any_bit_and_only_then():
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "opt": {"step": torch.tensor(3.0), "lr": [1e-3]}}
    same = {"opt": {"lr": [1e-3], "step": torch.tensor(3.0)}, "w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert train.digest(state) == train.digest(same)  # key order does not matter
    flipped = {**state, "w": state["w"].clone()}
    flipped["w"].view(torch.int32)[1, 2] ^= 1  # one bit of one value
    assert train.digest(flipped) != train.digest(state)
    assert train.digest({**state, "w": state["w"].reshape(3, 2)}) != train.digest(state)  # the shape counts
    assert train.digest({**state, "w": state["w"].double()}) != train.digest(state)  # and the dtype
    assert train.digest({**state, "opt": {"step": torch.tensor(3.0), "lr": [2e-3]}}) != train.digest(state)


def test_the_bottleneck_learns_at_its_own_rate_and_the_rest_at_lr():
    from torch import nn

    from pp_lab.bottleneck import Decoder, Encoder, fixed_basis

    basis = fixed_basis(16, 4, "random", 0)
    body, frozen = nn.Linear(16, 16), nn.Linear(16, 16)
    frozen.requires_grad_(False)
    model = nn.ModuleList([body, Encoder(16, 4, 1, 1, basis, True), frozen, Decoder(16, 4, 1, basis, True)])
    groups = train.param_groups(model, 1e-4, 10.0)
    assert [g["lr"] for g in groups] == [1e-4, pytest.approx(1e-3)]
    assert [len(g["params"]) for g in groups] == [2, 4]  # the body's weight and bias; each side's weight and bias
    assert {id(p) for p in groups[1]["params"]} == {id(p) for m in model[1::2] for p in m.parameters()}
    plain = train.param_groups(nn.ModuleList([body]), 1e-4, 1.0)  # no bottleneck: one group, as before
    assert len(plain) == 1 and plain[0]["lr"] == 1e-4
    with pytest.raises(SystemExit, match="--bottleneck-lr-scale 0.0; accepted: a number > 0"):
        train.param_groups(model, 1e-4, 0.0)


@pytest.mark.parametrize("flags, checkpoint, message", [
    (["--bottleneck-grad-weight", "2"], "a checkpoint",
     "--bottleneck-grad-weight 2.0 without --bottleneck: there is no bottleneck"),
    (["--bottleneck", "4", "--bottleneck-fisher-damping", "0.5"], "a checkpoint",
     "--bottleneck-fisher-damping 0.5 with --bottleneck-init pca: it applies to --bottleneck-init fisher only"),
    (["--bottleneck", "4", "--bottleneck-grad-weight", "2"], "a checkpoint",
     "--bottleneck-grad-weight 2.0 with --bottleneck-init pca: it applies to --bottleneck-init blend only"),
    (["--bottleneck", "4", "--bottleneck-init", "blend", "--bottleneck-grad-weight", "0"], "a checkpoint",
     "--bottleneck-grad-weight 0.0; accepted: a number > 0 (0 is --bottleneck-init pca)"),
    (["--bottleneck", "4", "--bottleneck-init", "fisher", "--bottleneck-fisher-damping", "-1"], "a checkpoint",
     "--bottleneck-fisher-damping -1.0; accepted: a number > 0"),
    # a token table is fitted on data from a pretrained model, or seeded random from scratch: nothing else
    (["--bottleneck", "4", "--bottleneck-tokens", "--bottleneck-init", "random"], "a checkpoint",
     "--bottleneck-tokens with --bottleneck-init random from a pretrained --checkpoint"),
    (["--bottleneck", "16", "--bottleneck-tokens", "--bottleneck-init", "identity"], None,
     "--bottleneck-tokens with --bottleneck-init identity: its table is fitted"),
    (["--bottleneck", "16", "--bottleneck-residual", "8", "--bottleneck-frozen"], None,
     "--bottleneck-residual 8 with --bottleneck-frozen; accepted: 0, or a width >= 1"),
])
def test_a_bottleneck_inits_options_are_refused_where_they_do_not_apply(flags, checkpoint, message):
    from pp_lab.model import GPTConfig

    args = train.add_args(argparse.ArgumentParser(), 10, 1e-3).parse_args(["--out", "x", *flags])
    with pytest.raises(SystemExit, match=re.escape(message)):
        train.with_bottleneck(args, GPTConfig.preset("tiny", vocab_size=256), checkpoint, None)


def test_muon_refuses_the_torch_engine_and_a_bottleneck_rate_of_its_own():
    """Both before any work: pretrain.py checks the engine right after parsing its arguments, and the parameter groups
    are made before DeepSpeed's engine (test_recipes.py's muon test runs what muon accepts)."""
    from torch import nn

    from pp_lab import torch_engine

    args = train.add_args(argparse.ArgumentParser(), 10, 1e-3).parse_args(["--out", "x", "--untied", "--optimizer",
                                                                           "muon"])
    with pytest.raises(SystemExit, match="--engine torch does not support --optimizer muon; use --engine deepspeed"):
        torch_engine.check(args)
    with pytest.raises(SystemExit, match=re.escape("--bottleneck-lr-scale 10.0 with --optimizer muon; accepted: 1")):
        train.param_groups(nn.Linear(4, 4), 1e-3, 10.0, "muon")


def test_the_pca_init_needs_a_pretrained_checkpoint():
    from pp_lab.model import GPTConfig

    args = train.add_args(argparse.ArgumentParser(), 10, 1e-3).parse_args(["--out", "x", "--bottleneck", "8",
                                                                           "--bottleneck-init", "pca"])
    with pytest.raises(SystemExit, match="--bottleneck-init pca needs a pretrained --checkpoint"):
        train.with_bottleneck(args, GPTConfig.preset("tiny", vocab_size=256), None, None)
