"""Start a script on several CPU processes (pp_lab/spawn.py, torchrun, or the deepspeed launcher as users run it) on a
free port, and always reap the whole job: its ranks run in sessions of their own and are found by a mark in their
environment.
The tests, the quality study and the benchmarks all launch recipes through this.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import typing
import uuid
from pathlib import Path
from typing import Any, Literal

from pp_lab.paths import ROOT
JOB_MARK = "PP_COMPRESS_JOB"
"""The environment variable whose value marks every process of one job (see `kill_job`)."""
OWN_JOB = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
           "TORCHELASTIC_RUN_ID")
"""Variables a job's launcher sets for its ranks: a job started from inside one does not inherit them."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Launcher = Literal["local", "torchrun", "deepspeed"]
LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)
"""local: pp_lab/spawn.py (torchrun's rank environment, no torch in the launcher: about 1.5 s less per job);
torchrun; deepspeed: the product card's `deepspeed --num_gpus N script.py ...`."""


def start_job(script: Path, nproc: int, *args: str, launcher: Launcher = "local", env: dict[str, str] | None = None,
              log: Any = subprocess.PIPE) -> tuple[subprocess.Popen, str]:
    """Start `script` on nproc CPU processes (gloo) without waiting: (the launcher's process, the job's mark for
    `kill_job` / `rank_pids`). Its output goes to `log` (a pipe by default, or an open file)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}; accepted: {', '.join(LAUNCHERS)}")
    tag = uuid.uuid4().hex  # launchers start ranks in sessions of their own: find them by this mark
    inherited = {k: v for k, v in os.environ.items() if k not in OWN_JOB}  # a job started from inside another one
    env = {**inherited, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           JOB_MARK: tag, **(env or {})}
    port = free_port()
    if launcher == "deepspeed":
        cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(nproc), f"--master_port={port}",
               str(script), *args]
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               str(script), *args]
    else:
        cmd = [sys.executable, "-m", "pp_lab.spawn", "--nproc", str(nproc), "--master-port", str(port), str(script),
               *args]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, tag


def run_job(script: Path, nproc: int, *args: str, launcher: Launcher = "local", timeout: int = 240,
            env: dict[str, str] | None = None, log_file: Path | None = None) -> tuple[int, str]:
    """Run `script` on nproc CPU processes (gloo); returns (exit code, combined log). A job that runs past `timeout`
    is killed, ranks and all, and raises TimeoutError. With `log_file`, the log is appended there as it is written
    (so that a job cut off with its caller keeps it), and the returned log is this job's part of it."""
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a+") if log_file is not None else tempfile.TemporaryFile("w+") as f:
        begin = os.fstat(f.fileno()).st_size
        proc, tag = start_job(script, nproc, *args, launcher=launcher, env=env, log=f)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(tag)
            proc.wait(timeout=30)
            raise TimeoutError(f"job hung for {timeout}s:\n{_since(f, begin)[-4000:]}") from None
        finally:
            kill_job(tag)
        return proc.returncode, _since(f, begin)


def _since(f: Any, begin: int) -> str:
    """What was written to the open log `f` from byte `begin` on."""
    f.flush()
    f.seek(begin)
    return f.read()


def rank_pids(tag: str) -> dict[int, int]:
    """{rank: pid} of the job's rank processes (those whose environment has RANK besides the job's mark)."""
    mark, out = f"{JOB_MARK}={tag}".encode(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
        if mark in env and ranks and ranks[0].isdigit():
            out[int(ranks[0])] = int(pid)
    return out


def kill_job(tag: str) -> None:
    """SIGKILL every process whose environment carries this job's mark (launcher and ranks alike)."""
    mark = f"{JOB_MARK}={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
