"""The docs against the code: the log events, CLI commands and settings they list, and the
testing and Django pages run as written (the quickstart: tests/test_quickstart.py)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from celery_lease import events
from tests.docpages import Page, argv, reader_env, run, write_files
from tests.helpers import REPO, Worker, wait_for

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
    places whose name is not a member of ``events.Event`` named in the code.

    Every event is declared once in ``events.Event``; what is emitted is each member the
    package names (``Event.CLAIMED``) outside its declaration, plus the typed lease
    transitions (``events._EVENT_NAMES``)."""
    found: dict[str, set[str]] = {}
    dynamic: list[str] = []

    def add(node: ast.AST, path: Path) -> None:
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Event"
        ):
            found.setdefault(events.Event[node.attr].value, set()).add(where)
        else:
            dynamic.append(where)

    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and path.name != "events.py":
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "emit" and not isinstance(node.args[0], (ast.Name, ast.IfExp)):
                    add(node.args[0], path)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Event"
                and path.name != "events.py"
            ):
                add(node, path)
    for state, name in events._EVENT_NAMES.items():  # typed lease transitions
        found.setdefault(name.value, set()).add(f"events.LeaseState.{state.name}")
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
    names an event the package logs, every declared event is logged somewhere, and no
    event name is computed at run time."""
    found, dynamic = emitted_events()
    assert not dynamic, f"lease_event names must be literals, so the docs can list them: {dynamic}"
    assert len(found) > 20, found  # the scan itself works
    documented = documented_events()
    missing = {name: sorted(where) for name, where in found.items() if name not in documented}
    assert not missing, f"add these lease_event rows to docs/operations.md: {missing}"
    assert documented <= set(found), f"documented but never emitted: {documented - set(found)}"
    declared = {event.value for event in events.Event}
    assert declared == set(found), f"declared but never emitted: {declared - set(found)}"


# -- the CLI commands and the settings the docs list --------------------------------


def lease_commands() -> set[str]:
    """The subcommands of the real ``celery lease`` group."""
    from celery_lease.cli import lease

    return set(lease.commands)


@pytest.mark.timeout(30)
def test_every_page_lists_the_real_cli_commands() -> None:
    """The index's command list, the operations page's synopsis and its table each name
    exactly the commands of the ``lease`` click group."""
    real = lease_commands()
    assert len(real) >= 9, real
    index = (REPO / "docs" / "index.md").read_text()
    (listed,) = re.findall(r"`celery lease ([a-z|]+)`", index)
    assert set(listed.split("|")) == real
    operations = OPERATIONS.read_text()
    assert set(re.findall(r"^celery -A proj lease ([a-z]+)", operations, re.MULTILINE)) == real
    table = operations.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^\| `([a-z]+)", table, re.MULTILINE)) == real


@pytest.mark.timeout(30)
def test_operations_page_names_the_store_methods_that_exist() -> None:
    """The Python calls docs/operations.md names on ``LeaseStore`` and on its ``reads``
    exist there (``list_runs`` and ``stats`` live on ``store.reads``)."""
    from celery_lease import LeaseStore
    from celery_lease.store.reads import RunReads

    (sentence,) = re.findall(r"In Python, `LeaseStore` has\s+(.*?);", OPERATIONS.read_text(), re.S)
    on_store = re.findall(r"`([a-z_]+)`", sentence)
    on_reads = re.findall(r"`store\.reads\.([a-z_]+)\(", OPERATIONS.read_text())
    assert len(on_store) >= 3 and len(on_reads) >= 2, (on_store, on_reads)
    assert [name for name in on_store if not callable(getattr(LeaseStore, name, None))] == []
    assert [name for name in on_reads if not callable(getattr(RunReads, name, None))] == []


@pytest.mark.timeout(30)
def test_settings_reference_table_lists_every_setting() -> None:
    """The reference table of docs/settings.md has one row per key the package reads:
    every per-task setting (``SETTING_NAMES``) and the app-level ones."""
    from celery_lease.config import APP_SETTING_NAMES, SETTING_NAMES

    page = (REPO / "docs" / "settings.md").read_text()
    table = page.split("| key | default | validation | notes |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(lease_[a-z_]+)` \|", table, re.MULTILINE)
    assert len(rows) == len(set(rows)), rows
    assert set(SETTING_NAMES) <= set(rows)
    assert set(rows) == set(APP_SETTING_NAMES)


# -- the testing and Django pages, run as written ---------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_testing_page_runs_under_pytest_on_the_quickstart_tasks(tmp_path: Path) -> None:
    """docs/testing.md's conftest and tests, pasted next to the quickstart's tasks.py,
    pass under pytest: each test the page shows runs and passes."""
    files = Page("testing.md").files()
    write_files({"tasks.py": Page("quickstart.md").files()["tasks.py"], **files}, tmp_path)
    shown = sum(code.count("\ndef test_") for code in files.values())
    assert shown >= 4, files.keys()
    out = run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q"],
        tmp_path,
        reader_env(),
        timeout=100,
    )
    assert f"{shown} passed" in out, out
    # The page's conftest imports celery_lease.testing before listing it as a plugin.
    assert "cannot be rewritten; celery_lease" not in out, out
    # An eager duplicate reads the row's result, not Celery's backend (which warns).
    assert "when task_always_eager is enabled" not in out, out


DJANGO_BASE = """\
BASE_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent
SECRET_KEY = "docs-test"
INSTALLED_APPS = ["django.contrib.contenttypes", "orders"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

"""

#: What a reader on one machine changes after pasting the page: a SQLite file and the
#: filesystem broker instead of the page's PostgreSQL and Redis hosts.
DJANGO_LOCAL = """

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}
CELERY_LEASE_DATABASE_URL = lease_database_url(DATABASES["default"])
CELERY_BROKER_URL = "filesystem://"
CELERY_BROKER_TRANSPORT = "celery_lease.contrib.fs_transport:Transport"
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "data_folder_in": str(BASE_DIR / "broker"),
    "data_folder_out": str(BASE_DIR / "broker"),
    "control_folder": str(BASE_DIR / "broker" / "control"),
}
"""

MANAGE_PY = """\
import os
import sys

from django.core.management import execute_from_command_line

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
execute_from_command_line(sys.argv)
"""


@pytest.mark.timeout(150)
def test_django_page_runs_under_a_real_worker(tmp_path: Path) -> None:
    """docs/django.md's files make a project whose commands work as written: migrate,
    lease migrate, a worker and beat; place_order writes its row once under
    fenced_atomic, with the run id the page gives, and a duplicate is dropped."""
    pytest.importorskip("django")
    page = Page("django.md")
    files = page.files()
    assert set(files) >= {"proj/celery.py", "proj/__init__.py", "proj/settings.py"}
    settings = DJANGO_BASE + files.pop("proj/settings.py") + DJANGO_LOCAL
    cmds = page.commands()
    # The page starts from nothing: Django's own project and app, then the page's files.
    startproject, startapp = cmds[:2]
    assert startproject == ["django-admin", "startproject", "proj", "."], startproject
    assert startapp == ["python", "manage.py", "startapp", "orders"], startapp
    run([sys.executable, "-m", "django", *startproject[1:]], tmp_path, reader_env())
    run(argv(startapp), tmp_path, reader_env())
    (tmp_path / "broker" / "control").mkdir(parents=True)
    write_files(
        {**files, "proj/settings.py": settings, "orders/__init__.py": "", "manage.py": MANAGE_PY},
        tmp_path,
    )
    # The page's own settings module, whatever another test of this process set.
    env = reader_env(DB_PASSWORD="not-used-on-sqlite", DJANGO_SETTINGS_MODULE="proj.settings")
    # The page's own commands only (its makemigrations included: a reader has no other).
    for command in cmds[2:]:
        if command[:2] == ["python", "manage.py"] or command[3:4] == ["lease"]:
            run(argv(command), tmp_path, env)
    (worker_cmd,) = [c for c in cmds if c[3:4] == ["worker"]]
    (beat_cmd,) = [c for c in cmds if c[3:4] == ["beat"]]
    (run_id,) = re.findall(r"`(orders\.tasks\.place_order:A-17)`", page.text)
    send = "from orders.tasks import place_order; place_order.delay('A-17')"

    def start(name: str, command: list[str]) -> Worker:
        log = tmp_path / f"{name}.log"
        return Worker(env, log, name=name, app="proj", command=command[3:], cwd=tmp_path)

    beat = start("beat", beat_cmd)
    worker = start("worker", worker_cmd).wait_ready(60)
    try:
        run([sys.executable, "manage.py", "shell", "-c", send], tmp_path, env)
        wait_for(lambda: f"{run_id} attempt 1: completing -> completed" in worker.log(), 30)
        run([sys.executable, "manage.py", "shell", "-c", send], tmp_path, env)
        wait_for(lambda: f"run {run_id} is already succeeded" in worker.log(), 30)
    finally:
        worker.stop()
        beat.stop()
    shown = run(argv(["celery", "-A", "proj", "lease", "show", run_id]), tmp_path, env)
    assert "succeeded" in shown, shown
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT number, attempt FROM orders_order")).all()
    engine.dispose()
    assert rows == [("A-17", 1)]
