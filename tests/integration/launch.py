"""ds_worker.py jobs for the tests; the launcher itself is lab/pp_lab/launch.py (shared with the study and benchmarks)."""
import json
from pathlib import Path

from pp_lab.launch import ROOT, free_port, kill_job, run_job  # noqa: F401 - re-exported for the tests

WORKER = Path(__file__).with_name("ds_worker.py")


def launch(out: Path, nproc: int, *worker_args: str, timeout: int = 240) -> tuple[int, str, dict[int, dict]]:
    """ds_worker.py on nproc ranks; returns (exit code, log, {rank: its JSON result})."""
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(WORKER, nproc, "--out", str(out), *worker_args, timeout=timeout)
    results = {}
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        results[r["rank"]] = r
    return rc, log, results
