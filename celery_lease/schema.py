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
#: Longest progress note, in characters.
MAX_PROGRESS_NOTE = 200

#: A checkpoint's type (JSON text): MySQL's plain ``TEXT`` stops at 64 KiB of bytes.
CheckpointType = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
#: Progress counts: double precision everywhere (MySQL's ``FLOAT`` is single).
ProgressType = Float().with_variant(mysql.DOUBLE(), "mysql", "mariadb")

metadata = MetaData()

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
    # The body's return value, serialized (at most MAX_RESULT_BYTES): the run's
    # outcome for Celery's result backend when Celery's own record is missing.
    Column("result", PayloadType, nullable=True),
    Column("result_content_type", String(64), nullable=True),
    # Times the sweeper published the run since a worker last claimed it.
    Column("requeues", Integer, nullable=False, server_default=text("0")),
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
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Index("ix_celery_lease_runs_status_expires", "status", "lease_expires_at"),
    Index("ix_celery_lease_runs_concurrency", "concurrency_key", "status"),
    # Retention: the sweeper and `lease purge` delete one status's oldest
    # finished rows in index order, never scanning the table.
    Index("ix_celery_lease_runs_status_finished", "status", "finished_at"),
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


#: Why a delivery is held in ``celery_lease_held``: its task (or key) is paused, or it
#: waits for its turn under ``lease_rate_limit``.
HELD_PAUSED = "paused"
HELD_RATE = "rate"

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


class db_now_ms(FunctionElement[int]):
    """The database server's clock in epoch milliseconds, as a SQL expression.

    Each database's class in :mod:`celery_lease.store.databases` gives its SQL
    (``clock_sql``) and compiles it for its dialect names. There is deliberately no
    default compilation, so an unsupported database fails loudly at compile time.
    """

    type = BigInteger()
    inherit_cache = True


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
    return run_id


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
    whose encoding is at most :data:`MAX_CHECKPOINT_BYTES`. The text is ASCII
    (other characters escaped), so any column character set holds it.
    """
    try:
        text = json.dumps(state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LeaseInputError("checkpoint", f"must be a JSON value: {exc}") from None
    size = len(text)
    if size > MAX_CHECKPOINT_BYTES:
        raise LeaseInputError(
            "checkpoint",
            f"its compact JSON is {size} bytes; at most {MAX_CHECKPOINT_BYTES} are stored "
            "(checkpoint a cursor or an offset, not the data)",
        )
    return text


def check_progress(
    done: object, total: object, note: object
) -> tuple[float, float | None, str | None]:
    """``progress()``'s values as stored, or :class:`LeaseInputError`.

    ``done`` and ``total`` are finite real numbers (``total`` may be None); ``note`` a
    string of at most :data:`MAX_PROGRESS_NOTE` characters, or None.
    """
    values: list[float | None] = []
    for field, value, optional in (("progress_done", done, False), ("progress_total", total, True)):
        if value is None and optional:
            values.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise LeaseInputError(field, f"must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise LeaseInputError(field, f"must be finite, got {value!r}")
        values.append(float(value))
    if note is not None:
        if not isinstance(note, str):
            raise LeaseInputError("progress_note", f"must be a string, got {type(note).__name__}")
        if len(note) > MAX_PROGRESS_NOTE:
            raise LeaseInputError(
                "progress_note",
                f"is {len(note)} characters long; at most {MAX_PROGRESS_NOTE} are stored",
            )
    return float(done), values[1], note  # type: ignore[arg-type]
