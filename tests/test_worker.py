"""LeasedTask in real ``celery worker -P prefork -c 2`` processes.

Each test runs on three set-ups: SQLite + filesystem broker (the embedded
default), SQLite + Redis, PostgreSQL + Redis. A representative subset (the plain
run, a duplicate delivery, a takeover after SIGSTOP) also runs on PostgreSQL
behind PgBouncer in transaction mode; the plain run and the duplicate delivery
also on PostgreSQL + RabbitMQ.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celery_lease.migrations import upgrade
from tests.cluster import (
    AMQP_ID,
    AMQP_SETUP,
    MARIADB_ID,
    MARIADB_SETUP,
    PG_AND_MARIADB,
    PGBOUNCER_ID,
    PGBOUNCER_SETUP,
    SETUP_IDS,
    SETUPS,
    Cluster,
)
from tests.helpers import REPO, Worker, wait_for

#: The three set-ups plus PostgreSQL behind PgBouncer (transaction pooling).
WITH_PGBOUNCER = pytest.mark.parametrize(
    "cluster", [*SETUPS, PGBOUNCER_SETUP], ids=[*SETUP_IDS, PGBOUNCER_ID], indirect=True
)
#: The same, and PostgreSQL + RabbitMQ. (Not for SIGSTOP: RabbitMQ pushes a duplicate to
#: the stopped worker's free prefetch slot, where it waits until that worker resumes.)
WITH_PGBOUNCER_AND_AMQP = pytest.mark.parametrize(
    "cluster",
    [*SETUPS, PGBOUNCER_SETUP, AMQP_SETUP],
    ids=[*SETUP_IDS, PGBOUNCER_ID, AMQP_ID],
    indirect=True,
)
#: Every set-up: the three, PgBouncer, RabbitMQ and MariaDB.
EVERY_SETUP = pytest.mark.parametrize(
    "cluster",
    [*SETUPS, PGBOUNCER_SETUP, AMQP_SETUP, MARIADB_SETUP],
    ids=[*SETUP_IDS, PGBOUNCER_ID, AMQP_ID, MARIADB_ID],
    indirect=True,
)
#: The three, PgBouncer and MariaDB.
WITH_PGBOUNCER_AND_MARIADB = pytest.mark.parametrize(
    "cluster",
    [*SETUPS, PGBOUNCER_SETUP, MARIADB_SETUP],
    ids=[*SETUP_IDS, PGBOUNCER_ID, MARIADB_ID],
    indirect=True,
)


@WITH_PGBOUNCER_AND_AMQP
@pytest.mark.timeout(90)
def test_task_succeeds_with_attempt_one(cluster: Cluster) -> None:
    """A plain run ends succeeded, attempt 1, with one committed effect."""
    cluster.start("w1")
    run_id = cluster.send("workerapp.work", 0.1)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="run to succeed")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1 and row.lease_owner.startswith("w1@")
    assert len(cluster.effects(run_id, "commit")) == 1


@EVERY_SETUP
@pytest.mark.timeout(120)
def test_duplicate_delivery_runs_body_once(cluster: Cluster) -> None:
    """The same task id delivered twice while the first runs: the body runs once."""
    w1 = cluster.start("w1", CL_LEASE_SECONDS="3")
    w2 = cluster.start("w2", CL_LEASE_SECONDS="3")
    run_id = cluster.send("workerapp.work", 2.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="first delivery to start")
    cluster.send("workerapp.work", 2.0, task_id=run_id)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="run to succeed")
    wait_for(
        lambda: "is already succeeded" in w1.log() + w2.log(),
        40,
        what="the duplicate delivery to be dropped",
    )
    assert len(cluster.effects(run_id, "start")) == 1
    assert len(cluster.effects(run_id, "commit")) == 1
    assert f"of {run_id} busy: held by another worker; sent again" in w1.log() + w2.log()
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1


@WITH_PGBOUNCER_AND_MARIADB
@pytest.mark.timeout(150)
def test_paused_worker_completion_refused_after_takeover(cluster: Cluster) -> None:
    """SIGSTOP a worker past its lease; another takes over; after SIGCONT its completion
    is refused with automation_run_lease_lost and the row keeps the second outcome."""
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.sleepy", 4.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w1.pause()
    try:
        time.sleep(2.5)  # past the 2 s lease, by the database clock too
        cluster.start("w2", **timing)
        cluster.send("workerapp.sleepy", 4.0, task_id=run_id)
        wait_for(lambda: len(cluster.effects(run_id, "start")) == 2, 30, what="w2 takeover")
    finally:
        w1.resume()
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="w2 to succeed")
    wait_for(lambda: "complete refused" in w1.log(), 30, what="w1's completion to be refused")
    log1 = w1.log()
    assert "automation_run_lease_lost" in log1
    row = cluster.store.get(run_id)
    assert row is not None
    assert row.status == "succeeded" and row.attempt == 2
    assert row.lease_owner is not None and row.lease_owner.startswith("w2@")
    starts = cluster.effects(run_id, "start")
    assert [e.attempt for e in starts] == [1, 2]
    assert f"Task workerapp.sleepy[{run_id}] succeeded" not in log1


@PG_AND_MARIADB
@pytest.mark.timeout(120)
def test_worker_stopped_inside_its_renewal_holds_no_run_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A worker SIGSTOPped right after its heartbeat's renewal statement (before the
    renewal's next round trip: a frozen VM, a long pause) holds no lock on its runs: once
    its leases expire, another worker takes every run over while it stays stopped.

    On MariaDB the renewal was an UPDATE then a SELECT in one transaction: stopped between
    them, the worker kept the UPDATE's row locks until it resumed, so every claim of its
    runs waited out the lock timeout ("busy"), and the sweep skipped them, for as long as
    it stayed stopped (issue 29, finding 3)."""
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
    marker = tmp_path / "renewal-stalled"
    w1 = cluster.start("w1", pool="threads", concurrency=4, CL_STALL_RENEWAL=str(marker), **timing)
    run_ids = [cluster.send("workerapp.sleepy", 6.0) for _ in range(4)]
    wait_for(lambda: all(cluster.effects(r, "start") for r in run_ids), 30, what="w1 to start")
    Path(f"{marker}.arm").touch()
    wait_for(marker.exists, 10, interval=0.01, what="w1's heartbeat inside its renewal")
    w1.pause()
    try:
        cluster.start("w2", pool="threads", concurrency=4, **timing)
        for run_id in run_ids:
            cluster.send("workerapp.sleepy", 0.1, task_id=run_id)
        wait_for(
            lambda: all(len(cluster.effects(r, "start")) == 2 for r in run_ids),
            30,
            what="w2 to take every run over while w1 is stopped",
        )
    finally:
        w1.resume()
    wait_for(lambda: all(cluster.status(r) == "succeeded" for r in run_ids), 30, what="the runs")
    for run_id in run_ids:
        row = cluster.store.get(run_id)
        assert row is not None and row.attempt == 2
        assert row.lease_owner is not None and row.lease_owner.startswith("w2@")


@pytest.mark.timeout(90)
def test_stolen_lease_seen_by_check_within_one_heartbeat(cluster: Cluster) -> None:
    """A lease stolen mid-run makes self.lease.check() raise LeaseLost within one tick."""
    cluster.start("w1", CL_LEASE_SECONDS="3", CL_HEARTBEAT="1")
    run_id = cluster.send("workerapp.watch", 30.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    assert cluster.store.expire(run_id)
    stolen_at = time.time()
    thief = cluster.store.claim(run_id, "thief", task_name="t", lease_ms=60_000, max_attempts=5)
    assert thief.outcome == "claimed" and thief.attempt == 2
    seen = wait_for(lambda: cluster.effects(run_id, "saw_lost"), 10, what="check() to raise")
    assert seen[0].at - stolen_at <= 1.0 + 0.75
    cluster.store.complete(run_id, "thief", 2)


def _start_refused(env: dict[str, str], *, shims: bool = False) -> str:
    """Run ``celery worker`` expecting a refusal; the combined output, checked for form."""
    import os

    path = f"{REPO / 'tests' / 'shims'}{os.pathsep}{REPO}" if shims else str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "worker", "-P", "prefork"],
        env={**os.environ, "CL_BROKER_URL": "memory://", **env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("celery-lease:")]
    assert len(refusals) == 1, output
    assert refusals[0].startswith("celery-lease: worker not started: ImproperlyConfigured: ")
    assert "Traceback" not in output
    assert "ForkPoolWorker" not in output and " ready." not in output
    return refusals[0]


def test_invalid_setting_refuses_to_start_worker(sqlite_url: str) -> None:
    """A worker with lease_seconds = -1 exits non-zero in one line naming the key, unforked."""
    line = _start_refused({"CL_LEASE_DB": sqlite_url, "CL_BAD_SETTING": "lease_seconds=-1"})
    assert "lease_seconds" in line


@pytest.mark.timeout(60)
def test_a_lease_under_a_second_refuses_to_start_worker(sqlite_url: str) -> None:
    """lease_seconds = 0.001 was accepted; the store then bounds every database wait of the
    worker's processes by a third of it (0.33 ms), and other tasks' runs lost their leases."""
    line = _start_refused({"CL_LEASE_DB": sqlite_url, "CL_BAD_SETTING": "lease_seconds=0.001"})
    assert "lease_seconds must be at least 1 second, got 0.001" in line


@pytest.mark.timeout(60)
def test_unknown_lease_key_refuses_to_start_worker(sqlite_url: str) -> None:
    """A misspelled lease_* key stops the worker, suggesting the close match."""
    line = _start_refused({"CL_LEASE_DB": sqlite_url, "CL_BAD_SETTING": "lease_secnds=3"})
    assert "unknown setting lease_secnds; did you mean lease_seconds?" in line


@pytest.mark.timeout(60)
def test_heartbeat_past_the_local_deadline_refuses_to_start_worker(sqlite_url: str) -> None:
    """L = 3 s with a 2.8 s heartbeat (under L, past half its 2.697 s local deadline) could
    lose a lease to one failed renewal: the worker exits non-zero, naming the key."""
    line = _start_refused(
        {"CL_LEASE_DB": sqlite_url, "CL_LEASE_SECONDS": "3", "CL_HEARTBEAT": "2.8"}
    )
    assert "lease_heartbeat_interval (2.8) must be at most 1.349s" in line
    assert "safety margin" in line


@pytest.mark.timeout(60)
def test_default_sqlite_behind_redis_refuses_to_start_worker() -> None:
    """No lease_database_url with a Redis broker: per-host SQLite files would not coordinate."""
    line = _start_refused({"CL_LEASE_DB": "", "CL_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert "lease_database_url is not set" in line and "redis" in line


@pytest.mark.timeout(60)
def test_missing_sqlite_directory_refuses_to_start_worker(tmp_path: Path) -> None:
    """A SQLite file in a directory that does not exist stops the worker."""
    missing = tmp_path / "no-such-dir"
    line = _start_refused({"CL_LEASE_DB": f"sqlite:///{missing / 'leases.db'}"})
    assert f"directory {missing} does not exist" in line


@pytest.mark.timeout(60)
def test_unresolvable_host_refuses_to_start_worker() -> None:
    """A database host that does not resolve stops the worker; the password is masked."""
    url = "postgresql+psycopg://app:pw-s3cret@lease-db.invalid:5432/app"
    line = _start_refused({"CL_LEASE_DB": url, "CL_SHIM_NO_DNS": "1"}, shims=True)
    assert "host 'lease-db.invalid' does not resolve" in line
    assert "app:***@lease-db.invalid" in line and "pw-s3cret" not in line


@pytest.mark.timeout(60)
def test_missing_driver_names_the_extra() -> None:
    """Without psycopg installed, the worker says which extra to install, in one line."""
    url = "postgresql+psycopg://app@127.0.0.1:9/app"
    line = _start_refused({"CL_LEASE_DB": url, "CL_SHIM_HIDE_MODULE": "psycopg"}, shims=True)
    assert "pip install 'celery-lease[postgres]'" in line and "psycopg" in line


@pytest.mark.timeout(60)
def test_failed_authentication_refuses_to_start_worker(pg_url: str) -> None:
    """A role the server does not accept stops the worker instead of retrying forever."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(username="no_such_role", password="pw-s3cret")
    line = _start_refused({"CL_LEASE_DB": url.render_as_string(hide_password=False)})
    assert "authentication failed" in line and "no_such_role" in line
    assert "pw-s3cret" not in line


@pytest.mark.timeout(60)
def test_failed_mysql_authentication_refuses_to_start_worker(mysql_url: str) -> None:
    """A wrong MySQL/MariaDB password stops the worker; the password is never shown."""
    from sqlalchemy.engine import make_url

    url = make_url(mysql_url).set(password="pw-s3cret")
    line = _start_refused({"CL_LEASE_DB": url.render_as_string(hide_password=False)})
    assert "authentication failed" in line and "pw-s3cret" not in line
    # The server's own words stay readable: they say a password was sent, not which.
    assert "(using password: YES)" in line, line


@pytest.mark.timeout(60)
def test_missing_table_refuses_to_start_worker(pg_url: str) -> None:
    """A server database without the runs table stops the worker: migrate first."""
    line = _start_refused({"CL_LEASE_DB": pg_url})
    assert "no celery_lease_runs table" in line
    assert "`celery -A tests.workerapp lease migrate`" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_older_server_schema_refuses_to_start_worker(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """A server database still at an earlier version's schema (the package upgraded,
    `lease migrate` forgotten) stops the worker in one line naming what is missing: it
    started with a warning, and every claim then failed for good (``missing_column``)."""
    url = str(request.getfixturevalue({"postgresql": "pg_url"}.get(backend, f"{backend}_url")))
    upgrade(url, "0013")
    line = _start_refused({"CL_LEASE_DB": url})
    assert "older celery-lease schema" in line and "payload_retries" in line, line
    assert "`celery -A tests.workerapp lease migrate`" in line


@pytest.mark.timeout(90)
def test_transient_outage_at_start_warns_retries_then_starts(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """Connection refused at start: a few bounded retries with warnings, then the worker
    starts (tasks fail closed until the database is back); the URL is logged masked."""
    url = "postgresql+psycopg://app:pw-s3cret@127.0.0.1:9/app?connect_timeout=1"
    folder = tmp_path / "broker"
    (folder / "control").mkdir(parents=True)
    env = {"CL_LEASE_DB": url, "CL_BROKER_URL": "filesystem://", "CL_FS_DIR": str(folder)}
    started = time.monotonic()
    worker = Worker(env, tmp_path / "w.log", name="w")
    workers.append(worker)
    worker.wait_ready(60)
    log = worker.log()
    assert "celery-lease: lease database postgresql+psycopg://app:***@127.0.0.1:9/app" in log
    assert log.count("unreachable at startup, retrying in") >= 2
    assert "starting anyway" in log
    assert "pw-s3cret" not in log
    assert time.monotonic() - started < 45


@pytest.mark.parametrize(
    ("message", "verdict"),
    [
        ('could not translate host name "db" to address: Name or service not known', "host"),
        ('could not translate host name "db": Temporary failure in name resolution', None),
        ('connection to server at "127.0.0.1", port 9 failed: Connection refused', None),
        ("connection timeout expired", None),
        ('FATAL:  password authentication failed for user "app"', "authentication"),
        ('FATAL:  database "app" does not exist', "database"),
        ("(1045, \"Access denied for user 'root'@'localhost' (using password: YES)\")", "auth"),
        ("unable to open database file", "SQLite"),
    ],
)
def test_startup_errors_split_into_permanent_and_transient(
    message: str, verdict: str | None
) -> None:
    """Start-up refuses only problems waiting will not fix; refused connections, timeouts
    and a failing DNS server are waited out."""
    from sqlalchemy.exc import OperationalError

    from celery_lease.worker import _permanent_problem

    problem = _permanent_problem(OperationalError("SELECT 1", {}, Exception(message)))
    if verdict is None:
        assert problem is None
    else:
        assert problem is not None and verdict in problem


@pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
@pytest.mark.timeout(90)
def test_gevent_worker_runs_a_leased_task_then_stops_on_sigterm(cluster: Cluster) -> None:
    """``-P gevent``: a run succeeds, and SIGTERM then ends the worker with a warm shutdown.
    Before: the lease's side threads, greenlets on the main OS thread there, masked
    SIGTERM, SIGINT and SIGQUIT for the whole process, and only SIGKILL ended it."""
    worker = cluster.start("w1", pool="gevent")
    assert "lease_interrupt is off on the gevent pool" in worker.log()
    run_id = cluster.send("workerapp.work", 0.1)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the run to succeed")
    worker.proc.send_signal(signal.SIGTERM)
    try:
        worker.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the gevent worker ignored SIGTERM:\n{worker.log()[-2000:]}")
    assert "Warm shutdown" in worker.log()


@pytest.mark.timeout(60)
def test_read_only_sqlite_file_refuses_to_start_worker(tmp_path: Path) -> None:
    """A lease database SQLite opens read-only (here a ``mode=ro`` URI; a file the worker
    may not write is the same) stops the worker in one line: a read-only database is a
    permanent problem, whatever its message says. Before, the worker retried it as an
    outage for 4 s, then started and reported ready with only a warning."""
    path = tmp_path / "leases.sqlite3"
    upgrade(f"sqlite:///{path}")
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    line = _start_refused({"CL_LEASE_DB": url})
    assert "read_only" in line and "readonly database" in line, line


@pytest.mark.timeout(90)
def test_a_long_error_message_is_recorded_at_once_and_redacted(cluster: Cluster) -> None:
    """A body fails with a 300 KB message (a provider's error page) that begins with a
    token. The run ends failed within seconds, its last_error capped and the token
    redacted. Before, redacting read the whole message with patterns whose time grows
    with the square of its length: about 40 s per pass, several passes per failure."""
    worker = cluster.start("w1", concurrency=1)
    run_id = cluster.send("workerapp.loud_failure", 300_000)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    wait_for(lambda: cluster.status(run_id) == "failed", 15, what="the failure recorded")
    row = cluster.store.get(run_id)
    assert row is not None and row.last_error is not None
    assert len(row.last_error) <= 2000 and "s3cr3t" not in row.last_error
    assert row.last_error.startswith("RuntimeError: upstream said token=***")
    # Celery's own "raised unexpected" line shows the task's exception as it is
    # (docs/security.md); celery-lease's lines do not.
    ours = [line for line in worker.log().splitlines() if "celery_lease" in line or "run " in line]
    assert not [line for line in ours if "s3cr3t" in line and "raised unexpected" not in line]


def test_missing_metrics_directory_refuses_the_worker_not_the_cli(
    sqlite_url: str, tmp_path: Path
) -> None:
    """``lease_metrics = True`` with ``PROMETHEUS_MULTIPROC_DIR`` naming no directory: the
    worker refuses to start in one line (prometheus_client would fail at the first count,
    inside a task), and `celery lease` commands, which need no metrics, still work (they
    printed a FileNotFoundError traceback)."""
    import json
    import os

    missing = str(tmp_path / "no-metrics-dir")
    upgrade(sqlite_url)
    env = {"CL_LEASE_DB": sqlite_url, "PROMETHEUS_MULTIPROC_DIR": missing}
    line = _start_refused({**env, "CL_CONF": json.dumps({"lease_metrics": True})})
    assert f"PROMETHEUS_MULTIPROC_DIR={missing!r} is not a directory" in line
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.metricsapp", "lease", "sweep"],
        env={**os.environ, "CL_BROKER_URL": "memory://", **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "nothing to sweep" in proc.stdout
