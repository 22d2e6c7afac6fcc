"""Retention: finished rows deleted in batches (store, sweeper, setting, migration 0004),
and the stored message of a run cleared on every path that ends it."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from sqlalchemy import create_engine, func, insert, inspect, select, update

from celery_lease import retention
from celery_lease.config import DEFAULT_RETENTION_SECONDS, LeaseConfig
from celery_lease.migrations import alembic_config, head, upgrade
from celery_lease.schema import outbox, rates, runs
from celery_lease.store import LeaseStore
from celery_lease.sweeper import sweep
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for
from tests.test_cli import Cli

HOUR_MS = 3_600_000
MESSAGE = b'{"args": [1], "kwargs": {}, "options": {}}'
INDEX = "ix_celery_lease_runs_status_finished"


def _claim(store: LeaseStore, run_id: str, *, max_attempts: int = 5) -> int:
    claim = store.claim(
        run_id,
        f"w:1:{run_id}",
        task_name="t",
        lease_ms=60_000,
        max_attempts=max_attempts,
        payload=MESSAGE,
        payload_content_type="application/json",
    )
    assert claim.outcome == "claimed", claim
    return claim.attempt


def _finish(store: LeaseStore, run_id: str, status: str) -> None:
    attempt = _claim(store, run_id)
    owner = f"w:1:{run_id}"
    if status == "succeeded":
        store.complete(run_id, owner, attempt)
    elif status == "failed":
        store.fail(run_id, owner, attempt, error="boom", failure_code="task_error", retry_in=None)
    else:
        store.mark_cancelled(run_id, owner, attempt)


def _age(store: LeaseStore, run_id: str, ms: int) -> None:
    """Move a row's finish time ``ms`` into the past (test set-up, not library SQL)."""
    with store.engine.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(finished_at=runs.c.finished_at - ms, updated_at=runs.c.updated_at - ms)
        )


def _old_live_row(store: LeaseStore, run_id: str, status: str) -> None:
    """A live row that carries an old ``finished_at`` (say, from before a re-run)."""
    _claim(store, run_id)
    with store.engine.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(status=status, finished_at=runs.c.created_at - 10 * HOUR_MS)
        )


@pytest.mark.timeout(60)
def test_purge_deletes_only_old_finished_rows(store: LeaseStore) -> None:
    """Old succeeded/failed/cancelled rows go; young finished rows and every live row stay."""
    for status in ("succeeded", "failed", "cancelled"):
        _finish(store, f"old-{status}", status)
        _age(store, f"old-{status}", 2 * HOUR_MS)
        _finish(store, f"young-{status}", status)
    for status in ("queued", "running", "retrying"):
        _old_live_row(store, f"live-{status}", status)
    for status in ("succeeded", "failed", "cancelled"):
        assert store.reads.count_finished(status, HOUR_MS) == 1
        assert store.purge_finished(status, HOUR_MS) == 1
        assert store.purge_finished(status, HOUR_MS) == 0
        assert store.get(f"old-{status}") is None
        assert store.get(f"young-{status}") is not None
    for status in ("queued", "running", "retrying"):
        row = store.get(f"live-{status}")
        assert row is not None and row.status == status


@pytest.mark.timeout(60)
def test_purge_goes_in_bounded_batches_oldest_first(store: LeaseStore) -> None:
    """A batch deletes at most its limit, the oldest rows first; purge() loops batch by batch."""
    for i in range(7):
        _finish(store, f"r{i}", "succeeded")
        _age(store, f"r{i}", (10 + i) * HOUR_MS)  # r6 is the oldest
    assert store.purge_finished("succeeded", HOUR_MS, limit=2) == 2
    assert store.get("r6") is None and store.get("r5") is None and store.get("r4") is not None
    seen: list[int] = []
    report = retention.purge(store, 3600.0, batch=2, progress=lambda r: seen.append(r.total))
    assert report.removed == {"succeeded": 5, "failed": 0, "cancelled": 0}
    # succeeded: 2, 2, 1 (short: done); failed and cancelled: one empty batch each.
    assert report.batches == 5 and seen[-1] == 5
    for i in range(3):
        _finish(store, f"c{i}", "cancelled")
        _age(store, f"c{i}", 2 * HOUR_MS)
    capped = retention.purge(store, 3600.0, statuses=iter(retention.FINISHED), batch=5, limit=2)
    assert capped.removed == {"succeeded": 0, "failed": 0, "cancelled": 2}


@pytest.mark.timeout(30)
def test_purge_refuses_live_statuses_and_bad_input(store: LeaseStore) -> None:
    """Asking to purge a live status is a ValueError before any SQL."""
    with pytest.raises(ValueError, match="only finished runs"):
        store.purge_finished("running", HOUR_MS)
    with pytest.raises(ValueError, match="only finished runs"):
        retention.purge(store, 3600.0, statuses=["succeeded", "queued"])
    with pytest.raises(ValueError, match="limit"):
        store.purge_finished("succeeded", HOUR_MS, limit=0)


@pytest.fixture(params=["postgresql", "mysql"])
def server_store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    """A store on PostgreSQL or MySQL/MariaDB (the dialects with SKIP LOCKED)."""
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")
    lease_store = LeaseStore.from_url(url)
    lease_store.create_schema()
    yield lease_store
    lease_store.dispose()


@pytest.mark.timeout(60)
def test_purge_skips_a_row_another_transaction_holds(server_store: LeaseStore) -> None:
    """SKIP LOCKED: a locked old row is left for later, never waited for; the others go."""
    store = server_store
    for run_id in ("a", "b", "c"):
        _finish(store, run_id, "succeeded")
        _age(store, run_id, 2 * HOUR_MS)
    engine = create_engine(store.engine.url)
    try:
        with engine.begin() as conn:
            conn.execute(runs.select().where(runs.c.id == "b").with_for_update())
            assert store.purge_finished("succeeded", HOUR_MS) == 2
        assert store.get("b") is not None
        assert store.purge_finished("succeeded", HOUR_MS) == 1
    finally:
        engine.dispose()


def _app(db_url: str, **conf: Any) -> Celery:
    app = Celery("retention", set_as_current=False)
    app.conf.update(broker_url="memory://", lease_database_url=db_url, **conf)
    return app


@pytest.mark.timeout(60)
def test_sweeper_deletes_expired_rows_up_to_its_limit_per_sweep(db_url: str) -> None:
    """Each sweep deletes at most its limit of rows past lease_retention; live and
    young rows are never touched; the report counts per status."""
    store = LeaseStore.from_url(db_url)
    store.create_schema()
    try:
        for i in range(5):
            _finish(store, f"s{i}", "succeeded")
            _age(store, f"s{i}", 2 * HOUR_MS)
        _finish(store, "f0", "failed")
        _age(store, "f0", 2 * HOUR_MS)
        _finish(store, "young", "succeeded")
        _old_live_row(store, "live", "running")
        app = _app(db_url, lease_retention=timedelta(hours=1))
        first = sweep(app, store, purge_limit=4, purge_budget=None)
        assert sum(first.purged.values()) == 4
        second = sweep(app, store, purge_limit=4, purge_budget=None)
        assert first.purged["succeeded"] + second.purged["succeeded"] == 5
        assert first.purged["failed"] + second.purged["failed"] == 1
        third = sweep(app, store, purge_budget=None)
        assert third.purged == {"succeeded": 0, "failed": 0, "cancelled": 0}
        assert store.get("young") is not None
        live = store.get("live")
        assert live is not None and live.status == "running"
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_sweep_retention_starts_no_batch_past_its_budget(sqlite_url: str) -> None:
    """A sweep facing a backlog stops deleting once another batch would overrun its
    time budget (here every batch takes 30 ms, the budget is 25 ms: one batch runs);
    the rest waits for the next sweep."""
    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    for i in range(6):
        _finish(store, f"s{i}", "succeeded")
        _age(store, f"s{i}", 2 * HOUR_MS)
    real = store.purge_finished

    def slow(status: str, older_than_ms: int, limit: int) -> int:
        time.sleep(0.03)
        return real(status, older_than_ms, limit)

    store.purge_finished = slow  # type: ignore[method-assign]
    try:
        report = retention.purge(store, 3600, batch=2, budget=0.025)
        assert (report.batches, report.total) == (1, 2)
        report = retention.purge(store, 3600, batch=2, budget=None)
        assert report.total == 4
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_retention_none_keeps_rows_forever(sqlite_url: str) -> None:
    """lease_retention = None: the sweeper deletes nothing, however old."""
    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    _finish(store, "ancient", "succeeded")
    _age(store, "ancient", 3650 * 24 * HOUR_MS)
    report = sweep(_app(sqlite_url, lease_retention=None), store)
    assert report.purged == {"succeeded": 0, "failed": 0, "cancelled": 0}
    assert store.get("ancient") is not None
    store.dispose()


# -- the setting ------------------------------------------------------------------


def test_retention_setting_values() -> None:
    """Default 7 days; seconds or a timedelta; None given means forever."""
    assert LeaseConfig.from_mapping({}).retention == DEFAULT_RETENTION_SECONDS == 7 * 86400
    assert LeaseConfig.from_mapping({"lease_retention": 3600}).retention == 3600.0
    assert LeaseConfig.from_mapping({"lease_retention": timedelta(days=2)}).retention == 172800.0
    assert LeaseConfig.from_mapping({"lease_retention": None}).retention is None
    app = Celery(set_as_current=False)
    app.conf.lease_retention = None
    assert LeaseConfig.from_app(app).retention is None
    config = LeaseConfig.from_app(app).with_overrides({"lease_seconds": 5})
    assert config.retention is None  # per-task overrides keep the app's retention


def test_retention_setting_read_through_a_django_namespace() -> None:
    """CELERY_LEASE_RETENTION = None (namespace CELERY) keeps rows; unset keeps the default."""

    class Settings:
        CELERY_LEASE_RETENTION = None

    app = Celery(set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    assert LeaseConfig.from_app(app).retention is None

    class Hours:
        CELERY_LEASE_RETENTION = timedelta(hours=6)

    other = Celery(set_as_current=False)
    other.config_from_object(Hours, namespace="CELERY")
    assert LeaseConfig.from_app(other).retention == 6 * 3600.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("7d", "number of seconds, a timedelta or None"),
        (True, "number of seconds, a timedelta or None"),
        (0, "positive and finite"),
        (-5, "positive and finite"),
        (timedelta(0), "positive and finite"),
        (float("inf"), "positive and finite"),
        (604_800_000, "at most"),  # a week in milliseconds
    ],
)
def test_bad_retention_is_refused_naming_the_key(value: object, message: str) -> None:
    """A bad lease_retention is an ImproperlyConfigured that names the key."""
    with pytest.raises(ImproperlyConfigured, match=f"lease_retention.*{message}"):
        LeaseConfig.from_mapping({"lease_retention": value})


# -- migration 0004 ---------------------------------------------------------------


def _indexes(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {str(ix["name"]) for ix in inspect(engine).get_indexes(runs.name)}
    finally:
        engine.dispose()


def _downgrade(url: str, revision: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), revision)
    finally:
        engine.dispose()


@pytest.mark.timeout(90)
def test_migration_0004_adds_and_drops_the_retention_index(db_url: str) -> None:
    """0003 -> 0004 creates (status, finished_at); downgrade drops it; upgrade again works."""
    upgrade(db_url, "0003")
    assert INDEX not in _indexes(db_url)
    assert upgrade(db_url).after == head()
    assert INDEX in _indexes(db_url)
    _downgrade(db_url, "0003")
    assert INDEX not in _indexes(db_url)
    upgrade(db_url)
    assert INDEX in _indexes(db_url)


@pytest.mark.timeout(60)
def test_create_schema_adds_the_index_to_an_older_sqlite_table(sqlite_url: str) -> None:
    """The embedded default (no migrate step) gets the new index on an existing table."""
    upgrade(sqlite_url, "0003")
    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    store.dispose()
    assert INDEX in _indexes(sqlite_url)


# -- payload privacy --------------------------------------------------------------


def _complete(s: LeaseStore) -> str:
    s.complete("r", "w:1:r", _claim(s, "r"))
    return "succeeded"


def _fence_complete(s: LeaseStore) -> str:
    attempt = _claim(s, "r")
    with s.engine.begin() as conn:
        s.fence(conn, "r", "w:1:r", attempt, complete=True)
    return "succeeded"


def _fail(s: LeaseStore) -> str:
    s.fail("r", "w:1:r", _claim(s, "r"), error="e", failure_code="task_error", retry_in=None)
    return "failed"


def _end(s: LeaseStore) -> str:
    s.end("r", "w:1:r", _claim(s, "r"), status="cancelled", failure_code="ignored")
    return "cancelled"


def _mark_cancelled(s: LeaseStore) -> str:
    s.mark_cancelled("r", "w:1:r", _claim(s, "r"))
    return "cancelled"


def _cancel_waiting(s: LeaseStore) -> str:
    s.release("r", "w:1:r", _claim(s, "r"), available_in=60)
    assert s.cancel("r") == "cancelled"
    return "cancelled"


def _sweep_expired(cancel: bool) -> Callable[[LeaseStore], str]:
    def run(s: LeaseStore) -> str:
        _claim(s, "r", max_attempts=1)
        if cancel:
            s.cancel("r")
        s.expire("r")
        [(_, status)] = s.sweep_expired()
        return status

    return run


def _refuse_message(s: LeaseStore) -> str:
    s.release("r", "w:1:r", _claim(s, "r"))
    row = s.get("r")
    assert row is not None
    assert s.refuse_message(row, "expired", "the message expired", status="cancelled")
    return "cancelled"


def _claim_after_attempts_spent(s: LeaseStore) -> str:
    s.release("r", "w:1:r", _claim(s, "r", max_attempts=1))
    refused = s.claim(
        "r",
        "w:2:r",
        task_name="t",
        lease_ms=60_000,
        max_attempts=1,
        payload=MESSAGE,
        payload_content_type="application/json",
    )
    assert refused.outcome == "finished"
    return "failed"


def _end_unclaimed(s: LeaseStore) -> str:
    s.release("r", "w:1:r", _claim(s, "r"))
    return s.end_unclaimed(
        "r", task_name="t", max_attempts=5, failure_code="lease_db_error", error="e"
    )


TERMINAL_PATHS = {
    "complete": _complete,
    "fence_complete": _fence_complete,
    "fail_final": _fail,
    "end_body_outcome": _end,
    "cancelled_by_worker": _mark_cancelled,
    "cancel_waiting_run": _cancel_waiting,
    "sweep_lease_expired": _sweep_expired(cancel=False),
    "sweep_cancel_requested": _sweep_expired(cancel=True),
    "expired_message": _refuse_message,
    "claim_refused_attempts_spent": _claim_after_attempts_spent,
    "end_unclaimed_db_error": _end_unclaimed,
}


#: The paths that clear the message: a success, and a message refused as expired.
#: Every other ending (failed, cancelled) keeps it for `celery lease rerun`.
CLEARING_PATHS = {"complete", "fence_complete", "expired_message"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted(TERMINAL_PATHS))
def test_terminal_paths_clear_the_message_on_success_and_keep_it_for_rerun(
    store: LeaseStore, path: str
) -> None:
    """A succeeded run's stored message (task arguments) and content type are gone; a
    failed or cancelled run keeps them until retention deletes the row."""
    status = TERMINAL_PATHS[path](store)
    row = store.get("r")
    assert row is not None and row.status == status and row.terminal
    if path in CLEARING_PATHS:
        assert (row.payload, row.payload_content_type) == (None, None)
    else:
        assert status in ("failed", "cancelled")
        assert row.payload is not None and row.payload_content_type is not None


# -- a duplicate after its row is purged runs again (real worker) ----------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
def test_duplicate_after_its_row_is_purged_runs_again(cluster: Cluster) -> None:
    """Within lease_retention a keyed duplicate is dropped; once the worker's sweep has
    deleted the finished row, the same key runs again: retention is the de-duplication window."""
    worker = cluster.start(
        "w1", conf={"lease_retention": 1, "lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1}
    )
    run_id = "workerapp.keyed:9"
    cluster.send("keyed", 9)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the first run")
    cluster.send("keyed", 9)  # a duplicate inside the window: dropped
    dropped = f"run {run_id} is already succeeded: delivery dropped"
    wait_for(lambda: dropped in worker.log(), 30, what="the duplicate to be dropped")
    assert len(cluster.effects(run_id, "start")) == 1
    row = cluster.store.get(run_id)
    assert row is not None and row.payload is None
    wait_for(
        lambda: cluster.store.now_ms() - (row.finished_at or 0) > 1500, 10, what="1.5 s to pass"
    )
    cluster.send("celery_lease.sweep")  # the sweeper task, run by the worker
    wait_for(lambda: cluster.status(run_id) is None, 30, what="the sweep to delete the row")
    cluster.send("keyed", 9)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the run again")
    assert len(cluster.effects(run_id, "start")) == 2


# -- celery lease purge / show (real subprocesses) --------------------------------


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Iterator[tuple[Cli, LeaseStore]]:
    """The ``celery lease`` command on a migrated database, and a store on it."""
    runner = Cli(db_url, tmp_path)
    upgrade(db_url)
    lease_store = LeaseStore.from_url(db_url)
    yield runner, lease_store
    lease_store.dispose()


def _usage_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 (click's usage error), the reason on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    flat = " ".join(proc.stderr.split())
    for needle in needles:
        assert needle in flat, proc.stderr


@pytest.mark.timeout(120)
def test_purge_cli_dry_run_status_filter_and_output(cli: tuple[Cli, LeaseStore]) -> None:
    """--dry-run counts and deletes nothing; --status limits; the output counts per status."""
    run, store = cli
    for i in range(3):
        _finish(store, f"s{i}", "succeeded")
        _age(store, f"s{i}", 48 * HOUR_MS)
    _finish(store, "f0", "failed")
    _age(store, "f0", 48 * HOUR_MS)
    _finish(store, "young", "succeeded")
    _claim(store, "live")
    dry = run.ok("purge", "--older-than", "1d", "--dry-run")
    assert "would delete 4 finished runs" in dry and "succeeded 3, failed 1, cancelled 0" in dry
    assert store.get("s0") is not None
    only_failed = json.loads(run.ok("purge", "--older-than", "1d", "--status", "failed", "--json"))
    assert only_failed["removed"] == {"failed": 1} and not only_failed["dry_run"]
    assert store.get("f0") is None and store.get("s0") is not None
    out = run.ok("purge", "--older-than", "24h", "--batch", "2")
    assert "deleted 3 finished runs that finished before" in out
    assert "succeeded 3, failed 0, cancelled 0" in out
    assert store.get("young") is not None and store.get("live") is not None
    assert "deleted 0 finished runs" in run.ok("purge", "--older-than", "1d")


@pytest.mark.timeout(120)
def test_purge_cli_deletes_followups_never_published(cli: tuple[Cli, LeaseStore]) -> None:
    """`lease purge` also deletes follow-up tasks recorded before its age and never
    published (the outbox stays bounded); --dry-run counts them."""
    run, store = cli
    now = store.now_ms()
    rows = [
        {
            "task_id": task_id,
            "run_id": "r",
            "task_name": "t",
            "payload": b"{}",
            "payload_content_type": "application/json",
            "created_at": now - age,
        }
        for task_id, age in (("old1", 48 * HOUR_MS), ("old2", 30 * HOUR_MS), ("new", 1000))
    ]
    with store.transaction() as conn:
        conn.execute(insert(outbox), rows)
    assert "would delete 2 follow-up tasks" in run.ok("purge", "--older-than", "1d", "--dry-run")
    assert store.outbox.count() == 3
    out = json.loads(run.ok("purge", "--older-than", "1d", "--json"))
    assert out["unsent_followups"] == 2 and store.outbox.count() == 1
    assert "follow-up" not in run.ok("purge", "--older-than", "1d")


@pytest.mark.timeout(120)
def test_purge_cli_refuses_bad_input_clearly(cli: tuple[Cli, LeaseStore]) -> None:
    """A bad duration, a live status, a missing age: usage errors naming the problem."""
    run, _ = cli
    _usage_error(run("purge", "--older-than", "7x"), "'7x' is not a duration", "7d")
    _usage_error(run("purge", "--older-than", "0s"), "more than zero")
    _usage_error(
        run("purge", "--older-than", "7d", "--status", "running"),
        "running is live: only finished runs (succeeded, failed, cancelled) can be purged",
    )
    _usage_error(run("purge", "--older-than", "7d", "--status", "done"), "'done' is not one of")
    _usage_error(run("purge"), "Missing option '--older-than'")
    _usage_error(run("purge", "--older-than", "7d", "--batch", "0"), "--batch")


@pytest.mark.timeout(120)
def test_show_says_a_finished_runs_arguments_were_cleared(cli: tuple[Cli, LeaseStore]) -> None:
    """`lease show` of a finished run says its payload was cleared, not a bare '-'."""
    run, store = cli
    _finish(store, "done", "succeeded")
    _claim(store, "live")
    assert "payload" in run.ok("show", "done")
    line = next(x for x in run.ok("show", "done").splitlines() if x.startswith("payload "))
    assert "cleared (run succeeded" in line
    live = next(x for x in run.ok("show", "live").splitlines() if x.startswith("payload "))
    assert "bytes (use --payload to print)" in live
    assert json.loads(run.ok("show", "done", "--json"))["payload_cleared"] is True
    assert json.loads(run.ok("show", "live", "--json"))["payload_cleared"] is False


# -- issue 28: idle rate keys and kept results have retention (real workers) ---------

FS_AND_PG = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)


def _rate_rows(cluster: Cluster) -> int:
    with cluster.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(rates)).scalar() or 0)


@FS_AND_PG
@pytest.mark.timeout(180)
def test_idle_rate_keys_are_deleted_by_lease_purge_and_by_the_sweep(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Every rate key leaves one bucket row in celery_lease_rates. Once its last slot has
    passed, `lease purge` deletes it (--dry-run counts it) and so does the worker's
    sweep (before: the table grew by one row per key value, for good)."""
    cluster.start("w1", conf={"lease_worker_sweeper": False})
    ids = [cluster.send("rate_keyed", f"acct-{n}", n) for n in range(8)]
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 60, what="8 runs")
    assert _rate_rows(cluster) == 8
    (tmp_path / "cli").mkdir()
    run = Cli(cluster.db_url, tmp_path / "cli")
    time.sleep(0.6)  # each key's slot (2/s: 0.5 s) has passed
    assert "would delete 8 idle rate keys" in run.ok("purge", "--older-than", "7d", "--dry-run")
    assert _rate_rows(cluster) == 8
    out = json.loads(run.ok("purge", "--older-than", "7d", "--json"))
    assert out["idle_rate_keys"] == 8
    assert _rate_rows(cluster) == 0
    w2 = cluster.start("w2", conf={"lease_sweep_interval": 0.5})  # this one sweeps
    more = [cluster.send("rate_keyed", f"more-{n}", n) for n in range(6)]
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in more), 60, what="6 runs")
    wait_for(lambda: _rate_rows(cluster) == 0, 30, what="the sweep to delete idle keys")
    assert "idle rate keys" in w2.log()


@FS_AND_PG
@pytest.mark.timeout(180)
def test_a_kept_result_lives_no_longer_than_result_expires_and_not_at_all_when_ignored(
    cluster: Cluster,
) -> None:
    """The result kept in the row for a replay: dropped by the sweep once Celery's
    result_expires (1 s here) has passed; never kept for a task with ignore_result, a
    call with ignore_result, or an app without a result backend (before: kept until
    lease_retention in every case)."""
    cluster.start("w1", conf={"result_expires": 1, "lease_sweep_interval": 0.5})
    kept = cluster.producer.signature("workerapp.step", args=(1,)).apply_async()
    assert kept.get(timeout=60) == 2
    quiet = cluster.send("quiet", 1)
    ignored = cluster.producer.signature("workerapp.step", args=(5,)).apply_async(
        ignore_result=True
    )
    wait_for(
        lambda: cluster.status(quiet) == cluster.status(ignored.id) == "succeeded",
        60,
        what="the ignore_result runs",
    )
    for run_id in (quiet, ignored.id):
        row = cluster.store.get(run_id)
        assert row is not None and row.result is None, run_id
    wait_for(
        lambda: getattr(cluster.store.get(kept.id), "result", b"") is None,
        30,
        what="the sweep to drop the expired result",
    )
    row = cluster.store.get(kept.id)
    assert row is not None and row.status == "succeeded" and row.result_content_type is None
    cluster.start("w2", conf={"result_backend": None}, queues=[f"{cluster.queue}.nb"])
    nobody = uuid.uuid4().hex
    cluster.producer.send_task(
        "workerapp.step", args=(7,), task_id=nobody, queue=f"{cluster.queue}.nb"
    )
    wait_for(lambda: cluster.status(nobody) == "succeeded", 60, what="the run without a backend")
    row = cluster.store.get(nobody)
    assert row is not None and row.result is None


@pytest.mark.timeout(120)
def test_purge_cli_drops_kept_results_past_result_expires(cli: tuple[Cli, LeaseStore]) -> None:
    """`lease purge` drops the result a succeeded row keeps for a replay once the app's
    result_expires (Celery's default, 1 day) has passed, as the sweep does; the row stays
    until --older-than; --dry-run counts (before: only a sweep dropped them, so a
    deployment sweeping with `lease purge` from cron kept every result until retention)."""
    run, store = cli
    for run_id, age in (("old", 48 * HOUR_MS), ("young", HOUR_MS)):
        attempt = _claim(store, run_id)
        store.complete(run_id, f"w:1:{run_id}", attempt, result=(b"[2]", "application/json"))
        _age(store, run_id, age)
    dry = run.ok("purge", "--older-than", "7d", "--dry-run")
    assert "would drop 1 kept result older than result_expires (86400s" in dry, dry
    assert store.get("old").result == b"[2]"  # type: ignore[union-attr]
    out = json.loads(run.ok("purge", "--older-than", "7d", "--json"))
    assert out["expired_results"] == 1 and out["total"] == 0
    old, young = store.get("old"), store.get("young")
    assert old is not None and old.status == "succeeded" and old.result is None
    assert young is not None and young.result == b"[2]"
    assert "kept result" not in run.ok("purge", "--older-than", "7d")
