"""ds_worker.py jobs for the tests; the launcher itself is lab/pp_lab/launch.py (shared with the study and benchmarks)."""
import json
import shlex
from pathlib import Path
from typing import Any

from pp_lab import launch as lab_launch
from pp_lab.launch import ROOT, free_port, kill_job  # noqa: F401 - re-exported for the tests

WORKER = Path(__file__).with_name("ds_worker.py")
HANG_S = 900
"""Every job's and subprocess's bound in the tests: a hang detector, never a performance check. Far above what any of
them takes on a machine fully loaded by other work, so only a real hang reaches it (and then costs minutes, not a
stuck CI)."""


def launch(out: Path, nproc: int, *worker_args: str, timeout: int = HANG_S) -> tuple[int, str, dict[int, dict]]:
    """ds_worker.py on nproc ranks; returns (exit code, log, {rank: its JSON result})."""
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(WORKER, nproc, "--out", str(out), *worker_args, timeout=timeout)
    results = {}
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        results[r["rank"]] = r
    return rc, log, results


def run_variants(out: Path, nproc: int, variants: dict[str, list[str]], *worker_args: str, worker: Path = WORKER,
                 timeout: int = HANG_S) -> dict[str, dict[int, dict]]:
    """A test worker (ds_worker.py by default) on nproc ranks, training one engine per variant in the same job (its
    args added to worker_args; tests/integration/variants.py); asserts that it succeeded and every rank wrote every
    variant; returns {variant: {rank: result}}."""
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(worker, nproc, "--out", str(out), *worker_args,
                      *(f"--variant={name}={shlex.join(args)}" for name, args in variants.items()), timeout=timeout)
    assert rc == 0, log[-4000:]
    files = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    assert len(files) == nproc, log[-4000:]
    return {name: {r["rank"]: r["variants"][name] for r in files} for name in variants}


def run_job(script: Path, nproc: int, *args: str, timeout: int = HANG_S, **kwargs: Any) -> tuple[int, str]:
    """pp_lab.launch.run_job with the tests' hang bound."""
    return lab_launch.run_job(script, nproc, *args, timeout=timeout, **kwargs)
