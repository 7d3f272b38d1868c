"""lab/pp_lab/launch.py: a job's log, appended to a file as it is written, and each call's own part returned."""
from pathlib import Path

from pp_lab.launch import run_job
from tests.integration.launch import HANG_S


def test_a_jobs_log_goes_to_its_file_and_each_call_returns_its_own_part(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello from rank', os.environ['RANK'])\nsys.exit(int(sys.argv[1]))\n")
    log = tmp_path / "run" / "train.log"
    rc, first = run_job(script, 1, "0", log_file=log, timeout=HANG_S)
    assert rc == 0 and "hello from rank 0" in first
    rc, second = run_job(script, 1, "3", log_file=log, timeout=HANG_S)
    assert rc != 0 and "hello from rank 0" in second and second not in first
    assert log.read_text().count("hello from rank 0") == 2  # both calls' output, in order
