import pytest
import torch

from pp_compress.ops import example_specs

# Every registered operator's own EXAMPLES (see OpConfig.EXAMPLES), plus compositions (not operators themselves).
CHAIN_SPECS = ["topk:0.1>int8", "topk:0.2>bf16", "lowrank:2>int8", "topk:0.1>int3", "mdtopk:0.2>int8",
               "mdtopk:0.3:mode=weighted_greedy>int4"]
OP_SPECS = example_specs() + CHAIN_SPECS
FEEDBACK_SPECS = ["topk:0.1+ef", "int4+ef", "randk:0.2+ef21", "topk:0.1>int8+ef21", "int8+aqsgd", "topk:0.3+aqsgd",
                  "int3:rot+ef", "int4:rot:stoch+ef21", "int1+ef", "nat:bits=4+ef21", "mdtopk:0.2+ef",
                  "mdtopk:0.2:mode=stochastic>int8+ef21"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(run directory, cache) of a 16-step uncompressed 2-stage pretraining run of the tiny GPT on the fixture corpus:
    a real checkpoint for the tools that read one (eval/, benchmarks/). Processes that use it need
    PP_COMPRESS_CACHE=cache (its tokenizer and data)."""
    from tests.integration.launch import ROOT, run_job

    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("run")
    rc, log = run_job(ROOT / "recipes/pretrain.py", 2, "--corpus", "fixture", "--model", "tiny", "--tokenizer", "bpe512",
                      "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "16", "--eval-batches", "2",
                      "--eval-every", "0", "--lr", "3e-3", "--log-every", "8",
                      "--pp-compress", "none", "--out", str(out), env={"PP_COMPRESS_CACHE": str(cache), "HF_HOME": str(cache / "hf")})
    assert rc == 0, log[-3000:]
    return out, cache
