"""The package's import graph has no circle, type-only and lazy imports included, and the contract is its
lowest floor: ``fedrcl/contract`` imports nothing else of fedrcl; ``algorithms``, ``server`` and ``data`` never
import the drivers (``federated``, ``flower``); ``flower`` touches no private attribute of Lightning."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "fedrcl"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The fedrcl modules ``name`` imports anywhere in its file (top level, functions, ``TYPE_CHECKING``), and
    the packages whose ``__init__`` those imports run."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        while target and target not in known:  # `from fedrcl.x import name`: the module is fedrcl.x
            target = target.rpartition(".")[0]
        while target.startswith("fedrcl."):  # importing fedrcl.a.b runs fedrcl.a's __init__ too
            if target != name and not name.startswith(target + "."):
                found.add(target)
            target = target.rpartition(".")[0]
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert circles(graph()) == []


def test_the_contract_is_the_lowest_floor():
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("fedrcl.contract"):
            assert all(t.startswith("fedrcl.contract") for t in targets), (name, targets)
        if name.split(".")[1:2] in (["algorithms"], ["server"], ["data"], ["losses"], ["models"]):
            drivers = [t for t in targets if t.split(".")[1:2] in (["federated"], ["flower"], ["cli"],
                                                                  ["lightning_cli"])]
            assert not drivers, (name, drivers)


def test_flower_touches_no_private_attribute_of_lightning():
    private = re.compile(r"\b(trainer|loop|fit_loop|strategy|module|datamodule|dm)\._[a-z]")
    for path in (PACKAGE / "flower").glob("*.py"):
        assert not private.findall(path.read_text(encoding="utf-8")), path
