"""benchmarks/serve.py and throttle.py's torch hooks: KV-cached generation over a rate-limited link, side by side."""
import csv
import os
import subprocess
import sys
import time

import torch.distributed as dist

from pp_lab.bench.e2e import netns_permitted
from pp_lab.bench.throttle import install
from tests.integration.launch import HANG_S, ROOT


def test_torch_hooks_delay_sends_and_a_source_broadcast(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(dist, "send", lambda t, dst, *a, **k: calls.append(("send", dst)))
    monkeypatch.setattr(dist, "broadcast", lambda t, src, *a, **k: calls.append(("broadcast", src)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    install(40.0, 0.0, "torch")
    t0 = time.perf_counter()
    dist.send(torch.zeros(4), 1)
    dist.broadcast(torch.zeros(4), src=0)  # this rank is the source: one message on the link
    waited = time.perf_counter() - t0
    dist.broadcast(torch.zeros(4), src=1)  # a receiver does not wait
    assert calls == [("send", 1), ("broadcast", 0), ("broadcast", 1)]
    assert waited >= 0.08


def test_serving_over_a_rate_limited_link(tiny_run, tmp_path):
    run, cache = tiny_run
    out = tmp_path / "serve"
    cmd = [sys.executable, str(ROOT / "benchmarks/serve.py"), "--checkpoint", str(run), "--corpus", "fixture",
           "--link", "25mbit@1ms", "--stages", "2", "--batch", "2", "--spec", "none", "--spec", "int8",
           "--prompt-tokens", "16", "--new", "4", "--work", str(tmp_path / "work"), "--out", str(out)]
    env = {**os.environ, "PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf")}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [x["spec"] for x in rows] == ["none", "int8"]
    assert {x["mode"] for x in rows} == {"netns+tbf" if netns_permitted() is None else "emulated"}
    assert float(rows[0]["prefill_bits"]) == 32.0 and 8.0 < float(rows[1]["prefill_bits"]) < 9.5
    assert 8.0 < float(rows[1]["decode_bits"]) < 9.5  # min_numel=0: one-position messages are compressed too
    assert float(rows[1]["ttft_speedup"]) > 0 and float(rows[1]["decode_speedup"]) > 0
    md = out.with_suffix(".md").read_text()
    assert "prefill on the link s" in md and "`int8`" in md
    subprocess.run([sys.executable, str(ROOT / "benchmarks/serve.py"), "--rewrite", "--out", str(out)], check=True,
                   cwd=ROOT, capture_output=True, env=env)
    assert out.with_suffix(".md").read_text() == md  # the table comes back from the CSV alone


def test_keep_blocks_serves_the_first_blocks_of_a_transformers_folder(tmp_path):
    import pytest
    import torch
    import transformers

    from pp_lab.bench.serve import first_blocks
    from pp_lab.model import GPT, GPTConfig

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "full")
    cut = first_blocks(tmp_path / "full", 2, tmp_path / "work")
    assert cut == tmp_path / "work" / "full-blocks2" and GPTConfig.from_hf(cut).n_layer == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full", num_hidden_layers=2).eval()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(GPT(GPTConfig.from_hf(cut), cut).eval()(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit, match="--keep-blocks 4: full has 3 blocks; accepted: 1 to that"):
        first_blocks(tmp_path / "full", 4, tmp_path / "work")
