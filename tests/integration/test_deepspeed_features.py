"""Turning pp_compress on loses nothing DeepSpeed gives: each pipeline feature with `identity` is bitwise stock
DeepSpeed, with int8 it stays close, and engines pp_compress cannot compress pass through with a warning.
(The assertions follow DeepSpeed's own pipeline tests: tests/unit/pipe/test_pipe_module.py compares a pipeline with
the sequential model; here stock DeepSpeed is the reference, on the same worker.)"""
import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import launch  # noqa: E402


def run(tmp_path, nproc, *args):
    rc, log, res = launch(tmp_path, nproc, *args)
    assert rc == 0, log[-4000:]
    assert len(res) == nproc, log[-4000:]
    return res, log


def _same(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for rank in a:
        for k in keys:
            assert a[rank].get(k) == b[rank].get(k), (rank, k, a[rank].get(k), b[rank].get(k))


@pytest.mark.parametrize("feature", [("--eval-options",), ("--act-ckpt",), ("--reshape",)],
                         ids=["eval_batch-options", "activation-checkpointing", "reset_activation_shape"])
def test_identity_is_bitwise_stock_and_int8_stays_close(tmp_path, feature):
    import deepspeed

    from pp_compress.versions import release

    if "--act-ckpt" in feature and release(deepspeed.__version__) < (0, 19, 0):
        pytest.skip("stock DeepSpeed before 0.19 cannot checkpoint activations on its CPU accelerator (no Stream there)")
    stock, _ = run(tmp_path / "stock", 2, "--steps", "4", *feature)
    ident, _ = run(tmp_path / "ident", 2, "--steps", "4", "--spec", "identity", *feature)
    _same(stock, ident, ("losses", "eval", "eval_logits_sum", "eval_nobcast", "sent_bytes"))
    int8, _ = run(tmp_path / "int8", 2, "--steps", "4", "--spec", "int8", "--hidden", "256", *feature)
    stock256, _ = run(tmp_path / "stock256", 2, "--steps", "4", "--hidden", "256", *feature)
    for a, b in zip(int8[1]["losses"], stock256[1]["losses"]):
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3
    if "--eval-options" in feature:  # the logits came back from the last stage (rank 1) through compressed traffic
        assert int8[1]["eval_logits_sum"] == pytest.approx(stock256[1]["eval_logits_sum"], rel=0.05, abs=0.5)
        assert ident[0]["eval_nobcast"] is None and len(ident[1]["eval_nobcast"]) == 2  # per micro-batch, not broadcast


def test_dualpipev_identity_is_bitwise_stock_and_int8_compresses(tmp_path):
    pytest.importorskip("deepspeed.runtime.pipe.dualpipev", reason="DualPipeV came with DeepSpeed 0.19.7")
    stock, _ = run(tmp_path / "stock", 2, "--steps", "4", "--dualpipev")
    ident, _ = run(tmp_path / "ident", 2, "--steps", "4", "--dualpipev", "--enable", "--spec", "identity")
    assert {r["engine"] for r in ident.values()} == {"CompressedDualPipeVEngine"}
    _same(stock, ident, ("losses", "eval"))
    int8, _ = run(tmp_path / "int8", 2, "--steps", "4", "--dualpipev", "--enable", "--spec", "int8", "--hidden", "256")
    stock256, _ = run(tmp_path / "stock256", 2, "--steps", "4", "--dualpipev", "--hidden", "256")
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
    stock, _ = run(tmp_path / "stock", 2, "--steps", str(steps), "--pair", *dualpipev[:1])
    ident, _ = run(tmp_path / "ident", 2, "--steps", str(steps), "--pair", "--spec", "identity", *dualpipev)
    stock_per_mb, ident_per_mb = ({0: 3, 1: 4}, {0: 2, 1: 2}) if dualpipev else ({0: 2, 1: 1}, {0: 1, 1: 1})
    def passes(res: dict) -> dict[int, int]:
        return {r: v["backward_passes"] // (steps * gas) for r, v in res.items()}

    assert passes(stock) == stock_per_mb, "DeepSpeed's backward changed: if one pass now, drop _OneBackwardPass"
    assert passes(ident) == ident_per_mb
    loss_rank = 0 if dualpipev else 1
    for a, b in zip(ident[loss_rank]["losses"], stock[loss_rank]["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert ident[loss_rank]["eval"] == pytest.approx(stock[loss_rank]["eval"], rel=1e-5)
