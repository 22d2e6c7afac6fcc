"""Prometheus metrics for lease events (optional extra: ``pip install celery-lease[prometheus]``).

Turn them on with ``app.conf.lease_metrics = True`` (read by :func:`celery_lease.install`)
or by calling :func:`enable`. They count the events the app emits in this process
(they listen on its :class:`~celery_lease.events.EventBus`); ``prometheus_client``
is imported only then, so the package works without the extra.

Exported (names as Prometheus shows them):

- ``celery_lease_claims_total``: claims that won a lease (a body started).
- ``celery_lease_busy_total``: deliveries refused by another live lease or a full
  concurrency key.
- ``celery_lease_completed_total``: runs recorded ``succeeded``.
- ``celery_lease_failures_total{outcome}``: failed attempts, ``outcome`` =
  ``retrying`` or ``failed`` (attempts spent).
- ``celery_lease_lease_lost_total``: leases this process lost (once per run
  attempt, whoever saw it first: the heartbeat, the local deadline, ``fence()``
  or a refused guarded write).
- ``celery_lease_sweep_recovered_total{action}``: runs the sweeper acted on:
  ``expired``/``stranded`` (re-enqueued), ``failed``, ``cancelled``, ``handoff``.
- ``celery_lease_cancelled_total``: runs a worker ended ``cancelled`` after a
  cancel request.
- ``celery_lease_duplicates_dropped_total``: deliveries of finished runs dropped.
- ``celery_lease_database_errors_total{stage}``: lease database errors at
  ``claim`` or ``fail``.
- ``celery_lease_checkpoints_total{fenced}``: checkpoints saved, ``fenced`` =
  ``true`` (committed with ``fence(conn, checkpoint=...)``) or ``false``.
- ``celery_lease_progress_writes_total``: progress reports a renewal wrote.
- ``celery_lease_progress_ratio{task}``: ``done / total`` of the latest progress
  written for a run of ``task`` (reports without a total are not shown).
- ``celery_lease_paused_total{task,key}``: deliveries of paused work held until resume.
- ``celery_lease_deferred_total{task,key}``: deliveries deferred by ``lease_rate_limit``
  (``key`` is the rate key); ``lease stats`` and ``lease top`` show how many wait now.
- ``celery_lease_heartbeat_seconds``: latency of one batched heartbeat statement.
- ``celery_lease_last_sweep_timestamp_seconds{database}``: when the last sweep of
  each lease database (password masked) ran, as a Unix time: set by the process
  that swept, and, with ``lease_worker_sweeper = False``, by each worker's main
  process once per ``lease_sweep_interval`` after it has seen a recorded sweep. A
  worker that never swept exports no series: alert on the ``max`` across workers,
  and on its absence.
- ``celery_lease_leader{role,database}``: 1 while this process holds the leader lease
  ``role`` of a lease database (``sweeper``: the worker that sweeps it; ``beat:<app>``:
  the ``LeaseScheduler`` that sends), else 0. Summed over a fleet it is 1 per role and
  database; 0 everywhere means no process leads.

Counts live in the process that emitted the event. With the prefork pool those
are the pool children: run the worker with ``PROMETHEUS_MULTIPROC_DIR`` set and
serve, from the main process, a registry holding only a
``prometheus_client.multiprocess.MultiProcessCollector`` (the recipe is in
``docs/operations.md``, *Metrics*). The counters and the histogram are summed
across processes, exited ones included; the last-sweep gauge takes the maximum.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.exceptions import ImproperlyConfigured

from .events import Event, EventBus, LeaseState, Transition
from .runtime import app_runtime

SETTING = "lease_metrics"

#: Heartbeat latency buckets, in seconds (one UPDATE: milliseconds, unless the DB struggles).
HEARTBEAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_SWEEP_ACTIONS = ("expired", "stranded", "failed", "cancelled", "handoff", "undeliverable")

_lock = threading.Lock()
#: The metrics in prometheus_client's global ``REGISTRY``, made on first use.
#: That registry is process-wide, so its series can be registered once only:
#: every app counting there shares these objects (each listens on its own bus).
_default: LeaseMetrics | None = None


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "celery-lease metrics need prometheus-client: pip install 'celery-lease[prometheus]' "
            f"(or set {SETTING} = False)"
        ) from exc
    return prometheus_client


class LeaseMetrics:
    """The metric objects, and the event listeners that update them.

    Lease state changes (completed, lost, cancelled) are counted from the typed
    :class:`~celery_lease.events.Transition` each lease publishes; the other
    counters from the named events of :meth:`celery_lease.events.EventLog.emit`.

    Args:
        registry: the ``prometheus_client`` registry to register in (default:
            the global ``REGISTRY``).
    """

    def __init__(self, registry: Any = None) -> None:
        prom = _prometheus()
        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self.registry = registry if registry is not None else prom.REGISTRY
        self.claims = prom.Counter(
            "celery_lease_claims", "Claims that won a lease (a body started).", **kw
        )
        self.busy = prom.Counter(
            "celery_lease_busy",
            "Deliveries refused: another live lease or a full concurrency key.",
            **kw,
        )
        self.completed = prom.Counter(
            "celery_lease_completed", "Runs recorded succeeded by their lease owner.", **kw
        )
        self.failures = prom.Counter(
            "celery_lease_failures",
            "Failed attempts; outcome=retrying or failed (attempts spent).",
            ["outcome"],
            **kw,
        )
        self.lease_lost = prom.Counter(
            "celery_lease_lease_lost", "Leases this process lost (once per run attempt).", **kw
        )
        self.sweep_recovered = prom.Counter(
            "celery_lease_sweep_recovered",
            "Runs the sweeper acted on, by action.",
            ["action"],
            **kw,
        )
        self.cancelled = prom.Counter(
            "celery_lease_cancelled", "Runs ended cancelled after a cancel request.", **kw
        )
        self.duplicates = prom.Counter(
            "celery_lease_duplicates_dropped", "Deliveries of finished runs dropped.", **kw
        )
        self.db_errors = prom.Counter(
            "celery_lease_database_errors",
            "Lease database errors, by stage (claim, fail).",
            ["stage"],
            **kw,
        )
        self.checkpoints = prom.Counter(
            "celery_lease_checkpoints",
            "Checkpoints saved; fenced=true when committed with fence(conn, checkpoint=...).",
            ["fenced"],
            **kw,
        )
        self.followups = prom.Counter(
            "celery_lease_followups",
            "Follow-up tasks of fenced transactions, by outcome: sent (after the commit), "
            "swept (sent by the sweeper), error (retried), dropped (can never be sent).",
            ["outcome"],
            **kw,
        )
        self.progress_writes = prom.Counter(
            "celery_lease_progress_writes", "Progress reports a heartbeat renewal wrote.", **kw
        )
        self.progress_ratio = prom.Gauge(
            "celery_lease_progress_ratio",
            "done/total of the latest progress written for a run of the task.",
            ["task"],
            multiprocess_mode="mostrecent",
            **kw,
        )
        self.paused = prom.Counter(
            "celery_lease_paused",
            "Deliveries of paused work held until resume, by task and concurrency key.",
            ["task", "key"],
            **kw,
        )
        self.deferred = prom.Counter(
            "celery_lease_deferred",
            "Deliveries deferred by lease_rate_limit, by task and rate key.",
            ["task", "key"],
            **kw,
        )
        self.heartbeat = prom.Histogram(
            "celery_lease_heartbeat_seconds",
            "Latency of one batched heartbeat statement.",
            buckets=HEARTBEAT_BUCKETS,
            **kw,
        )
        self.last_sweep = prom.Gauge(
            "celery_lease_last_sweep_timestamp_seconds",
            "When the last sweep of a lease database ran (Unix time).",
            ["database"],
            multiprocess_mode="max",
            **kw,
        )
        self.leader = prom.Gauge(
            "celery_lease_leader",
            "1 while this process holds the leader lease role of a lease database.",
            ["role", "database"],
            multiprocess_mode="livemax",
            **kw,
        )
        for outcome in ("retrying", "failed"):
            self.failures.labels(outcome=outcome)
        for action in _SWEEP_ACTIONS:
            self.sweep_recovered.labels(action=action)
        for stage in ("claim", "fail"):
            self.db_errors.labels(stage=stage)
        for fenced in ("true", "false"):
            self.checkpoints.labels(fenced=fenced)
        for outcome in ("sent", "swept", "error", "dropped"):
            self.followups.labels(outcome=outcome)
        #: What each counted event does; every other event is not counted.
        self._counting: dict[Event, Callable[[Event, dict[str, Any]], None]] = {
            Event.CLAIMED: lambda event, fields: self.claims.inc(),
            Event.BUSY: lambda event, fields: self.busy.inc(),
            Event.RETRYING: self._failure,
            Event.FAILED: self._failure,
            Event.SWEPT: self._swept,
            Event.PAUSED: self._held,
            Event.DEFERRED: self._held,
            Event.DUPLICATE_DROPPED: lambda event, fields: self.duplicates.inc(),
            Event.CLAIM_ERROR: self._db_error,
            Event.CLAIM_FAILED: self._db_error,
            Event.FAIL_ERROR: self._db_error,
            Event.SWEEP_DONE: self._sweep_time,
            Event.SWEEP_SEEN: self._sweep_time,
            Event.CHECKPOINT: self._checkpoint,
            Event.PROGRESS: self._progress,
            Event.HEARTBEAT: self._heartbeat,
            Event.LEADER_TAKEN: self._leader,
            Event.LEADER_LOST: self._leader,
            Event.LEADER_RESIGNED: self._leader,
            Event.FOLLOWUP_SENT: self._followup,
            Event.FOLLOWUP_ERROR: self._followup,
            Event.FOLLOWUP_DROPPED: self._followup,
        }

    def __call__(self, event: Event, fields: dict[str, Any]) -> None:
        """The :meth:`~celery_lease.events.EventBus.add_listener` hook."""
        count = self._counting.get(event)
        if count is not None:
            count(event, fields)

    def _failure(self, event: Event, fields: dict[str, Any]) -> None:
        self.failures.labels(outcome=event.value).inc()

    def _swept(self, event: Event, fields: dict[str, Any]) -> None:
        self.sweep_recovered.labels(action=str(fields.get("action") or "unknown")).inc()

    def _held(self, event: Event, fields: dict[str, Any]) -> None:
        counter = self.paused if event is Event.PAUSED else self.deferred
        counter.labels(task=str(fields.get("task")), key=str(fields.get("key") or "")).inc()

    def _db_error(self, event: Event, fields: dict[str, Any]) -> None:
        self.db_errors.labels(stage=event.value.partition("_")[0]).inc()

    def _sweep_time(self, event: Event, fields: dict[str, Any]) -> None:
        swept_at, database = fields.get("swept_at"), fields.get("database")
        if isinstance(swept_at, (int, float)) and isinstance(database, str):
            self.last_sweep.labels(database=database).set(float(swept_at))

    def _leader(self, event: Event, fields: dict[str, Any]) -> None:
        role, database = fields.get("role"), fields.get("database")
        if isinstance(role, str) and isinstance(database, str):
            held = 1.0 if event is Event.LEADER_TAKEN else 0.0
            self.leader.labels(role=role, database=database).set(held)

    def _checkpoint(self, event: Event, fields: dict[str, Any]) -> None:
        self.checkpoints.labels(fenced="true" if fields.get("fenced") else "false").inc()

    def _followup(self, event: Event, fields: dict[str, Any]) -> None:
        if event is Event.FOLLOWUP_SENT:
            outcome = "swept" if fields.get("swept") else "sent"
        else:
            outcome = event.value.rpartition("_")[2]
        self.followups.labels(outcome=outcome).inc()

    def _progress(self, event: Event, fields: dict[str, Any]) -> None:
        self.progress_writes.inc()
        done, total = fields.get("done"), fields.get("total")
        if isinstance(done, float) and isinstance(total, float) and total > 0:
            self.progress_ratio.labels(task=str(fields.get("task") or "")).set(done / total)

    def _heartbeat(self, event: Event, fields: dict[str, Any]) -> None:
        seconds = fields.get("seconds")
        if isinstance(seconds, (int, float)):
            self.heartbeat.observe(float(seconds))

    def on_transition(self, transition: Transition) -> None:
        """The :meth:`~celery_lease.events.EventBus.add_transition_listener` hook."""
        state = transition.state
        if state is LeaseState.LOST:
            self.lease_lost.inc()  # a lease enters LOST once
        elif state is LeaseState.COMPLETED:
            self.completed.inc()
        elif state is LeaseState.CANCELLED:
            self.cancelled.inc()

    def subscribe(self, events: EventBus) -> None:
        """Count the events of ``events`` (an app's bus)."""
        events.add_listener(self)
        events.add_transition_listener(self.on_transition)

    def unsubscribe(self, events: EventBus) -> None:
        """Stop counting the events of ``events``."""
        events.remove_listener(self)
        events.remove_transition_listener(self.on_transition)


def enable(app: Celery, registry: Any = None) -> LeaseMetrics:
    """Count ``app``'s lease events of this process in ``registry`` (default: the global one).

    Idempotent per app and registry. Raises ImportError, saying how to install
    the extra, when ``prometheus_client`` is missing.
    """
    global _default
    prom = _prometheus()
    target = registry if registry is not None else prom.REGISTRY
    runtime = app_runtime(app)
    with _lock:
        metrics = runtime.metrics
        if not isinstance(metrics, LeaseMetrics) or metrics.registry is not target:
            if target is prom.REGISTRY:
                if _default is None:
                    _default = LeaseMetrics(target)
                metrics = _default
            else:
                metrics = LeaseMetrics(target)
        runtime.count_with(metrics)  # the previous metrics stop counting
    return metrics


def disable(app: Celery) -> None:
    """Stop counting ``app``'s events (the series stay registered)."""
    runtime = app_runtime(app)
    with _lock:
        runtime.count_with(None)


class MetricsDirectoryMissing(ImproperlyConfigured):  # type: ignore[misc]
    """``PROMETHEUS_MULTIPROC_DIR`` names no directory: this process cannot count."""


def enable_from_app(app: Celery) -> LeaseMetrics | None:
    """Enable metrics when ``app.conf.lease_metrics`` is True; validate the setting.

    Raises:
        ImproperlyConfigured: ``lease_metrics`` is not a boolean.
        MetricsDirectoryMissing: ``PROMETHEUS_MULTIPROC_DIR`` names no directory.
        ImportError: it is True and ``prometheus_client`` is not installed.
    """
    value = app.conf.get(SETTING)
    if value is None or value is False:
        return None
    if value is not True:
        raise ImproperlyConfigured(f"{SETTING} must be True or False, got {value!r}")
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder and not os.path.isdir(folder):
        # prometheus_client would fail at the first count, in a task or a CLI command.
        raise MetricsDirectoryMissing(
            f"{SETTING}: PROMETHEUS_MULTIPROC_DIR={folder!r} is not a directory: create it "
            "(empty) before starting the worker, or unset it"
        )
    return enable(app)
