"""Real multi-process DeepSpeed pipelines on CPU/gloo (torchrun, free ports, reaped on failure)."""
import pytest
import torch

pytest.importorskip("deepspeed")
import pp_compress as ppc  # noqa: E402
from tests.integration.launch import launch, run_variants  # noqa: E402

HANDSHAKE, META = 4, 1024  # DeepSpeed's own p2p bytes: init handshake (stage 0) + one activation meta message


def run(tmp_path, nproc, *args):
    rc, log, res = launch(tmp_path, nproc, *args)
    assert rc == 0, log[-4000:]
    assert len(res) == nproc, log[-4000:]
    return res


def test_identity_is_bitwise_plain_deepspeed(tmp_path):
    res = run_variants(tmp_path, 2, {"plain": [], "ident": ["--spec", "identity"]}, "--steps", "6")
    plain, ident = res["plain"], res["ident"]
    assert plain[0]["losses"] == ident[0]["losses"] and plain[0]["eval"] == ident[0]["eval"]
    assert plain[0]["sent_bytes"] == ident[0]["sent_bytes"] and plain[1]["sent_bytes"] == ident[1]["sent_bytes"]


@pytest.mark.parametrize("spec,promise", [("act=int8,grad=int8", ("int8", "int8")),
                                          ("act=topk:0.1,grad=topk:0.3+ef", ("topk:0.1", "topk:0.3"))])
def test_wire_bytes_shrink_as_promised_and_loss_falls(tmp_path, spec, promise):
    steps, calls = 12, 12 * 4
    res = run(tmp_path, 2, "--steps", str(steps), "--spec", spec, "--hidden", "256")
    act_shape, grad_shape = (4, 256), (4, 256)
    act_payload = ppc.build(promise[0]).wire_nbytes(act_shape, torch.float32) * calls
    grad_payload = ppc.build(promise[1]).wire_nbytes(grad_shape, torch.float32) * calls
    # bytes measured at deepspeed's p2p.send = payload + DeepSpeed's own handshake/meta, nothing else
    assert res[0]["sent_bytes"] == act_payload + HANDSHAKE + META
    assert res[1]["sent_bytes"] == grad_payload
    raw = 4 * 256 * 4 * calls
    assert res[0]["stats"]["b0.act"]["raw_bytes"] == raw and res[0]["stats"]["b0.act"]["wire_bytes"] == act_payload
    assert raw / act_payload > (3.8 if promise[0] == "int8" else 4.9)
    losses = res[0]["losses"]
    assert sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize("nproc,stages,extra", [(3, 3, []), (4, 4, ["--bf16"]), (4, 2, [])])
def test_more_stages_bf16_and_data_parallel(tmp_path, nproc, stages, extra):
    res = run(tmp_path, nproc, "--stages", str(stages), "--steps", "24", "--spec", "act=int8,grad=topk:0.3+ef", *extra)
    for r in res.values():
        assert r["losses"] == res[0]["losses"] or r["dp"] != res[0]["dp"]
        assert all(x == x and x < 1e3 for x in r["losses"])  # finite
        if not extra:  # the 4-stage bf16 MLP barely moves in 24 steps even uncompressed (1.49 -> 1.37)
            assert sum(r["losses"][-6:]) < sum(r["losses"][:6])
    # every boundary carried compressed traffic both ways
    seen = {k for r in res.values() for k in r["stats"]}
    assert seen >= {f"b{b}.{d}" for b in range(stages - 1) for d in ("act", "grad")}


CKPT_SPECS = {"ef21": ("act=topk:0.2+ef21,grad=randk:0.3+ef", []), "aqsgd": ("act=int4+aqsgd,grad=topk:0.3+aqsgd", ["--ids"]),
              "ef": ("act=mdtopk:0.3:mode=stochastic+ef,grad=nat:bits=4", [])}


def test_checkpoint_resume_with_error_feedback_is_identical(tmp_path):
    """Each setting in one job of 2 stages x 2 data-parallel ranks: saved at step 4, continued, and resumed into a fresh
    engine from the checkpoint."""
    runs = {name: ["--spec", spec, "--ckpt", str(tmp_path / f"ckpt_{name}"), *extra]
            for name, (spec, extra) in CKPT_SPECS.items()}
    for name, res in run_variants(tmp_path, 4, runs, "--stages", "2", "--steps", "8").items():
        for r in res.values():
            assert r["continued"] == r["resumed"], (name, r)
            if name != "aqsgd":  # measured at step 0 (AQ-SGD sends first visits raw: no error there)
                assert r["stats"]["b0.act" if r["stage"] == 0 else "b0.grad"]["rel_error"] > 0, name


def test_aqsgd_with_sample_ids_in_the_tuple_learns_and_revisits_samples(tmp_path):
    res = run(tmp_path, 2, "--steps", "16", "--spec", "act=topk:0.2+aqsgd,grad=int8", "--ids", "--hidden", "128")
    act = res[0]["stats"]["b0.act"]
    # 16 samples in the pool: after the first visits, only deltas travel (topk:0.2 ~ 2.5x fewer bytes)
    assert act["ratio"] > 1.8, act
    losses = res[0]["losses"]
    assert sum(losses[-3:]) < sum(losses[:3])


def test_config_mismatch_stops_every_rank(tmp_path):
    rc, log, res = launch(tmp_path, 2, "--steps", "2", "--spec", "int8", "--rank1-spec", "int4")
    assert rc != 0 and "config differs across ranks" in log and not res


def test_bad_spec_fails_clearly_on_every_rank(tmp_path):
    rc, log, res = launch(tmp_path, 2, "--steps", "2", "--spec", "topk:1.5")
    assert rc != 0 and not res
    assert log.count("topk ratio=1.5") >= 2 and "accepted" in log


def test_bool_masks_pass_untouched_and_identity_stays_bitwise(tmp_path):
    """has_attention_mask: stock DeepSpeed sends the mask as half; pp_compress sends its uint8 bytes, compresses the
    float tensor, and with identity trains bitwise like stock."""
    res = run_variants(tmp_path, 2, {"plain": [], "ident": ["--spec", "identity"], "int8": ["--spec", "int8"]},
                   "--steps", "4", "--mask")
    plain, ident, int8 = res["plain"], res["ident"], res["int8"]
    assert plain[0]["losses"] == ident[0]["losses"] and plain[0]["eval"] == ident[0]["eval"]
    assert ident[0]["sent_bytes"] < plain[0]["sent_bytes"]  # 1 byte per mask element instead of 2
    assert int8[0]["stats"]["b0.act"]["ratio"] > 1.5


def test_enable_hooks_deepspeed_initialize_from_the_json_section(tmp_path):
    """ppd.enable() + the script's own deepspeed.initialize(args=...): compressed with a "pp_compress" section,
    stock DeepSpeed (bitwise) without one."""
    res = run_variants(tmp_path, 2, {"plain": [], "stock": ["--enable"], "hooked": ["--enable", "--spec", "act=int8,grad=int8"]},
                   "--steps", "4")
    plain, stock, hooked = res["plain"], res["stock"], res["hooked"]
    assert stock[0]["engine"] == "PipelineEngine" and stock[0]["losses"] == plain[0]["losses"]
    assert stock[0]["sent_bytes"] == plain[0]["sent_bytes"]
    assert hooked[0]["engine"] == "CompressedPipelineEngine"
    assert hooked[0]["stats"]["b0.act"]["ratio"] > 3 and hooked[1]["stats"]["b0.grad"]["ratio"] > 3
