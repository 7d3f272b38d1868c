"""The README's DeepSpeed example (recipes/minimal.py) as a new user runs it, with the deepspeed launcher."""
import pytest

pytest.importorskip("deepspeed")
from tests.integration.launch import HANG_S, ROOT, run_job  # noqa: E402

MINIMAL = ROOT / "recipes/minimal.py"


def test_a_small_hidden_size_warns_that_nothing_was_compressed():
    rc, log = run_job(MINIMAL, 2, "--pp-compress", "act=int8,grad=topk:0.1+ef", "--hidden", "64", "--steps", "3",
                      launcher="deepspeed", timeout=HANG_S)
    assert rc == 0 and "terminate called" not in log, log[-3000:]
    assert log.count("none was compressed") == 2  # once per boundary and direction, on its sender
    assert "512 elements" in log and "skipped (below min_numel)" in log
    # at the default hidden size the same spec compresses: test_a_finished_run_compressed_and_leaves_no_shared_memory_behind


def test_a_bad_spec_stops_the_job_with_one_message_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    rc, log = run_job(ROOT / "recipes/pretrain.py", 2, "--pp-compress", "int8:per=rows", "--out", str(out),
                      launcher="deepspeed", timeout=HANG_S)
    assert rc != 0 and log.count("error: --pp-compress 'int8:per=rows'") == 1
    assert "Traceback" not in log and "terminate called" not in log and not out.exists()


def test_a_build_lock_left_by_a_killed_build_stops_the_job_with_one_message_instead_of_a_wait(tmp_path):
    """DeepSpeed builds its CPU shared-memory op when the job starts and waits, as torch does, for as long as a build
    lock exists: one left by a killed build would make this job (and every later one) wait forever. check_args names
    it before any work."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    rc, log = run_job(MINIMAL, 2, "--pp-compress", "safe", launcher="deepspeed", env=env, timeout=HANG_S)
    assert rc == 2 and log.count(f"error: pp_compress: {lock} is left by a build") == 1, log[-3000:]
    assert f"rm '{lock}'" in log and "Traceback" not in log and lock.exists()


def test_a_finished_run_compressed_and_leaves_no_shared_memory_behind(monkeypatch):
    """DeepSpeed's CPU communication op creates a 69 MB /dev/shm buffer per rank and never removes it (a run of
    minimal.py before pp_compress.deepspeed.finish unlinked them left two); `finish` does."""
    from pathlib import Path

    import pp_lab.launch as launch

    port = launch.free_port()
    monkeypatch.setattr(launch, "free_port", lambda: port)
    rc, log = run_job(MINIMAL, 2, "--pp-compress", "act=int8,grad=topk:0.1+ef", "--steps", "3", launcher="deepspeed",
                      timeout=HANG_S)
    assert rc == 0 and "terminate called" not in log, log[-3000:]  # the process group torn down cleanly at exit
    assert "loss " in log and "b0.act" in log
    assert "none was compressed" not in log and "3.97" in log  # the default hidden size (256) is compressed
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
