"""Turning pp_compress on loses nothing DeepSpeed gives: each pipeline feature with `identity` is bitwise stock
DeepSpeed, with int8 it stays close, and engines pp_compress cannot compress pass through with a warning.
(The assertions follow DeepSpeed's own pipeline tests: tests/unit/pipe/test_pipe_module.py compares a pipeline with
the sequential model; here stock DeepSpeed is the reference, on the same worker.)"""
import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import run_variants  # noqa: E402


def _same(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for rank in a:
        for k in keys:
            assert a[rank].get(k) == b[rank].get(k), (rank, k, a[rank].get(k), b[rank].get(k))


@pytest.mark.parametrize("feature", [("--eval-options",), ("--act-ckpt",), ("--reshape",), ("--variable",)],
                         ids=["eval_batch-options", "activation-checkpointing", "reset_activation_shape",
                              "variable-lengths-per-micro-batch"])
def test_identity_is_bitwise_stock_and_int8_stays_close(tmp_path, feature):
    import deepspeed

    from pp_compress.versions import release

    if "--act-ckpt" in feature and release(deepspeed.__version__) < (0, 19, 0):
        pytest.skip("stock DeepSpeed before 0.19 cannot checkpoint activations on its CPU accelerator (no Stream there)")
    res = run_variants(tmp_path, 2, {"stock": [], "ident": ["--spec", "identity"], "int8": ["--spec", "int8", "--hidden", "256"],
                                 "stock256": ["--hidden", "256"]}, "--steps", "4", *feature)
    stock, ident, int8, stock256 = res["stock"], res["ident"], res["int8"], res["stock256"]
    _same(stock, ident, ("losses", "eval", "eval_logits_sum", "eval_nobcast", "sent_bytes"))
    for a, b in zip(int8[1]["losses"], stock256[1]["losses"]):
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3
    if "--eval-options" in feature:  # the logits came back from the last stage (rank 1) through compressed traffic
        assert int8[1]["eval_logits_sum"] == pytest.approx(stock256[1]["eval_logits_sum"], rel=0.05, abs=0.5)
        assert ident[0]["eval_nobcast"] is None and len(ident[1]["eval_nobcast"]) == 2  # per micro-batch, not broadcast


def test_dualpipev_identity_is_bitwise_stock_and_int8_compresses(tmp_path):
    pytest.importorskip("deepspeed.runtime.pipe.dualpipev", reason="DualPipeV came with DeepSpeed 0.19.7")
    res = run_variants(tmp_path, 2, {"stock": [], "ident": ["--enable", "--spec", "identity"],
                                 "int8": ["--enable", "--spec", "int8", "--hidden", "256"], "stock256": ["--hidden", "256"]},
                   "--steps", "4", "--dualpipev")
    stock, ident, int8, stock256 = res["stock"], res["ident"], res["int8"], res["stock256"]
    assert {r["engine"] for r in ident.values()} == {"CompressedDualPipeVEngine"}
    _same(stock, ident, ("losses", "eval"))
    rows = {k: v for r in int8.values() for k, v in r["stats"].items() if v["calls"]}
    # 2 ranks, 4 model stages: boundaries 0 (rank 0 -> 1) and 2 (rank 1 -> 0) cross the wire, 1 is the turn-around
    assert set(rows) == {"b0.act", "b2.act", "b0.grad", "b2.grad"}  # (the worker reads the stats before eval_batch)
    assert all(v["ratio"] > 3.5 for v in rows.values())
    for a, b in zip(int8[0]["losses"], stock256[0]["losses"]):  # rank 0 holds the loss stage
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3


@pytest.mark.parametrize("engine", ["pipeline", "dualpipev"])
def test_several_float_outputs_take_one_backward_pass(tmp_path, engine):
    """DeepSpeed backpropagates each float tensor a stage sends on its own, walking the stage's graph once per tensor;
    the compressed engine walks it once for all of them, with the same gradients up to the order of a sum. Each model
    stage counts the passes through its first layer: per micro-batch, a stage that sends two tensors takes 2 in stock
    DeepSpeed, the loss stage 1; a DualPipeV rank holds two model stages (rank 0: the first and the loss stage)."""
    steps, gas = 3, 4  # the worker's 4 micro-batches per step
    dualpipev = ("--dualpipev", "--enable") if engine == "dualpipev" else ()
    if dualpipev:
        pytest.importorskip("deepspeed.runtime.pipe.dualpipev", reason="DualPipeV came with DeepSpeed 0.19.7")
    res = run_variants(tmp_path, 2, {"stock": [], "ident": ["--spec", "identity", *dualpipev[1:]]}, "--steps", str(steps),
                   "--pair", *dualpipev[:1])
    stock, ident = res["stock"], res["ident"]
    stock_per_mb, ident_per_mb = ({0: 3, 1: 4}, {0: 2, 1: 2}) if dualpipev else ({0: 2, 1: 1}, {0: 1, 1: 1})
    def passes(res: dict) -> dict[int, int]:
        return {r: v["backward_passes"] // (steps * gas) for r, v in res.items()}

    assert passes(stock) == stock_per_mb, "DeepSpeed's backward changed: if one pass now, drop _OneBackwardPass"
    assert passes(ident) == ident_per_mb
    loss_rank = 0 if dualpipev else 1
    for a, b in zip(ident[loss_rank]["losses"], stock[loss_rank]["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert ident[loss_rank]["eval"] == pytest.approx(stock[loss_rank]["eval"], rel=1e-5)
