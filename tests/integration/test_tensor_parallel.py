"""2 pipeline stages x 2 tensor-parallel ranks (4 processes, gloo): the recipe's GPT with Megatron-style TP blocks and
[seq, batch, hidden] between stages, with DeepSpeed's partitioned pipes and without."""
import pytest
import torch

pytest.importorskip("deepspeed")
import pp_compress as ppc  # noqa: E402
from tests.integration.launch import launch, run_variants  # noqa: E402

TP = ["--tp", "2", "--steps", "4"]
SBH = (16, 4, 64)  # [seq, batch, hidden] of the tiny GPT in ds_worker.py
META = 1 + 3 + 2 + 3  # PartitionedTensor meta: ndim, shape, parts, rank, offsets (int64)


def run(tmp_path, *args):
    rc, log, res = launch(tmp_path, 4, *args)
    assert rc == 0 and len(res) == 4, log[-4000:]
    return res


@pytest.mark.parametrize("mode", [[], ["--no-partition"]], ids=["partitioned", "full"])
def test_identity_is_bitwise_stock_deepspeed_and_int8_shrinks_the_send(tmp_path, mode):
    res = run_variants(tmp_path, 4, {"stock": [], "ident": ["--spec", "identity"],
                                     "int8": ["--spec", "act=int8,grad=int8,batch_dim=1"]}, *TP, *mode)
    stock, ident, int8 = res["stock"], res["ident"], res["int8"]
    for r in range(4):
        assert stock[r]["losses"] == ident[r]["losses"] and stock[r]["eval"] == ident[r]["eval"]
        assert stock[r]["sent_bytes"] == ident[r]["sent_bytes"]
    calls = 4 * 4  # training micro-batches (sent_bytes is read before the final eval_batch)
    slice_shape = (SBH[0] // 2, *SBH[1:]) if not mode else SBH  # each TP rank sends its half, or everything
    payload = ppc.build("int8").wire_nbytes(slice_shape, torch.float32) + (0 if mode else META * 8)
    raw = 4 * torch.Size(slice_shape).numel() + (0 if mode else META * 8)
    for r in (0, 1):  # stage 0's two TP ranks send activations
        act = int8[r]["stats"]["b0.act"]
        assert act["wire_bytes"] == payload * calls and act["raw_bytes"] == raw * calls, act
        # bytes through DeepSpeed's p2p.send shrink by exactly what the layout promises
        assert ident[r]["sent_bytes"] - int8[r]["sent_bytes"] == (raw - payload) * calls
    assert sum(int8[0]["losses"][-2:]) < sum(int8[0]["losses"][:2])


def test_per_sample_topk_and_aqsgd_with_batch_dim_1_train_on_partitioned_slices(tmp_path):
    res = run(tmp_path, *TP, "--steps", "8", "--ids", "--spec", "act=topk:0.3+aqsgd,grad=topk:0.5,batch_dim=1")
    assert sum(res[0]["losses"][-3:]) < sum(res[0]["losses"][:3])
    assert res[0]["stats"]["b0.act"]["ratio"] > 1.0 and res[2]["stats"]["b0.grad"]["ratio"] > 1.5
