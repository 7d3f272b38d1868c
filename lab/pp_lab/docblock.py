"""Blocks of the docs that a script writes from committed results: the lines between two markers, replaced whole."""
from __future__ import annotations

from pathlib import Path


def markers(name: str, writer: str = "eval/report.py") -> tuple[str, str]:
    """The lines between which `writer` writes the block `name`."""
    return f"<!-- {name}: written by {writer} -->", f"<!-- {name}: end -->"


def update_readme(readme: Path, name: str, lines: list[str], writer: str = "eval/report.py") -> None:
    """Replace the document's block `name` (between its markers) by these lines."""
    start, end = markers(name, writer)
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {name} block: add the lines {start!r} and {end!r} where it goes")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + start + "\n".join(["", *lines, ""]) + "\n" + end + tail)
