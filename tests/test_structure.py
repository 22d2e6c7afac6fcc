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


def test_event_names_are_declared_once() -> None:
    """No string literal is handed to ``emit()`` or logged as ``lease_event``: every event
    is a member of ``celery_lease.events.Event``, which metrics and tracing match."""
    literal = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "emit"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                literal.append(f"{path}:{node.lineno}: emit({node.args[0].value!r})")
            if isinstance(node, ast.Dict) and not path.endswith("events.py"):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "lease_event"
                        and not (
                            isinstance(value, ast.Attribute)
                            and ast.unparse(value).startswith("Event.")
                        )
                    ):
                        literal.append(f"{path}:{node.lineno}: lease_event={ast.unparse(value)}")
    assert literal == []


def _contracts() -> dict[type, list[type]]:
    """Each abstract base of the database classes, with its concrete subclasses."""
    from celery_lease.store import database as contracts
    from celery_lease.store.databases import DATABASES

    found: dict[type, list[type]] = {}
    for base in (contracts.Database, contracts.MigrationLock, contracts.OnlineDDL):
        importlib.import_module("celery_lease.store.databases")  # every database module
        found[base] = sorted(
            (sub for sub in _subclasses(base) if not inspect.isabstract(sub)),
            key=lambda cls: cls.__qualname__,
        )
    assert {type(database) for database in DATABASES.values()} == set(found[contracts.Database])
    return found


def _subclasses(base: type) -> list[type]:
    found = []
    for sub in base.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_no_database_class_inherits_what_its_siblings_replace() -> None:
    """For every method of ``Database`` (and of the migration lock and online DDL each
    database gives): either every concrete class writes its own, or none does.

    A default that some databases override and another silently inherits is how MySQL's
    claim once lived in the base class "for a database celery-lease does not know".
    """
    uneven = []
    for base, concrete in _contracts().items():
        assert len(concrete) >= 3, (base, concrete)
        for name, member in vars(base).items():
            if not callable(member) or (name.startswith("__") and name != "__init__"):
                continue
            writers = [cls.__name__ for cls in concrete if name in vars(cls)]
            if writers and len(writers) != len(concrete):
                uneven.append(f"{base.__name__}.{name}: written by {writers} only")
    assert uneven == []


def test_database_is_an_abstract_contract() -> None:
    """``Database`` cannot be instantiated, nor can a database class that leaves a method
    unwritten; the store's calls are all part of the contract."""
    from celery_lease.store.database import Database
    from celery_lease.store.sqlite import SQLite

    with pytest.raises(TypeError, match="abstract"):
        Database(names=("x",), driver_extra="", clock_sql="")  # type: ignore[abstract]

    class Partial(Database):
        def insert(self, table: object) -> object:
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial(names=("x",), driver_extra="", clock_sql="")  # type: ignore[abstract]
    called = {
        "claim_path", "lock_key", "count_live", "record_waiting", "reserve_rate", "renew",
        "keep", "lock_expired", "purge", "insert", "classify", "wrap", "lock_wait_ended",
        "single_statements", "open", "prepare", "migration_lock", "online_ddl",
    }  # fmt: skip
    assert called <= set(vars(Database)), called - set(vars(Database))
    assert called <= set(dir(SQLite()))


def test_one_home_per_module_name() -> None:
    """No two modules of the package share a file name (``__init__`` aside): a name says
    which home a thing lives in."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" and "versions" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_run_path_names_no_feature() -> None:
    """``run/attempt.py`` imports no feature (flow control, tracing, metrics, the rate
    limit, pausing, follow-ups): features reach a delivery only as run hooks
    (``celery_lease.hooks``), and the lease reaches its follow-ups through its holder."""
    features = {"flow", "tracing", "metrics", "ratelimit", "pausing", "followups"}
    for module in ("run/attempt.py",):
        tree = ast.parse((PACKAGE / module).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").rpartition(".")[2])
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name.rpartition(".")[2] for alias in node.names)
        assert imported & features == set(), module


def test_a_task_without_features_has_no_hooks_on_its_fast_path() -> None:
    """A task that uses no feature gets hooks only where a refused claim needs them (a
    pause): nothing before the claim, at the claim, around the lease or at the end."""
    from celery import Celery

    from celery_lease import LeasedTask
    from celery_lease.run.task import task_hooks

    app = Celery("structure-hooks", set_as_current=False)
    app.conf.lease_tracing = False

    @app.task(base=LeasedTask, shared=False, name="structure.plain")
    def plain() -> None:
        return None

    @app.task(base=LeasedTask, shared=False, name="structure.limited", lease_rate_limit="5/s")
    def limited() -> None:
        return None

    hooks = task_hooks(plain, plain.lease_config())
    assert not hooks.begin
    assert hooks.before_claim == hooks.claimed == hooks.around == hooks.finished == ()
    assert [type(h).__name__ for h in hooks.refused] == ["PausedWork"]
    limited_hooks = task_hooks(limited, limited.lease_config())
    assert [type(h).__name__ for h in limited_hooks.before_claim] == ["RateLimit"]
