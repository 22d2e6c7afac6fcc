"""The example project's demo, run as users run it: ``python -m example_project demo``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from example_project.demo import workdir_note
from tests.helpers import REPO

pytestmark = pytest.mark.slow  # each test runs a project with workers of its own

#: The demo's own deadline; the test waits a little longer for its clean-up.
DEMO_TIMEOUT = 120


def run_demo(tmp_path: Path, **env: str) -> tuple[int, str, float]:
    """Run the demo in a subprocess; return its exit status, stdout and runtime."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EXAMPLE_")}
    full_env.update(env, PYTHONPATH=str(REPO))
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "example_project",
            "demo",
            "--workdir",
            str(tmp_path / "demo"),
            "--timeout",
            str(DEMO_TIMEOUT),
        ],
        env=full_env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=DEMO_TIMEOUT + 40)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the demo stop the workers it started, by their PIDs.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"demo did not finish:\n{out}\n{err[-3000:]}")
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        logs = "".join(
            f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted((tmp_path / "demo").glob("*.log"))
        )
        pytest.fail(f"demo exited {proc.returncode}:\n{out}\n{err[-3000:]}{logs}")
    return proc.returncode, out, elapsed


def summary_value(out: str, label: str) -> int:
    """The number the summary table prints for ``label``."""
    match = re.search(rf"^  {re.escape(label)}\s+(\d+)$", out, re.MULTILINE)
    assert match, f"no {label!r} row in the summary:\n{out}"
    return int(match.group(1))


def check_summary(out: str) -> None:
    assert summary_value(out, "runs") == 30
    assert summary_value(out, "succeeded") == 30
    assert summary_value(out, "payments committed") == 30
    assert summary_value(out, "double commits") == 0
    assert summary_value(out, "peak captures per merchant") <= 2
    assert summary_value(out, "recovered by the sweeper") >= 1
    assert summary_value(out, "stale completions refused") >= 1
    assert summary_value(out, "retried (attempt > 1)") >= 1
    assert "refused: automation_run_lease_lost: run capture:ord-" in out
    assert re.search(r"SIGKILL alpha .* between the gateway's reply and the commit of", out)
    # The killed capture's next attempt sent the same key: the gateway charged once.
    assert re.search(
        r"capture:ord-\w+-\d+: attempt \d+ sent the gateway the same key "
        r"\(capture:ord-\w+-\d+:capture:0\): answered with the first charge; charged once",
        out,
    )
    assert summary_value(out, "gateway charges") == 30
    assert summary_value(out, "gateway calls answered by key") >= 1
    assert summary_value(out, "orders charged twice") == 0
    assert summary_value(out, "receipts sent") == 30
    assert summary_value(out, "receipts sent twice") == 0
    assert summary_value(out, "orders exported") == 300
    assert summary_value(out, "orders exported twice") == 0
    assert summary_value(out, "export attempts") >= 2
    # The export's run id is its key, whole: "export:hist-<batch>", no dangling separator.
    assert re.search(r"mid-export of export:hist-[0-9a-f]+: checkpoint at (\d+) of 300", out)
    assert re.search(r"resumed by delta on attempt \d+ at order hist-\w+-\d+ \(checkpoint", out)
    assert "invariants hold" in out


@pytest.mark.timeout(DEMO_TIMEOUT + 90)
def test_demo_on_embedded_default_captures_every_order_once(tmp_path: Path) -> None:
    """On SQLite + filesystem:// the demo survives a frozen and a killed worker, exits 0,
    and its summary shows takeover, a refused stale completion and no double commit."""
    _, out, elapsed = run_demo(tmp_path)
    assert "sqlite:///" in out and "filesystem://" in out
    assert f"logs in {tmp_path / 'demo'} (kept)" in out
    check_summary(out)
    assert elapsed < DEMO_TIMEOUT


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(DEMO_TIMEOUT + 90)
def test_demo_on_postgresql_and_redis(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    """With EXAMPLE_DATABASE_URL and EXAMPLE_BROKER_URL set, the same demo runs on
    PostgreSQL + Redis (migrating the lease table first) with the same guarantees."""
    _, out, elapsed = run_demo(tmp_path, EXAMPLE_DATABASE_URL=pg_url, EXAMPLE_BROKER_URL=redis_url)
    assert "postgresql+psycopg://" in out and "redis://" in out
    assert "migrated" in out
    check_summary(out)
    assert elapsed < DEMO_TIMEOUT


@pytest.mark.timeout(10)
def test_demo_says_its_temporary_folder_goes_unless_keep() -> None:
    """The demo's header says that a temporary work folder is removed after a successful
    run and that --keep keeps it; a folder the user chose is kept."""
    assert workdir_note(Path("/tmp/x"), temporary=True) == (
        "logs in /tmp/x (removed after a successful run; --keep keeps them)"
    )
    assert workdir_note(Path("/tmp/x"), temporary=False) == "logs in /tmp/x (kept)"
