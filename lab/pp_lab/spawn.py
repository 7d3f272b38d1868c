"""Start N ranks of a script on this machine with the environment torchrun gives them, and end the job as torchrun
does: when one rank fails, the others are stopped, and the job's exit code is the first failure's.

    python -m pp_lab.spawn --nproc 2 --master-port 29500 recipes/pretrain.py --steps 3 ...

What torchrun adds on one machine (an elastic agent, its store and restarts) the lab's jobs never use, and it costs
each job an interpreter that imports torch before any rank starts (about 1.5 CPU-s and as much wall time): this
launcher imports nothing but the standard library. The ranks meet through env:// (MASTER_ADDR, MASTER_PORT; rank 0
holds the store), as torch.distributed and DeepSpeed read it. `pp_lab.launch` starts jobs through it by default.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
"""How long the other ranks get after SIGTERM, once one has failed, before SIGKILL."""


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-machine job (those torch.distributed and DeepSpeed read)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, then SIGKILL those left after GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    procs = [subprocess.Popen([sys.executable, args.script, *args.args],
                              env={**os.environ, **rank_env(rank, args.nproc, args.master_port)})
             for rank in range(args.nproc)]
    signal.signal(signal.SIGTERM, lambda *_: (stop(procs), sys.exit(143)))
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"pp_lab.spawn: rank {rank} exited with {code}; stopping the others", file=sys.stderr, flush=True)
            stop(procs)
            return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
