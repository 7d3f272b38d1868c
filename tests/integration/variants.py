"""`--variant NAME=ARGS` for the test workers (ds_worker.py, torch_pipe_worker.py): one job trains one engine per
variant, one after the other in the same processes, with ARGS added to the job's own command line. A test that compares
a stock engine with compressed ones then pays for one job's start-up (interpreters, imports, the process group), not
one per engine. `launch.launch_variants` starts such a job."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="train this variant too: the command line's arguments and ARGS (see tests/integration/variants.py)")


def parse(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """{name: the arguments of that variant}, in the command line's order; {} without --variant."""
    return {name: ap.parse_args([*sys.argv[1:], *shlex.split(extra)])
            for name, _, extra in (v.partition("=") for v in args.variant)}


def run(train: Callable[[argparse.Namespace], dict], args: argparse.Namespace,
        chosen: dict[str, argparse.Namespace], rank: int) -> dict:
    """What the worker writes: train(args), or {"rank": rank, "variants": {name: train(its arguments)}}."""
    if not chosen:
        return train(args)
    return {"rank": rank, "variants": {name: train(variant) for name, variant in chosen.items()}}
