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


#: Run in a fresh interpreter: import the third-party packages once, then fork one child per
#: module named on stdin, which imports that module alone (no celery_lease module is loaded
#: before the fork) and reports "ok" or the error's last line. Paying Celery's and
#: SQLAlchemy's imports once instead of once per module takes this test from about 40 s
#: of CPU to a few.
_FORKING_IMPORTER = """
import importlib, os, sys, traceback
import celery, celery.app.task, kombu, sqlalchemy, sqlalchemy.engine, click
assert not any(m == "celery_lease" or m.startswith("celery_lease.") for m in sys.modules)

def start(name):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = "ok"
        except BaseException:
            message = (traceback.format_exc().strip().splitlines() or ["?"])[-1]
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    return pid, read

def finish(name, pid, read):
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    message = b"".join(chunks).decode() or f"exit status {status}"
    print(f"{name}\t{message}", flush=True)

names = sys.stdin.read().split()
for first in range(0, len(names), 4):  # four children at a time
    batch = [(name, *start(name)) for name in names[first : first + 4]]
    for name, pid, read in batch:
        finish(name, pid, read)
"""


@pytest.mark.timeout(300)
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    """``import celery_lease.X`` works for every module X with no other module of the
    package imported before it (one forked child per module, see ``_FORKING_IMPORTER``)."""
    names = [
        name
        for name in module_names()
        if not name.startswith("celery_lease.migrations.versions")  # Alembic scripts, run
        and name != "celery_lease.migrations.env"  # by Alembic with its context
    ]
    done = subprocess.run(
        [sys.executable, "-c", _FORKING_IMPORTER],
        input="\n".join(names),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = dict(line.split("\t", 1) for line in done.stdout.splitlines())
    assert sorted(results) == sorted(names), done.stderr
    failed = [f"{name}: {message}" for name, message in results.items() if message != "ok"]
    assert not failed, failed
