"""The package's structure: objects that own their state, not layers that share it.

Each rule reads the package's own source (or imports it), so a change that
brings a layer back fails here, whatever its size.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import celery_lease

PACKAGE = Path(celery_lease.__file__).parent

pytestmark = pytest.mark.timeout(60)


def _modules() -> list[str]:
    """Every importable module of the package (Alembic's scripts aside)."""
    names = []
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="celery_lease."):
        if ".migrations.versions" in info.name or info.name.endswith(".migrations.env"):
            continue
        names.append(info.name)
    return names


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "versions" not in path.parts
    ]


def _own(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "celery_lease"


def test_no_class_stacks_package_classes() -> None:
    """No class has two or more celery_lease classes among its ancestors.

    An exception may sit deeper in the error tree (STYLE.md 7); any other class
    that inherits from a class of ours that inherits from another is a layer stack.
    """
    stacked = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name:
                continue
            ancestors = [base for base in cls.__mro__[1:] if _own(base)]
            direct = [base for base in cls.__bases__ if _own(base)]
            if len(direct) > 1 or (len(ancestors) > 1 and not issubclass(cls, BaseException)):
                stacked.append(f"{name}.{cls.__qualname__}: {[a.__name__ for a in ancestors]}")
    assert stacked == []


def _is_record(node: ast.ClassDef) -> bool:
    """Dataclasses, named tuples, typed dicts and protocols declare fields by annotation."""
    names = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
    bases = {ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases}
    return bool(names & {"dataclass"} or bases & {"NamedTuple", "TypedDict", "Protocol"})


def _self_assigned(tree: ast.AST) -> set[str]:
    """The attribute names assigned on ``self`` anywhere in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def test_attributes_are_assigned_where_declared() -> None:
    """An attribute a class declares (annotated, no value) is assigned in the class's own module."""
    stray = []
    for path, tree in _sources():
        assigned = _self_assigned(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or _is_record(node):
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and item.value is None
                    and isinstance(item.target, ast.Name)
                    and "ClassVar" not in ast.unparse(item.annotation)
                    and item.target.id not in assigned
                ):
                    stray.append(f"{path}: {node.name}.{item.target.id}")
    assert stray == []


def test_no_module_assigns_another_modules_attributes() -> None:
    """``obj.attr = ...`` only where ``attr``'s class lives: state changes through its owner."""
    sources = _sources()
    owners: dict[str, set[str]] = {}
    for path, tree in sources:
        for name in _self_assigned(tree):
            owners.setdefault(name, set()).add(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        owners.setdefault(item.target.id, set()).add(path)
    foreign = []
    for path, tree in sources:
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute) or (
                    isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
                ):
                    continue
                declared_in = owners.get(target.attr, set())
                if declared_in and path not in declared_in:
                    foreign.append(f"{path}:{node.lineno}: {ast.unparse(target)}")
    assert foreign == []


#: Modules users import from: they may list what they gather from elsewhere.
USER_FACING = ("celery_lease/__init__.py", "celery_lease/testing.py")


def test_no_re_export_lists() -> None:
    """``__all__`` lists a module's own names (a package's: its API), never a private one."""
    re_exported = []
    for path, tree in _sources():
        if path in USER_FACING:
            continue
        gathers = path.endswith("/__init__.py")
        defined: set[str] = set()
        listed: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        defined.add(target.id)
                        if target.id == "__all__" and node.value is not None:
                            listed = list(ast.literal_eval(node.value))
        re_exported += [
            f"{path}: {name}"
            for name in listed
            if name.startswith("_") or (name not in defined and not gathers)
        ]
    assert re_exported == []
