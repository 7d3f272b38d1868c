"""pp_compress.torch_pipelining on real torchrun processes (gloo): four of torch's schedules."""
from pathlib import Path

import pytest

from tests.integration.launch import run_variants

WORKER = Path(__file__).with_name("torch_pipe_worker.py")
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]


def losses(res: dict[int, dict]) -> list[float]:
    return next(r["losses"] for r in res.values() if r["losses"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_identity_is_bitwise_the_stock_stage(tmp_path, schedule):
    res = run_variants(tmp_path, 2, {"stock": [], "ident": ["--spec", "identity"]}, "--schedule", schedule, worker=WORKER)
    stock, ident = res["stock"], res["ident"]
    assert {r["engine"] for r in ident.values()} == {"CompressedPipelineStage"}
    assert losses(stock) == losses(ident) and len(losses(stock)) == 4
    assert [stock[r]["sent_bytes"] for r in (0, 1)] == [ident[r]["sent_bytes"] for r in (0, 1)]


@pytest.mark.parametrize("schedule,spec,ratio", [("GPipe", "int8", 3.8), ("1F1B", "act=nf6,grad=int3:stoch", 6.8),
                                                 ("Interleaved1F1B", "int8", 3.8), ("ZBVZeroBubble", "act=nf6,grad=int3:stoch", 6.8)])
def test_compressed_bytes_shrink_by_the_stated_ratio_and_training_follows(tmp_path, schedule, spec, ratio):
    res = run_variants(tmp_path, 2, {"stock": [], "comp": ["--spec", spec]}, "--schedule", schedule, "--hidden", "256",
                       "--steps", "6", worker=WORKER)
    stock, comp = res["stock"], res["comp"]
    total = sum(r["sent_bytes"] for r in stock.values()) / sum(r["sent_bytes"] for r in comp.values())
    rows = {k: v for r in comp.values() for k, v in r["stats"].items() if v["calls"]}  # the senders' rows
    assert {k.split(".")[1] for k in rows} == {"act", "grad"}
    both = sum(v["raw_bytes"] for v in rows.values()) / sum(v["wire_bytes"] for v in rows.values())
    assert total > ratio and both == pytest.approx(total, rel=0.01)  # the stats count what went on the wire
    ref, got = losses(stock), losses(comp)
    assert got[-1] < got[0]  # it trains
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(got, ref))
