"""What the web view shows, as plain data: filters, pages, a run's fields, the overview.

Nothing here imports the web stack, so the pages' content is the same whether
Jinja2 renders it or the browser's script refreshes it from the JSON endpoints.
Every value is text the templates escape; a run's stored message and result are
never read into a page, only their sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery

from .. import flow
from ..actions import ActionResult, cancel_run, rerun_run
from ..display import format_duration, format_relative, progress_text
from ..errors import RunNotFound
from ..owner import Owner
from ..sanitize import sanitize
from ..schema import (
    CANCELLED,
    FAILED,
    MAX_ID_LENGTH,
    QUEUED,
    RETRYING,
    RUNNING,
    STATUSES,
    SUCCEEDED,
)
from ..store import LeaseStore, RunPageQuery, RunRecord, RunSummary

#: Runs on one page.
PAGE_SIZE = 50
#: The age filter's choices: label -> seconds (None: any age).
AGES: dict[str, int | None] = {"": None, "15m": 900, "1h": 3600, "24h": 86_400, "7d": 604_800}
#: The overview's window for recent ends and lease expiries.
OVERVIEW_WINDOW_MS = 3_600_000


class BadFilter(ValueError):
    """A filter value the runs page does not accept; ``str()`` says which and why."""


@dataclasses.dataclass(frozen=True)
class Filters:
    """The runs page's filters and keyset bound, as given in its query string."""

    status: str = ""
    task: str = ""
    key: str = ""
    age: str = ""
    after_created: int | None = None
    after_id: str = ""

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Filters:
        """Filters from a query string; :class:`BadFilter` for a value out of range."""
        status = params.get("status", "")
        if status and status not in STATUSES:
            raise BadFilter(f"status must be one of {', '.join(STATUSES)}")
        age = params.get("age", "")
        if age not in AGES:
            raise BadFilter(f"age must be one of {', '.join(a for a in AGES if a)}")
        task, key, after_id = (params.get(n, "").strip() for n in ("task", "key", "after_id"))
        for name, value in (("task", task), ("key", key), ("after_id", after_id)):
            if len(value) > MAX_ID_LENGTH:
                raise BadFilter(f"{name} is longer than {MAX_ID_LENGTH} characters")
        after_created: int | None = None
        if params.get("after_created"):
            try:
                after_created = int(params["after_created"])
            except ValueError:
                raise BadFilter("after_created must be an integer (epoch ms)") from None
        return cls(status, task, key, age, after_created, after_id)

    def query(self, now: int, limit: int = PAGE_SIZE) -> RunPageQuery:
        """The store query of this page (``now``: the database clock, for the age)."""
        seconds = AGES[self.age]
        return RunPageQuery(
            status=self.status or None,
            task_name=self.task or None,
            id_prefix=self.key or None,
            created_since=None if seconds is None else now - seconds * 1000,
            after_created=self.after_created,
            after_id=self.after_id or None,
            limit=limit,
        )

    def params(self) -> dict[str, str]:
        """The filters (without the keyset bound) as query parameters."""
        values = {"status": self.status, "task": self.task, "key": self.key, "age": self.age}
        return {name: value for name, value in values.items() if value}

    def next_page(self, rows: list[RunSummary], limit: int = PAGE_SIZE) -> dict[str, str] | None:
        """The query parameters of the page after ``rows``; None when it was the last."""
        if len(rows) < limit:
            return None
        last = rows[-1]
        bound = {"after_id": last.id}
        if not self.key:  # newest first: the bound is (created_at, id)
            bound["after_created"] = str(last.created_at)
        return {**self.params(), **bound}


# -- formatting ---------------------------------------------------------------------


def past(ms: int | None, now: int) -> str:
    """A moment that has happened, relative to ``now``: a row written after the page read
    the database clock shows as ``0ms ago``, not in the future."""
    return format_relative(None if ms is None else min(ms, now), now)


def time_left(run: RunSummary | RunRecord, now: int) -> str:
    """A running lease's time left by the database clock, or how long ago it expired."""
    if run.status != RUNNING or run.lease_expires_at is None:
        return "-"
    left = run.lease_expires_at - now
    return f"{format_duration(left)} left" if left > 0 else f"expired {format_duration(left)} ago"


def short_owner(owner: str | None) -> str:
    """``host:pid`` of an owner (its random part only matters to the guard)."""
    return Owner.parse(owner).short() if owner else "-"


def status_text(run: RunSummary | RunRecord) -> str:
    """The status, with a pending cancel request."""
    pending = run.cancel_requested_at is not None and not run.terminal
    return run.status + (" (cancel requested)" if pending else "")


def run_row(run: RunSummary, now: int) -> dict[str, str]:
    """One row of the runs table: every cell as text."""
    return {
        "id": run.id,
        "task": run.task_name,
        "status": run.status,
        "status_text": status_text(run),
        "attempt": f"{run.attempt}/{run.max_attempts}",
        "owner": short_owner(run.lease_owner) if run.status == RUNNING else "-",
        "lease": time_left(run, now),
        "created": past(run.created_at, now),
        "updated": past(run.updated_at, now),
        "failure": run.failure_code or "",
        "progress": progress_text(run.progress_done, run.progress_total),
    }


def runs_page(store: LeaseStore, filters: Filters) -> dict[str, Any]:
    """The runs page: its rows and the next page's query parameters (DB clock ``now``)."""
    now = store.now_ms()
    rows = store.page_runs(filters.query(now))
    return {
        "now": now,
        "rows": [run_row(r, now) for r in rows],
        "next": filters.next_page(rows),
    }


# -- one run ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
    """One line of a run's page: a stable name (for the live update), label, text."""

    name: str
    label: str
    text: str


def size_text(data: bytes | None, what: str) -> str:
    """The size of a stored blob, never its contents."""
    return "-" if data is None else f"{len(data)} bytes ({what} not shown)"


def run_fields(run: RunRecord, now: int) -> list[Field]:
    """Every field a run's page shows, by the database clock; payload and result by size."""
    heartbeat = past(run.heartbeat_at, now)
    fields = [
        Field("status", "status", status_text(run)),
        Field("task", "task", run.task_name),
        Field("attempt", "attempt", f"{run.attempt} of {run.max_attempts}"),
        Field("owner", "owner", run.lease_owner or "-"),
        Field("heartbeat", "heartbeat", heartbeat if run.status == RUNNING else "-"),
        Field("lease", "time left", time_left(run, now)),
        Field(
            "progress",
            "progress",
            progress_text(run.progress_done, run.progress_total, run.progress_note),
        ),
        Field("checkpoint", "checkpoint", checkpoint_text(run, now)),
        Field("failure_code", "failure code", run.failure_code or "-"),
        Field(
            "last_error", "last error", "-" if run.last_error is None else sanitize(run.last_error)
        ),
        Field("task_id", "task id", run.task_id or "-"),
        Field("payload", "stored message", size_text(run.payload, "contents")),
        Field("result", "stored result", size_text(run.result, "contents")),
        Field("concurrency_key", "concurrency key", run.concurrency_key or "-"),
        Field("cancel_requested", "cancel requested", past(run.cancel_requested_at, now)),
        Field("requeues", "re-published by the sweeper", str(run.requeues)),
        Field("created", "created", past(run.created_at, now)),
        Field("started", "started", past(run.started_at, now)),
        Field("finished", "finished", past(run.finished_at, now)),
        Field("updated", "updated", past(run.updated_at, now)),
    ]
    return fields


def checkpoint_text(run: RunRecord, now: int) -> str:
    """The checkpoint's size and age (never its contents), or ``-``."""
    if run.checkpoint is None:
        return "-"
    return f"{len(run.checkpoint.encode('utf-8')):,} bytes, saved {past(run.checkpoint_at, now)}"


def run_view(run: RunRecord, now: int) -> dict[str, Any]:
    """A run's page as data: its fields and the actions that apply to it now."""
    return {
        "now": now,
        "id": run.id,
        "status": run.status,
        "fields": [dataclasses.asdict(f) for f in run_fields(run, now)],
        "actions": [a.name for a in ACTIONS.values() if a.applies(run)],
    }


# -- the overview --------------------------------------------------------------------


def overview(store: LeaseStore) -> dict[str, Any]:
    """The overview as data: live runs per status and runs that ended in the last hour,
    the same per task, running leases live and expired, leases that expired in the last
    hour, and the oldest running lease.

    Every figure is an index range bounded by the live rows or the window, never a count
    of the whole table (``lease stats`` gives all-time totals): a million finished rows
    cost this page nothing.
    """
    now = store.now_ms()
    per_task = store.task_counts(now, OVERVIEW_WINDOW_MS)
    oldest = store.oldest_running()
    live = (QUEUED, RUNNING, RETRYING)
    ended = (SUCCEEDED, FAILED, CANCELLED)
    counts = dict.fromkeys(STATUSES, 0)
    for t in per_task:
        for status, n in (*t.live.items(), *t.ended_recently.items()):
            counts[status] += n
    expired = sum(t.expired_leases for t in per_task)
    return {
        "now": now,
        "statuses": [{"status": s, "count": counts[s]} for s in STATUSES],
        "live_columns": list(live),
        "ended_columns": list(ended),
        "tasks": [
            {
                "task": t.task_name,
                "live": [t.live.get(s, 0) for s in live],
                "ended": [t.ended_recently.get(s, 0) for s in ended],
            }
            for t in per_task
        ],
        "live_leases": counts[RUNNING] - expired,
        "expired_leases": expired,
        "taken_over": sum(t.lease_expired_recently for t in per_task),
        "oldest": None
        if oldest is None
        else {
            "id": oldest.id,
            "task": oldest.task_name,
            "owner": short_owner(oldest.lease_owner),
            "running_for": "-"
            if oldest.started_at is None
            else format_duration(now - oldest.started_at),
            "lease": time_left(oldest, now),
        },
    }


# -- actions ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Action:
    """A button on a run's page: what it asks before, and what it calls.

    ``applies``: whether the button is offered for a run as it is now (the action
    itself re-checks, guarded, when it runs). ``run(app, store, run_id)``: does it.
    """

    name: str
    label: str
    question: str
    applies: Callable[[RunRecord], bool]
    run: Callable[[Celery, LeaseStore, str], ActionResult]


def _rerun(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    return rerun_run(app, store, run_id)


def _task_of(store: LeaseStore, run_id: str) -> str:
    run = store.get(run_id)
    if run is None:
        raise RunNotFound(run_id)
    return run.task_name


def _pause(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    task_name = _task_of(store, run_id)
    new = flow.pause(app, task_name, reason="paused from the web view", store=store)
    status = "paused" if new else "already paused"
    return ActionResult(
        run_id,
        status,
        f"task {task_name} is {status} on every worker: its new deliveries are kept until "
        "resume; running bodies finish",
    )


def _resume(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    task_name = _task_of(store, run_id)
    sent = flow.resume(app, task_name, store=store)
    return ActionResult(
        run_id,
        "resumed",
        f"task {task_name} is resumed: {sent} kept deliveries published in the order they came",
    )


#: The actions, by the name their URL uses. A new one is one more entry.
ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        Action(
            "cancel",
            "Cancel",
            "Cancel this run? A queued or retrying run ends cancelled at once; a running "
            "run stops within one heartbeat.",
            lambda run: not run.terminal,
            cancel_run,
        ),
        Action(
            "rerun",
            "Rerun",
            "Run this run again? It goes back to queued with fresh attempts and is "
            "published from its stored message.",
            lambda run: run.status in (FAILED, CANCELLED),
            _rerun,
        ),
        Action(
            "pause",
            "Pause task",
            "Pause this run's task on every worker? Its new deliveries are kept in the lease "
            "database until resume; running bodies finish.",
            lambda run: True,
            _pause,
        ),
        Action(
            "resume",
            "Resume task",
            "Resume this run's task? The deliveries kept while it was paused are published "
            "again in the order they came.",
            lambda run: True,
            _resume,
        ),
    )
}
