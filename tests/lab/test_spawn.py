"""lab/pp_lab/spawn.py: the ranks get torchrun's environment, and one failing rank ends the job with its code."""
import sys
from pathlib import Path

import pytest

from pp_lab.launch import run_job
from tests.integration.launch import HANG_S


def test_the_ranks_get_torchruns_environment(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(' '.join(f'{k}={os.environ[k]}' for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                      "'LOCAL_WORLD_SIZE', 'MASTER_ADDR')), flush=True)\n")
    rc, log = run_job(script, 3, timeout=HANG_S)
    assert rc == 0, log
    for rank in range(3):
        assert f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1" in log


def test_a_failing_rank_stops_the_others_and_gives_its_code(tmp_path: Path) -> None:
    """Rank 1 fails at once; rank 0 would wait an hour (as on a collective its peer never joins): the job ends within
    the hang bound only if rank 0 is stopped."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(3600)\n")
    rc, log = run_job(script, 2, timeout=HANG_S)
    assert rc == 3 and "rank 1 exited with 3; stopping the others" in log


def test_an_unknown_launcher_is_named_with_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="launcher='mpirun'; accepted: local, torchrun, deepspeed"):
        run_job(Path(sys.executable), 1, launcher="mpirun")
