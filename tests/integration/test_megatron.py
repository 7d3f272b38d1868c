"""pp_compress.megatron on Megatron-Core's own schedules, in real processes on CPU/gloo (the CUDA shim is the lab's
megatron_cpu.py): identity is bitwise the stock engine, compressed traffic shrinks and trains, variable lengths and
a restarted session work."""
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launch import HANG_S, run_job, run_variants

# Megatron-Core imports triton, which must not be imported in the test process before the interpreter tests
# (tests/unit/ops/interpreted.py): found, not imported, and everything that imports it runs in a process of its own
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

WORKER = Path(__file__).with_name("megatron_worker.py")
run = functools.partial(run_variants, worker=WORKER)


def same(a: dict[int, dict], b: dict[int, dict]) -> None:
    for rank in a:
        for key in ("losses", "grads", "eval"):
            assert a[rank][key] == b[rank][key], (rank, key)


@pytest.mark.parametrize("nproc,args", [(2, []), (2, ["--no-batch"]), (2, ["--variable"]), (3, ["--vpp", "2"]),
                                        (3, ["--vpp", "2", "--overlap", "--no-batch"]),
                                        (4, ["--tp", "2"]), (4, ["--tp", "2", "--sp"])],
                         ids=["1f1b", "1f1b-unbatched", "variable-lengths", "interleaved-pp3", "interleaved-overlapped",
                              "tp2xpp2", "tp2xpp2-sequence-parallel"])
def test_identity_is_bitwise_stock_megatron_and_int8_shrinks_the_traffic(tmp_path, nproc, args):
    res = run(tmp_path, nproc, {"stock": [], "ident": ["--spec", "identity"], "int8": ["--spec", "act=int8,grad=int8"]},
              *args)
    same(res["stock"], res["ident"])
    last, pp = nproc - 1, nproc // (int(args[args.index("--tp") + 1]) if "--tp" in args else 1)
    assert len(res["stock"][last]["losses"]) == 3 * 2 * pp and res["stock"][last]["eval"]
    rows = {k: v for r in res["int8"].values() for k, v in r["stats"].items() if v["calls"]}
    assert {k.split(".")[1] for k in rows} >= {"act", "grad", "act_eval"}
    assert all(v["ratio"] > 3.5 for v in rows.values()), rows
    if "--variable" not in args:  # [seq, batch, hidden] fp32; with sequence parallel each rank sends its shard
        shard = 16 // (nproc // pp) if "--sp" in args else 16
        assert {v["raw_bytes"] / v["calls"] for v in rows.values()} == {shard * 4 * 32 * 4}, rows
    for a, b in zip(res["int8"][last]["losses"], res["stock"][last]["losses"], strict=True):
        assert abs(a - b) <= 0.02 * b + 1e-4


def test_interleaved_on_two_ranks_is_exact_with_batched_p2p(tmp_path):
    """With 2 pipeline ranks the previous and the next rank are one rank: stock Megatron-Core's batched posting order
    swaps the activation and the gradient it sends there on gloo (wrong gradients, no error); the adapter posts them
    in the order the peer receives them, so identity matches stock Megatron-Core run without batching."""
    res = run(tmp_path, 2, {"unbatched": ["--no-batch"], "ident": ["--spec", "identity"]}, "--vpp", "2")
    same(res["unbatched"], res["ident"])


def test_a_restarted_session_resumes_its_error_feedback_exactly(tmp_path):
    """Save after 3 steps, a new session (enable, load), 3 more: the same losses as the uninterrupted session."""
    spec = ["--spec", "act=int4+ef,grad=int8+ef21"]
    res = run(tmp_path, 2, {"whole": [*spec, "--steps", "6"], "resumed": [*spec, "--save", str(tmp_path / "ckpt")]})
    assert res["whole"][1]["losses"] == res["resumed"][1]["losses"]
    assert (tmp_path / "ckpt").is_dir()


def test_megatron_lm_s_command_line_turns_it_on_with_a_spec_or_a_yaml_file(tmp_path):
    """`pretrain(..., extra_args_provider=ppm.add_arguments)`: --pp-compress, or --pp-compress-config's YAML section,
    read from Megatron-LM's parsed arguments at the first schedule call, trains as enable(spec) does, bitwise."""
    (tmp_path / "pp.yaml").write_text("pp_compress:\n  activations: int8\n  gradients: int8\n  min_numel: 0\n")
    res = run(tmp_path / "run", 2, {"enable": ["--spec", "act=int8,grad=int8"],
                                    "flag": ["--lm-args", "--pp-compress act=int8,grad=int8,min_numel=0"],
                                    "yaml": ["--lm-args", f"--pp-compress-config {tmp_path / 'pp.yaml'}"]})
    same(res["enable"], res["flag"])
    same(res["enable"], res["yaml"])
    assert res["yaml"][0]["stats"]["b0.act"]["ratio"] > 3.5


def test_auto_decides_every_link_of_the_1f1b_schedule_and_refuses_the_interleaved_one(tmp_path):
    """`auto`: before step 1 and every `every` steps each link's sender probes the link, times the candidates and
    tells the receiver, over the adapter's own p2p; both sides switch together (a mismatch could not decode)."""
    rc, log = run_job(WORKER, 3, "--out", str(tmp_path), "--spec", "auto:every=2", "--steps", "4")
    assert rc == 0, log[-4000:]
    for b, direction in ((0, "act"), (0, "grad"), (1, "act"), (1, "grad")):
        assert f"step 1: pp_compress auto: boundary {b} {direction}: link" in log, (b, direction, log[-3000:])
    rc, log = run_job(WORKER, 2, "--out", str(tmp_path / "vpp"), "--spec", "auto", "--vpp", "2")
    assert rc != 0 and "pp_compress.megatron cannot serve: auto" in log and "interleaved schedule" in log


def test_a_bad_spec_fails_at_enable_with_one_message():
    code = "import pp_compress.megatron as ppm; ppm.enable('int8:per=rows')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("ValueError:") and "int8:per=rows" in last, done.stderr[-2000:]


def test_a_bad_config_file_fails_as_megatron_lm_parses_its_command_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("pp_compress:\n  activation: int8\n")  # a misspelt key
    code = ("import argparse, sys, pp_compress.megatron as ppm; "
            "ppm.add_arguments(argparse.ArgumentParser()).parse_args(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", code, "--pp-compress-config", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, timeout=HANG_S)
    lines = [line for line in done.stderr.splitlines() if "pp_compress" in line]
    assert done.returncode == 2 and len(lines) == 1 and "unknown pp_compress key(s) ['activation']" in lines[0], \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr
