"""Root pytest configuration.

pytest-celery 1.x replaces the classic ``celery_worker`` fixture with a Docker
one; load Celery's own plugin to get the in-process fixtures back. Worker tests
start real ``celery worker`` subprocesses themselves (see tests/helpers.py).
"""

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery._state import _set_task_join_will_block

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(autouse=True)
def _joins_allowed_after_in_process_workers() -> Iterator[None]:
    """An in-process worker (``start_worker``) marks the process as a worker's, where
    ``AsyncResult.get()`` raises "Never call result.get() within a task!". Celery 5.5+
    clears the mark when ``start_worker`` exits; 5.4 (the oldest we support) leaves it set
    for every later test in the same xdist process. Clear it after each test."""
    yield
    _set_task_join_will_block(False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long tests first: the ones marked ``slow`` (processes of their own, tens of seconds),
    then those that start workers (the ``workers`` fixture), then the rest, each group in
    collection order. pytest-xdist hands tests out in this order, so the run ends on short
    tests instead of on one xdist worker still running a minute-long scenario while the
    others idle (the last five minutes of CI's suite ran at 38% CPU in file order)."""

    def weight(item: pytest.Item) -> int:
        if item.get_closest_marker("slow"):
            return 0
        return 1 if "workers" in getattr(item, "fixturenames", ()) else 2

    items.sort(key=weight)


_SERVER_ENV = re.compile(r"\bCELERY_LEASE_TEST_[A-Z_]+\b")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per reason for skipping, instead of pytest's line per skipped test.

    Skips for a missing server name its variable (``tests.helpers.require``) and are
    grouped by it: ``skipped 40 tests: CELERY_LEASE_TEST_PG_URL not set``. Under
    pytest-xdist the reports reach the controller, which prints this once.
    """
    groups: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        found = _SERVER_ENV.search(reason)
        groups[f"{found.group(0)} not set" if found else reason] += 1
    if not groups:
        return
    terminalreporter.section("skips", sep="-")
    for reason, count in sorted(groups.items(), key=lambda item: (-item[1], item[0])):
        noun = "test" if count == 1 else "tests"
        terminalreporter.write_line(f"skipped {count} {noun}: {reason}")
