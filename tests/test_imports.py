"""No import circle inside celery_lease, and every module imports on its own.

The graph counts every import of a ``celery_lease`` module: at module level,
inside a function (a function-local import that dodges a circle is still one),
and under ``if TYPE_CHECKING:`` (an import made only for the type checker still
says that one module depends on the other, so "imports only go down" holds for
those too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import celery_lease

PACKAGE = Path(celery_lease.__file__).parent


def module_names() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    names: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its code, TYPE_CHECKING blocks included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {other for other in found if other in modules and other != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports.

    Importing ``a.b`` runs ``a/__init__`` first; that implicit edge to a parent
    package is not counted, or every module would sit in a circle with it.
    """
    modules = module_names()
    graph = {}
    for name, path in modules.items():
        graph[name] = {
            other for other in _imported(name, path, modules) if not name.startswith(other + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return None


@pytest.mark.timeout(30)
def test_no_import_circle_in_celery_lease() -> None:
    """No module of celery_lease reaches itself through its imports, local ones included."""
    graph = import_graph()
    assert "celery_lease.worker" in graph and "celery_lease.run.task" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.timeout(30)
def test_watchdog_and_interrupter_know_no_lease() -> None:
    """The watchdog and the interrupter import no other celery_lease module but the declared
    event names: the lease tells them what they need (a deadline to poll, an interrupt owed)."""
    graph = import_graph()
    assert graph["celery_lease.lease.watchdog"] <= {"celery_lease.events"}
    assert graph["celery_lease.lease.interrupt"] <= {"celery_lease.events"}
    assert "celery_lease.lease.lease" not in graph["celery_lease.lease"]


@pytest.mark.timeout(10)
def test_cycle_finder_sees_a_local_import_circle() -> None:
    """The check itself: a circle closed by a function-local import is found."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.timeout(10)
def test_type_checking_imports_count(tmp_path: Path) -> None:
    """The check itself: an import under ``if TYPE_CHECKING:`` is an edge of the graph."""
    source = tmp_path / "a.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .b import B\n"
        "    import pkg.c\n",
        encoding="utf-8",
    )
    modules = {"pkg.a": source, "pkg.b": source, "pkg.c": source}
    assert _imported("pkg.a", source, modules) == {"pkg.b", "pkg.c"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    """``python -c "import celery_lease.X"`` works for every module X."""
    names = [
        name
        for name in module_names()
        if not name.startswith("celery_lease.migrations.versions")  # Alembic scripts, run
        and name != "celery_lease.migrations.env"  # by Alembic with its context
    ]
    failed = []
    for start in range(0, len(names), 4):  # four interpreters at a time
        batch = {
            name: subprocess.Popen(
                [sys.executable, "-c", f"import {name}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in names[start : start + 4]
        }
        for name, process in batch.items():
            _, stderr = process.communicate(timeout=60)
            if process.returncode:
                failed.append(f"{name}: {stderr.strip().splitlines()[-1:]}")
    assert not failed, failed
