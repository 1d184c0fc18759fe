"""The package's import graph has no circles, and so no import that runs back up.

Rooms as a reader of `ls lanelock/` sees them: each top-level module is one, each sub-package
(store/, run/, proxy/, inspection/, testing/) is one. An import anywhere in a file -- at the top or
inside a function, where lanelock keeps its lazy imports -- is an arrow from its room to the room
it names. The rooms must then stand in floors: no arrow may lead back to a room that (through
others) imports the first. lanelock/__init__.py is the package's face (it only hands names on)
and is not a room. A failure names the circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lanelock"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str | None:
    """lanelock.store.flock -> store, lanelock.gate -> gate; None outside the package."""
    parts = module.split(".")
    if parts[0] != "lanelock" or len(parts) < 2:
        return None
    return parts[1]


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported(path: Path) -> set[str]:
    """The lanelock modules a file imports, at any depth."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:   # from . import journal: the module journal
                if is_module(f"{target}.{alias.name}"):
                    found.add(f"{target}.{alias.name}")
    return {name for name in found if name.split(".")[0] == "lanelock"}


def graph() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue
        source = room(module_name(path))
        for target in imported(path):
            other = room(target)
            if other is not None and other != source:
                arrows.setdefault(source, set()).add(other)
        arrows.setdefault(source, set())
    return arrows


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(arrows.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(arrows):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read():
    arrows = graph()
    assert {"gate", "store", "proxy", "run", "cli", "settings", "handover"} <= set(arrows)
    assert "store" in arrows["gate"] and "gate" in arrows["proxy"]


def test_no_import_circles_between_rooms():
    arrows = graph()
    found = circles(arrows)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(group) + " (" + ", ".join(f"{a}->{b}" for a in group
                                                for b in sorted(arrows[a]) if b in group) + ")"
        for group in found)


def test_a_circle_is_found_when_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
