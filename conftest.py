"""Root pytest configuration.

pytest-celery 1.x replaces the classic ``celery_worker`` fixture with a Docker
one; load Celery's own plugin to get the in-process fixtures back. Worker tests
start real ``celery worker`` subprocesses themselves (see tests/helpers.py).
"""

import re
from collections import Counter
from typing import Any

pytest_plugins = ("celery.contrib.pytest",)


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
