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
from celery.exceptions import ImproperlyConfigured

from ..actions import (
    BULK_STATUSES,
    ActionResult,
    BulkRerun,
    cancel_run,
    pause_task,
    rerun_run,
    rerun_runs,
    resume_task,
)
from ..config import LeaseConfig
from ..display import format_duration, format_relative, leader_text, run_progress_text
from ..errors import LeaseError, RunNotFound
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
from ..store import FlowCounts, LeaseStore, Pause, RunPageQuery, RunRecord, RunSummary

#: Runs on one page.
PAGE_SIZE = 50
#: The age filter's choices: label -> seconds (None: any age).
AGES: dict[str, int | None] = {"": None, "15m": 900, "1h": 3600, "24h": 86_400, "7d": 604_800}
#: The overview's window for recent ends and lease expiries.
OVERVIEW_WINDOW_MS = 3_600_000
#: Most runs one bulk rerun from the web view takes (confirm again for the next ones).
WEB_BULK_LIMIT = 1000
#: Most rate buckets (task and rate key) the overview lists.
RATE_ROWS = 50


class BadFilter(ValueError):
    """A filter value the runs page does not accept; ``str()`` says which and why."""


def storable_text(value: str) -> bool:
    """False for text no run id holds and some databases refuse in a query (a NUL, a
    lone surrogate): a filter with it is a bad request, not a database error."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
            if not storable_text(value):
                raise BadFilter(f"{name} holds a NUL or a lone surrogate: no run id does")
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
        "progress": run_progress_text(
            run.status, run.terminal, run.progress_done, run.progress_total
        ),
    }


def runs_page(store: LeaseStore, filters: Filters) -> dict[str, Any]:
    """The runs page: its rows and the next page's query parameters (DB clock ``now``)."""
    now = store.now_ms()
    rows = store.reads.page_runs(filters.query(now))
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


def run_fields(run: RunRecord, now: int, *, full_owner: bool = False) -> list[Field]:
    """Every field a run's page shows, by the database clock; payload and result by size.
    The owner is ``host:pid`` unless ``full_owner`` (a viewer who presented the token)."""
    heartbeat = past(run.heartbeat_at, now)
    owner = (run.lease_owner or "-") if full_owner else short_owner(run.lease_owner)
    fields = [
        Field("status", "status", status_text(run)),
        Field("task", "task", run.task_name),
        Field("attempt", "attempt", f"{run.attempt} of {run.max_attempts}"),
        Field("owner", "owner", owner),
        Field("heartbeat", "heartbeat", heartbeat if run.status == RUNNING else "-"),
        Field("lease", "time left", time_left(run, now)),
        Field(
            "progress",
            "progress",
            run_progress_text(
                run.status,
                run.terminal,
                run.progress_done,
                run.progress_total,
                run.progress_note,
            ),
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
        Field("takeovers", "taken over (its lease expired)", takeover_text(run, now)),
        Field("republishes", "re-published by the sweeper", republish_text(run, now)),
        Field("created", "created", past(run.created_at, now)),
        Field("started", "started", past(run.started_at, now)),
        Field("finished", "finished", past(run.finished_at, now)),
        Field("updated", "updated", past(run.updated_at, now)),
    ]
    return fields


def times_text(count: int, last: int | None, now: int) -> str:
    """``never``, or how many times and when last."""
    if not count:
        return "never"
    return f"{count} time{'' if count == 1 else 's'}, last {past(last, now)}"


def takeover_text(run: RunRecord, now: int) -> str:
    """How often a claim took the run over from an expired lease (never reset)."""
    return times_text(run.takeovers, run.taken_over_at, now)


def republish_text(run: RunRecord, now: int) -> str:
    """How often the sweeper published the run, in all (never reset), and since its last
    claim (the count that ends a run no worker takes as undeliverable)."""
    text = times_text(run.republishes, run.republished_at, now)
    return text if not run.requeues else f"{text} ({run.requeues} since its last claim)"


def checkpoint_text(run: RunRecord, now: int) -> str:
    """The checkpoint's size and age (never its contents), or ``-``."""
    if run.checkpoint is None:
        return "-"
    return f"{len(run.checkpoint.encode('utf-8')):,} bytes, saved {past(run.checkpoint_at, now)}"


def run_view(run: RunRecord, now: int, *, full_owner: bool = False) -> dict[str, Any]:
    """A run's page as data: its fields and the actions that apply to it now (the full
    lease owner only with ``full_owner``: a viewer who presented the token)."""
    return {
        "now": now,
        "id": run.id,
        "task": run.task_name,
        "status": run.status,
        "fields": [dataclasses.asdict(f) for f in run_fields(run, now, full_owner=full_owner)],
        "actions": [{"name": a.name, "label": a.label} for a in ACTIONS.values() if a.applies(run)],
    }


# -- flow control: what is paused, what is rate-limited -------------------------------------


def rate_limits(app: Celery) -> dict[str, LeaseConfig]:
    """The settings of every task of ``app`` with a ``lease_rate_limit``, by task name."""
    found: dict[str, LeaseConfig] = {}
    try:
        tasks = list(app.tasks.items())
    except RuntimeError:  # an app that must not finalize yet: its tasks are not known
        return found
    for name, task in tasks:
        settings = getattr(task, "lease_config", None)  # LeasedTask's public method
        if not callable(settings):
            continue
        try:
            config = settings()
        except ImproperlyConfigured:
            continue
        if isinstance(config, LeaseConfig) and config.rate_limit is not None:
            found[str(name)] = config
    return found


def limit_text(config: LeaseConfig) -> str:
    """A rate limit as configured: ``20/s``, with its burst and whether it is per key."""
    text = str(config.rate_limit)
    if config.rate_burst > 1:
        text += f", burst {config.rate_burst}"
    if config.rate_key is not None:
        text += ", per rate key"
    return text


def next_slot_ms(config: LeaseConfig, tat: int | None, now: int) -> int:
    """Milliseconds until a delivery arriving now would get its slot (0: at once): the
    bucket's next theoretical arrival, less its burst (as the claim reserves it)."""
    period = config.rate_period_ms or 0
    if tat is None:
        return 0
    due = max(tat, now) + period - period * config.rate_burst
    return max(0, due - now)


def slot_text(wait_ms: int) -> str:
    """``now`` or ``in 1.2s``."""
    return "now" if wait_ms <= 0 else f"in {format_duration(wait_ms)}"


def flow_state(store: LeaseStore) -> tuple[list[Pause], FlowCounts | None]:
    """Every pause and the held deliveries per task and key; none before ``lease migrate``
    made the flow-control tables."""
    try:
        return store.flow.list_pauses(), store.flow.flow_counts()
    except LeaseError:
        return [], None


def pause_rows(pauses: list[Pause], now: int) -> list[dict[str, str]]:
    """What is paused: task, key, reason, since when, deliveries held."""
    return [
        {
            "task": p.task_name,
            "key": p.key or "(every key)",
            "reason": p.reason or "-",
            "since": past(p.paused_at, now),
            "held": str(p.waiting),
        }
        for p in pauses
    ]


def rate_rows(
    app: Celery, store: LeaseStore, held: FlowCounts | None, task_name: str | None = None
) -> list[dict[str, str]]:
    """What is rate-limited: per task (and rate key with a bucket or a waiting delivery):
    the limit, the deliveries waiting for their slot, and when the next slot is."""
    limits = rate_limits(app)
    if task_name is not None:
        limits = {name: c for name, c in limits.items() if name == task_name}
    if not limits:
        return []
    try:
        buckets = store.reads.rate_buckets(list(limits), RATE_ROWS)
    except LeaseError:  # no flow-control tables yet
        buckets = []
    now = buckets[0].now if buckets else store.now_ms()
    deferred = {} if held is None else held.deferred
    tats = {(b.task_name, b.rate_key): b.tat for b in buckets}
    rows = []
    for name in sorted(limits):
        config = limits[name]
        keys = sorted({k for t, k in tats if t == name} | {k for t, k in deferred if t == name})
        for key in keys or [""]:
            rows.append(
                {
                    "task": name,
                    "key": key or "-",
                    "limit": limit_text(config),
                    "waiting": str(deferred.get((name, key), 0)),
                    "next_slot": slot_text(next_slot_ms(config, tats.get((name, key)), now)),
                }
            )
    return rows[:RATE_ROWS]


# -- the overview --------------------------------------------------------------------


#: The overview's recovery counters: name -> what it counts (the label says so).
RECOVERY = {
    "taken_over": "runs taken over by another worker after their lease expired",
    "republished": "runs re-published by the sweeper (lease expired, or message never claimed)",
    "ended_expired": "runs ended failed: lease expired on the last attempt, or never claimed",
}


def overview(app: Celery, store: LeaseStore) -> dict[str, Any]:
    """The overview as data: what is paused and what is rate-limited; live runs per status
    and runs that ended in the last hour, the same per task; running leases live and
    expired; the runs taken over, re-published by the sweeper or ended after an expired
    lease in the last hour; the oldest running lease; and who leads the sweeper and each
    LeaseScheduler.

    Every figure is an index range bounded by the live rows or the window, never a count
    of the whole table (``lease stats`` gives all-time totals): a million finished rows
    cost this page nothing. The recovery counters read the history no claim resets.
    """
    now = store.now_ms()
    per_task = store.reads.task_counts(now, OVERVIEW_WINDOW_MS)
    oldest = store.reads.oldest_running()
    pauses, held = flow_state(store)
    live = (QUEUED, RUNNING, RETRYING)
    ended = (SUCCEEDED, FAILED, CANCELLED)
    counts = dict.fromkeys(STATUSES, 0)
    for t in per_task:
        for status, n in (*t.live.items(), *t.ended_recently.items()):
            counts[status] += n
    expired = sum(t.expired_leases for t in per_task)
    leaders = {
        leader.name: leader_text(
            leader.owner,
            leader.term,
            leader.acquired_at,
            leader.renewed_at,
            leader.expires_at,
            leader.now,
        )
        for leader in store.leaders.list_all()
    }
    return {
        "now": now,
        "paused": pause_rows(pauses, now),
        "rate_limited": rate_rows(app, store, held),
        "statuses": [{"status": s, "count": counts[s]} for s in STATUSES],
        "live_columns": list(live),
        "ended_columns": list(ended),
        "tasks": [
            {
                "task": t.task_name,
                "live": [t.live.get(s, 0) for s in live],
                "ended": [t.ended_recently.get(s, 0) for s in ended],
                "taken_over": t.taken_over,
                "republished": t.republished,
            }
            for t in per_task
        ],
        "live_leases": counts[RUNNING] - expired,
        "expired_leases": expired,
        "recovery": [
            {"name": name, "label": label, "count": sum(getattr(t, name) for t in per_task)}
            for name, label in RECOVERY.items()
        ],
        "sweeper": leaders.pop("sweeper", "no worker has led it"),
        "beats": "; ".join(f"{name}: {text}" for name, text in sorted(leaders.items())) or "-",
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


# -- one task ----------------------------------------------------------------------------


def task_view(app: Celery, store: LeaseStore, task_name: str) -> dict[str, Any]:
    """A task's page as data: its runs per status (live, and ended in the last hour), its
    recovery counters, its pause (and its keys' pauses) with the deliveries held, its rate
    limit, and the actions that apply now. The same index ranges as the overview, for one
    task."""
    now = store.now_ms()
    found = store.reads.task_counts(now, OVERVIEW_WINDOW_MS, task_name)
    counts = found[0] if found else None
    pauses, held = flow_state(store)
    own = [p for p in pauses if p.task_name == task_name]
    whole = next((p for p in own if p.key == ""), None)
    waiting = {} if held is None else held.paused
    statuses = []
    for status in STATUSES:
        if counts is None:
            n = 0
        elif status in (QUEUED, RUNNING, RETRYING):
            n = counts.live.get(status, 0)
        else:
            n = counts.ended_recently.get(status, 0)
        statuses.append({"status": status, "count": n})
    if whole is not None:
        state = f"paused since {past(whole.paused_at, now)}: {whole.reason or 'no reason given'}"
    elif own:
        state = "some keys paused (below)"
    else:
        state = "not paused"
    return {
        "now": now,
        "task": task_name,
        "state": state,
        "paused": whole is not None,
        "held": sum(n for (t, _), n in waiting.items() if t == task_name),
        "pauses": pause_rows(own, now),
        "rate_limited": rate_rows(app, store, held, task_name),
        "statuses": statuses,
        "expired_leases": 0 if counts is None else counts.expired_leases,
        "recovery": [
            {"name": name, "label": label, "count": 0 if counts is None else getattr(counts, name)}
            for name, label in RECOVERY.items()
        ],
        "actions": [
            {"name": a.name, "label": f"{a.label} task"}
            for a in TASK_ACTIONS.values()
            if a.applies(whole is not None)
        ],
    }


# -- actions ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Action:
    """A button on a run's page: what it asks before, and what it calls.

    ``applies``: whether the button is offered for a run as it is now (the action
    itself re-checks, guarded, when it runs). ``run(app, store, run_id)``: does it.
    ``confirm``: the confirmation button's words.
    """

    name: str
    label: str
    question: str
    applies: Callable[[RunRecord], bool]
    run: Callable[[Celery, LeaseStore, str], ActionResult]
    confirm: str


def _rerun(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    return rerun_run(app, store, run_id)


def _task_of(store: LeaseStore, run_id: str) -> str:
    run = store.get(run_id)
    if run is None:
        raise RunNotFound(run_id)
    return run.task_name


def _pause(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    result = pause_task(app, store, _task_of(store, run_id), reason="paused from the web view")
    return dataclasses.replace(result, run_id=run_id)


def _resume(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    return dataclasses.replace(resume_task(app, store, _task_of(store, run_id)), run_id=run_id)


#: The actions on one run, by the name their URL uses. A new one is one more entry.
ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        Action(
            "cancel",
            "Cancel",
            "Cancel this run? A queued or retrying run ends cancelled at once; a running "
            "run stops within one heartbeat, unless its body completes first.",
            lambda run: not run.terminal,
            cancel_run,
            "Yes, cancel the run",
        ),
        Action(
            "rerun",
            "Rerun",
            "Run this run again? It goes back to queued with fresh attempts and is "
            "published from its stored message.",
            lambda run: run.status in (FAILED, CANCELLED),
            _rerun,
            "Yes, rerun the run",
        ),
        Action(
            "pause",
            "Pause task",
            "Pause this run's task on every worker? Its new deliveries are kept in the lease "
            "database until resume; running bodies finish.",
            lambda run: True,
            _pause,
            "Yes, pause the task",
        ),
        Action(
            "resume",
            "Resume task",
            "Resume this run's task? The deliveries kept while it was paused are published "
            "again in the order they came.",
            lambda run: True,
            _resume,
            "Yes, resume the task",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class TaskAction:
    """A button on a task's page. ``applies(paused)``: offered while the task is paused
    (as a whole) or not. ``run(app, store, task, form)``: does it, with the confirmation
    form's fields (a pause's reason, whether to cancel running runs)."""

    name: str
    label: str
    question: str
    applies: Callable[[bool], bool]
    run: Callable[[Celery, LeaseStore, str, Mapping[str, str]], ActionResult]
    confirm: str


#: Longest pause reason the web form takes.
MAX_REASON = 500


def _pause_task(
    app: Celery, store: LeaseStore, task_name: str, form: Mapping[str, str]
) -> ActionResult:
    reason = " ".join(form.get("reason", "").split())[:MAX_REASON] or "paused from the web view"
    cancel = form.get("cancel_running") == "yes"
    return pause_task(app, store, task_name, reason=reason, cancel_running=cancel)


def _resume_task(
    app: Celery, store: LeaseStore, task_name: str, form: Mapping[str, str]
) -> ActionResult:
    return resume_task(app, store, task_name)


#: The actions on a task (its page's buttons), by the name their URL uses.
TASK_ACTIONS: dict[str, TaskAction] = {
    action.name: action
    for action in (
        TaskAction(
            "pause-task",
            "Pause",
            "Pause this task on every worker? From now on its deliveries are kept in the "
            "lease database, not run, until resume; running bodies finish unless you "
            "cancel them below.",
            lambda paused: not paused,
            _pause_task,
            "Yes, pause the task",
        ),
        TaskAction(
            "resume-task",
            "Resume",
            "Resume this task? The deliveries kept while it was paused are published again "
            "in the order they came.",
            lambda paused: paused,
            _resume_task,
            "Yes, resume the task",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class BulkRerunTarget:
    """The runs a bulk rerun from the runs page takes: the list's filters, whose status is
    ``failed`` or ``cancelled`` and whose task is named."""

    filters: Filters

    @classmethod
    def of(cls, filters: Filters) -> BulkRerunTarget | None:
        """The target of ``filters``, or None when the list is not one a bulk rerun takes."""
        if filters.task and filters.status in BULK_STATUSES:
            return cls(filters)
        return None

    def run(self, app: Celery, store: LeaseStore, *, dry_run: bool) -> BulkRerun:
        """:func:`~celery_lease.actions.rerun_runs` on these runs, at most
        :data:`WEB_BULK_LIMIT` (dry: what it would take)."""
        return rerun_runs(
            app,
            store,
            self.filters.task,
            self.filters.status,
            created_within=AGES[self.filters.age],
            id_prefix=self.filters.key or None,
            dry_run=dry_run,
            limit=WEB_BULK_LIMIT,
        )
