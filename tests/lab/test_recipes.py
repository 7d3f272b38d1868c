"""The three recipes as users run them: multi-process CPU pipelines, tiny models, the committed fixture text."""
import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import ROOT, run_job  # noqa: E402

TINY = ["--corpus", "fixture", "--model", "tiny", "--tokenizer", "bpe512", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2",
        "--eval-batches", "2", "--log-every", "1"]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Tokenizers and datasets caches of these runs go to a temporary directory, not the project's .cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PP_COMPRESS_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("HF_HOME", raising=False)
        yield


def rows(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def ok(rc: int, log: str) -> None:
    errors = [line for line in log.splitlines() if "Error" in line or "error:" in line or "abort" in line.lower()]
    assert rc == 0, "\n".join(errors[:40]) + "\n...\n" + log[-3000:]


def tiny_llama(path: Path) -> Path:
    """A randomly initialised 2-block LLaMA with GPT-2's vocabulary, saved as a transformers folder."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The product card's command line on 2 CPU processes: 4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("pretrain")
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2",
                "--pp-compress", "act=int8,grad=topk:0.3+ef", "--out", str(out), launcher="deepspeed"))
    return out


def test_pretrain_logs_learning_and_wire_bytes(pretrained):
    train = rows(pretrained, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[-1]["loss"] < train[0]["loss"]
    # one micro-batch: 2 x 32 x 64 fp32 activations (+ 2 int64 sample ids); 2 micro-batches per step
    act_raw = 2 * (2 * 32 * 64 * 4 + 2 * 8)
    assert all(r["act_raw_bytes"] == act_raw and r["grad_raw_bytes"] == 2 * 2 * 32 * 64 * 4 for r in train)
    assert all(3.5 < r["act_ratio"] < 4 and 2.5 < r["grad_ratio"] < 3.5 for r in train)
    assert train[0]["act_rel_error"] > 0 and train[1]["act_rel_error"] is None  # measured on step 0 only
    assert (pretrained / "metrics.csv").read_text().count("\n") == 5
    summary = json.loads((pretrained / "summary.json").read_text())
    assert summary["final_val_loss"] == rows(pretrained, "eval")[-1]["val_loss"]
    assert {"b0.act", "b0.grad", "b0.act_eval"} <= set(summary["stats"])


def test_same_seed_same_start_with_a_warm_cache(pretrained, tmp_path):
    """The fixture's run had a cold tokenizer/dataset cache, this one a warm one: the first loss must not differ."""
    out = tmp_path / "again"
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *TINY, "--steps", "1", "--eval-every", "0",
                "--pp-compress", "act=int8,grad=topk:0.3+ef", "--out", str(out)))
    assert rows(out, "train")[0]["loss"] == rows(pretrained, "train")[0]["loss"]


def test_resume_continues_exactly(pretrained, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(pretrained, out, ignore=shutil.ignore_patterns("global_step4", "metrics.*"))
    (out / "ckpt" / "latest").write_text("global_step2")
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *TINY, "--steps", "4", "--eval-every", "2",
                "--pp-compress", "act=int8,grad=topk:0.3+ef", "--out", str(out), "--resume"))
    assert [r["step"] for r in rows(out, "train")] == [3, 4]
    assert rows(out, "train") [-1]["loss"] == rows(pretrained, "train")[-1]["loss"]
    assert rows(out, "eval")[-1]["val_loss"] == rows(pretrained, "eval")[-1]["val_loss"]


def test_infer_generates_and_reproduces_the_validation_loss(pretrained, tmp_path):
    res = tmp_path / "infer.json"
    ok(*run_job(ROOT / "recipes/infer.py", 2, "--checkpoint", str(pretrained), "--prompt", "My lord,", "--prompt", "O",
                "--max-new-tokens", "3", "--data", "fixture", "--ppl-batches", "4", "--seq-len", "32",
                "--micro-batch", "2", "--pp-compress", "act=int8,grad=topk:0.3+ef", "--out", str(res)))
    out = json.loads(res.read_text())
    assert out["generations"][0].startswith("My lord,") and len(out["generations"]) == 2
    assert out["time_to_first_token_s"] > 0 and [s["timings"]["compute"] > 0 for s in out["per_stage"]] == [True] * 2
    # the KV-cached generator and the recomputing eval_batch path agree on greedy tokens (uncompressed)
    for flag, name in (([], "kv.json"), (["--no-kv-cache"], "full.json")):
        ok(*run_job(ROOT / "recipes/infer.py", 2, "--checkpoint", str(pretrained), "--prompt", "My lord,", "--prompt", "O",
                    "--max-new-tokens", "4", "--seq-len", "32", "--micro-batch", "2", "--pp-compress", "none",
                    "--out", str(tmp_path / name), *flag))
    kv, full = (json.loads((tmp_path / n).read_text())["generations"] for n in ("kv.json", "full.json"))
    assert kv == full
    ok(*run_job(ROOT / "recipes/infer.py", 2, "--checkpoint", str(pretrained), "--prompt", "My lord, what news",
                "--seq-len", "32", "--pp-compress", "none", "--score", "--out", str(tmp_path / "score.json")))
    scored = json.loads((tmp_path / "score.json").read_text())
    assert scored["ppl"] > 1 and len(scored["scored"]["top1"]) == 1 and len(scored["scored"]["logprob"][0]) >= 2
    # pretraining's last evaluation (int8 at inference, as trained): 2 pipeline batches x 2 micro-batches = these 4
    assert math.isclose(math.log(out["val_ppl"]), rows(pretrained, "eval")[-1]["val_loss"], rel_tol=1e-5)


def test_finetune_loads_a_llama_checkpoint_per_stage(tmp_path):
    ckpt = tiny_llama(tmp_path / "llama")
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Say {w}.", "response": f"{w} {w} {w}."}) + "\n"
                           for w in ["yes", "no", "maybe", "soon", "later", "never", "always", "now"] * 4))
    out = tmp_path / "ft"
    ok(*run_job(ROOT / "recipes/finetune.py", 2, "--checkpoint", str(ckpt), "--tokenizer", "gpt2", "--data", str(sft),
                "--seq-len", "16", "--micro-batch", "2", "--grad-accum", "2", "--steps", "3", "--log-every", "1",
                "--eval-batches", "1", "--lr", "1e-3", "--val-fraction", "0.2", "--bf16", "--pp-compress", "act=topk:0.5+aqsgd,grad=int8",
                "--train-sequences", "4", "--out", str(out)))
    train = rows(out, "train")
    assert len(train) == 3 and all(math.isfinite(r["loss"]) for r in train)
    # --train-sequences 4 with 4 sequences a step: every step is one epoch. AQ-SGD sends the first visit raw, later
    # visits as compressed deltas
    assert train[0]["act_ratio"] < 1.01 and all(r["act_ratio"] > 1.5 for r in train[1:])
    assert json.loads((out / "run.json").read_text())["model"]["base_checkpoint"] == str(ckpt)


def test_tensor_parallel_recipe_reproduces_tp1(tmp_path):
    """`--stages 2 --tp 2` (4 processes, Megatron-style TP blocks, [seq, batch, hidden] between stages, DeepSpeed's
    partitioned pipes) starts from TP=1's weights and follows its losses to float tolerance."""
    common = [*TINY, "--steps", "4", "--stages", "2", "--eval-every", "0"]
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--sbh", "--pp-compress", "none", "--out", str(tmp_path / "tp1")))
    ok(*run_job(ROOT / "recipes/pretrain.py", 4, *common, "--tp", "2", "--pp-compress", "none", "--out", str(tmp_path / "tp2")))
    one, two = (rows(tmp_path / d, "train") for d in ("tp1", "tp2"))
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-5)
    run = json.loads((tmp_path / "tp2" / "run.json").read_text())
    assert run["tp"] == 2 and run["model"]["layout"] == "sbh" and "batch_dim=1" in run["pp_compress"]


def test_subspace_pipeline_sends_k_coordinates_and_token_ids_and_infer_loads_it(tmp_path, monkeypatch):
    """`--subspace auto` (k = 64 / 16 = 4): each micro-batch sends c (2, 32, 4) fp32 + token ids (2, 32) int16 (+ the
    recipe's 2 int64 sample ids) forward and only the coordinates' gradient back, int8 compresses c; --resume, infer.py
    and eval/ load the run and reproduce its numbers."""
    out = tmp_path / "sub"
    sub = [*TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--stages", "2", "--subspace", "auto",
           "--pp-compress", "int8,min_numel=0"]
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *sub, "--out", str(out)))
    train = rows(out, "train")
    assert {r["act_raw_bytes"] for r in train} == {2 * (2 * 32 * 4 * 4 + 2 * 32 * 2 + 2 * 8)}  # 2 micro-batches per step
    assert {r["grad_raw_bytes"] for r in train} == {2 * (2 * 32 * 4 * 4)}
    assert all(r["act_ratio"] > 2 and r["grad_ratio"] > 2.5 for r in train)  # int8 on c: 4 codes + a bf16 scale per row
    resumed = tmp_path / "resumed"  # --resume from step 2 (E0 and U regenerate from the seed) ends where the run did
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("global_step4", "metrics.*"))
    (resumed / "ckpt" / "latest").write_text("global_step2")
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *sub, "--out", str(resumed), "--resume"))
    assert rows(resumed, "train")[-1]["loss"] == train[-1]["loss"]
    assert rows(resumed, "eval")[-1]["val_loss"] == rows(out, "eval")[-1]["val_loss"]
    assert json.loads((out / "run.json").read_text())["model"]["subspace"] == 4
    res = tmp_path / "infer.json"
    ok(*run_job(ROOT / "recipes/infer.py", 2, "--checkpoint", str(out), "--data", "fixture", "--ppl-batches", "4",
                "--seq-len", "32", "--micro-batch", "2", "--pp-compress", "int8,min_numel=0", "--out", str(res)))
    assert math.isclose(math.log(json.loads(res.read_text())["val_ppl"]), rows(out, "eval")[-1]["val_loss"], rel_tol=1e-5)
    pytest.importorskip("lm_eval")
    import os

    import torch

    from pp_lab.eval.lm import PPCompressLM
    from pp_lab import data
    from pp_lab.model import lm_loss

    monkeypatch.setattr(data, "CACHE", Path(os.environ["PP_COMPRESS_CACHE"]))
    lm = PPCompressLM(checkpoint=str(out), compress="int8,min_numel=0", stages=2)  # eval/ loads the run in process
    val = data.lm_datasets(data.corpus_files("fixture"), lm.tok, 32, 0.02)[1]
    with torch.no_grad():
        losses = [float(lm_loss(lm.net(ids), labels)) for (ids, _), labels in list(data.eval_batches(val, 2))[:4]]
    assert math.isclose(sum(losses) / len(losses), rows(out, "eval")[-1]["val_loss"], rel_tol=1e-5)


def test_pretrain_on_the_torch_engine_follows_deepspeed_and_compresses(tmp_path):
    """`--engine torch`: the same GPT through torch.distributed.pipelining (1F1B) with CompressedPipelineStage; it
    learns, its int8 traffic shrinks ~3.9x, and tied embeddings are refused before any work. Launched with torchrun,
    as torch.distributed.pipelining users do (the other jobs start through pp_lab/spawn.py)."""
    common = [*TINY, "--steps", "6", "--eval-every", "3", "--untied"]
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--engine", "torch", "--pp-compress", "int8,min_numel=0",
                "--out", str(tmp_path / "torch"), launcher="torchrun"))
    train = rows(tmp_path / "torch", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and train[-1]["loss"] < train[0]["loss"]
    summary = json.loads((tmp_path / "torch" / "summary.json").read_text())
    assert summary["engine"] == "torch" and 3.5 < summary["stats"]["b0.act"]["ratio"] < 4
    assert 3.5 < summary["stats"]["b0.grad"]["ratio"] < 4 and math.isfinite(summary["final_val_loss"])
    rc, log = run_job(ROOT / "recipes/pretrain.py", 2, *TINY, "--engine", "torch", "--out", str(tmp_path / "tied"))
    assert rc != 0 and "add --untied" in log and not (tmp_path / "tied" / "metrics.jsonl").exists()


def test_the_torch_engine_resumes_bitwise_from_its_checkpoint(tmp_path):
    """`--engine torch --save-every`: per-rank checkpoints with the compression state (EF here); a run resumed from
    the step-4 checkpoint ends with the uninterrupted run's weights, optimizer, schedule and compression state."""
    common = [*TINY, "--steps", "8", "--eval-every", "0", "--untied", "--engine", "torch", "--save-every", "4",
              "--keep-checkpoints", "0", "--digest", "--pp-compress", "act=int8:rot+ef21,grad=int4:rot+ef,min_numel=0"]
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--out", str(tmp_path / "whole")))
    ckpt = tmp_path / "whole" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step4", "global_step8", "latest"]
    assert (ckpt / "latest").read_text() == "global_step8"
    half = tmp_path / "half"
    shutil.copytree(ckpt / "global_step4", half / "ckpt" / "global_step4")
    (half / "ckpt" / "latest").write_text("global_step4")
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--resume", "--out", str(half)))
    assert [r["step"] for r in rows(half, "train")] == [5, 6, 7, 8]
    whole, resumed = (json.loads((d / "summary.json").read_text())["digest"] for d in (tmp_path / "whole", half))
    assert len(whole) == 2 and whole == resumed
    assert all(r["rss_mb"] > 0 for r in rows(half, "train"))


@pytest.mark.parametrize("engine", ["deepspeed", "torch"])
def test_auto_decides_every_boundary_in_both_engines(tmp_path, engine):
    """`--pp-compress auto`: before step 1 and every `every` steps, each boundary's sender probes its link, times
    the candidates, and tells the receiver; both sides then run the same codec (a mismatch could not decode)."""
    extra = ["--engine", "torch"] if engine == "torch" else []
    rc, log = run_job(ROOT / "recipes/pretrain.py", 3, *TINY, "--stages", "3", "--grad-accum", "3", "--steps", "6", "--eval-every", "0",
                      "--untied", "--pp-compress", "auto:every=2,min_numel=0", "--out", str(tmp_path / engine), *extra)
    ok(rc, log)
    for b, direction in ((0, "act"), (0, "grad"), (1, "act"), (1, "grad")):
        assert f"step 1: pp_compress auto: boundary {b} {direction}: link" in log, (b, direction)
    losses = [r["loss"] for r in rows(tmp_path / engine, "train")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)


def test_muon_trains_the_blocks_matrices_and_resumes_exactly(tmp_path):
    """`--optimizer muon`: DeepSpeed's Muon takes the blocks' matrices at --muon-lr and AdamW the embedding, norms and
    biases at --lr, with the weight decay scaled so that the matrices decay per step as under AdamW; the schedule
    scales both rates alike; a run resumed from its step-2 checkpoint ends where the whole run does."""
    import torch

    common = [*TINY, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--pp-compress", "int8,min_numel=0",
              "--optimizer", "muon", "--muon-lr", "0.02", "--lr", "1e-3", "--weight-decay", "0.1"]
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--out", str(tmp_path / "whole")))
    adamw = tmp_path / "adamw"
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *[a for a in common if a not in ("--optimizer", "muon")],
                "--out", str(adamw)))
    whole = rows(tmp_path / "whole", "train")
    assert whole[0]["loss"] == rows(adamw, "train")[0]["loss"] and whole[-1]["loss"] != rows(adamw, "train")[-1]["loss"]
    state = torch.load(tmp_path / "whole/ckpt/global_step4/mp_rank_00_model_states.pt", weights_only=False)
    groups = {g["use_muon"]: g for g in state["optimizer"]["param_groups"]}
    ratio = groups[True]["lr"] / groups[False]["lr"]  # the schedule's factor is the same for both
    assert ratio == pytest.approx(20) and groups[True]["weight_decay"] == pytest.approx(0.1 * 1e-3 / 0.02)
    assert len(groups[True]["params"]) > 0 and len(groups[False]["params"]) > 0
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed, ignore=shutil.ignore_patterns("global_step4", "metrics.*"))
    (resumed / "ckpt" / "latest").write_text("global_step2")
    ok(*run_job(ROOT / "recipes/pretrain.py", 2, *common, "--resume", "--out", str(resumed)))
    assert rows(resumed, "train")[-1]["loss"] == whole[-1]["loss"]
    # what muon refuses: test_train.py's test_muon_refuses_the_torch_engine_and_a_bottleneck_rate_of_its_own
