"""The docs against the code: every log event the package emits is in the operations table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from celery_lease import events
from tests.helpers import REPO

PACKAGE = REPO / "celery_lease"
OPERATIONS = REPO / "docs" / "operations.md"


def _strings(node: ast.expr) -> set[str] | None:
    """The string constants ``node`` can evaluate to, or None when it is not static."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        body, orelse = _strings(node.body), _strings(node.orelse)
        return body | orelse if body is not None and orelse is not None else None
    return None


def emitted_events() -> tuple[dict[str, set[str]], list[str]]:
    """``lease_event`` names in celery_lease/ (with the files emitting them), and the
    places whose name is not a literal."""
    found: dict[str, set[str]] = {}
    dynamic: list[str] = []

    def add(names: set[str] | None, path: Path, node: ast.AST) -> None:
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
        if names is None:
            dynamic.append(where)
        for name in names or ():
            found.setdefault(name, set()).add(where)

    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "events.py":  # the generic emitters; their names come from callers
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "emit":
                    add(_strings(node.args[0]), path, node)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "lease_event":
                        add(_strings(value), path, node)
    for state, name in events._EVENT_NAMES.items():  # typed lease transitions
        found.setdefault(name, set()).add(f"events.LeaseState.{state.name}")
    return found, dynamic


def documented_events() -> set[str]:
    """The names in the first column of the ``lease_event`` table of docs/operations.md."""
    lines = OPERATIONS.read_text().splitlines()
    start = lines.index("| `lease_event` | level | when |")
    names: set[str] = set()
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


@pytest.mark.timeout(30)
def test_every_emitted_lease_event_is_in_the_operations_table() -> None:
    """Each ``lease_event`` the package logs has a row in docs/operations.md, each row
    names an event the package logs, and no event name is computed at run time."""
    found, dynamic = emitted_events()
    assert not dynamic, f"lease_event names must be literals, so the docs can list them: {dynamic}"
    assert len(found) > 20, found  # the scan itself works
    documented = documented_events()
    missing = {name: sorted(where) for name, where in found.items() if name not in documented}
    assert not missing, f"add these lease_event rows to docs/operations.md: {missing}"
    assert documented <= set(found), f"documented but never emitted: {documented - set(found)}"
