"""Flow control across every worker: pause and resume, and the deliveries held back.

A paused task's deliveries, and rate-limited deliveries whose turn is further
off than :data:`HORIZON_MS`, are kept in the lease database
(``celery_lease_held``) with their message and dropped by the worker.
:func:`release` publishes them again: the paused ones on :func:`resume` (in
arrival order), the rate-limited ones when due, by a :class:`FlowPump` thread in
the process that held them, and both by the sweeper as a backstop.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery

from .errors import LeaseError, LeaseUsageError
from .events import Event
from .requeue import MessageNotAccepted, decode_message
from .runtime import app_runtime, lease_databases, runtime_for, store_for, task_configs
from .sanitize import describe_exception, sanitize
from .schema import HELD_RATE
from .store import HeldRecord, LeaseStore

logger = logging.getLogger(__name__)

#: A rate-limited delivery due within this many ms goes to the broker with a
#: countdown (Celery holds it in a worker's memory until due); one due later
#: waits in the lease database. So at most ``rate * horizon + burst`` ETA
#: messages of a limited task exist at a time, fleet-wide.
HORIZON_MS = 3000
#: The longest a pump sleeps between two looks at the held deliveries.
PUMP_TICK = 1.0
#: Message header of a deferred delivery: the ``seq`` of the rate slot recorded for it
#: (:meth:`~celery_lease.store.flowstore.FlowStore.record_slot`). Its claim takes that
#: slot once, for its own task id; a copy of the message (a retry, a busy or claim-error
#: re-publish) or a forged header finds none and takes a slot of its own.
SLOT_HEADER = "celery_lease_rate_slot"


#: How long a recorded rate slot waits for its delivery after it came due (a message
#: held up in a broker longer takes a new slot): the sweep deletes it then.
SLOT_KEPT_MS = 3_600_000


def slot_of(request: Any) -> int | None:
    """The recorded rate slot the delivery ``request`` names, or None."""
    value: Any = (getattr(request, "headers", None) or {}).get(SLOT_HEADER)
    if value is None:
        value = getattr(request, SLOT_HEADER, None)
    if isinstance(value, bool):
        return None
    try:
        slot = int(value) if value is not None else None
    except (TypeError, ValueError, OverflowError):
        return None
    # A slot is a time in epoch ms (a BIGINT): any other value names no recorded slot.
    return slot if slot is None or 0 <= slot < 2**63 else None


def without_slot(headers: Any) -> dict[str, Any]:
    """``headers`` without the rate slot (a held paused delivery takes a new one)."""
    return {k: v for k, v in dict(headers or {}).items() if k != SLOT_HEADER}


def store_of(app: Celery, task_name: str) -> LeaseStore:
    """The lease database of ``task_name``: its own ``lease_database_url``, else the app's."""
    task = app.tasks.get(task_name)
    settings = getattr(task, "lease_config", None)
    if callable(settings):
        return runtime_for(app, settings()).store
    return store_for(app)


def pause(
    app: Celery,
    task_name: str,
    key: str | None = None,
    reason: str | None = None,
    *,
    cancel_running: bool = False,
    store: LeaseStore | None = None,
) -> bool:
    """Pause ``task_name`` on every worker (only its runs of concurrency ``key`` if given).

    From the moment this returns, no claim of it succeeds: each of its deliveries is
    kept in the lease database and dropped, until :func:`resume`. Running bodies
    finish, unless ``cancel_running`` (they are cancelled as by ``lease cancel``).
    True when this call paused it (False: it was paused already; ``reason`` is updated).
    """
    return pause_counted(app, task_name, key, reason, cancel_running=cancel_running, store=store)[0]


def pause_counted(
    app: Celery,
    task_name: str,
    key: str | None = None,
    reason: str | None = None,
    *,
    cancel_running: bool = False,
    store: LeaseStore | None = None,
) -> tuple[bool, int]:
    """:func:`pause`, and how many running runs it asked to stop (``cancel_running``).

    Raises:
        LeaseUsageError: ``key`` given for a task of this app that has no
            ``lease_concurrency_key`` (such a pause would hold nothing).
    """
    if key is not None:
        check_pause_key(app, task_name, key)
    store = store or store_of(app, task_name)
    # Shown on pages, in `lease paused` and on claim spans: redacted like last_error.
    paused = store.flow.pause(task_name, key, None if reason is None else sanitize(reason))
    asked = store.flow.request_cancel_running(task_name, key) if cancel_running else 0
    app_runtime(app).events.emit(
        Event.FLOW_PAUSED,
        None,
        "celery-lease: paused %s%s%s",
        task_name,
        "" if key is None else f" (key {key})",
        "" if not asked else f", cancel requested for {asked} running",
        task=task_name,
        key=key,
    )
    return paused, asked


def check_pause_key(app: Celery, task_name: str, key: str) -> None:
    """:class:`LeaseUsageError` when ``task_name`` is a task of ``app`` without a
    ``lease_concurrency_key``: its runs have no key, so a pause of ``key`` holds nothing.
    A task this app does not know is not judged (another app's may have keys)."""
    task = app.tasks.get(task_name)
    settings = getattr(task, "lease_config", None)
    if callable(settings) and settings().concurrency_key is None:
        raise LeaseUsageError(
            f"{task_name} has no lease_concurrency_key, so no run of it has key {key!r}: "
            "a pause of that key would hold nothing. Pause the whole task (without a key)."
        )


def resume(
    app: Celery, task_name: str, key: str | None = None, *, store: LeaseStore | None = None
) -> int:
    """Lift the pause of ``task_name`` (of its ``key``) and publish the deliveries it held,
    in the order they came; how many were published.

    Deliveries still held by another pause (the whole task, or another key) stay held.
    A resume that dies halfway loses nothing: the sweeper publishes the rest.
    """
    return lift(app, task_name, key, store=store)[1]


def lift(
    app: Celery, task_name: str, key: str | None = None, *, store: LeaseStore | None = None
) -> tuple[bool, int]:
    """:func:`resume`, saying also whether ``task_name`` (its ``key``) was paused at all:
    ``(was_paused, published)``. Held deliveries are published either way (a resume that
    died halfway may have left some)."""
    store = store or store_of(app, task_name)
    was_paused = store.flow.resume(task_name, key)
    sent = len(release(app, store, task_name=task_name, key=key))
    app_runtime(app).events.emit(
        Event.FLOW_RESUMED,
        None,
        "celery-lease: resumed %s%s, %d held deliveries published",
        task_name,
        "" if key is None else f" (key {key})",
        sent,
        task=task_name,
        key=key,
        published=sent,
    )
    return was_paused, sent


def release(
    app: Celery,
    store: LeaseStore,
    *,
    task_name: str | None = None,
    key: str | None = None,
    limit: int = 500,
) -> list[str]:
    """Publish the held deliveries that may go now (see :meth:`FlowStore.take_held`), in
    batches of ``limit``; the run ids published, in order. A delivery that cannot be published
    stays held (its take goes stale and a later release retries it)."""
    sent: list[str] = []
    while True:
        rows = store.flow.take_held(
            horizon_ms=HORIZON_MS, task_name=task_name, key=key, limit=limit
        )
        for row in rows:
            try:
                publish_held(app, row)
            except MessageNotAccepted as exc:
                logger.error(
                    "celery-lease: held delivery %s of %s dropped: %s",
                    row.task_id,
                    row.run_id,
                    exc,
                    extra={"lease_event": Event.SWEEP_ERROR, "run_id": row.run_id},
                )
            except Exception as exc:
                logger.warning(
                    "celery-lease: could not publish held delivery %s of %s (retried later): %s",
                    row.task_id,
                    row.run_id,
                    describe_exception(exc),
                    extra={"lease_event": Event.SWEEP_ERROR, "run_id": row.run_id},
                )
                continue
            else:
                sent.append(row.run_id)
            store.flow.drop_held(row.seq)
        if len(rows) < limit:
            return sent


def publish_held(app: Celery, row: HeldRecord) -> None:
    """Publish a held delivery: its stored message, under its own task id; a rate-limited
    one with the countdown left until its slot."""
    body = decode_message(app, row.payload, row.payload_content_type)
    options = {
        k: v for k, v in dict(body.get("options") or {}).items() if k not in ("countdown", "eta")
    }
    options["task_id"] = row.task_id
    if row.reason == HELD_RATE and row.available_at > row.now:
        options["countdown"] = (row.available_at - row.now) / 1000.0
    args = list(body.get("args") or ())
    kwargs = dict(body.get("kwargs") or {})
    task = app.tasks.get(row.task_name)
    if task is not None:
        task.apply_async(args, kwargs, **options)
    else:
        app.send_task(row.task_name, args=args, kwargs=kwargs, **options)


class FlowPump:
    """Publishes the rate-limited deliveries of one lease database as they come due.

    One daemon thread per process and database, started by :meth:`wake` when this
    process holds a delivery, and ending once none is held there (any process's). A
    tick is one read (:meth:`FlowStore.take_held`) plus the publishes; a failing tick
    is logged and the loop goes on. :meth:`tick` is one tick, for tests.
    """

    def __init__(self, app: Celery, store: LeaseStore) -> None:
        self.app = app
        self.store = store
        self._lock = threading.Lock()
        self._woken = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Run the pump (again) now: a delivery was just held."""
        with self._lock:
            self._woken = True
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._loop, name="celery-lease-flow", daemon=True
                )
                self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread, waiting at most ``timeout`` seconds."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def tick(self) -> float | None:
        """Publish what is due; seconds until the next look, or None when nothing is held."""
        release(self.app, self.store)
        left = self.store.flow.next_held_due()
        if left is None:
            return None
        return min(PUMP_TICK, max(0.05, (left - HORIZON_MS / 2) / 1000.0))

    def _loop(self) -> None:
        delay = 0.0
        # An outage is logged when it starts and when it ends, not on every tick.
        failing = False
        while not self._stop.wait(delay):
            with self._lock:
                self._woken = False
            try:
                found = self.tick()
            except LeaseError as exc:
                transient = bool(getattr(exc, "transient", False))
                if not failing or not transient:
                    logger.warning(
                        "celery-lease: flow pump: %s%s",
                        describe_exception(exc),
                        f"; retrying every {PUMP_TICK:g}s, quietly until it answers"
                        if transient
                        else "",
                        extra={"lease_event": Event.SWEEP_ERROR},
                    )
                failing = True
                if not transient:
                    # A missing table (run `lease migrate`) does not heal by itself:
                    # stop; the next held delivery or the sweeper tries again.
                    with self._lock:
                        self._thread = None
                    return
                found = PUMP_TICK
            except Exception:
                logger.exception("celery-lease: flow pump tick failed")
                found = PUMP_TICK
            else:
                if failing:
                    failing = False
                    logger.warning(
                        "celery-lease: flow pump: the lease database answers again",
                        extra={"lease_event": Event.SWEEP_ERROR},
                    )
            with self._lock:
                if found is None and not self._woken:
                    self._thread = None
                    return
            delay = PUMP_TICK if found is None else found


def pump_for(app: Celery, url: str, store: LeaseStore) -> FlowPump:
    """This process's :class:`FlowPump` of the lease database ``url``."""
    pump = app_runtime(app).pump_for(url, lambda: FlowPump(app, store))
    assert isinstance(pump, FlowPump)
    return pump


def wake_pumps(app: Celery) -> None:
    """Look once at each lease database of ``app``'s rate-limited tasks for held
    deliveries and keep publishing them as they come due (a worker starting after the
    ones that held them stopped); each pump ends once nothing is held. A database no
    rate-limited task uses gets no pump (the sweeper is the backstop there)."""
    limited = {c.database_url for c in task_configs(app) if c.rate_period_ms is not None}
    for config in lease_databases(app):
        if config.database_url in limited:
            store = runtime_for(app, config).store
            pump_for(app, config.database_url, store).wake()
