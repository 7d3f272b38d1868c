"""The device kernels' settings that a benchmark can change per measurement, so that a GPU times (or `ptxas.py`
compiles) each value side by side in one run. They are module constants of pp_compress.ops.triton_int that stay at
their defaults until a GPU measures another value faster:

- `--rows-per-program N`: rows one program of the rotated int and vq kernels takes (ROWS_PER_PROGRAM);
- `--sign-table-rows N|off`: rotated tensors with at least N rows read the rotation's signs from a table computed once
  per message (SIGN_TABLE_ROWS; off: every program hashes them);
- `--butterfly split|sum`: how the rotating kernels spell the rotation's butterfly (BUTTERFLY).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
from typing import Iterator

from pp_compress.ops import triton_int

SETTINGS = {"rows_per_program": "ROWS_PER_PROGRAM", "sign_table_rows": "SIGN_TABLE_ROWS", "butterfly": "BUTTERFLY"}
"""Each option's dest and the triton_int constant it sets."""

Setting = tuple[tuple[str, int | str | None], ...]
"""(dest, value) for each option given on the command line: () where none was."""


def _rows(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: an integer >= 1")
    return n


def _table_rows(text: str) -> int | None:
    if text == "off":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: off, or an integer >= 0")
    return n


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The settings' options, each repeatable: every value is measured in turn (every combination, if both)."""
    ap.add_argument("--rows-per-program", type=_rows, action="append", default=None,
                    help="rows per program of the rotated int and vq kernels (pp_compress.ops.triton_int."
                         "ROWS_PER_PROGRAM; default: the library's)")
    ap.add_argument("--sign-table-rows", type=_table_rows, action="append", default=None,
                    help="rotated tensors with at least this many rows read the rotation's signs from a table made "
                         "once per message; off: every program hashes them (pp_compress.ops.triton_int."
                         "SIGN_TABLE_ROWS; default: the library's)")
    ap.add_argument("--butterfly", choices=["split", "sum"], action="append", default=None,
                    help="how the rotating kernels spell the rotation's butterfly (pp_compress.ops.triton_int."
                         "BUTTERFLY; default: the library's)")


def settings(args: argparse.Namespace) -> list[Setting]:
    """Every combination of the values given, in the order given; [()] where no setting was given."""
    given = [[(dest, v) for v in getattr(args, dest)] for dest in SETTINGS if getattr(args, dest)]
    return [tuple(combo) for combo in itertools.product(*given)]


def label(setting: Setting) -> str:
    """How a measurement names its setting next to the spec: "" for the library's defaults."""
    words = {"rows_per_program": lambda v: f"{v} rows/program",
             "sign_table_rows": lambda v: "signs hashed" if v is None else f"sign table from {v} rows",
             "butterfly": lambda v: f"{v} butterfly"}
    return f" [{', '.join(words[dest](v) for dest, v in setting)}]" if setting else ""


@contextlib.contextmanager
def applied(setting: Setting) -> Iterator[None]:
    """Within: the library's kernels run with `setting`; its defaults afterwards."""
    saved = {dest: getattr(triton_int, SETTINGS[dest]) for dest in SETTINGS}
    try:
        for dest, value in setting:
            setattr(triton_int, SETTINGS[dest], value)
        triton_int.rows_per_program.cache_clear()
        yield
    finally:
        for dest, value in saved.items():
            setattr(triton_int, SETTINGS[dest], value)
        triton_int.rows_per_program.cache_clear()
