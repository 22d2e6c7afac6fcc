"""PostgreSQL restarted under a batch: on a PostgreSQL server of the test's own.

The shared server CI starts serves every other test at the same time (chaos runs beside
the suite), so this scenario initdb's a throwaway server, restarts that one, and stops it
by its postmaster's PID at teardown. It needs PostgreSQL's binaries and root (to run the
server as ``postgres``), as CI has.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import free_port
from tests.chaos.history import check
from tests.chaos.test_chaos import CONF, SWEEP, TIMING, all_terminal, report
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import require, wait_for

pytestmark = pytest.mark.chaos
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
PG_BIN_ENV = "CELERY_LEASE_TEST_PG_BIN"


def _as_postgres(command: str, timeout: float = 60) -> None:
    subprocess.run(
        ["su", "postgres", "-s", "/bin/sh", "-c", command],
        check=True,
        timeout=timeout,
        # A postmaster started here must not inherit our pipes.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


@pytest.fixture
def own_postgres() -> Iterator[tuple[str, Path, str]]:
    """A PostgreSQL server of this test's own: (URL of its ``postgres`` database, data
    directory, bin directory)."""
    bin_dir = require(os.environ.get(PG_BIN_ENV), PG_BIN_ENV)
    require(os.geteuid() == 0, "root (to run PostgreSQL as the postgres user)")
    base = Path(tempfile.mkdtemp(prefix="celery-lease-pg-"))
    base.chmod(0o755)  # the postgres user reaches its data directory and socket through it
    data = base / "data"
    data.mkdir()
    shutil.chown(data, "postgres")
    shutil.chown(base, "postgres")
    port = free_port()
    try:
        _as_postgres(
            f"'{bin_dir}/initdb' -D '{data}' -U postgres -A trust -E UTF8 --locale=C.UTF-8 -N"
        )
        options = (
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        )
        _as_postgres(f"'{bin_dir}/pg_ctl' -D '{data}' -l '{base}/pg.log' -w -o '{options}' start")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", data, bin_dir
    finally:
        pid = _postmaster_pid(data)
        if pid is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _as_postgres(f"'{bin_dir}/pg_ctl' -D '{data}' -m immediate -w stop")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # gone already, unless the stop failed
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(own_postgres: tuple[str, Path, str]) -> str:
    """The ``cluster`` fixture's PostgreSQL, here the test's own server."""
    return own_postgres[0]


@ON_PG
@pytest.mark.timeout(300)
def test_postgres_restart_mid_batch(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], own_postgres: tuple[str, Path, str]
) -> None:
    """pg_ctl restart -m fast in the middle of a batch: no lost runs, no double
    commits, and the same workers recover without restarts."""
    _, data, bin_dir = own_postgres
    workers = [cluster.start(f"w{i}", conf=CONF, **TIMING) for i in range(2)]
    cluster.start_beat(SWEEP)
    run_ids = [cluster.send("workerapp.effect", 0.3) for _ in range(80)]
    wait_for(
        lambda: sum(1 for r in run_ids if cluster.status(r) == "succeeded") >= 10,
        60,
        what="the batch to get going",
    )
    _as_postgres(f"'{bin_dir}/pg_ctl' -D '{data}' -l '{data}/restart.log' -w -m fast restart")
    cluster.store.dispose()
    cluster.engine.dispose()
    wait_for(lambda: all_terminal(cluster, run_ids), 180, interval=1.0, what="the batch")
    assert all(w.proc.poll() is None for w in workers), "a worker died"
    history = check(cluster, run_ids)
    report(capsys, "pg-restart", history)


@ON_PG
@pytest.mark.timeout(180)
def test_a_restart_between_tasks_costs_no_attempt_of_a_fenced_transaction(
    cluster: Cluster, own_postgres: tuple[str, Path, str]
) -> None:
    """The documented commit (``with self.lease.transaction() as conn: fence(conn)``) after a
    restart the worker slept through: the transaction's pooled connection is dead, and is
    replaced before the body's block runs, so the body runs once, on attempt 1."""
    _, data, bin_dir = own_postgres
    cluster.start("w", conf=CONF, concurrency=1, CL_LEASE_SECONDS="5")
    # Warm the pool child's connections, the transaction engine's included.
    warm = cluster.send("workerapp.resumable", 1, 1, 0.0, "fenced")
    wait_for(lambda: cluster.status(warm) == "succeeded", 30, what="the warm-up run")
    _as_postgres(f"'{bin_dir}/pg_ctl' -D '{data}' -l '{data}/restart.log' -w -m fast restart")
    cluster.store.dispose()
    cluster.engine.dispose()
    run_id = cluster.send("workerapp.resumable", 1, 1, 0.0, "fenced")
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="the run after the restart")
    kinds = [e.kind for e in cluster.effects(run_id)]
    assert kinds == ["resume:0:0", "item:0"], kinds  # no second start of the body
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1, row
