"""LeaseScheduler in process: slots, task ids, handover and the fence (real SQLite, no beat
process; tests/test_beat.py runs real ``celery beat`` processes)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_lease import LeasedTask, testing
from celery_lease.beat import LeaseScheduler, next_slot, tick_task_id
from celery_lease.events import Event
from celery_lease.runtime import app_runtime, store_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("sched", set_as_current=False)
    app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)

    @app.task(base=LeasedTask, bind=True, shared=False, name="sched.leased")
    def leased(self: LeasedTask) -> None:
        return None

    @app.task(shared=False, name="sched.plain")
    def plain() -> None:
        return None

    app.conf.beat_schedule = {
        "leased": {"task": "sched.leased", "schedule": 0.2},
        "plain": {"task": "sched.plain", "schedule": 0.2},
    }
    testing.use_lease_database(app, tmp_path / "leases.sqlite3", eager=False, lease_seconds=6)
    yield app
    testing.shutdown_leases(app)


def _sent(app: Celery) -> list[tuple[str, int]]:
    """Every tick a scheduler of ``app`` reports sent, as ``(entry, due ms)``, in order."""
    sent: list[tuple[str, int]] = []

    def listen(event: Event, fields: dict[str, Any]) -> None:
        if event is Event.BEAT_SENT:
            sent.append((fields["entry"], fields["due_ms"]))

    app_runtime(app).events.add_listener(listen)
    return sent


def _run(scheduler: LeaseScheduler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(max(scheduler.tick(), 0.0), 0.05))


def test_slots_and_task_ids_depend_on_the_last_slot_only() -> None:
    """The next slot of an interval is last + interval, of a crontab its next occurrence
    after the last slot, whenever it is computed; a tick's task id is a function of the
    scheduler, the entry and the slot."""
    app = Celery("slots", set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    start = int(datetime(2026, 1, 1, 0, 0, 0, 123_000, tzinfo=timezone.utc).timestamp() * 1000)
    from celery.schedules import schedule

    assert next_slot(schedule(1.5, app=app), start) == start + 1500
    hourly = crontab(minute=0, hour=3, app=app)  # 03:00 in Paris: 02:00 UTC in winter
    first = next_slot(hourly, start)
    assert datetime.fromtimestamp(first / 1000, timezone.utc).hour == 2
    assert next_slot(hourly, first) - first == 86_400_000
    assert tick_task_id("beat:a", "e", 1) == tick_task_id("beat:a", "e", 1)
    assert len({tick_task_id("beat:a", "e", 1), tick_task_id("beat:a", "e", 2),
                tick_task_id("beat:b", "e", 1), tick_task_id("beat:a", "f", 1)}) == 4  # fmt: skip


def test_a_second_scheduler_stands_by_then_continues_where_the_first_stopped(
    app: Celery,
) -> None:
    """Two schedulers of one app: only the one leading sends; once it closes (resigning),
    the other takes the lead and sends the next slot of each entry: none repeated, none
    skipped."""
    sent = _sent(app)
    first = LeaseScheduler(app)
    second = LeaseScheduler(app)
    _run(first, 0.1)
    _run(second, 0.1)
    assert first.leadership is not None and first.leadership.current() is not None
    assert second.leadership is not None and second.leadership.current() is None
    _run(first, 1.0)
    _run(second, 0.2)  # standing by: sends nothing
    first.close()
    _run(second, 2.5)  # its next try takes the lead (two seconds at most), then it sends
    assert second.leadership.current() is not None
    for entry in ("leased", "plain"):
        slots = [due for name, due in sent if name == entry]
        assert len(slots) >= 12 and len(set(slots)) == len(slots), slots
        assert {b - a for a, b in itertools.pairwise(slots)} == {200}, slots
    rows = store_for(app).leaders.schedule_of("beat:sched")
    assert {"leased", "plain", "celery-lease-sweep"} <= set(rows)


def test_a_stale_leaders_records_are_refused(app: Celery) -> None:
    """A scheduler whose lead was taken over while it still believed it led (its local
    deadline not yet passed): its record of a tick is refused by the fence, so it sends no
    tick of a plain task and stops leading; the new leader sends every slot once."""
    sent = _sent(app)
    refused: list[int] = []
    app_runtime(app).events.add_listener(
        lambda event, fields: refused.append(1) if event is Event.BEAT_FENCED else None
    )
    stale = LeaseScheduler(app)
    fresh = LeaseScheduler(app)
    _run(stale, 0.5)
    assert stale.leadership is not None and fresh.leadership is not None
    term = stale.leadership.current()
    assert term is not None
    store_for(app).leaders.resign(term)  # as if its lease had expired while it stalled
    fresh.leadership.step()
    assert fresh.leadership.current() is not None
    before = len(sent)
    _run(stale, 0.4)  # before its next renewal it still believes it leads: the fence refuses
    assert refused and stale.leadership.current() is None
    plain_after = [due for name, due in sent[before:] if name == "plain"]
    assert plain_after == []  # recorded first, so never sent
    _run(fresh, 0.6)
    for entry in ("leased", "plain"):
        slots = sorted({due for name, due in sent if name == entry})
        assert {b - a for a, b in itertools.pairwise(slots)} == {200}, (entry, slots)
    plain = [due for name, due in sent if name == "plain"]
    assert len(plain) == len(set(plain))
