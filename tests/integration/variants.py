"""`--variant NAME=ARGS` for the test workers (ds_worker.py, torch_pipe_worker.py): one job trains one engine per
variant, one after the other in the same processes, with ARGS added to the job's own command line. A test that compares
a stock engine with compressed ones then pays for one job's start-up (interpreters, imports, the process group), not
one per engine. `launch.run_variants` starts such a job."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Callable, NoReturn


def parse_args(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, dict[str, argparse.Namespace]]:
    """The worker's arguments, with --variant and --out added: (the command line's, {name: each variant's}, in the
    command line's order; {} without --variant)."""
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="train this variant too: the command line's arguments and ARGS")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    return args, {name: ap.parse_args([*sys.argv[1:], *shlex.split(extra)])
                  for name, _, extra in (v.partition("=") for v in args.variant)}


def write(train: Callable[[argparse.Namespace], dict], args: argparse.Namespace,
          chosen: dict[str, argparse.Namespace], rank: int) -> None:
    """Write <out>/rank<R>.json: train(args), or {"rank": rank, "variants": {name: train(its arguments)}}."""
    if chosen:
        output = {"rank": rank, "variants": {name: train(variant) for name, variant in chosen.items()}}
    else:
        output = train(args)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(output, f)


def end() -> NoReturn:
    """Leave a finished torch.distributed worker: barrier, process group down, and no C++ finalizers (gloo's threads
    can abort a finished rank at exit; see pp_compress.runtime.finish)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
