"""A JIT build's lock that nobody holds any more, found before a process waits on it.

torch's `cpp_extension.load` takes a `lock` file in the extension's build folder (`FileBaton`) and keeps it open for
the whole build; every other process that loads the same extension waits for as long as the file exists. A build
killed mid-way (a timeout, an OOM kill, Ctrl-C twice) leaves the file behind, and every later job on that machine
then waits on it forever, silently. `check(name)` is called before such a load (pp_compress's fused kernels,
DeepSpeed's shared-memory op): a lock that no process holds is reported with one message that names the file and
what to do, instead of a hang.

From torch 2.14 on, `cpp_extension` holds an advisory lock on that file instead (`filelock`): the kernel releases it
when its holder dies, and the file stays after every build, so its presence means nothing and `check` has nothing to
do (`waits_on_lock_file`).

Who holds a lock is read from /proc (Linux): the process that is building keeps the file open. Another machine's
build cannot be seen from here, so where the build folder is on a network file system (a shared home directory),
`check` waits up to `STALE_LOCK_S` for the lock to go before it reports it; on a local one it reports at once.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_LOCK_S = 600.0
"""On a network file system, how long a lock that no process on this machine holds may stay before it is reported
(a build on another machine sharing the folder takes a minute or two)."""
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "9p", "afs",
              "fuse")
"""File system types (or prefixes, as `fuse.sshfs`) that other machines may share."""


SETTLE_S = 2.0
"""How long a lock must stay with no holder before it counts as left behind: torch takes and releases the lock on
every load (not only for a build), and `FileBaton.release` closes the file a moment before it deletes it, so a lock
seen unheld once may be one that is being released right then (ranks that start together load together)."""


class StaleBuildLock(RuntimeError):
    """A build lock that no running build holds: torch would wait on it forever."""


def lock_path(name: str) -> Path:
    """Where torch's build of extension `name` keeps its lock (TORCH_EXTENSIONS_DIR, else torch's default folder)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, False)) / "lock"  # the one private torch name used here


def holders(lock: Path) -> list[int] | None:
    """The pids of this machine's processes that have `lock` open; None where that cannot be read (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    try:
        target = lock.stat()
    except FileNotFoundError:
        return []
    found = []
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                st = os.stat(proc / pid / "fd" / fd)
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
                found.append(int(pid))
                break
    return found


def filesystem(path: Path) -> str:
    """The type of the file system that holds `path` (from /proc/self/mounts; "" where unknown)."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    where = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (where == point or where.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def shared(path: Path) -> bool:
    """Whether `path` is on a file system other machines may share (or one whose type is unknown)."""
    kind = filesystem(path)
    return not kind or kind.startswith(NETWORK_FS)


def waits_on_lock_file() -> bool:
    """Whether this torch's JIT builds wait for as long as the lock file exists (`FileBaton`, torch 2.13 and before),
    rather than on an advisory lock that dies with its holder (torch 2.14 and later)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def check(name: str, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0, settle_s: float = SETTLE_S) -> None:
    """Before loading JIT extension `name`: return when its build folder has no lock, or one that a running build on
    this machine holds (torch then waits for that build, as it should), or when this torch cannot wait on a stale one;
    raise StaleBuildLock naming the file where nobody has held it for `settle_s` (on a network file system: once it
    has also stayed `stale_after_s`, as another machine's build may)."""
    if not waits_on_lock_file():
        return
    lock = lock_path(name)
    waited = False
    unheld_since: float | None = None
    while lock.exists():
        pids = holders(lock)
        if pids:
            return
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        now = time.monotonic()
        unheld_since = now if unheld_since is None else unheld_since
        remote = pids is None or shared(lock.parent)
        if now - unheld_since >= settle_s and (not remote or age >= stale_after_s):
            why = "no process on this machine has it open" if pids is not None else "nothing here can tell who has it"
            unless = ", unless a machine sharing that folder is building it now" if remote else ""
            raise StaleBuildLock(f"{lock} is left by a build of {name} that is no longer running ({age:.0f} s old; "
                                 f"{why}), and torch would wait on it forever. Delete it (rm '{lock}') and start "
                                 f"again{unless}")
        if remote and not waited:
            print(f"pp_compress: waiting for {lock} (a build of {name} on another machine sharing this folder?); "
                  f"reported as stale if it stays {stale_after_s:.0f} s", file=sys.stderr, flush=True)
            waited = True
        time.sleep(min(poll_s, settle_s / 4) if now - unheld_since < settle_s else poll_s)
