"""Table definition and the database clock.

Times are stored as **epoch milliseconds** (``BIGINT``), computed by the
database server inside each statement with :class:`db_now_ms`. Integers compare
the same way on every dialect and keep millisecond resolution on SQLite, whose
``CURRENT_TIMESTAMP`` has only one-second resolution.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.sql.expression import FunctionElement

from .errors import LeaseInputError

QUEUED = "queued"
RUNNING = "running"
RETRYING = "retrying"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

STATUSES = (QUEUED, RUNNING, RETRYING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL_STATUSES = frozenset({SUCCEEDED, FAILED, CANCELLED})

TABLE_NAME = "celery_lease_runs"

#: Longest run id (and task name, owner, concurrency key) the columns hold.
MAX_ID_LENGTH = 255
#: Largest ``lease_ms`` the 32-bit column holds (about 24.8 days).
MAX_LEASE_MS = 2**31 - 1
#: Largest stored message, in bytes. Every dialect's column holds more (MySQL
#: gets ``LONGBLOB``); the bound keeps one claim below MySQL's default
#: ``max_allowed_packet`` (16 MiB on MariaDB), whose breach looks like a disconnect.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024

#: Bound of ``trace_context``: an attempt's W3C ``traceparent`` (55 characters), a
#: space, and the ``traceparent`` of the attempt it took the run over from.
TRACE_CONTEXT_LENGTH = 512
#: Length of a W3C ``traceparent`` (version 00): the most kept of each attempt.
TRACEPARENT_LENGTH = 55

#: The stored message's type: MySQL's plain ``BLOB`` stops at 64 KiB.
PayloadType = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")

#: Largest checkpoint, in bytes of its compact JSON encoding (ASCII, other characters escaped).
MAX_CHECKPOINT_BYTES = 64 * 1024
#: Deepest nesting of a checkpoint's lists and objects (decoding stays far from
#: Python's recursion limit on every next attempt).
MAX_CHECKPOINT_DEPTH = 100
#: Longest progress note, in characters.
MAX_PROGRESS_NOTE = 200

#: A checkpoint's type (JSON text): MySQL's plain ``TEXT`` stops at 64 KiB of bytes.
CheckpointType = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
#: Progress counts: double precision everywhere (MySQL's ``FLOAT`` is single).
ProgressType = Float().with_variant(mysql.DOUBLE(), "mysql", "mariadb")

metadata = MetaData()

#: The rows the concurrency index holds (where partial indexes exist): runs with a key.
CONCURRENCY_INDEX_WHERE = "concurrency_key IS NOT NULL"
#: The rows the ``(status, finished_at)`` index holds: runs that ended (every query on it
#: bounds ``finished_at``).
FINISHED_INDEX_WHERE = "finished_at IS NOT NULL"


def partial(where: str | None) -> dict[str, Any]:
    """``Index`` / ``create_index`` keyword arguments for an index over the rows ``where``
    (SQL) holds for, on the databases that have partial indexes (PostgreSQL, SQLite;
    MySQL and MariaDB index every row)."""
    if where is None:
        return {}
    return {"postgresql_where": text(where), "sqlite_where": text(where)}


runs = Table(
    TABLE_NAME,
    metadata,
    Column("id", String(255), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("status", String(16), nullable=False),
    Column("lease_owner", String(255), nullable=True),
    Column("lease_expires_at", BigInteger, nullable=True),
    Column("lease_ms", Integer, nullable=False),
    Column("heartbeat_at", BigInteger, nullable=True),
    Column("attempt", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("available_at", BigInteger, nullable=False),
    Column("cancel_requested_at", BigInteger, nullable=True),
    Column("started_at", BigInteger, nullable=True),
    Column("finished_at", BigInteger, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("failure_code", String(64), nullable=True),
    Column("concurrency_key", String(255), nullable=True),
    # The Celery task id of the delivery that claimed the run last: the id whose
    # result the run's body records. Deliveries under other ids are duplicates.
    Column("task_id", String(255), nullable=True),
    Column("payload", PayloadType, nullable=True),
    Column("payload_content_type", String(64), nullable=True),
    # Celery's ``retries`` of that message. A delivery under the same task id with fewer
    # retries is an older copy of the run's message (e.g. the original of a retry,
    # redelivered because its ack failed): the claim refuses it as stale.
    Column("payload_retries", Integer, nullable=False, server_default=text("0")),
    # The body's return value, serialized (at most MAX_RESULT_BYTES): the run's
    # outcome for Celery's result backend when Celery's own record is missing.
    Column("result", PayloadType, nullable=True),
    Column("result_content_type", String(64), nullable=True),
    # Times the sweeper published the run since a worker last claimed it.
    Column("requeues", Integer, nullable=False, server_default=text("0")),
    # The run's recovery history, never reset (not by a claim, not by a rerun): how many
    # times a claim took it over from an expired lease, and the sweeper published it
    # (expired lease or lost message), each with the last time (DB clock). Written by
    # the claim's and the sweep's own statements; the web view counts them.
    Column("takeovers", Integer, nullable=False, server_default=text("0")),
    Column("taken_over_at", BigInteger, nullable=True),
    Column("republishes", Integer, nullable=False, server_default=text("0")),
    Column("republished_at", BigInteger, nullable=True),
    # The latest checkpoint (JSON text) a holder of the run saved, and when (DB
    # clock); carried to every next attempt, cleared when the run succeeds.
    Column("checkpoint", CheckpointType, nullable=True),
    Column("checkpoint_at", BigInteger, nullable=True),
    # The body's last reported progress, written by a heartbeat renewal.
    Column("progress_done", ProgressType, nullable=True),
    Column("progress_total", ProgressType, nullable=True),
    Column("progress_note", String(MAX_PROGRESS_NOTE), nullable=True),
    Column("progress_at", BigInteger, nullable=True),
    # The claiming attempt's W3C traceparent, then the one of the attempt it took
    # over from (celery-lease[otel]); NULL when the claimer traced nothing.
    Column("trace_context", String(TRACE_CONTEXT_LENGTH), nullable=True),
    # Raised by one only when `lease rerun --force` puts a succeeded run back: part of
    # every idempotency key (`Lease.idempotency_key`), so a forced rerun charges anew.
    Column("generation", Integer, nullable=False, server_default=text("0")),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Index("ix_celery_lease_runs_status_expires", "status", "lease_expires_at"),
    # Partial where the database has them (PostgreSQL, SQLite): a run without a key
    # (the common case) never enters it, and a running one has no finish time, so
    # neither costs a claim or a completion an index entry it never reads.
    Index(
        "ix_celery_lease_runs_concurrency",
        "concurrency_key",
        "status",
        **partial(CONCURRENCY_INDEX_WHERE),
    ),
    # Retention: the sweeper and `lease purge` delete one status's oldest
    # finished rows in index order, never scanning the table.
    Index(
        "ix_celery_lease_runs_status_finished",
        "status",
        "finished_at",
        **partial(FINISHED_INDEX_WHERE),
    ),
    # The web view's pages: newest first per status, and per task and status, read in
    # index order with keyset bounds (never OFFSET, never a sort of the table).
    Index("ix_celery_lease_runs_status_created", "status", "created_at", "id"),
    Index("ix_celery_lease_runs_task_created", "task_name", "status", "created_at", "id"),
)

#: Largest stored result, in bytes: a bigger one is not kept (the result backend
#: still gets it from the worker; a replay from the row then cannot).
MAX_RESULT_BYTES = 64 * 1024

SWEEPS_TABLE_NAME = "celery_lease_sweeps"

#: One row per sweeper name: when it last swept this database, and what it did.
sweeps = Table(
    SWEEPS_TABLE_NAME,
    metadata,
    Column("name", String(64), primary_key=True),
    Column("swept_at", BigInteger, nullable=False),
    Column("took_ms", Integer, nullable=False),
    Column("sweeper", String(255), nullable=False),
    Column("requeued", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("cancelled", Integer, nullable=False),
    Column("purged", Integer, nullable=False),
    Column("errors", Integer, nullable=False),
)


#: One row per leader lease: ``sweeper`` (the in-worker sweeper of this database) and
#: ``beat:<app>`` (the :class:`~celery_lease.beat.LeaseScheduler` that sends). ``owner``
#: is unguessable and new at every acquisition; ``term`` grows by one at each. A leader
#: fences its writes on ``(owner, term)`` and an unexpired ``expires_at`` (DB clock).
#: A handful of rows, one per name: nothing to retain.
leaders = Table(
    "celery_lease_leaders",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("owner", String(255), nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("acquired_at", BigInteger, nullable=False),
    Column("renewed_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
)

#: A ``LeaseScheduler``'s schedule: per scheduler (``beat:<app>``) and entry, the due
#: time of the last tick sent (epoch ms) and how many were sent. Rows of entries no
#: longer in the leader's ``beat_schedule`` are deleted when a beat takes the lead.
schedule = Table(
    "celery_lease_schedule",
    metadata,
    Column("scheduler", String(128), primary_key=True),
    Column("entry", String(255), primary_key=True),
    Column("last_run_at", BigInteger, nullable=False),
    Column("total_run_count", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
)

#: Why a delivery is held in ``celery_lease_held``: its task (or key) is paused, or it
#: waits for its turn under ``lease_rate_limit``.
HELD_PAUSED = "paused"
HELD_RATE = "rate"
#: Not a delivery: the rate slot a deferred delivery was sent for, bound to its task id
#: and taken by that delivery's claim once (its message names the row's ``seq``).
HELD_SLOT = "slot"

#: One row per pause: a task name, and a concurrency key or ``""`` for every key.
pauses = Table(
    "celery_lease_pauses",
    metadata,
    Column("task_name", String(255), primary_key=True),
    Column("pause_key", String(255), primary_key=True),
    Column("reason", Text, nullable=True),
    Column("paused_at", BigInteger, nullable=False),
)

#: The fleet-wide rate limits' state (GCRA): per task and rate key (``""`` for none),
#: the theoretical arrival time of the next delivery, epoch ms (DB clock).
rates = Table(
    "celery_lease_rates",
    metadata,
    Column("task_name", String(255), primary_key=True),
    Column("rate_key", String(255), primary_key=True),
    Column("tat", BigInteger, nullable=False),
)

#: Deliveries held back by flow control, with their message: paused ones (published
#: again on resume, in ``seq`` order) and rate-limited ones (published when due).
held = Table(
    "celery_lease_held",
    metadata,
    Column(
        "seq",
        BigInteger().with_variant(Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("reason", String(16), nullable=False),
    Column("task_name", String(255), nullable=False),
    Column("flow_key", String(255), nullable=False),
    Column("run_id", String(255), nullable=False),
    Column("task_id", String(255), nullable=False),
    Column("payload", PayloadType, nullable=False),
    Column("payload_content_type", String(64), nullable=False),
    Column("available_at", BigInteger, nullable=False),
    # Set by whoever publishes the row; another may take it over once it is stale.
    Column("taken_at", BigInteger, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Index("ix_celery_lease_held_reason_available", "reason", "available_at"),
    Index("ix_celery_lease_held_task", "task_name", "flow_key", "seq"),
)


#: Most follow-up tasks one call hands to a fenced transaction.
MAX_FOLLOWUPS = 100
#: Largest follow-up message, in bytes of the serialized signature.
MAX_FOLLOWUP_BYTES = 64 * 1024

#: Follow-up tasks recorded in a fenced transaction (``fence(conn, send=...)``), one row
#: each, published after that transaction commits and deleted once published.
outbox = Table(
    "celery_lease_outbox",
    metadata,
    # The follow-up's Celery task id, derived from the run (celery_lease.lease.keys).
    Column("task_id", String(255), primary_key=True),
    Column("run_id", String(255), nullable=False),
    Column("task_name", String(255), nullable=False),
    # The signature (task, args, kwargs, options) in the app's task serializer.
    Column("payload", PayloadType, nullable=False),
    Column("payload_content_type", String(64), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    # Set by whoever publishes the row; another may take it over once it is stale.
    Column("taken_at", BigInteger, nullable=True),
    Index("ix_celery_lease_outbox_created", "created_at"),
)


class db_now_ms(FunctionElement[int]):
    """The database server's clock in epoch milliseconds, as a SQL expression.

    Each database's class in :mod:`celery_lease.store.databases` gives its SQL
    (``clock_sql``) and compiles it for its dialect names. There is deliberately no
    default compilation, so an unsupported database fails loudly at compile time.
    """

    type = BigInteger()
    inherit_cache = True


def gaps_text(gaps: list[str], shown: int = 3) -> str:
    """The first ``shown`` schema gaps (``LeaseStore.schema_gaps``), and how many more."""
    more = len(gaps) - shown
    return ", ".join(gaps[:shown]) + (f" and {more} more" if more > 0 else "")


def check_run_id(run_id: object, field: str = "run_id") -> str:
    """``run_id`` if the ``id`` column can hold it, else :class:`LeaseInputError`.

    Call it on the final run id (after any scoping of ``lease_key``) so a bad
    key is a clear error at call time, before any SQL runs.
    """
    if not isinstance(run_id, str) or not run_id:
        raise LeaseInputError(field, f"must be a non-empty string, got {type(run_id).__name__}")
    if len(run_id) > MAX_ID_LENGTH:
        raise LeaseInputError(
            field, f"is {len(run_id)} characters long; at most {MAX_ID_LENGTH} fit the column"
        )
    # The same refusal on every database: PostgreSQL refuses a NUL, none stores a lone
    # surrogate (SQLite kept a NUL, the drivers raised UnicodeEncodeError on a surrogate).
    _check_text(field, run_id, MAX_ID_LENGTH)
    return run_id


def check_retries(value: object) -> int:
    """Celery's ``retries`` of a message as the ``payload_retries`` column holds it, else
    :class:`LeaseInputError` (a forged or foreign message: not an integer, or outside
    0 to 2**31 - 1)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LEASE_MS:
        raise LeaseInputError(
            "retries",
            f"the message's retries must be an integer from 0 to {MAX_LEASE_MS}, got {value!r:.40}",
        )
    return value


def check_claim_inputs(
    *,
    run_id: str,
    task_name: str,
    owner: str,
    lease_ms: int,
    max_attempts: int,
    concurrency_key: str | None,
    payload: bytes | None,
    task_id: str | None = None,
    trace_context: str | None = None,
) -> None:
    """Raise :class:`LeaseInputError` for any claim value its column cannot hold."""
    check_run_id(run_id)
    check_run_id(task_name, "task_name")
    check_run_id(owner, "owner")
    if concurrency_key is not None:
        check_run_id(concurrency_key, "concurrency_key")
    if task_id is not None:
        check_run_id(task_id, "task_id")
    if trace_context is not None and len(trace_context) > TRACEPARENT_LENGTH:
        raise LeaseInputError(
            "trace_context", f"a traceparent has at most {TRACEPARENT_LENGTH} characters"
        )
    if not 1 <= lease_ms <= MAX_LEASE_MS:
        raise LeaseInputError("lease_ms", f"{lease_ms} is outside 1..{MAX_LEASE_MS}")
    if not 1 <= max_attempts <= MAX_LEASE_MS:
        raise LeaseInputError("max_attempts", f"{max_attempts} is outside 1..{MAX_LEASE_MS}")
    if payload is not None and len(payload) > MAX_PAYLOAD_BYTES:
        raise LeaseInputError(
            "payload",
            f"the task's serialized arguments are {len(payload)} bytes; at most "
            f"{MAX_PAYLOAD_BYTES} are stored (pass a reference, not the data)",
        )


def encode_checkpoint(state: Any) -> str:
    """``state`` as compact JSON text, or :class:`LeaseInputError` (before any SQL runs).

    A JSON value (dict, list, str, int, float, bool, None; no NaN or infinity)
    nested at most :data:`MAX_CHECKPOINT_DEPTH` deep, whose strings (and keys) are
    text (no lone surrogate; a NUL is escaped) and whose encoding is at most
    :data:`MAX_CHECKPOINT_BYTES`. The text is ASCII (other characters escaped), so
    any column character set holds it, and every next attempt decodes it.
    """
    check_checkpoint_value(state)
    try:
        text = json.dumps(state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError, OverflowError) as exc:
        raise LeaseInputError("checkpoint", f"must be a JSON value: {exc}") from None
    size = len(text)
    if size > MAX_CHECKPOINT_BYTES:
        raise LeaseInputError(
            "checkpoint",
            f"its compact JSON is {size} bytes; at most {MAX_CHECKPOINT_BYTES} are stored "
            "(checkpoint a cursor or an offset, not the data)",
        )
    return text


def check_checkpoint_value(state: Any) -> None:
    """Walk ``state`` without recursion: :class:`LeaseInputError` for a value nested
    deeper than :data:`MAX_CHECKPOINT_DEPTH`, a lone surrogate in a string, or a
    string alone longer than the whole checkpoint may be (checked before encoding)."""
    stack: list[tuple[Any, int]] = [(state, 1)]
    # A lower bound of the JSON's size, summed as the walk goes: each value takes a byte at
    # least, a string its length. Past the limit it cannot fit, however many times a list
    # or a string is shared ([big] * 60000 would otherwise be walked 60000 times).
    least = 0
    while stack:
        value, depth = stack.pop()
        least += 1 + (len(value) if isinstance(value, str) else 0)
        if least > MAX_CHECKPOINT_BYTES:
            raise LeaseInputError(
                "checkpoint",
                f"its compact JSON is over {MAX_CHECKPOINT_BYTES} bytes "
                "(checkpoint a cursor or an offset, not the data)",
            )
        if isinstance(value, str):
            # A NUL is fine here: the JSON text escapes it (as ``\u0000``).
            _check_text("checkpoint", value, MAX_CHECKPOINT_BYTES, nul=True)
        elif isinstance(value, (dict, list, tuple)):
            if depth > MAX_CHECKPOINT_DEPTH:
                raise LeaseInputError(
                    "checkpoint",
                    f"is nested more than {MAX_CHECKPOINT_DEPTH} deep "
                    "(checkpoint a cursor or an offset, not a tree)",
                )
            if len(value) > MAX_CHECKPOINT_BYTES:
                raise LeaseInputError(
                    "checkpoint",
                    f"holds a container of {len(value)} items; its JSON cannot fit "
                    f"{MAX_CHECKPOINT_BYTES} bytes",
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    stack.append((key, depth + 1))
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)


def _check_text(field: str, text: str, longest: int, *, nul: bool = False) -> None:
    """:class:`LeaseInputError` unless ``text`` is at most ``longest`` characters of text
    every supported database stores as given: no NUL (PostgreSQL refuses it; allowed
    with ``nul``), no lone surrogate (no encoding holds it)."""
    if len(text) > longest:
        raise LeaseInputError(
            field, f"is {len(text)} characters long; at most {longest} are stored"
        )
    if not nul and "\x00" in text:
        raise LeaseInputError(field, "contains a NUL character, which databases do not store")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LeaseInputError(
            field,
            f"contains a lone surrogate at position {exc.start} ({text[exc.start]!a}), "
            "which no database encoding stores",
        ) from None


def check_progress(
    done: object, total: object, note: object
) -> tuple[float, float | None, str | None]:
    """``progress()``'s values as stored, or :class:`LeaseInputError`.

    ``done`` and ``total`` are finite real numbers a double holds (``total`` may be
    None); ``note`` a string of at most :data:`MAX_PROGRESS_NOTE` characters with no
    NUL and no lone surrogate, or None.
    """
    values: list[float | None] = []
    for field, value, optional in (("progress_done", done, False), ("progress_total", total, True)):
        if value is None and optional:
            values.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise LeaseInputError(field, f"must be a number, got {type(value).__name__}")
        try:
            number = float(value)
        except (OverflowError, ValueError):
            raise LeaseInputError(
                field, f"must be finite: this {type(value).__name__} is too large for a double"
            ) from None
        if not math.isfinite(number):
            raise LeaseInputError(field, f"must be finite, got {number!r}")
        values.append(number)
    if note is not None:
        if not isinstance(note, str):
            raise LeaseInputError("progress_note", f"must be a string, got {type(note).__name__}")
        _check_text("progress_note", note, MAX_PROGRESS_NOTE)
    return values[0], values[1], note  # type: ignore[return-value]
