"""A JIT build's lock that nobody holds is reported with its name before anyone waits on it; one that a running build
holds is waited for, as torch does."""
import os
import subprocess
import sys
import time

import pytest

from pp_compress import buildlock

NAME = "pp_compress_lock_test"


@pytest.fixture
def lock(tmp_path, monkeypatch):
    """A lock file's place, with torch's builds waiting on lock files as 2.13 and before do (whatever torch runs)."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "FileBaton", getattr(cpp_extension, "FileBaton", object), raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = buildlock.lock_path(NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_no_lock_no_wait(lock):
    buildlock.check(NAME)


def test_a_lock_nobody_holds_is_named_with_what_to_do(lock):
    lock.touch()
    with pytest.raises(buildlock.StaleBuildLock) as e:
        buildlock.check(NAME)
    assert str(lock) in str(e.value) and f"rm '{lock}'" in str(e.value) and "no process on this machine" in str(e.value)
    assert lock.exists()  # reported, not removed


def test_a_lock_being_released_is_not_taken_for_a_stale_one(lock):
    """FileBaton.release closes the file, then deletes it: in between the lock has no holder. Ranks that load the
    kernels together (every load takes the lock) met that moment; the check waits `settle_s` before it decides."""
    import threading

    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    began = time.monotonic()
    buildlock.check(NAME, settle_s=5.0)  # the lock went within the settling time: no error
    assert 0.2 < time.monotonic() - began < 4


def test_a_torch_whose_lock_dies_with_its_holder_is_never_stopped_by_a_leftover_file(lock, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.delattr(cpp_extension, "FileBaton")  # torch 2.14 and later: an advisory lock (filelock)
    lock.touch()
    assert not buildlock.waits_on_lock_file()
    buildlock.check(NAME)  # returns at once: the file stays after every build there


def test_a_lock_a_running_build_holds_is_waited_for(lock):
    """torch's FileBaton keeps the lock open for the whole build: here a process that opened it the same way."""
    code = f"import os, sys, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print(flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        assert buildlock.holders(lock) == [holder.pid]
        buildlock.check(NAME)  # returns: torch waits for that build
    finally:
        holder.kill()
        holder.wait()
    assert buildlock.holders(lock) == []
    with pytest.raises(buildlock.StaleBuildLock):
        buildlock.check(NAME)  # its builder killed mid-way


def test_on_a_shared_file_system_another_machine_may_be_building_so_the_wait_is_bounded(lock, monkeypatch, capsys):
    monkeypatch.setattr(buildlock, "shared", lambda path: True)
    lock.touch()
    began = time.monotonic()
    with pytest.raises(buildlock.StaleBuildLock, match="unless a machine sharing that folder is building it now"):
        buildlock.check(NAME, stale_after_s=0.5, poll_s=0.05)
    assert time.monotonic() - began >= 0.4
    assert f"waiting for {lock}" in capsys.readouterr().err
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(buildlock.StaleBuildLock):
        buildlock.check(NAME, stale_after_s=600)  # long past the bound: at once


def test_a_lock_that_goes_while_waiting_ends_the_wait(lock, monkeypatch):
    monkeypatch.setattr(buildlock, "shared", lambda path: True)
    lock.touch()
    monkeypatch.setattr(buildlock.time, "sleep", lambda s: lock.unlink())
    buildlock.check(NAME, stale_after_s=600)


def test_the_file_system_type_is_read_from_the_mounts(tmp_path):
    assert buildlock.filesystem(buildlock.Path("/proc/self")) == "proc"
    assert buildlock.filesystem(tmp_path)
    assert not buildlock.shared(buildlock.Path("/proc/self"))
