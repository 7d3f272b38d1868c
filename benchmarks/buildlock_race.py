"""How often `pp_compress.buildlock.check` takes a lock that is being released for a stale one.

    python benchmarks/buildlock_race.py [--seconds 8] [--settle 0 --settle 2]

One process takes and releases a lock file in a loop, as torch's `FileBaton` does on every JIT load (it closes the
file a moment before it deletes it); this process runs `check` against it for the same time, once per --settle
value (buildlock.SETTLE_S is the default; 0 is the check without a settling wait), and prints the false reports.
Needs a torch whose JIT builds wait on lock files (2.13 and before); the folder is a temporary one.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def hold(lock: str, seconds: float) -> None:
    from torch.utils.file_baton import FileBaton

    end = time.time() + seconds
    while time.time() < end:
        baton = FileBaton(lock)
        if baton.try_acquire():
            time.sleep(0.001)
            baton.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--settle", type=float, action="append", default=None, help="settling waits to try (s)")
    ap.add_argument("--hold", default=None, help=argparse.SUPPRESS)  # the holder process's lock path
    args = ap.parse_args()
    if args.hold:
        hold(args.hold, args.seconds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCH_EXTENSIONS_DIR"] = tmp
        from pp_compress import buildlock

        if not buildlock.waits_on_lock_file():
            raise SystemExit("this torch holds an advisory lock: a lock file cannot be taken for a stale one")
        lock = buildlock.lock_path("buildlock_race")
        lock.parent.mkdir(parents=True, exist_ok=True)
        for settle in args.settle or [0.0, buildlock.SETTLE_S]:
            holder = subprocess.Popen([sys.executable, __file__, "--hold", str(lock), "--seconds", str(args.seconds)])
            checks = false = 0
            end = time.time() + args.seconds
            while time.time() < end:
                checks += 1
                try:
                    buildlock.check("buildlock_race", settle_s=settle, poll_s=0.01)
                except buildlock.StaleBuildLock:
                    false += 1
            holder.wait()
            print(f"settle {settle:.1f} s: {false} false stale reports in {checks} checks", flush=True)


if __name__ == "__main__":
    main()
