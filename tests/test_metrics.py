"""``celery_lease.metrics``: Prometheus counters fed by lease events."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from prometheus_client import CollectorRegistry

from celery_lease import Lease, LeasedTask, LeaseLost, install, testing
from celery_lease import metrics as lease_metrics
from celery_lease.events import Event, LeaseState, Transition
from celery_lease.lease.lease import Standalone
from celery_lease.runtime import app_runtime, store_for
from tests.helpers import REPO, wait_for


@pytest.fixture
def registry(app: Celery) -> Iterator[CollectorRegistry]:
    """A private registry counting ``app``'s events, disabled afterwards."""
    reg = CollectorRegistry()
    lease_metrics.enable(app, reg)
    yield reg
    lease_metrics.disable(app)


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    sample = reg.get_sample_value(name, labels or None)
    return 0.0 if sample is None else sample


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("metrics", set_as_current=False)
    app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)
    testing.use_lease_database(app, tmp_path / "leases.sqlite3", lease_max_attempts=1)
    yield app
    testing.shutdown_leases(app)


def test_events_update_counters(app: Celery, registry: CollectorRegistry) -> None:
    """Each emitted lease event or lease transition moves its counter (or the histogram)."""
    held, completing = LeaseState.HELD, LeaseState.COMPLETING
    bus = app_runtime(app).events
    emit, publish = bus.emit, bus.publish
    emit(Event.CLAIMED, "r1", "x", attempt=1)
    emit(Event.BUSY, "r1", "x", retry_in=1.0, policy="retry")
    publish(Transition("r1", "A", 1, held, completing))
    publish(Transition("r1", "A", 1, completing, LeaseState.COMPLETED))
    emit(Event.RETRYING, "r2", "x", attempt=1)
    emit(Event.FAILED, "r2", "x", attempt=2)
    publish(Transition("r3", "A", 1, held, LeaseState.CANCEL_REQUESTED))
    publish(Transition("r3", "A", 1, LeaseState.CANCEL_REQUESTED, LeaseState.CANCELLED))
    emit(Event.COMPLETED, "r4", "a string is not a transition", attempt=1)
    emit(Event.DUPLICATE_DROPPED, "r1", "x", status="succeeded")
    emit(Event.CLAIM_ERROR, "r4", "x")
    emit(Event.SWEPT, "r5", "x", action="expired")
    emit(Event.SWEPT, "r6", "x", action="failed")
    emit(Event.HEARTBEAT, None, "x", leases=3, seconds=0.004)
    assert value(registry, "celery_lease_claims_total") == 1
    assert value(registry, "celery_lease_busy_total") == 1
    assert value(registry, "celery_lease_completed_total") == 1
    assert value(registry, "celery_lease_failures_total", outcome="retrying") == 1
    assert value(registry, "celery_lease_failures_total", outcome="failed") == 1
    assert value(registry, "celery_lease_cancelled_total") == 1
    assert value(registry, "celery_lease_duplicates_dropped_total") == 1
    assert value(registry, "celery_lease_database_errors_total", stage="claim") == 1
    assert value(registry, "celery_lease_sweep_recovered_total", action="expired") == 1
    assert value(registry, "celery_lease_sweep_recovered_total", action="failed") == 1
    assert value(registry, "celery_lease_heartbeat_seconds_count") == 1
    assert value(registry, "celery_lease_heartbeat_seconds_bucket", le="0.005") == 1
    assert value(registry, "celery_lease_heartbeat_seconds_bucket", le="0.0025") == 0


def test_lease_lost_counted_once_per_attempt(app: Celery, registry: CollectorRegistry) -> None:
    """The heartbeat and the refused write both report a loss; the lease enters LOST
    once, so it counts once per attempt."""
    store = store_for(app)
    claim = testing.hold_lease(store, "r1", task_name="t", lease_seconds=30)
    for attempt in (1, 2):
        assert claim.attempt == attempt
        lease = Lease(
            Standalone(store, events=app_runtime(app).events),
            "r1",
            claim.owner,
            attempt,
            lease_seconds=30,
            heartbeat_interval=10,
        )
        claim = testing.steal_lease(store, "r1")
        lease.refused("heartbeat refused")
        with pytest.raises(LeaseLost):
            lease.complete()
    assert value(registry, "celery_lease_lease_lost_total") == 2


def test_loss_found_by_fence_is_counted(app: Celery, registry: CollectorRegistry) -> None:
    """The README's main path: fence() refuses a stolen lease; that loss is counted
    (before, fence marked it silently and the counter stayed 0)."""
    store = store_for(app)

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="metrics.fenced", lease_lost_policy="abort"
    )
    def fenced(self: LeasedTask) -> str:
        testing.steal_lease(store, self.lease.run_id)
        with store.engine.begin() as conn:
            self.lease.fence(conn, complete=True)
        return "late"

    with pytest.raises(LeaseLost, match="fence refused"):
        fenced.delay()
    assert value(registry, "celery_lease_lease_lost_total") == 1
    assert value(registry, "celery_lease_completed_total") == 0


def test_real_runs_are_counted(app: Celery, registry: CollectorRegistry) -> None:
    """Leased tasks run in process move claims, completed, failures and lease-lost."""
    store = store_for(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="metrics.ok")
    def ok(self: LeasedTask) -> str:
        return "ok"

    @app.task(base=LeasedTask, bind=True, shared=False, name="metrics.boom")
    def boom(self: LeasedTask) -> str:
        raise ValueError("boom")

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="metrics.stolen", lease_lost_policy="abort"
    )
    def stolen(self: LeasedTask) -> str:
        testing.steal_lease(store, self.lease.run_id)
        return "late"

    ok.delay()
    with pytest.raises(ValueError):
        boom.delay()
    with pytest.raises(LeaseLost):
        stolen.delay()
    assert value(registry, "celery_lease_claims_total") == 3
    assert value(registry, "celery_lease_completed_total") == 1
    assert value(registry, "celery_lease_failures_total", outcome="failed") == 1
    assert value(registry, "celery_lease_lease_lost_total") == 1


def test_enable_is_idempotent_per_app_and_registry(app: Celery) -> None:
    """enable() twice for one app and registry returns the same metrics, listening once."""
    reg = CollectorRegistry()
    bus = app_runtime(app).events
    first = lease_metrics.enable(app, reg)
    try:
        assert lease_metrics.enable(app, reg) is first
        assert bus._listeners.count(first) == 1
        assert bus._transition_listeners.count(first.on_transition) == 1
    finally:
        lease_metrics.disable(app)
    assert first not in bus._listeners and app_runtime(app).metrics is None


def test_metrics_count_only_their_apps_events(app: Celery, registry: CollectorRegistry) -> None:
    """Listeners are per app: another app's events are not counted, and reset() drops
    the app's listeners (no process-wide list keeps them)."""
    other = Celery("metrics-other", set_as_current=False)
    app_runtime(other).events.emit(Event.CLAIMED, "r1", "x", attempt=1)
    assert value(registry, "celery_lease_claims_total") == 0
    app_runtime(app).events.emit(Event.CLAIMED, "r1", "x", attempt=1)
    assert value(registry, "celery_lease_claims_total") == 1
    app_runtime(app).reset()
    assert app_runtime(app).metrics is None
    app_runtime(app).events.emit(Event.CLAIMED, "r2", "x", attempt=1)
    assert value(registry, "celery_lease_claims_total") == 1


def test_lease_metrics_setting_enables_on_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """app.conf.lease_metrics = True makes install() enable metrics; other values are refused."""
    enabled: list[object] = []
    monkeypatch.setattr(
        lease_metrics, "enable", lambda app, registry=None: enabled.append(registry)
    )
    app = Celery("m1", set_as_current=False)
    app.conf.lease_metrics = True
    install(app)
    assert enabled == [None]
    off = Celery("m2", set_as_current=False)
    install(off)
    assert enabled == [None]
    bad = Celery("m3", set_as_current=False)
    bad.conf.lease_metrics = "yes"
    with pytest.raises(ImproperlyConfigured, match="lease_metrics must be True or False"):
        install(bad)


def test_missing_extra_gives_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enabling metrics without prometheus-client says which extra to install."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'celery-lease\[prometheus\]'"):
        lease_metrics.enable(Celery("no-extra", set_as_current=False))


def test_package_imports_without_prometheus() -> None:
    """celery_lease, its CLI and metrics module import without prometheus_client."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import celery_lease, celery_lease.cli, celery_lease.metrics, celery_lease.testing\n"
        "from celery import Celery\n"
        "app = Celery('x', set_as_current=False); celery_lease.install(app); print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_last_sweep_timestamp_is_exported(app: Celery, registry: CollectorRegistry) -> None:
    """A sweep sets the last-sweep gauge of its database; a worker's sweep watch reading
    the recorded sweep sets it too."""
    import time

    from celery_lease.liveness import SweepWatch
    from celery_lease.sweeper import sweep

    store = store_for(app)
    database = store.engine.url.render_as_string(hide_password=True)
    before = time.time()
    sweep(app, store)
    name = "celery_lease_last_sweep_timestamp_seconds"
    swept = value(registry, name, database=database)
    assert before - 1 <= swept <= time.time() + 1
    # The watch sets it again from the recorded row:
    lease_metrics.enable(app, registry).last_sweep.clear()
    assert SweepWatch(app, warn=False).check_once()
    assert before - 2 <= value(registry, name, database=database) <= time.time() + 1


def test_checkpoints_and_progress_are_exported(app: Celery, registry: CollectorRegistry) -> None:
    """Saved checkpoints are counted (plain and fenced, the fenced one on its commit); a
    renewal writing progress counts it and sets the task's done/total ratio."""
    from celery_lease.runtime import runtime_for

    @app.task(base=LeasedTask, bind=True, shared=False, name="metrics.resumable")
    def resumable(self: LeasedTask) -> str:
        self.lease.checkpoint({"next": 1})
        self.lease.checkpoint({"next": 2})
        with self.lease.transaction() as conn:
            self.lease.fence(conn, checkpoint={"next": 3})
        self.lease.progress(30, 120, "rows")
        runtime_for(app, self.lease_config()).heartbeat.beat_once()
        return "ok"

    resumable.delay()
    assert value(registry, "celery_lease_checkpoints_total", fenced="false") == 2
    assert value(registry, "celery_lease_checkpoints_total", fenced="true") == 1
    assert value(registry, "celery_lease_progress_writes_total") == 1
    assert value(registry, "celery_lease_progress_ratio", task="metrics.resumable") == 0.25


def test_leader_gauge_follows_the_sweepers_lead(app: Celery, registry: CollectorRegistry) -> None:
    """The in-worker sweeper's lead shows as celery_lease_leader{role="sweeper"}: 1 once
    this process takes it and its sweep sets the last-sweep time, 0 once it resigns."""
    import time

    from celery_lease.runtime import app_config
    from celery_lease.worker_sweeper import WorkerSweeper

    sweeper = WorkerSweeper(app, app_config(app), hostname="w1@test")
    database = sweeper.database
    name = "celery_lease_leader"
    assert value(registry, name, role="sweeper", database=database) == 0.0
    sweeper.leadership.step()
    assert value(registry, name, role="sweeper", database=database) == 1.0
    before = time.time()
    assert sweeper.sweep_once() is not None
    swept = value(registry, "celery_lease_last_sweep_timestamp_seconds", database=database)
    assert before - 1 <= swept <= time.time() + 1
    sweeper.stop()
    assert value(registry, name, role="sweeper", database=database) == 0.0


def test_followups_are_counted_by_outcome(app: Celery, registry: CollectorRegistry) -> None:
    """A follow-up published after its commit counts ``sent``; the sweeper's, ``swept``."""
    from celery_lease.followups import send
    from celery_lease.store import OutboxRecord

    @app.task(shared=False, name="metrics.mail")
    def mail(n: int) -> int:
        return n

    @app.task(base=LeasedTask, bind=True, shared=False, name="metrics.pay")
    def pay(self: LeasedTask) -> str:
        with self.lease.transaction() as conn:
            self.lease.fence(conn, complete=True, send=[mail.s(1)])
        return "ok"

    pay.delay()
    wait_for(
        lambda: value(registry, "celery_lease_followups_total", outcome="sent") == 1,
        10,
        what="the follow-up to be sent",
    )
    body = b'{"task": "metrics.mail", "args": [2], "kwargs": {}, "options": {}}'
    row = OutboxRecord("r:followup:1.0", "r", "metrics.mail", body, "application/json", 0)
    send(app, store_for(app), [row], app_runtime(app).events, swept=True)
    assert value(registry, "celery_lease_followups_total", outcome="swept") == 1
    refused = OutboxRecord("r:followup:1.1", "r", "metrics.mail", b"x", "application/x-yaml", 0)
    send(app, store_for(app), [refused], app_runtime(app).events, swept=True)
    assert value(registry, "celery_lease_followups_total", outcome="dropped") == 1


def test_every_documented_sweep_action_is_exported_from_the_start(
    app: Celery, registry: CollectorRegistry
) -> None:
    """Each ``action`` operations.md lists for ``celery_lease_sweep_recovered_total`` is a
    series at 0 before the first sweep, so an ``increase()`` alert sees it from the start
    (``undeliverable`` appeared only once a run had ended so)."""
    row = next(
        line
        for line in (REPO / "docs" / "operations.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `celery_lease_sweep_recovered_total` |")
    )
    actions = re.findall(r"`([a-z]+)`", row.split("|")[3].partition("=")[2])
    assert "undeliverable" in actions and "expired" in actions, row
    for action in actions:
        sample = registry.get_sample_value("celery_lease_sweep_recovered_total", {"action": action})
        assert sample == 0.0, action
