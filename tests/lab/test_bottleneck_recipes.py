"""--bottleneck K in the recipes, as multi-process pipelines: the exact bytes of what crosses, the identity at k = d,
checkpoint and resume, the PCA init from a pretrained checkpoint, and both engines."""
import json
import math
import shutil

import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import ROOT, run_job  # noqa: E402
from tests.lab.test_recipes import TINY, ok, private_cache, rows, tiny_llama  # noqa: E402,F401 - the fixture applies here too

PRETRAIN = ROOT / "recipes/pretrain.py"
B, T, D, K = 2, 32, 64, 16  # micro-batch, sequence, the tiny model's width, the code's width


def test_k_equal_d_identity_frozen_trains_bitwise_like_no_bottleneck(tmp_path):
    common = [*TINY, "--steps", "3", "--eval-every", "3", "--eval-at-start", "--pp-compress", "none"]
    ok(*run_job(PRETRAIN, 2, *common, "--out", str(tmp_path / "plain")))
    ok(*run_job(PRETRAIN, 2, *common, "--bottleneck", str(D), "--bottleneck-init", "identity", "--bottleneck-frozen",
                "--out", str(tmp_path / "bn")))
    for kind in ("train", "eval"):
        key = "loss" if kind == "train" else "val_loss"
        assert [r[key] for r in rows(tmp_path / "bn", kind)] == [r[key] for r in rows(tmp_path / "plain", kind)]
    assert rows(tmp_path / "bn", "eval")[0]["step"] == 0


@pytest.fixture(scope="module")
def bottlenecked(tmp_path_factory):
    out = tmp_path_factory.mktemp("bn")
    ok(*run_job(PRETRAIN, 2, *TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--bottleneck", str(K),
                "--bottleneck-group", "4",
                "--pp-compress", "int8:rot,min_numel=0", "--out", str(out)))
    return out


def test_the_code_and_the_sink_cross_compressed_and_their_bytes_are_exact(bottlenecked):
    train = rows(bottlenecked, "train")
    code, sink = B * T * K, B * 1 * D  # per micro-batch, 2 micro-batches a step
    assert all(r["act_raw_bytes"] == 2 * ((code + sink) * 4 + B * 8) for r in train)  # + the int64 sample ids
    assert all(r["grad_raw_bytes"] == 2 * (code + sink) * 4 for r in train)  # the gradient crosses k-wide too
    assert all(3.5 < r["act_ratio"] < 4 and 3.5 < r["grad_ratio"] < 4 for r in train)
    model = json.loads((bottlenecked / "run.json").read_text())["model"]
    assert model["bottleneck"] == K and model["bottleneck_after"] == [1] and train[-1]["loss"] < train[0]["loss"]


def test_a_bottleneck_run_resumes_exactly(bottlenecked, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(bottlenecked, out, ignore=shutil.ignore_patterns("global_step4", "metrics.*"))
    (out / "ckpt" / "latest").write_text("global_step2")
    ok(*run_job(PRETRAIN, 2, *TINY, "--steps", "4", "--eval-every", "2", "--bottleneck", str(K), "--bottleneck-group", "4",
                "--pp-compress", "int8:rot,min_numel=0", "--out", str(out), "--resume"))
    assert rows(out, "train")[-1]["loss"] == rows(bottlenecked, "train")[-1]["loss"]
    assert rows(out, "eval")[-1]["val_loss"] == rows(bottlenecked, "eval")[-1]["val_loss"]


def test_the_torch_engine_carries_the_bottleneck_too(tmp_path):
    ok(*run_job(PRETRAIN, 2, *TINY, "--steps", "3", "--eval-every", "3", "--untied", "--engine", "torch",
                "--bottleneck", str(K), "--pp-compress", "int8,min_numel=0", "--out", str(tmp_path / "torch")))
    stats = json.loads((tmp_path / "torch" / "summary.json").read_text())["stats"]
    per_step = 2 * (B * T * K + B * D) * 4
    assert stats["b0.act"]["raw_bytes"] == 3 * (per_step + 2 * B * 8)  # + the sample ids
    assert stats["b0.grad"]["raw_bytes"] == 3 * per_step
    assert 3.5 < stats["b0.act"]["ratio"] < 4


def test_from_scratch_a_seeded_random_token_table_crosses_with_the_ids_in_both_engines(tmp_path):
    """Trained from scratch there is nothing to fit a token table to: --bottleneck-tokens takes a seeded random one
    (bottleneck.random_tokens, at the embedding's init scale), the same in the cut's encoder and decoder and in every
    engine, and the int16 ids of bpe512's vocabulary cross beside the code, counted in the bytes (with
    --bottleneck-sink 0, as the study's from-scratch rows, the code and the ids alone)."""
    import torch

    from pp_lab.bottleneck import random_tokens

    common = [*TINY, "--steps", "2", "--eval-every", "2", "--save-every", "2", "--bottleneck", str(K),
              "--pp-compress", "int8,min_numel=0"]
    ok(*run_job(PRETRAIN, 2, *common, "--out", str(tmp_path / "plain")))
    ok(*run_job(PRETRAIN, 2, *common, "--bottleneck-tokens", "--out", str(tmp_path / "tokens")))
    ids = B * T * 2  # int16 ids of a micro-batch
    for a, b in zip(rows(tmp_path / "plain", "train"), rows(tmp_path / "tokens", "train")):
        assert b["act_raw_bytes"] == a["act_raw_bytes"] + 2 * ids and b["grad_raw_bytes"] == a["grad_raw_bytes"]
        assert b["loss"] != a["loss"]  # the table reaches the blocks after the cut
    tables = [t for f in sorted((tmp_path / "tokens" / "ckpt" / "global_step2").glob("layer_*-model_states.pt"))
              for n, t in torch.load(f, weights_only=True).items() if n.endswith("coder.tokens")]
    model = json.loads((tmp_path / "tokens" / "run.json").read_text())["model"]
    expected = random_tokens(model["vocab_size"], D, model["init_std"], model["subspace_seed"])
    assert len(tables) == 2 and all(torch.equal(t, expected) for t in tables)
    ok(*run_job(PRETRAIN, 2, *common, "--bottleneck-tokens", "--bottleneck-sink", "0", "--untied", "--engine",
                "torch", "--out", str(tmp_path / "torch")))
    stats = json.loads((tmp_path / "torch" / "summary.json").read_text())["stats"]
    assert stats["b0.act"]["raw_bytes"] == 2 * (2 * (B * T * K * 4 + ids) + 2 * B * 8)  # no token in full


def test_a_residual_branch_trains_beside_a_fixed_identity_path_resumes_and_runs_in_both_engines(tmp_path):
    """--bottleneck-residual R (ResBM's design): the same code crosses as without it (equal bytes), and the run starts
    where the plain bottleneck does (the branches start at zero); the checkpoint holds the branches, trained, beside
    the maps still at their seeded init; a run resumed from step 2 ends where the whole run does; the torch engine
    carries it too."""
    import torch

    from pp_lab.bottleneck import fixed_basis

    common = [*TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--bottleneck", str(K),
              "--pp-compress", "int8,min_numel=0"]
    ok(*run_job(PRETRAIN, 2, *common, "--out", str(tmp_path / "plain")))
    ok(*run_job(PRETRAIN, 2, *common, "--bottleneck-residual", "8", "--out", str(tmp_path / "res")))
    plain, res = rows(tmp_path / "plain", "train"), rows(tmp_path / "res", "train")
    assert [r["act_raw_bytes"] for r in res] == [r["act_raw_bytes"] for r in plain]
    assert [r["grad_raw_bytes"] for r in res] == [r["grad_raw_bytes"] for r in plain]
    assert res[0]["loss"] == plain[0]["loss"] and res[-1]["loss"] != plain[-1]["loss"]
    model = json.loads((tmp_path / "res" / "run.json").read_text())["model"]
    assert model["bottleneck_residual"] == 8
    state = {n: t for f in sorted((tmp_path / "res" / "ckpt" / "global_step4").glob("layer_*-model_states.pt"))
             for n, t in torch.load(f, weights_only=True).items() if "coder." in n}
    init = fixed_basis(D, K, "random", model["subspace_seed"] + 1)  # cut 1's seeded basis
    assert torch.equal(state["encoder.weight"], init.enc) and torch.equal(state["decoder.weight"], init.dec)
    assert state["encoder.branch.outer"].shape == (K, 8) and state["encoder.branch.outer"].any()
    assert state["decoder.branch.outer"].shape == (D, 8) and state["decoder.branch.outer"].any()
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "res", resumed, ignore=shutil.ignore_patterns("global_step4", "metrics.*"))
    (resumed / "ckpt" / "latest").write_text("global_step2")
    ok(*run_job(PRETRAIN, 2, *common, "--bottleneck-residual", "8", "--out", str(resumed), "--resume"))
    assert rows(resumed, "train")[-1]["loss"] == res[-1]["loss"]
    assert rows(resumed, "eval")[-1]["val_loss"] == rows(tmp_path / "res", "eval")[-1]["val_loss"]
    ok(*run_job(PRETRAIN, 2, *TINY, "--steps", "2", "--eval-every", "2", "--untied", "--engine", "torch",
                "--bottleneck", str(K), "--bottleneck-residual", "8", "--pp-compress", "int8,min_numel=0",
                "--out", str(tmp_path / "torch")))
    stats = json.loads((tmp_path / "torch" / "summary.json").read_text())["stats"]
    assert stats["b0.grad"]["raw_bytes"] == 2 * 2 * (B * T * K + B * D) * 4


def test_the_pca_blend_and_fisher_inits_start_a_pretrained_model_close_to_itself(tmp_path):
    """The init flags reach the engine's calibration: k = d from pca is the pretrained model itself, and each init
    at k < d starts somewhere of its own. (The bases' own properties, fisher's oblique identity at k = d included,
    are test_bottleneck.py's.)"""
    ckpt = tiny_llama(tmp_path / "llama")
    common = ["recipes/finetune.py", "--checkpoint", str(ckpt), "--tokenizer", "gpt2", "--data", "fixture",
              "--seq-len", "16", "--micro-batch", "2", "--grad-accum", "2", "--steps", "1", "--eval-batches", "2",
              "--eval-at-start", "--pp-compress", "none"]
    ok(*run_job(ROOT / common[0], 2, *common[1:], "--out", str(tmp_path / "plain")))
    ok(*run_job(ROOT / common[0], 2, *common[1:], "--bottleneck", "32", "--out", str(tmp_path / "full")))
    ok(*run_job(ROOT / common[0], 2, *common[1:], "--bottleneck", "4", "--out", str(tmp_path / "k4")))
    ok(*run_job(ROOT / common[0], 2, *common[1:], "--bottleneck", "4", "--bottleneck-init", "fisher",
                "--bottleneck-fisher-damping", "0.5", "--out", str(tmp_path / "fisher_k4")))
    ok(*run_job(ROOT / common[0], 2, *common[1:], "--bottleneck", "4", "--bottleneck-init", "blend",
                "--bottleneck-grad-weight", "2", "--out", str(tmp_path / "blend_k4")))
    names = ("plain", "full", "k4", "fisher_k4", "blend_k4")
    start = {n: rows(tmp_path / n, "eval")[0]["val_loss"] for n in names}
    assert math.isclose(start["full"], start["plain"], rel_tol=1e-4)  # k = d: the projection is the identity
    assert all(math.isfinite(v) for v in start.values())
    assert len({start[n] for n in ("plain", "k4", "fisher_k4", "blend_k4")}) == 4  # each init is its own


def test_the_bottleneck_learns_at_its_scaled_rate_in_the_engine(tmp_path):
    """--bottleneck-lr-scale reaches DeepSpeed's optimizer as a parameter group of its own, and the schedule keeps
    the ratio: each stage's saved optimizer holds its encoder or decoder at 10x the body's rate."""
    import torch

    ok(*run_job(PRETRAIN, 2, *TINY, "--steps", "2", "--save-every", "2", "--eval-every", "2", "--bottleneck", str(K),
                "--bottleneck-lr-scale", "10", "--pp-compress", "none", "--out", str(tmp_path)))
    for rank in (0, 1):
        state = torch.load(tmp_path / f"ckpt/global_step2/mp_rank_0{rank}_model_states.pt", weights_only=False)
        body, inner = state["optimizer"]["param_groups"]
        assert inner["lr"] == pytest.approx(10 * body["lr"]) and len(inner["params"]) == 2  # a weight and a bias


def test_a_token_table_crosses_with_the_ids_and_serves_from_the_checkpoint(tmp_path):
    """--bottleneck-tokens in DeepSpeed's engine: the token ids cross beside the code (their bytes counted), the fitted
    table changes where the model starts (that it loses less than pca, test_bottleneck.py checks), and infer.py,
    which builds the model without the pretrained checkpoint, serves the run from its DeepSpeed checkpoint alone (the
    frozen table is in it, the same for the cut's encoder and decoder; that a model built without it takes it from a
    state dict, test_bottleneck.py checks)."""
    import torch

    ckpt = tiny_llama(tmp_path / "llama")
    common = ["--checkpoint", str(ckpt), "--tokenizer", "gpt2", "--data", "fixture", "--seq-len", "16",
              "--micro-batch", "2", "--grad-accum", "2", "--steps", "2", "--eval-batches", "2", "--eval-every", "2",
              "--save-every", "2", "--eval-at-start", "--bottleneck", "4", "--bottleneck-calib", "8",
              "--pp-compress", "int8:rot,min_numel=0"]
    finetune = ROOT / "recipes/finetune.py"
    ok(*run_job(finetune, 2, *common, "--out", str(tmp_path / "pca")))
    ok(*run_job(finetune, 2, *common, "--bottleneck-tokens", "--out", str(tmp_path / "tokens")))
    pca, tokens = rows(tmp_path / "pca", "eval"), rows(tmp_path / "tokens", "eval")
    assert tokens[0]["val_loss"] != pca[0]["val_loss"] and math.isfinite(tokens[0]["val_loss"])  # the table is used
    ids = 2 * 16 * 4  # int32 ids of a micro-batch (GPT-2's vocabulary needs more than int16)
    for a, b in zip(rows(tmp_path / "pca", "train"), rows(tmp_path / "tokens", "train")):
        assert b["act_raw_bytes"] == a["act_raw_bytes"] + 2 * ids and b["grad_raw_bytes"] == a["grad_raw_bytes"]
    assert json.loads((tmp_path / "tokens" / "run.json").read_text())["model"]["bottleneck_tokens"] is True
    tables = [t for f in sorted((tmp_path / "tokens" / "ckpt" / "global_step2").glob("layer_*-model_states.pt"))
              for n, t in torch.load(f, weights_only=True).items() if n.endswith("coder.tokens")]
    assert len(tables) == 2 and torch.equal(*tables) and tables[0].shape == (50257, 32) and tables[0].abs().sum() > 0
    served = tmp_path / "tokens" / "infer.json"
    ok(*run_job(ROOT / "recipes/infer.py", 2, "--checkpoint", str(tmp_path / "tokens"), "--stages", "2",
                "--data", "fixture", "--micro-batch", "2", "--ppl-batches", "2", "--pp-compress", "none",
                "--out", str(served)))
    assert math.isfinite(json.loads(served.read_text())["val_ppl"])


def test_the_torch_engine_finetunes_a_pretrained_model_with_a_fitted_bottleneck(tmp_path):
    """`finetune.py --engine torch`: the pretrained weights load into each rank's stage, the PCA init (with k = d
    the model itself) and the token table are fitted as in DeepSpeed's engine, the ids cross beside the code, and
    --eval-at-start evaluates where the run starts."""
    ckpt = tiny_llama(tmp_path / "llama")
    common = ["--checkpoint", str(ckpt), "--tokenizer", "gpt2", "--data", "fixture", "--seq-len", "16",
              "--micro-batch", "2", "--grad-accum", "2", "--steps", "2", "--eval-batches", "2", "--eval-every", "2",
              "--eval-at-start", "--untied", "--engine", "torch", "--bottleneck-calib", "8"]
    finetune = ROOT / "recipes/finetune.py"
    runs = {"plain": ["--pp-compress", "none"], "full": ["--bottleneck", "32", "--pp-compress", "none"],
            "tokens": ["--bottleneck", "4", "--bottleneck-tokens", "--pp-compress", "int8:rot,min_numel=0"]}
    for name, extra in runs.items():
        ok(*run_job(finetune, 2, *common, *extra, "--out", str(tmp_path / name)))
    # DeepSpeed's engine evaluates micro-batches of 4 where this one runs 2 of 2: the same sequences
    ds = [a for a in common if a not in ("--untied", "--engine", "torch")]
    ds[ds.index("--micro-batch") + 1], ds[ds.index("--grad-accum") + 1] = "4", "1"
    ok(*run_job(finetune, 2, *ds, "--pp-compress", "none", "--out", str(tmp_path / "deepspeed")))
    start = {n: rows(tmp_path / n, "eval")[0] for n in ("plain", "full", "tokens", "deepspeed")}
    assert all(r["step"] == 0 for r in start.values())
    assert math.isclose(start["plain"]["val_loss"], start["deepspeed"]["val_loss"], rel_tol=1e-5)  # the same weights
    assert math.isclose(start["full"]["val_loss"], start["plain"]["val_loss"], rel_tol=1e-4)  # k = d: the model itself
    assert start["tokens"]["val_loss"] != start["full"]["val_loss"] and math.isfinite(start["tokens"]["val_loss"])
    stats = json.loads((tmp_path / "tokens" / "summary.json").read_text())["stats"]
    code, sink, ids = 2 * 16 * 4, 2 * 1 * 32, 2 * 16  # per micro-batch: k = 4, d = 32, int32 ids
    assert stats["b0.act"]["raw_bytes"] == 2 * 2 * ((code + sink) * 4 + ids * 4 + 2 * 8)  # + the int64 sample ids
    assert stats["b0.grad"]["raw_bytes"] == 2 * 2 * (code + sink) * 4
