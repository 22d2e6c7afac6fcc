"""Follow-up tasks sent exactly once, only when a fenced transaction commits.

A body hands Celery signatures to its fenced transaction
(``self.lease.fence(conn, send=[...])`` or ``self.lease.send_on_commit(conn, sig)``).
:class:`Followups` checks and serializes them before any SQL; the lease inserts
them in that transaction (``celery_lease_outbox``, :class:`~celery_lease.store.OutboxStore`),
so they exist only if its writes commit. When it commits, this process's
:class:`FollowupPump` publishes them, each under a task id derived from the run
(:func:`~celery_lease.lease.keys.followup_task_id`), and deletes each row once
sent. What a crash leaves behind (a worker killed between the commit and the
publish) is published by the sweeper (:func:`sweep`), under the same task id. A
``LeasedTask`` follow-up gets its ``queued`` run row right after its publish, so a
message the broker loses before any worker claimed it is sent again by the sweeper too.

Each row is taken by a guarded ``UPDATE`` before it is published, so two
publishers never both send it. Only a crash after the broker took the message and
before the row was deleted sends it twice, under the same task id: a
``LeasedTask`` follow-up is then one run (its run id is that task id) and its
lease drops the second delivery; a plain Celery task runs twice. Rows that can
never be published are deleted (:data:`~celery_lease.events.Event.FOLLOWUP_DROPPED`),
and so are rows older than ``lease_retention`` and, with ``lease purge``, older
than its age: the table stays bounded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import types
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.canvas import Signature
from celery.utils.time import maybe_iso8601
from kombu.serialization import dumps

from .errors import LeaseError, LeaseInputError, migrate_hint
from .events import Event, EventLog
from .lease.keys import followup_task_id
from .requeue import COPY, MessageNotAccepted, SweepReport, copy_headers, decode_message
from .run.runids import concurrency_key, run_id_of
from .runtime import app_config, app_runtime, runtime_for
from .sanitize import describe_exception
from .schema import MAX_FOLLOWUP_BYTES, MAX_FOLLOWUPS, MAX_ID_LENGTH
from .store import FollowupMessage, LeaseStore, OutboxRecord

logger = logging.getLogger(__name__)

#: How long the pump looks for a batch it was handed to become visible (committed), at
#: most, before it leaves the batch to the sweeper (a commit that failed is never seen).
VISIBLE_WITHIN = 5.0
#: The pump's first and longest pause between two looks at a batch not visible yet.
FIRST_LOOK = 0.002
LONGEST_LOOK = 0.25


class Followups:
    """The follow-up tasks of one app's leases on one lease database.

    What a lease calls (it sees the :class:`~celery_lease.lease.lease.FollowupSender`
    protocol): :meth:`encode`, before any SQL, and :meth:`committed`, from the commit
    of the transaction that recorded them. Made per delivery by the run path (two
    references: it costs nothing until a body sends a follow-up).

    Args:
        app: the Celery app that serializes and publishes the follow-ups.
        store: the lease database they are recorded in.
    """

    def __init__(self, app: Celery, store: LeaseStore) -> None:
        self.app = app
        self.store = store

    def encode(self, run_id: str, attempt: int, first: int, send: Any) -> list[FollowupMessage]:
        """``send`` (a signature, or a list or tuple of them) as outbox messages, with task
        ids from position ``first`` of ``attempt`` on.

        Raises:
            LeaseInputError: (field ``send``) something that is not one task's signature
                (a chain, group or chord, a task id of its own), arguments its task does
                not take, a message the serializer refuses or over 64 KiB, or more than
                100 follow-ups at once.
        """
        signatures = _signatures(send)
        parent = self.app.current_worker_task
        parent_id = getattr(getattr(parent, "request", None), "id", None)
        root_id = getattr(getattr(parent, "request", None), "root_id", None) or parent_id
        messages = []
        for index, sig in enumerate(signatures):
            name = sig.task
            what = f"follow-up {index} ({name})"
            options = dict(sig.options)
            if "task_id" in options:
                raise LeaseInputError(
                    "send",
                    f"{what} sets its own task_id: a follow-up's task id is derived from the "
                    "run (read it from what fence()/send_on_commit() return)",
                )
            if parent_id:
                options.setdefault("parent_id", parent_id)
                options.setdefault("root_id", root_id)
            args, kwargs = tuple(sig.args or ()), dict(sig.kwargs or {})
            task = self.app.tasks.get(name)
            _check_arguments(task, what, args, kwargs)
            self._check_timing(what, name, options)
            body = {"task": name, "args": list(args), "kwargs": kwargs, "options": options}
            serializer = getattr(task, "serializer", None) or self.app.conf.task_serializer
            try:
                content_type, _encoding, data = dumps(  # type: ignore[no-untyped-call]
                    body, serializer=serializer
                )
            except Exception as exc:
                raise LeaseInputError(
                    "send", f"{what} cannot be serialized with {serializer!r}: {exc}"
                ) from None
            if isinstance(data, str):
                data = data.encode("utf-8")
            if len(data) > MAX_FOLLOWUP_BYTES:
                raise LeaseInputError(
                    "send",
                    f"{what} is {len(data)} bytes serialized; at most {MAX_FOLLOWUP_BYTES} are "
                    "kept (pass a reference, not the data)",
                )
            task_id = followup_task_id(run_id, attempt, first + index)
            messages.append(FollowupMessage(task_id, name, bytes(data), content_type))
        return messages

    def _check_timing(self, what: str, name: str, options: dict[str, Any]) -> None:
        """Celery's own conversion of ``countdown``, ``eta`` and ``expires`` (as its publish
        makes it), now rather than at the publish: a follow-up it would refuse (a countdown
        past any date, an ``eta`` that is no datetime) could never be sent, and stayed in
        the outbox, before the others, until retention."""
        timing = {k: options[k] for k in ("countdown", "eta", "expires") if k in options}
        if not timing:
            return
        try:
            self.app.amqp.as_task_v2("check", name, **timing)
            for key in ("eta", "expires"):  # a string is sent as is; the worker parses it
                if isinstance(timing.get(key), str):
                    maybe_iso8601(timing[key])
        except Exception as exc:
            shown = ", ".join(f"{k}={v!r:.40}" for k, v in timing.items())
            raise LeaseInputError(
                "send", f"{what}: Celery cannot publish it with {shown}: {exc}"
            ) from None

    def committed(self, task_ids: list[str]) -> None:
        """The transaction that recorded ``task_ids`` is committing (SQLAlchemy's commit
        event comes just before the database's): this process's pump publishes them as
        soon as they are visible."""
        pump_for(self.app, self.store).add(task_ids)


def _signatures(send: Any) -> list[Signature]:
    """``send`` as a list of single-task signatures, or :class:`LeaseInputError`."""
    items: list[Any] = [send] if isinstance(send, (dict, str)) else _listed(send)
    if len(items) > MAX_FOLLOWUPS:
        raise LeaseInputError(
            "send", f"{len(items)} follow-ups at once; at most {MAX_FOLLOWUPS} are recorded"
        )
    found: list[Signature] = []
    for index, item in enumerate(items):
        if not isinstance(item, Signature):
            raise LeaseInputError(
                "send",
                f"follow-up {index} is a {type(item).__name__}, not a Celery signature "
                "(task.s(...), task.si(...) or task.signature(...))",
            )
        if item.subtask_type is not None:
            raise LeaseInputError(
                "send",
                f"follow-up {index} is a {item.subtask_type or type(item).__name__}: send "
                "each task, or one task that starts the canvas",
            )
        name = item.task
        if not isinstance(name, str) or not name or len(name) > MAX_ID_LENGTH:
            raise LeaseInputError("send", f"follow-up {index} names no task: {name!r}")
        found.append(item)
    return found


def _listed(send: Any) -> list[Any]:
    if isinstance(send, Iterable):
        return list(send)
    raise LeaseInputError(
        "send", f"must be a signature or a list of them, got {type(send).__name__}"
    )


def _check_arguments(task: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Celery's own argument check (``Task.typing``), now rather than at the publish."""
    if task is None or not getattr(task, "typing", False):
        return
    header = getattr(task, "__header__", None)
    if header is None:
        return
    try:
        header(*args, **kwargs)
    except TypeError as exc:
        raise LeaseInputError("send", f"{what}: {exc}") from None


# -- publishing -------------------------------------------------------------------


def publish(app: Celery, row: OutboxRecord) -> dict[str, Any]:
    """Publish one follow-up: its signature, under its derived task id; the stored message,
    decoded.

    Raises:
        MessageNotAccepted: the stored message is in a format the app does not accept;
            nothing was decoded.
    """
    body = decode_message(app, row.payload, row.payload_content_type)
    options = dict(body.get("options") or {})
    options["task_id"] = row.task_id
    # Published by the pump and, after a crash, the sweeper: a second publish is a copy.
    options["headers"] = copy_headers(options.get("headers"), COPY)
    args = list(body.get("args") or ())
    kwargs = dict(body.get("kwargs") or {})
    task = app.tasks.get(row.task_name)
    if task is not None:
        task.apply_async(args, kwargs, **options)
    else:
        app.send_task(row.task_name, args=args, kwargs=kwargs, **options)
    return body


def send(
    app: Celery,
    store: LeaseStore,
    rows: list[OutboxRecord],
    events: EventLog,
    *,
    swept: bool = False,
) -> list[str]:
    """Publish the taken ``rows`` and delete each once sent; the task ids sent.

    A row whose message is refused is deleted (it can never go); one whose publish
    failed stays taken, and the sweeper tries it again once the take is stale. Each
    sent follow-up is logged: at DEBUG after its commit, at INFO by the sweeper
    (``swept``: its sender died).
    """
    sent: list[str] = []
    for row in rows:
        try:
            body = publish(app, row)
        except MessageNotAccepted as exc:
            events.emit(
                Event.FOLLOWUP_DROPPED,
                row.run_id,
                "run %s: follow-up %s dropped: %s",
                row.run_id,
                row.task_id,
                exc,
                level=logging.ERROR,
                task_id=row.task_id,
            )
            _drop(store, row)
            continue
        except Exception as exc:
            events.emit(
                Event.FOLLOWUP_ERROR,
                row.run_id,
                "run %s: could not publish follow-up %s (the sweeper tries again): %s",
                row.run_id,
                row.task_id,
                describe_exception(exc),
                level=logging.WARNING,
                task_id=row.task_id,
            )
            continue
        sent.append(row.task_id)
        recorded = _record_leased_run(app, row, body, events)
        events.emit(
            Event.FOLLOWUP_SENT,
            row.run_id,
            "run %s: follow-up %s sent%s (%s)",
            row.run_id,
            row.task_id,
            " by the sweeper" if swept else "",
            row.task_name,
            level=logging.INFO if swept else logging.DEBUG,
            task_id=row.task_id,
            task=row.task_name,
            swept=swept,
        )
        if recorded:
            _drop(store, row)
    return sent


def _record_leased_run(
    app: Celery, row: OutboxRecord, body: dict[str, Any], events: EventLog
) -> bool:
    """After the publish of ``row`` (``body``: its message, decoded): give a ``LeasedTask``
    follow-up its ``queued`` run row (attempt 0, carrying the message), unless its run has a
    row already; True when the outbox row may be deleted.

    A broker can lose a message it handed out before any worker claimed it (kombu's Redis
    transport between its ``BRPOP`` and its save to ``unacked``; the filesystem transport
    once a killed worker had read it). With the row, the sweeper sends it again
    (:meth:`~celery_lease.store.LeaseStore.reclaim_stale`), as any run never claimed. A
    follow-up with a ``countdown`` or ``eta`` is left out (the sweeper's copy would run it
    early), and so is a plain Celery task: nothing records those once sent. When the row
    cannot be written, the outbox row stays taken and the sweeper publishes it again.
    """
    options = dict(body.get("options") or {})
    if options.get("countdown") or options.get("eta"):
        return True
    try:
        args, kwargs = tuple(body.get("args") or ()), dict(body.get("kwargs") or {})
        request = types.SimpleNamespace(id=row.task_id, headers=None, replaced_task_nesting=0)
        keep_leased_run(
            app,
            row.task_name,
            request,
            args,
            kwargs,
            (row.payload, row.payload_content_type),
            int(options.get("retries") or 0),
        )
    except Exception as exc:
        events.emit(
            Event.FOLLOWUP_ERROR,
            row.run_id,
            "run %s: follow-up %s sent, but its run could not be recorded (the sweeper "
            "sends it again): %s",
            row.run_id,
            row.task_id,
            describe_exception(exc),
            level=logging.WARNING,
            task_id=row.task_id,
        )
        return False
    return True


def keep_leased_run(
    app: Celery,
    task_name: str,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    message: tuple[bytes, str],
    retries: int,
) -> bool:
    """Give a delivery of ``task_name`` sent (or about to be sent) under ``request.id`` its
    ``queued`` run row (attempt 0, carrying ``message``: its bytes and content type) in the
    task's lease database, unless its run has a row already; False when the task is no
    ``LeasedTask`` (nothing to keep). Database errors propagate.
    """
    task = app.tasks.get(task_name)
    lease_config = getattr(task, "lease_config", None)
    if lease_config is None:
        return False
    config = lease_config()
    runtime_for(app, config).store.keep_delivery(
        run_id_of(task_name, config, request, args, kwargs),
        task_name=task_name,
        task_id=request.id,
        payload=message[0],
        payload_content_type=message[1],
        retries=retries,
        lease_ms=config.lease_ms,
        max_attempts=config.max_attempts,
        concurrency_key=concurrency_key(task_name, config, args, kwargs),
    )
    return True


def _drop(store: LeaseStore, row: OutboxRecord) -> None:
    try:
        store.outbox.drop(row.task_id)
    except LeaseError as exc:
        # Sent, but still recorded: the sweeper sends it again once the take is stale,
        # under the same task id (a LeasedTask follow-up drops it as a duplicate).
        logger.warning(
            "celery-lease: follow-up %s of %s sent, but its row could not be deleted: %s",
            row.task_id,
            row.run_id,
            describe_exception(exc),
            extra={"lease_event": Event.FOLLOWUP_ERROR, "run_id": row.run_id},
        )


class FollowupPump:
    """Publishes the follow-ups this process committed, right after each commit.

    One daemon thread per process and lease database, started by :meth:`add` and
    ending once no batch is left. A batch is looked for until it is visible (its
    transaction committed) or :data:`VISIBLE_WITHIN` has passed (the commit failed,
    or the sweeper took the rows): whatever is left is the sweeper's.

    Args:
        app: the Celery app that publishes.
        store: the lease database the follow-ups are recorded in.
        stale_after: seconds after which a row another publisher took and never
            deleted may be taken again.
    """

    def __init__(self, app: Celery, store: LeaseStore, stale_after: float) -> None:
        self.app = app
        self.store = store
        self.stale_ms = max(1, round(stale_after * 1000))
        self._lock = threading.Lock()
        self._batches: collections.deque[tuple[float, list[str]]] = collections.deque()
        self._woken = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, task_ids: list[str]) -> None:
        """Publish ``task_ids`` as soon as they are visible."""
        with self._lock:
            self._batches.append((time.monotonic() + VISIBLE_WITHIN, list(task_ids)))
            self._start_locked()
        self._woken.set()

    def wake(self) -> None:
        """Run the pump now if it has work (the :class:`~celery_lease.runtime.Pump` protocol)."""
        with self._lock:
            if self._batches:
                self._start_locked()
        self._woken.set()

    def stop(self, timeout: float) -> None:
        """Stop the thread, waiting at most ``timeout`` seconds; what it had not published
        is the sweeper's."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._woken.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def pending(self) -> int:
        """Follow-ups handed to the pump and not published (nor given up) yet."""
        with self._lock:
            return sum(len(batch) for _, batch in self._batches)

    def tick(self) -> bool:
        """Take and publish what is visible of the pending batches; True if anything was."""
        with self._lock:
            wanted = [task_id for _, batch in self._batches for task_id in batch]
        if not wanted:
            return False
        rows = self.store.outbox.take(wanted, stale_ms=self.stale_ms)
        taken = {row.task_id for row in rows}
        send(self.app, self.store, rows, app_runtime(self.app).events)
        now = time.monotonic()
        with self._lock:
            left: collections.deque[tuple[float, list[str]]] = collections.deque()
            for deadline, batch in self._batches:
                rest = [task_id for task_id in batch if task_id not in taken]
                if rest and now < deadline:
                    left.append((deadline, rest))
                elif rest:
                    logger.debug(
                        "celery-lease: follow-ups %s not visible within %.0f s: left to the "
                        "sweeper",
                        ", ".join(rest),
                        VISIBLE_WITHIN,
                    )
            self._batches = left
        return bool(taken)

    def _start_locked(self) -> None:
        if self._stopped:
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="celery-lease-followups", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        pause = FIRST_LOOK
        while True:
            with self._lock:
                if self._stopped or not self._batches:
                    self._thread = None
                    return
            try:
                found = self.tick()
            except Exception as exc:
                logger.warning(
                    "celery-lease: follow-up pump: %s (the sweeper publishes what is left)",
                    describe_exception(exc),
                    extra={"lease_event": Event.FOLLOWUP_ERROR},
                )
                found = False
                pause = LONGEST_LOOK
            pause = FIRST_LOOK if found else min(pause * 2, LONGEST_LOOK)
            self._woken.wait(pause)
            self._woken.clear()


def pump_for(app: Celery, store: LeaseStore) -> FollowupPump:
    """This process's :class:`FollowupPump` of ``store``'s lease database."""
    url = store.engine.url.render_as_string(hide_password=False)
    stale = app_config(app).lease_seconds
    pump = app_runtime(app).pump_for(
        f"followups:{url}", lambda: FollowupPump(app, store, stale_after=stale)
    )
    assert isinstance(pump, FollowupPump)
    return pump


# -- the sweeper's backstop, and retention -------------------------------------------


def sweep(app: Celery, store: LeaseStore, report: SweepReport, *, limit: int = 500) -> None:
    """The sweeper's step: publish the follow-ups no committing process sent (it died
    between the commit and the publish), then delete those older than ``lease_retention``
    (never published in all that time). A database error is logged and left for the
    next sweep: it never stops recovery."""
    config = app_config(app)
    events = app_runtime(app).events
    # A row another process is publishing is left to it for one lease length.
    age_ms = max(1, round(config.lease_seconds * 1000))
    try:
        rows = store.outbox.take(older_than_ms=age_ms, stale_ms=age_ms, limit=limit)
        report.followups.extend(send(app, store, rows, events, swept=True))
        if config.retention is not None:
            for task_id in store.outbox.purge(round(config.retention * 1000), limit):
                events.emit(
                    Event.FOLLOWUP_DROPPED,
                    None,
                    "celery-lease: follow-up %s never published within lease_retention: deleted",
                    task_id,
                    level=logging.ERROR,
                    task_id=task_id,
                )
    except LeaseError as exc:
        report.steps_failed.append(f"follow-ups: {describe_exception(exc)}")
        logger.warning(
            "celery-lease: could not publish follow-ups%s: %s",
            migrate_hint(exc),
            describe_exception(exc),
            extra={"lease_event": Event.SWEEP_ERROR},
        )


def purge(store: LeaseStore, older_than: float, *, dry_run: bool = False) -> int:
    """``lease purge``: delete (or with ``dry_run`` count) the follow-ups recorded more than
    ``older_than`` seconds ago and never published; how many."""
    older_than_ms = round(older_than * 1000)
    if dry_run:
        return store.outbox.count(older_than_ms + 1)
    removed = 0
    while True:
        batch = store.outbox.purge(older_than_ms)
        removed += len(batch)
        for task_id in batch:
            logger.warning(
                "celery-lease: follow-up %s never published: purged",
                task_id,
                extra={"lease_event": Event.FOLLOWUP_DROPPED, "run_id": None},
            )
        if not batch:
            return removed
