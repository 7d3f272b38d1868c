"""Launch a torchrun job of ds_worker.py with a free port; always reap the process group."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ds_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, nproc: int, *worker_args: str, timeout: int = 240) -> tuple[int, str, dict[int, dict]]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(WORKER), "--out", str(out), *worker_args]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"pipeline job hung for {timeout}s:\n{log[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    results = {}
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        results[r["rank"]] = r
    return proc.returncode, log, results
