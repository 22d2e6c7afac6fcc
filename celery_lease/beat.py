"""Beat on every host: :class:`LeaseScheduler`, a Celery beat scheduler that needs no single beat.

``celery -A proj beat -S celery_lease.beat:LeaseScheduler`` on as many hosts as
you like. They stand for one leader lease per app (``beat:<app main>`` in
``celery_lease_leaders``, :class:`~celery_lease.leadership.Leadership`); the
holder sends, the others try to take the lease every ``lease_seconds / 3`` and
take over within ``lease_seconds`` of the leader's death.

The schedule's state lives in the lease database (``celery_lease_schedule``):
per entry, the due time of the last tick sent. Each tick is a slot of the
entry's schedule (the next one after the last), computed the same way by any
beat from that row, so a beat taking over sends the slot its predecessor did
not record, and never one it did. Slots that fell due while no beat led are
sent when a beat takes over (all of those of the last ``2 * lease_seconds``;
older ones, after every beat was down, once, as Celery's own beat does after a
restart). Due times are read on the database's clock.

Every tick is sent under a task id derived from the scheduler, the entry and
the slot's due time. A tick of a :class:`~celery_lease.LeasedTask` is sent, then
recorded (fenced by the beat's leader term): a beat that dies in between leaves
the slot unrecorded, its successor sends it again under the same task id, and
the run's own lease drops the duplicate; a stalled ex-leader's late send is
dropped the same way, and its record is refused. A tick of any other task is
recorded first, then sent: it is never sent twice, and is lost if its beat dies
between the two or the broker refuses it (as Celery's own beat loses it).
"""

from __future__ import annotations

import copy
import logging
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.exceptions import ImproperlyConfigured
from celery.schedules import schedule as interval_schedule

from .errors import LeadershipLost, LeaseError
from .events import Event
from .leadership import Leadership
from .run.task import LeasedTask
from .runtime import app_config, app_runtime, database_settings, runtime_for
from .sanitize import describe_exception, safe_url
from .schema import MAX_ID_LENGTH
from .store import LeaseStore

logger = logging.getLogger(__name__)

#: The namespace of the task ids ticks are sent under (uuid5 of scheduler, entry, due).
TICK_NAMESPACE = uuid.UUID("6f1c1d8e-5a3b-4f7e-9a53-2f0c3b9d7e41")
#: The message header naming the slot a tick serves (its due time, epoch ms, DB clock):
#: a task reads it as ``self.request.celery_lease_beat_due``.
DUE_HEADER = "celery_lease_beat_due"
#: How often the leader reads the database's clock again (seconds).
CLOCK_REFRESH_SECONDS = 60.0
#: Most slots of one entry walked through to coalesce an outage (beyond: jump to now).
MAX_SLOTS_WALKED = 10_000


def tick_task_id(scheduler: str, entry: str, due_ms: int) -> str:
    """The task id of ``entry``'s tick due at ``due_ms`` (epoch ms): the same on every beat."""
    return str(uuid.uuid5(TICK_NAMESPACE, f"{scheduler}\n{entry}\n{due_ms}"))


def _to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _to_ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def next_slot(sched: Any, last_ms: int) -> int:
    """The first slot of ``sched`` (a Celery schedule) after ``last_ms``, in epoch ms.

    Computed with the schedule's own ``remaining_estimate`` on a copy whose clock
    reads ``last_ms``, so the result depends on ``last_ms`` alone (never on when
    it is computed): every beat finds the same slot. Raises ValueError for a
    schedule whose next slot does not lie after ``last_ms``.
    """
    last = _to_datetime(last_ms)
    if isinstance(sched, interval_schedule) and not sched.relative:
        step = max(1, round(sched.run_every.total_seconds() * 1000))
        return int(last_ms + step)
    # In the schedule's own timezone, as Celery's beat hands it ``last_run_at`` (Celery
    # before 5.5 reads a crontab's fields from ``last_run_at`` as given).
    zone = getattr(sched, "tz", None)
    if zone is not None:
        last = last.astimezone(zone)
    probe = copy.copy(sched)
    probe.nowfun = lambda: last
    remaining = probe.remaining_estimate(last)
    due = _to_ms(last + remaining) if isinstance(remaining, timedelta) else last_ms
    if due <= last_ms:
        raise ValueError(f"the schedule {sched!r} has no slot after {last.isoformat()}")
    return due


class LeaseScheduler(Scheduler):  # type: ignore[misc]
    """A beat scheduler for any number of beats: one sends at a time (a leader lease).

    Use it with ``celery -A proj beat -S celery_lease.beat:LeaseScheduler``; the
    schedule is ``beat_schedule`` as Celery users write it (intervals, timedeltas,
    crontabs, per-entry ``options``). See the module for what each tick guarantees.
    """

    #: beat's loop calls sync() after sends; the schedule is written as it is sent.
    sync_every = 365 * 24 * 3600.0

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        #: The leader lease and schedule rows' name: ``beat:<app main>``.
        self.name = f"beat:{app.main or 'celery'}"[:128]
        self.leadership: Leadership | None = None
        self._store: LeaseStore | None = None
        self._last: dict[str, int] = {}
        self._synced: Any = None
        self._next_step = 0.0
        self._offset_ms: float | None = None
        self._clock_read = 0.0
        self._catch_up_ms = 0
        super().__init__(app, *args, **kwargs)

    # -- Celery's hooks ------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read ``beat_schedule`` (Celery's own merge) and prepare the leader lease."""
        super().setup_schedule()
        for name in self.schedule:
            if len(name) > MAX_ID_LENGTH:
                raise ImproperlyConfigured(
                    f"beat_schedule entry {name[:40]!r}...: names of at most {MAX_ID_LENGTH} "
                    "characters fit celery_lease_schedule"
                )
        config = app_config(self.app)
        runtime = runtime_for(self.app, config)
        lease_seconds, _ = database_settings(self.app, config)
        self._store = runtime.store
        self._catch_up_ms = round(2 * lease_seconds * 1000)
        self.leadership = Leadership(
            runtime.store,
            self.name,
            lease_seconds=lease_seconds,
            hostname=socket.gethostname(),
            events=runtime.events,
            database=safe_url(config.database_url),
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: renew or take the lead when due; as leader, send each entry's due
        slot. Returns the seconds to sleep before the next pass."""
        leadership = self.leadership
        if leadership is None:  # a lazy instance (introspection): it never sends
            return float(self.max_interval)
        if time.monotonic() >= self._next_step:
            self._next_step = time.monotonic() + leadership.step()
        term = leadership.current()
        until_step = max(0.0, self._next_step - time.monotonic())
        if term is None:
            self._synced = None
            return min(until_step, float(self.max_interval))
        try:
            if self._synced != term:
                self._sync(term)
            wait_ms = self._send_due(term)
        except LeadershipLost:
            self._fenced(term)
            return 0.0
        except LeaseError as exc:
            self._error("the schedule could not be read or written", exc)
            self._synced = None
            return min(until_step, 1.0)
        return min(until_step, wait_ms / 1000, float(self.max_interval))

    def sync(self) -> None:
        """Nothing to do: every tick is recorded in the lease database as it is sent."""

    def close(self) -> None:
        """Resign the lead (a standby takes over at its next try), then close as Celery does."""
        if self.leadership is not None:
            self.leadership.resign()
        super().close()

    @property
    def info(self) -> str:
        """What ``celery beat`` prints at start."""
        config = app_config(self.app)
        return (
            f"    . leader lease -> {self.name} on {safe_url(config.database_url)}\n"
            "    . any number of beats may run: one sends at a time"
        )

    # -- the leader's work -----------------------------------------------------------

    def _now_ms(self) -> int:
        """The database's clock, read at most every CLOCK_REFRESH_SECONDS and followed locally."""
        store = self._store
        assert store is not None
        if self._offset_ms is None or time.monotonic() - self._clock_read > CLOCK_REFRESH_SECONDS:
            self._offset_ms = store.now_ms() - time.time() * 1000
            self._clock_read = time.monotonic()
        return round(time.time() * 1000 + self._offset_ms)

    def _sync(self, term: Any) -> None:
        """A new term: read the schedule's rows, add the entries they lack (last run: now,
        as Celery starts a new entry) and forget the entries no longer scheduled."""
        store = self._store
        assert store is not None
        self._offset_ms = None
        now = self._now_ms()
        rows = store.leaders.schedule_of(self.name)
        missing = {name: now for name in self.schedule if name not in rows}
        store.leaders.add_entries(term, self.name, missing)
        if set(rows) - set(self.schedule):
            store.leaders.forget_entries(term, self.name, list(self.schedule))
        self._last = {
            name: rows[name].last_run_at if name in rows else now for name in self.schedule
        }
        self._synced = term

    def _send_due(self, term: Any) -> float:
        """Send the due slot of each entry (one per entry per pass); the milliseconds until
        the next slot falls due (0 when one is due already)."""
        now = self._now_ms()
        wait = float("inf")
        for name, entry in list(self.schedule.items()):
            last = self._last.get(name)
            if last is None:
                continue
            try:
                due = next_slot(entry.schedule, last)
                if due <= now:
                    due = self._coalesce(name, entry, due, now)
            except Exception as exc:  # one bad entry never stops the others
                self._error(f"cannot compute the next run of {name!r}", exc)
                continue
            if due > now:
                wait = min(wait, due - now)
                continue
            recorded = self._send(term, name, entry, last, due)
            if recorded is None:
                self._synced = None  # the row moved: read the schedule again
                return 0.0
            self._last[name] = recorded
            if recorded == last:
                wait = min(wait, 1000.0)  # not sent: try the same slot again in a second
                continue
            try:
                if next_slot(entry.schedule, due) <= now:
                    wait = 0.0  # catching up: come back at once
            except Exception:
                continue
        return wait

    def _coalesce(self, name: str, entry: ScheduleEntry, due: int, now: int) -> int:
        """The slot to send for ``entry`` when ``due`` is past: the first one still within
        the catch-up window, else the latest one due (the others are skipped, logged)."""
        floor = now - self._catch_up_ms
        skipped = 0
        while due <= floor and skipped < MAX_SLOTS_WALKED:
            following = next_slot(entry.schedule, due)
            if following > now:
                break
            due, skipped = following, skipped + 1
        if skipped >= MAX_SLOTS_WALKED:  # a long outage of a frequent entry: jump
            due = next_slot(entry.schedule, floor)
        if skipped:
            app_runtime(self.app).events.emit(
                Event.BEAT_COALESCED,
                None,
                "celery-lease beat: %s: %d tick(s) fell due unsent (no beat led, or the "
                "broker refused them), longer ago than the catch-up window: sending the one "
                "due at %s",
                name,
                skipped,
                _to_datetime(due).isoformat(),
                level=logging.WARNING,
                entry=name,
                skipped=skipped,
            )
        return due

    def _send(self, term: Any, name: str, entry: ScheduleEntry, last: int, due: int) -> int | None:
        """Send ``entry``'s slot ``due`` and record it (in that order for a leased task,
        the other way round for any other). Returns the entry's last slot now: ``due``,
        or ``last`` when a leased tick could not be sent (the next pass sends it again);
        None when the row moved meanwhile."""
        store = self._store
        assert store is not None
        task_id = entry.options.get("task_id") or tick_task_id(self.name, name, due)
        leased = isinstance(self.app.tasks.get(entry.task), LeasedTask)
        if not leased and not store.leaders.advance(term, self.name, name, last, due):
            return None
        sent = self._apply(entry, task_id, due)
        if leased:
            if not sent:
                return last
            if not store.leaders.advance(term, self.name, name, last, due):
                return None
        if sent:
            app_runtime(self.app).events.emit(
                Event.BEAT_SENT,
                None,
                "celery-lease beat: sent %s (%s) due %s as %s",
                name,
                entry.task,
                _to_datetime(due).isoformat(),
                task_id,
                entry=name,
                task=entry.task,
                due_ms=due,
                task_id=task_id,
            )
        return due

    def _apply(self, entry: ScheduleEntry, task_id: str, due: int) -> bool:
        """Publish one tick of ``entry`` under ``task_id`` as Celery's beat does, its slot in
        the header :data:`DUE_HEADER`; False when it could not be sent (logged)."""
        headers = {**(entry.options.get("headers") or {}), DUE_HEADER: due}
        options = {**entry.options, "task_id": task_id, "headers": headers}
        tick = entry.__class__(**dict(entry, options=options))
        try:
            self.apply_async(tick, producer=self.producer, advance=False)
        except Exception as exc:
            self._error(f"could not send {entry.name!r}", exc)
            return False
        return True

    def _fenced(self, term: Any) -> None:
        """A fenced write was refused: another beat leads now."""
        app_runtime(self.app).events.emit(
            Event.BEAT_FENCED,
            None,
            "celery-lease beat: a tick's record was refused: this beat no longer leads %s "
            "(term %d); another beat sends",
            self.name,
            term.term,
            level=logging.WARNING,
            term=term.term,
        )
        if self.leadership is not None:
            self.leadership.refused(term)
        self._synced = None

    def _error(self, what: str, exc: BaseException) -> None:
        error = describe_exception(exc)
        app_runtime(self.app).events.emit(
            Event.BEAT_ERROR,
            None,
            "celery-lease beat: %s: %s",
            what,
            error,
            level=logging.ERROR,
            error=error,
        )
