"""LeaseStore on MySQL/MariaDB: atomic concurrency limit, UTC clock, first-claim deadlocks."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_lease.store import ClaimResult, LeaseStore

from .helpers import require

#: 2026-10-25 01:30:00 UTC: Europe/Berlin's repeated hour (02:30 happens twice).
DST_FOLD_EPOCH = 1_792_891_800


@pytest.fixture
def mstore(mysql_url: str) -> Iterator[LeaseStore]:
    """A store on a fresh MariaDB database with the schema created."""
    store = LeaseStore.from_url(mysql_url, pool_size=20)
    store.create_schema()
    yield store
    store.dispose()


def _together(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` in ``count`` threads released at once; results or raised errors."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        barrier.wait(10)
        try:
            results[i] = work(i)
        except BaseException as exc:  # reported to the test, not swallowed
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.timeout(120)
def test_concurrency_limit_holds_under_concurrent_claims(mstore: LeaseStore) -> None:
    """max_concurrency=1 and 8 claimers of different runs on one key, released together, 15
    times: never two live holders (the count and the claim used to be two transactions)."""
    for round_ in range(15):
        key = f"acct-{round_}"

        def claim(i: int, key: str = key, round_: int = round_) -> ClaimResult:
            return mstore.claim(
                f"r{round_}-{i}",
                f"w{i}:1:x",
                task_name="t",
                lease_ms=60_000,
                max_attempts=5,
                concurrency_key=key,
                max_concurrency=1,
            )

        results = _together(8, claim)
        claimed = [r for r in results if isinstance(r, ClaimResult) and r.outcome == "claimed"]
        assert len(claimed) <= 1, f"round {round_}: {len(claimed)} live holders of {key}"
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == [], errors
        with mstore.engine.connect() as conn:
            live = conn.execute(
                text(
                    "SELECT COUNT(*) FROM celery_lease_runs WHERE concurrency_key = :k "
                    "AND status = 'running'"
                ),
                {"k": key},
            ).scalar_one()
        assert live <= 1


@pytest.mark.timeout(120)
def test_concurrent_first_claims_of_one_id_never_raise(mstore: LeaseStore) -> None:
    """10 new ids, each claimed by 8 threads at once: exactly one claims, the rest report
    busy; InnoDB's gap-lock deadlock (1213) is retried as contention, never raised."""
    for n in range(10):
        run_id = f"new-{n}"

        def claim(i: int, run_id: str = run_id) -> ClaimResult:
            return mstore.claim(run_id, f"w{i}:1:x", task_name="t", lease_ms=60_000, max_attempts=5)

        results = _together(8, claim)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == [], errors
        outcomes = sorted(r.outcome for r in results)
        assert outcomes == ["busy"] * 7 + ["claimed"], outcomes
        row = mstore.get(run_id)
        assert row is not None and row.attempt == 1


def _session_store(mysql_url: str, time_zone: str, timestamp: int) -> LeaseStore:
    """A store whose every connection runs in ``time_zone`` with its clock set to ``timestamp``."""
    init = f"SET time_zone = '{time_zone}', timestamp = {timestamp}"
    engine = create_engine(mysql_url, connect_args={"init_command": init})
    auto = create_engine(
        mysql_url, isolation_level="AUTOCOMMIT", connect_args={"init_command": init}
    )
    return LeaseStore(engine, autocommit_engine=auto)


def _ensure_named_zone(mysql_url: str, zone: str) -> None:
    """Load ``zone`` into the server's time zone tables when they lack it (one zone only)."""
    engine = create_engine(mysql_url)
    try:
        with engine.connect() as conn:
            known = conn.execute(
                text("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = :z"), {"z": zone}
            ).scalar_one()
        if known:
            return
        tool = shutil.which("mariadb-tzinfo-to-sql") or shutil.which("mysql_tzinfo_to_sql")
        client = shutil.which("mariadb") or shutil.which("mysql")
        require(tool and client, "mariadb-tzinfo-to-sql and the mariadb client")
        sql = subprocess.run(
            [str(tool), f"/usr/share/zoneinfo/{zone}", zone],
            check=True,
            capture_output=True,
            timeout=30,
        ).stdout
        url = make_url(mysql_url)
        command = [str(client), "-h", str(url.host), "-P", str(url.port or 3306)]
        command += ["-u", str(url.username), "mysql"]
        if url.password:
            command.insert(1, f"--password={url.password}")
        loaded = subprocess.run(command, input=sql, capture_output=True, timeout=30)
        with engine.connect() as conn:
            known = conn.execute(
                text("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = :z"), {"z": zone}
            ).scalar_one()
        assert known, loaded.stderr.decode(errors="replace")[-2000:]
    finally:
        engine.dispose()


@pytest.mark.parametrize("time_zone", ["+05:00", "-11:00", "Europe/Berlin"])
def test_clock_is_utc_whatever_the_session_time_zone(mysql_url: str, time_zone: str) -> None:
    """With the session clock inside Berlin's repeated hour (daylight saving ends), the DB
    clock still reads true UTC epoch ms; UNIX_TIMESTAMP(NOW()) read an hour behind there."""
    if "/" in time_zone:
        _ensure_named_zone(mysql_url, time_zone)
    store = _session_store(mysql_url, time_zone, DST_FOLD_EPOCH)
    try:
        store.create_schema()
        assert store.now_ms() == DST_FOLD_EPOCH * 1000
        claim = store.claim("r1", "o:1:x", task_name="t", lease_ms=30_000, max_attempts=3)
        assert claim.outcome == "claimed"
        row = store.get("r1")
        assert row is not None and row.lease_expires_at == DST_FOLD_EPOCH * 1000 + 30_000
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_open_fence_on_one_run_does_not_hold_up_the_heartbeat_of_another(
    mstore: LeaseStore,
) -> None:
    """A fenced transaction holds run A's row lock; the heartbeat renewing run B (the same
    process's other lease) does not wait for it (before: InnoDB scanned the status index,
    waited on A's lock and the renewal failed with 1205)."""
    a = mstore.claim("fence-a", "w1:a", task_name="t", lease_ms=30_000, max_attempts=5)
    b = mstore.claim("beat-b", "w1:b", task_name="t", lease_ms=30_000, max_attempts=5)
    with mstore.transaction() as conn:
        mstore.fence(conn, "fence-a", a.owner, a.attempt)
        started = time.monotonic()
        result = mstore.heartbeat([("beat-b", b.owner, b.attempt)])
        waited = time.monotonic() - started
    assert result.renewed == {("beat-b", b.owner, b.attempt)}
    assert waited < 1.0
