"""The SQL the store and the database classes share: plain builder functions.

Each returns a SQLAlchemy construct or a dict of column values; none runs
anything. Every time in them is :class:`~celery_lease.schema.db_now_ms`, the
database clock.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import (
    Integer,
    String,
    Table,
    and_,
    bindparam,
    case,
    exists,
    func,
    literal,
    literal_column,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from ..schema import (
    FAILED,
    MAX_PROGRESS_NOTE,
    QUEUED,
    RETRYING,
    RUNNING,
    STATUSES,
    SUCCEEDED,
    TERMINAL_STATUSES,
    TRACEPARENT_LENGTH,
    PayloadType,
    ProgressType,
    db_now_ms,
    pauses,
    rates,
    runs,
)
from .records import _CLEARED_ON_SUCCESS, LeaseKey, Progress, RunPageQuery, RunSummary

#: Builds a dialect's ``INSERT`` construct for a table (see ``Database.insert``).
InsertBuilder = Callable[[Table], Any]


def ended_values(now: Any, status: str, failure_code: str, error: str | None) -> dict[str, Any]:
    """The values that end a run in ``status``, with its failure, at ``now``.

    ``lease_expires_at`` becomes the end time too: ``lease top`` counts recent ends by it.
    """
    return {
        "status": status,
        "failure_code": failure_code,
        "last_error": error,
        "lease_expires_at": now,
        "finished_at": now,
        "updated_at": now,
    }


def success_values(now: Any) -> dict[str, Any]:
    """The values that end a run ``succeeded`` at ``now``, its stored message and
    checkpoint cleared."""
    return {
        "status": SUCCEEDED,
        "lease_expires_at": now,
        "finished_at": now,
        "updated_at": now,
        "last_error": None,
        "failure_code": None,
        **_CLEARED_ON_SUCCESS,
    }


def checkpoint_values(now: Any, state: Any) -> dict[str, Any]:
    """The values that save ``state`` (JSON text) as the run's checkpoint at ``now``."""
    return {"checkpoint": state, "checkpoint_at": now, "updated_at": now}


def progress_values(
    progress: Mapping[LeaseKey, Progress],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The heartbeat renewal's extra values writing each lease's reported ``progress``,
    and their bind parameters.

    One ``CASE`` per column, on the owner (unique per claim); rows without new
    progress keep theirs. The construct depends only on how many leases
    reported, so it is built once per count and its compiled form is cached.
    Empty when no lease reported any.
    """
    if not progress:
        return {}, {}
    params: dict[str, Any] = {"p_powners": [key[1] for key in progress]}
    for i, (key, value) in enumerate(progress.items()):
        params[f"p_po{i}"] = key[1]
        params[f"p_pd{i}"] = value.done
        params[f"p_pt{i}"] = value.total
        params[f"p_pn{i}"] = value.note
    return _progress_template(len(progress)), params


@functools.lru_cache(maxsize=128)
def _progress_template(count: int) -> dict[str, Any]:
    """The ``CASE`` values of :func:`progress_values` for ``count`` reporting leases."""
    owners = [runs.c.lease_owner == bindparam(f"p_po{i}", type_=String) for i in range(count)]

    def per_owner(name: str, type_: Any, column: Any) -> Any:
        whens = [(owners[i], bindparam(f"p_p{name}{i}", type_=type_)) for i in range(count)]
        return case(*whens, else_=column)

    reported = runs.c.lease_owner.in_(bindparam("p_powners", expanding=True))
    return {
        "progress_done": per_owner("d", ProgressType, runs.c.progress_done),
        "progress_total": per_owner("t", ProgressType, runs.c.progress_total),
        "progress_note": per_owner("n", String(MAX_PROGRESS_NOTE), runs.c.progress_note),
        "progress_at": case((reported, db_now_ms()), else_=runs.c.progress_at),
    }


def guarded(run_id: Any, owner: Any, attempt: Any) -> Any:
    """The guard of every write by a lease holder: this id, owner and attempt, still running."""
    return and_(
        runs.c.id == run_id,
        runs.c.lease_owner == owner,
        runs.c.attempt == attempt,
        runs.c.status == RUNNING,
    )


def attempt_ceiling(max_attempts: Any) -> Any:
    """The attempt at which a run is out of attempts: the claimer's ``max_attempts``,
    or the row's own when larger (``celery lease rerun`` raises it, so that
    ``attempt``, the fencing token, never goes back)."""
    return case((runs.c.max_attempts > max_attempts, runs.c.max_attempts), else_=max_attempts)


def status_is(status: str) -> Any:
    """``status = '<status>'`` with the constant written into the SQL: shorter than a bound
    parameter with its cast (``%(status_1)s::VARCHAR(16)`` on older SQLAlchemy), which keeps
    the claim within psycopg's query cache (``claim_upsert``)."""
    return runs.c.status == literal_column(f"'{status}'", String)


def claimable(max_attempts: Any) -> Any:
    """A row a claim may take over: available and waiting, or running with an expired lease;
    attempts left and no cancel request."""
    now = db_now_ms()
    return and_(
        or_(
            and_(
                # Two equalities, not IN: an IN list is expanded on every execution.
                or_(status_is(QUEUED), status_is(RETRYING)),
                runs.c.available_at <= now,
            ),
            and_(status_is(RUNNING), runs.c.lease_expires_at <= now),
        ),
        runs.c.attempt < attempt_ceiling(max_attempts),
        runs.c.cancel_requested_at.is_(None),
    )


def takeover_values(
    owner: Any, lease_ms: Any, max_attempts: Any, values: dict[str, Any], now: Any = None
) -> dict[str, Any]:
    """The values a claim sets on a row it takes over: the next attempt, a fresh lease.

    ``now``: the database clock (default :class:`db_now_ms`; the upsert passes the clock
    reading of the row it proposed). A row still ``running`` (its lease expired) is a
    takeover: ``takeovers`` grows by one and ``taken_over_at`` is now. Those two come
    first: MySQL assigns ``SET`` left to right, each expression seeing the columns already
    assigned, so they must read ``status`` before it is set (the locked claim keeps this
    order, see ``LockedClaim``).
    """
    now = db_now_ms() if now is None else now
    expired = status_is(RUNNING)
    return {
        "takeovers": runs.c.takeovers
        + case((expired, literal_column("1")), else_=literal_column("0")),
        "taken_over_at": case((expired, now), else_=runs.c.taken_over_at),
        "status": RUNNING,
        "lease_owner": owner,
        # The claimer's delivery becomes the run's own: its id and message.
        "task_id": values["task_id"],
        "payload": values["payload"],
        "payload_content_type": values["payload_content_type"],
        "payload_retries": values["payload_retries"],
        "lease_ms": lease_ms,
        "lease_expires_at": now + lease_ms,
        "heartbeat_at": now,
        "attempt": runs.c.attempt + 1,
        "max_attempts": attempt_ceiling(max_attempts),
        # A delivery reached a worker: the sweeper's re-publishes are counted afresh.
        "requeues": 0,
        "started_at": func.coalesce(runs.c.started_at, now),
        "finished_at": None,
        "updated_at": now,
        "trace_context": continued_trace(values["trace_context"]),
    }


def not_stale(task_id: Any, retries_floor: Any) -> Any:
    """The delivery is no older copy of the run's own message: another task id, or at least
    as many Celery ``retries`` as the message the row keeps (``payload_retries``).

    ``retries_floor`` is the delivery's ``retries`` (:func:`stale_floor`). A delivery
    without a task id compares as another one (SQL's ``<>`` with NULL is not true, so its
    floor admits every row).
    """
    return or_(runs.c.task_id != task_id, runs.c.payload_retries <= retries_floor)


def stale_floor(values: dict[str, Any]) -> int:
    """What :func:`not_stale` compares ``payload_retries`` with: the delivery's ``retries``,
    or, for a delivery without a task id, a value every row is under."""
    return int(values["payload_retries"]) if values["task_id"] is not None else 2**31 - 1


def continued_trace(trace_context: Any) -> Any:
    """The ``trace_context`` a takeover writes: the claimer's ``traceparent``, a space,
    and the first ``traceparent`` the row held (the attempt taken over from).

    NULL when the claimer traces nothing. Bounded: two ``traceparent`` and a space.
    """
    new = (
        trace_context
        if isinstance(trace_context, ColumnElement)
        else literal(trace_context, String)
    )
    previous = func.coalesce(func.substr(runs.c.trace_context, 1, TRACEPARENT_LENGTH), "")
    return new + literal(" ", String) + previous


def insert_values(values: dict[str, Any], lease_ms: Any) -> dict[str, Any]:
    """The row a first claim inserts: ``values`` with a lease from the database's now."""
    now = db_now_ms()
    return {
        **values,
        "lease_expires_at": now + lease_ms,
        "heartbeat_at": now,
        "available_at": now,
        "started_at": now,
        "created_at": now,
        "updated_at": now,
    }


def not_paused(task_name: Any, key: Any) -> Any:
    """No pause holds ``task_name``: neither one of the whole task (``pause_key = ''``) nor
    one of concurrency ``key``. A subquery on the pauses table's primary key: while
    nothing is paused it reads an empty index."""
    return ~exists().where(
        pauses.c.task_name == task_name,
        or_(pauses.c.pause_key == "", pauses.c.pause_key == func.coalesce(key, "")),
    )


def insert_source(values: dict[str, Any], lease_ms: Any) -> tuple[list[str], Any]:
    """The columns and the ``SELECT`` a first claim inserts: :func:`insert_values`, only
    while the run's task (and key) is not paused (no row otherwise)."""
    row = insert_values(values, lease_ms)
    columns = [
        (value if hasattr(value, "label") else literal(value, runs.c[name].type)).label(name)
        for name, value in row.items()
    ]
    unpaused = not_paused(values["task_name"], values["concurrency_key"])
    return list(row), select(*columns).where(unpaused)


def reserve_rate(insert: InsertBuilder) -> Any:
    """GCRA with reservation, one upsert: the bucket's theoretical arrival time moves to
    ``max(tat, now) + p_period``; returns it and the database's now (epoch ms).

    Each delivery takes the next slot, so one told to wait holds its turn: it runs
    exactly when due, without asking again. Parameters ``p_task``, ``p_key``, ``p_period``.
    """
    period = bindparam("p_period", type_=Integer)
    now = db_now_ms()
    stmt = insert(rates).values(
        task_name=bindparam("p_task", type_=String),
        rate_key=bindparam("p_key", type_=String),
        tat=now + period,
    )
    return stmt.on_conflict_do_update(
        index_elements=[rates.c.task_name, rates.c.rate_key],
        set_={"tat": case((rates.c.tat > now, rates.c.tat), else_=now) + period},
    ).returning(rates.c.tat, now)


def claim_upsert(insert: InsertBuilder) -> Any:
    """``INSERT .. SELECT .. WHERE not paused ON CONFLICT DO UPDATE .. WHERE claimable and
    not paused RETURNING`` with bind parameters.

    Returns the new attempt, expiry, attempt ceiling, the run's checkpoint (kept by a
    takeover, NULL on an insert), trace context and generation; no row when the run was not
    claimable or its task (or concurrency key) is paused. Its parameters come from
    :func:`claim_params`.
    """
    lease_ms = bindparam("p_lease_ms", type_=Integer)
    max_attempts = bindparam("p_max_attempts", type_=Integer)
    values = {
        "id": bindparam("p_id", type_=String),
        "task_name": bindparam("p_task_name", type_=String),
        "status": RUNNING,
        "lease_owner": bindparam("p_owner", type_=String),
        "lease_ms": lease_ms,
        "attempt": 1,
        "max_attempts": max_attempts,
        "concurrency_key": bindparam("p_concurrency_key", type_=String),
        "task_id": bindparam("p_task_id", type_=String),
        "payload": bindparam("p_payload", type_=PayloadType),
        "payload_content_type": bindparam("p_payload_content_type", type_=String),
        "payload_retries": bindparam("p_payload_retries", type_=Integer),
        "trace_context": bindparam("p_trace_context", type_=String),
    }
    unpaused = not_paused(values["task_name"], values["concurrency_key"])
    upsert = insert(runs).from_select(*insert_source(values, lease_ms))
    # The proposed row's task id, and an untyped floor (no cast): a shorter statement.
    fresh = not_stale(upsert.excluded.task_id, bindparam("p_floor"))
    # The proposed row's clock reading is the takeover's now: the statement then stays
    # under psycopg's 4 KiB query cache (a longer one is parsed again on every claim,
    # about 0.1 ms of CPU each), whatever the clock's SQL.
    now = upsert.excluded.heartbeat_at
    # The proposed row's columns where they are shorter to name than their parameters.
    proposed = {name: upsert.excluded[name] for name in ("task_id", "payload_retries")}
    return upsert.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={
            **takeover_values(values["lease_owner"], lease_ms, max_attempts, values, now),
            **proposed,
        },
        where=and_(claimable(max_attempts), fresh, unpaused),
    ).returning(
        runs.c.attempt,
        runs.c.lease_expires_at,
        runs.c.max_attempts,
        runs.c.checkpoint,
        runs.c.trace_context,
        runs.c.generation,
    )


def claim_params(values: dict[str, Any], lease_ms: int, max_attempts: int) -> dict[str, Any]:
    """The bind parameters of :func:`claim_upsert` for the claim ``values``."""
    return {
        "p_id": values["id"],
        "p_task_name": values["task_name"],
        "p_owner": values["lease_owner"],
        "p_lease_ms": lease_ms,
        "p_max_attempts": max_attempts,
        "p_concurrency_key": values["concurrency_key"],
        "p_task_id": values["task_id"],
        "p_payload": values["payload"],
        "p_payload_content_type": values["payload_content_type"],
        "p_payload_retries": values["payload_retries"],
        "p_floor": stale_floor(values),
        "p_trace_context": values["trace_context"],
    }


def complete_by_binds() -> Any:
    """``UPDATE .. SET succeeded WHERE guarded`` with bind parameters ``p_id``, ``p_owner``,
    ``p_attempt``, and ``p_result``/``p_result_ct`` (the body's serialized return value, or
    NULL): the completion, compiled once per store."""
    return (
        update(runs)
        .where(guarded(bindparam("p_id"), bindparam("p_owner"), bindparam("p_attempt")))
        .values(
            **success_values(db_now_ms()),
            result=bindparam("p_result", None, type_=runs.c.result.type),
            result_content_type=bindparam(
                "p_result_ct", None, type_=runs.c.result_content_type.type
            ),
        )
    )


def checkpoint_by_binds() -> Any:
    """``UPDATE .. SET checkpoint WHERE guarded AND lease unexpired`` with bind parameters
    ``p_id``, ``p_owner``, ``p_attempt`` and ``p_checkpoint`` (JSON text): compiled once
    per store."""
    now = db_now_ms()
    return (
        update(runs)
        .where(
            guarded(bindparam("p_id"), bindparam("p_owner"), bindparam("p_attempt")),
            runs.c.lease_expires_at > now,
        )
        .values(checkpoint_values(now, bindparam("p_checkpoint", type_=runs.c.checkpoint.type)))
    )


def purgeable(status: str, older_than_ms: int) -> Any:
    """Rows of finished ``status`` that finished more than ``older_than_ms`` ago (DB clock)."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"only finished runs can be purged, not {status!r} ones")
    if older_than_ms < 0:
        raise ValueError(f"older_than_ms must be >= 0, got {older_than_ms}")
    # A scalar subquery, evaluated once: an index bound (clock_timestamp() is
    # volatile, so PostgreSQL would filter every row of the status instead).
    cutoff = select(db_now_ms() - older_than_ms).scalar_subquery()
    return and_(runs.c.status == status, runs.c.finished_at < cutoff)


#: The columns of a :class:`RunSummary`: never the stored message or the result.
SUMMARY_COLUMNS = tuple(runs.c[field.name] for field in dataclasses.fields(RunSummary))

#: One character above any a run id holds: a prefix's upper bound.
_PREFIX_TOP = "\uffff"


def run_page(query: RunPageQuery) -> Any:
    """The ``SELECT`` of one page of :class:`RunSummary` rows for ``query``.

    Newest first, each status an index range on ``(status, created_at, id)`` (or
    ``(task_name, status, created_at, id)`` with a task) from the keyset bound down,
    at most ``limit`` rows each, merged by one ``UNION ALL``: no sort of the table,
    no ``OFFSET``. With ``id_prefix``: a range of the primary key, in id order.
    """
    limit = max(0, query.limit)
    if query.id_prefix is not None:
        where = run_filter(query)
        if query.after_id is not None:
            where.append(runs.c.id > query.after_id)
        return select(*SUMMARY_COLUMNS).where(*where).order_by(runs.c.id).limit(limit)
    statuses = STATUSES if query.status is None else (query.status,)
    parts = []
    for status in statuses:
        where = _run_filters(query, status)
        if query.after_created is not None and query.after_id is not None:
            # `created_at <= c` bounds the index range; the rest breaks ties by id.
            where += [
                runs.c.created_at <= query.after_created,
                or_(runs.c.created_at < query.after_created, runs.c.id < query.after_id),
            ]
        part = (
            select(*SUMMARY_COLUMNS)
            .where(*where)
            .order_by(runs.c.created_at.desc(), runs.c.id.desc())
            .limit(limit)
        )
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    merged = union_all(*(select(part.subquery()) for part in parts)).subquery()
    return (
        select(*(merged.c[column.name] for column in SUMMARY_COLUMNS))
        .order_by(merged.c.created_at.desc(), merged.c.id.desc())
        .limit(limit)
    )


def run_filter(query: RunPageQuery) -> list[Any]:
    """The conditions of ``query``'s filters (its id prefix as an index range), without its
    keyset bound: the runs its pages list, all together."""
    where = _run_filters(query, query.status)
    if query.id_prefix is not None:
        prefix = query.id_prefix
        where += [
            runs.c.id >= prefix,
            runs.c.id < prefix + _PREFIX_TOP,
            # The range bounds the index scan; LIKE keeps only true prefixes (a
            # collation may order ids otherwise than code points).
            runs.c.id.startswith(prefix, autoescape=True),
        ]
    return where


def _run_filters(query: RunPageQuery, status: str | None) -> list[Any]:
    """The conditions of a page for one status (None: any)."""
    where: list[Any] = []
    if status is not None:
        where.append(runs.c.status == status)
    if query.task_name is not None:
        where.append(runs.c.task_name == query.task_name)
    if query.created_since is not None:
        where.append(runs.c.created_at >= query.created_since)
    if query.finished_since is not None:
        where.append(runs.c.finished_at >= query.finished_since)
    return where


def oldest_running() -> Any:
    """The ``SELECT`` of the running run that started first."""
    return (
        select(runs)
        .where(runs.c.status == RUNNING)
        .order_by(runs.c.started_at.is_(None), runs.c.started_at, runs.c.id)
        .limit(1)
    )


def lease_expired_since(since: Any) -> Any:
    """The ``SELECT count(*)`` of runs with ``failure_code = 'lease_expired'`` updated at or
    after ``since`` (a value or a scalar subquery: an index bound either way); only live
    rows and runs that failed since then can carry that code."""
    return select(func.count()).where(
        runs.c.failure_code == "lease_expired",
        or_(
            and_(runs.c.status.in_((QUEUED, RUNNING, RETRYING)), runs.c.updated_at >= since),
            and_(runs.c.status == FAILED, runs.c.finished_at >= since),
        ),
    )


#: The longest wait between two re-sends of a run nobody claims (an hour), unless the
#: first wait is longer.
STRANDED_SPACING_MAX_MS = 3_600_000


def stranded_wait(first_ms: int, doublings: int = 8) -> Any:
    """How long a run waits unclaimed before the sweeper sends it again: ``first_ms`` for the
    first re-send, twice as long for each one since (``requeues``), at most
    :data:`STRANDED_SPACING_MAX_MS` (or ``first_ms``, if longer).

    A message waiting behind a backlog is not multiplied there, and a run is not ended
    ``undeliverable`` while a busy worker has yet to reach it. A ``CASE`` on ``requeues``:
    portable, and it reads only the row.
    """
    cap = max(first_ms, STRANDED_SPACING_MAX_MS)
    steps = [(runs.c.requeues == k, min(first_ms * 2**k, cap)) for k in range(1, doublings)]
    return case((runs.c.requeues <= 0, first_ms), *steps, else_=min(first_ms * 2**doublings, cap))
