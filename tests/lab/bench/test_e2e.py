"""benchmarks/e2e.py and throttle.py: link parsing, the delay model, and one real run over rate-limited links."""
import argparse
import csv
import json
import subprocess
import sys

import pytest

from pp_lab.bench.e2e import AUTO_LINE, median_run, netns_permitted, timeline
from pp_lab.bench.throttle import LINKS, parse_link
from pp_lab.bench.throttle import delay_s
from tests.integration.launch import HANG_S, ROOT


def test_parse_link_forms_and_errors():
    assert parse_link("none") == ("none", 0.0, 0.0)
    assert parse_link("100mbit") == ("100mbit", 100.0, LINKS["100mbit"][1])
    assert parse_link("2.5gbit@0.3ms") == ("2.5gbit", 2500.0, 0.3)
    with pytest.raises(argparse.ArgumentTypeError, match="'5kbit'.*accepted: none, <N>mbit"):
        parse_link("5kbit")


def test_a_changing_link_gets_a_table_of_step_times_and_autos_decisions():
    log = ("[rank 1] step 0: pp_compress auto: boundary 1 act: link 1 GB/s, 0.1 ms; none: 1 ms per message expected\n"
           "noise\n[rank 2] step 8: pp_compress auto: boundary 1 grad: link 0.001 GB/s, 20 ms; aggressive (x): 9 ms\n")
    decisions = AUTO_LINE.findall(log)
    assert [d.split(":")[0] for d in decisions] == ["step 0", "step 8"] and "noise" not in "".join(decisions)
    link = "0=none~9s=5mbit"
    lines = timeline({(link, "none"): ([(1, 0.5), (2, 3.25)], []), (link, "auto"): ([(1, 0.6)], decisions)})
    table = "\n".join(lines)
    assert "| step | `none` | `auto` |" in table and "| 1 | 0.500 | 0.600 |" in table and "| 2 | 3.250 |  |" in table
    assert "- step 8: pp_compress auto: boundary 1 grad" in table and table.count("decisions") == 1
    steady = "\n".join(timeline({("25mbit", "auto"): ([], decisions[:1])}))  # a steady link: decisions, no step table
    assert "| step |" not in steady and "`auto`'s decisions on `25mbit`" in steady and "- step 0: pp_compress" in steady


def test_rounds_in_turns_report_the_run_of_the_median_step_time():
    runs = [({"step_s": t}, [{"step": 1, "step_s": t}], f"log {t}") for t in (0.9, 0.7, 1.4)]
    row, rows, log = median_run(runs)
    assert row == {"step_s": 0.9, "rounds": "0.900 0.700 1.400"} and log == "log 0.9" and rows[0]["step_s"] == 0.9
    assert median_run(runs[1:])[0]["step_s"] == 0.7  # of an even count, the lower: a run that happened
    assert median_run(runs[:1])[0] == {"step_s": 0.9, "rounds": "0.900"}


def test_delay_model():
    assert delay_s(1_000_000, 0.0, 0.0) == 0.0  # unlimited
    assert delay_s(1_250_000, 2.0, 100.0) == pytest.approx(0.002 + 0.1)  # 10 Mbit at 100 Mbit/s
    assert delay_s(0, 5.0, 1.0) == pytest.approx(0.005)


def test_compressed_run_over_a_rate_limited_link(tmp_path):
    """Two stage processes over a 25 Mbit/s link (namespaces + tbf here; emulated where not permitted)."""
    out = tmp_path / "res"
    cmd = [sys.executable, str(ROOT / "benchmarks/e2e.py"), "--link", "25mbit@1ms", "--spec", "none", "--spec", "int8",
           "--steps", "3", "--model", "tiny", "--work", str(tmp_path / "runs"), "--out", str(out),
           "--", "--corpus", "fixture", "--tokenizer", "bpe512", "--seq-len", "32", "--micro-batch", "2"]
    namespaces = lambda: set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) \
        if netns_permitted() is None else set()  # noqa: E731
    before = namespaces()  # another benchmark running beside this test may hold namespaces of its own
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [x["spec"] for x in rows] == ["none", "int8"]
    assert {x["mode"] for x in rows} == {"netns+tbf" if netns_permitted() is None else "emulated"}
    none, int8 = ({k: float(v) for k, v in x.items() if k in ("act_wire", "grad_wire", "raw", "step_s")} for x in rows)
    assert none["act_wire"] + none["grad_wire"] == none["raw"]
    assert 3.5 < none["raw"] / (int8["act_wire"] + int8["grad_wire"]) < 4.0
    assert float(rows[1]["speedup"]) > 0 and out.with_suffix(".png").exists()
    md = out.with_suffix(".md").read_text()
    assert "Untied embeddings: the links carry pipeline traffic only" in md
    assert "`tiny` GPT, 2 stages, micro-batch 2 x seq 32, 4 micro-batches per step" in md and "(mean of steps 3..3)" in md
    assert (tmp_path / "runs" / "25mbit_int8" / "job.log").read_text().count("loss") > 0  # every run's log is kept
    assert json.loads((tmp_path / "runs" / "25mbit_none" / "run.json").read_text())["model"]["tie_embeddings"] is False
    assert not [ns for ns in namespaces() - before if ns.startswith("ppcb")]  # this run's namespaces torn down


def test_bad_options_stop_before_any_run(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/e2e.py"), "--recipe", "finetune", "--model", "tiny",
                        "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode != 0 and "--model tiny: the finetune recipe's model is its checkpoint" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/e2e.py"), "--steps", "40", "--skip", "40",
                        "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode != 0 and "--skip 40: accepted 0..39 (the run has --steps 40)" in r.stderr


PAIR = '''
import os, socket, sys, time
size, rank = int(sys.argv[1]), int(os.environ["RANK"])
if rank == 1:
    s = socket.create_server(("0.0.0.0", 29601))
    c, _ = s.accept()
    for _ in range(3):
        got = 0
        while got < size:
            got += len(c.recv(1 << 20))
        c.sendall(b"k")
else:
    time.sleep(1.0)
    c = socket.create_connection((os.environ["MASTER_ADDR"].rsplit(".", 1)[0] + ".2", 29601))
    for _ in range(3):
        time.sleep(0.3)  # the link idles: a token bucket fills up in between
        t0 = time.perf_counter()
        c.sendall(b"x" * size)
        c.recv(1)
        print("took", time.perf_counter() - t0)
'''


def test_a_small_message_on_an_idle_shaped_link_takes_the_links_time(tmp_path):
    """A 37 KB message (one decode step's hidden states for 16 SmolLM2 sequences) over 5 Mbit/s needs 59 ms; the
    token bucket must not let it through at once."""
    import sys

    import pytest

    from pp_lab.bench.e2e import Namespaces

    if netns_permitted() is not None:
        pytest.skip(f"network namespaces: {netns_permitted()}")
    (tmp_path / "pair.py").write_text(PAIR)
    with Namespaces(2) as ns:
        ns.shape(5.0)
        rc, log = ns.run([sys.executable, str(tmp_path / "pair.py"), "37000"], {"PATH": "/usr/bin:/bin"}, 60)
    took = [float(line.split()[1]) for line in log.splitlines() if line.startswith("took")]
    assert rc == 0 and len(took) == 3, log
    assert min(took) > 0.8 * 37000 * 8 / 5e6, took


def test_a_link_per_boundary_and_its_changes_parse_and_apply(monkeypatch):
    from pp_lab.bench import throttle

    links = throttle.parse_links("0=none,1=5mbit@20ms~60s=100mbit@1ms")
    assert links == {0: [(0.0, 0.0, 0.0)], 1: [(0.0, 5.0, 20.0), (60.0, 100.0, 1.0)]}
    assert throttle.link_at(links[1], 59.9) == (5.0, 20.0) and throttle.link_at(links[1], 61) == (100.0, 1.0)
    assert parse_link("0=none,1=5mbit@20ms") == ("0=none,1=5mbit@20ms", 0.0, 0.0)  # one emulated profile
    for bad in ("1=5mbit,1=none", "x=none", "1=5mbit~10=none", "1=5mbit~20s=none~10s=none", "1=5kbit"):
        with pytest.raises((ValueError, argparse.ArgumentTypeError)):
            throttle.parse_links(bad)
    # the torch API: rank 1 sends to rank 2 over boundary 1, to rank 0 over boundary 0 (unlimited); boundary 2 (not
    # named) takes the global link
    import torch
    import torch.distributed as dist

    slept = []
    monkeypatch.setattr(dist, "send", lambda t, dst, *a, **k: None)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(throttle.time, "sleep", slept.append)
    throttle.install(3.0, 0.0, "torch", links)
    msg = torch.zeros(625_000, dtype=torch.uint8)  # 5 Mbit
    dist.send(msg, 2)
    dist.send(msg, 0)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    dist.send(msg, 3)
    assert slept == [pytest.approx(1.02), 0.0, pytest.approx(0.003)]


def test_batched_p2p_ops_sleep_for_each_send_on_its_link(monkeypatch):
    """PPC_BENCH_P2P=batch (Megatron-Core): a batch's sends each take their link's time before it is posted; its
    receives take none."""
    import types

    import torch
    import torch.distributed as dist

    from pp_lab.bench import throttle

    slept, posted = [], []
    monkeypatch.setattr(dist, "batch_isend_irecv", posted.append)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(throttle.time, "sleep", slept.append)
    throttle.install(0.0, 0.0, "batch", throttle.parse_links("0=5mbit@20ms,1=none"))
    msg = torch.zeros(625_000, dtype=torch.uint8)  # 5 Mbit
    ops = [types.SimpleNamespace(op=kind, tensor=msg, peer=peer)  # what a dist.P2POp holds
           for kind, peer in ((dist.isend, 0), (dist.irecv, 0), (dist.isend, 2))]
    dist.batch_isend_irecv(ops)
    assert slept == [pytest.approx(1.02), 0.0] and posted == [ops]
