"""No two modules of the library, or of the lab, import each other, directly or around a circle: every import counts,
a lazy one inside a function and one under TYPE_CHECKING alike (a circle resolved by deferring the import is still a
circle). Read with `ast`, so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path, package: str) -> dict[str, Path]:
    """{dotted name: file} of every module of `package` under `root`; a package is its __init__.py."""
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules among `known` that `name` imports. `from pkg import sub` counts as the submodule where `sub` is
    one, else as `pkg` itself; importing a submodule does not count its parent package (Python imports the parent
    first, but the parent's own imports decide whether that is a circle)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("root,package", [(ROOT, "pp_compress"), (ROOT / "lab", "pp_lab")], ids=["library", "lab"])
def test_no_import_circles(root: Path, package: str) -> None:
    known = modules(root, package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    """The check itself: a lazy import that closes a loop is a circle."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
