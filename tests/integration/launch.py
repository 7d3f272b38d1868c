"""Start multi-process jobs (torchrun or the deepspeed launcher) on free ports; always reap the process group."""
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

WORKER = Path(__file__).with_name("ds_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: Path, nproc: int, *args: str, launcher: str = "torchrun", timeout: int = 240,
            env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `script` on nproc CPU processes (gloo); returns (exit code, combined log). Hangs become failures."""
    tag = uuid.uuid4().hex  # launchers start ranks in sessions of their own: find them by this mark
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PP_COMPRESS_TEST_JOB": tag, **(env or {})}
    port = f"--master_port={free_port()}"
    if launcher == "deepspeed":  # the product card's launcher: `deepspeed --num_gpus N script.py ...`
        cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(nproc), port, str(script), *args]
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", port, str(script), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(tag)
        log, _ = proc.communicate(timeout=30)
        raise AssertionError(f"job hung for {timeout}s:\n{log[-4000:]}")
    finally:
        kill_job(tag)
    return proc.returncode, log


def kill_job(tag: str) -> None:
    """SIGKILL every process whose environment carries this job's mark (launcher and ranks alike)."""
    mark = f"PP_COMPRESS_TEST_JOB={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def launch(out: Path, nproc: int, *worker_args: str, timeout: int = 240) -> tuple[int, str, dict[int, dict]]:
    """ds_worker.py on nproc ranks; returns (exit code, log, {rank: its JSON result})."""
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(WORKER, nproc, "--out", str(out), *worker_args, timeout=timeout)
    results = {}
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        results[r["rank"]] = r
    return rc, log, results
