"""The values the store returns, and its shared constants."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ..schema import TERMINAL_STATUSES

#: What :meth:`~celery_lease.store.LeaseStore.cancel` returns for a task id that is not the
#: run's own delivery (a revoked duplicate): the run is left alone.
OTHER_DELIVERY = "another delivery's"

#: How many times one claim call re-runs after losing to a concurrent claim
#: (deadlock, serialization failure, duplicate insert) before reporting busy.
CLAIM_CONTENTION_TRIES = 8

ClaimOutcome = Literal["claimed", "busy", "finished", "paused", "stale"]

#: Rows one retention statement deletes at most: a short transaction on every dialect.
PURGE_BATCH = 1000

#: A succeeded run keeps no stored message: task arguments are often personal data. A
#: failed or cancelled one keeps it until retention deletes the row, so that
#: ``celery lease rerun`` can publish it again (docs/security.md says so).
_CLEARED_MESSAGE: dict[str, Any] = {"payload": None, "payload_content_type": None}
LeaseKey = tuple[str, str, int]

#: What success clears besides the stored message: the checkpoint (a finished run
#: resumes nothing; ``celery lease rerun --force`` of it starts from scratch).
_CLEARED_ON_SUCCESS: dict[str, Any] = {
    **_CLEARED_MESSAGE,
    "checkpoint": None,
    "checkpoint_at": None,
}


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a body reported with ``self.lease.progress()``: written by the next renewal."""

    done: float
    total: float | None = None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """What a claim attempt found.

    ``claimed``: this owner holds the lease, ``attempt`` is its fencing token.
    ``busy``: another live lease (or a backoff) blocks it; retry in ``retry_in`` s.
    ``finished``: the run is terminal (``status``); the body must not run.
    ``paused``: the run's task (or its concurrency key) is paused; ``reason`` is the pause's.
    ``stale``: the delivery is an older copy of the run's own message (same task id, fewer
    Celery ``retries`` than the message the row keeps); the body must not run.
    """

    outcome: ClaimOutcome
    run_id: str
    owner: str
    attempt: int
    status: str
    retry_in: float = 0.0
    reason: str = ""
    #: For ``finished``: the task id of the delivery that ran the run (None if unknown).
    task_id: str | None = None
    #: For ``finished``: the name of the task whose run it is (None if unknown).
    task_name: str | None = None
    #: For ``claimed``: the attempt at which the run is out of attempts (the row's
    #: ``max_attempts``: the claimer's setting, or more after ``celery lease rerun``).
    max_attempts: int = 0
    #: For ``claimed``: the run's latest checkpoint (JSON text), read by the claim
    #: statement itself; None on a fresh run.
    checkpoint: str | None = None
    #: For ``claimed``: the row's ``trace_context`` as the claim wrote it: the
    #: claimer's ``traceparent``, then that of the attempt it took over from (None
    #: when the claimer traces nothing).
    trace_context: str | None = None
    #: For ``claimed``: the run's generation, read by the claim statement itself (raised
    #: only by ``lease rerun --force`` of a succeeded run; part of its idempotency keys).
    generation: int = 0


@dataclasses.dataclass(frozen=True)
class HeartbeatResult:
    """Outcome of one heartbeat tick, as sets of ``(run_id, owner, attempt)``."""

    renewed: frozenset[LeaseKey]
    lost: frozenset[LeaseKey]
    cancel_requested: frozenset[LeaseKey]


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One row of ``celery_lease_runs``; times are epoch milliseconds (DB clock)."""

    id: str
    task_name: str
    status: str
    lease_owner: str | None
    lease_expires_at: int | None
    lease_ms: int
    heartbeat_at: int | None
    attempt: int
    max_attempts: int
    available_at: int
    cancel_requested_at: int | None
    started_at: int | None
    finished_at: int | None
    last_error: str | None
    failure_code: str | None
    concurrency_key: str | None
    task_id: str | None
    payload: bytes | None
    payload_content_type: str | None
    created_at: int
    updated_at: int
    #: The body's serialized return value (bounded; see ``schema.MAX_RESULT_BYTES``).
    result: bytes | None = None
    result_content_type: str | None = None
    #: Times the sweeper published the run since a worker last claimed it.
    requeues: int = 0
    #: Times a claim took the run over from an expired lease, in all, and the last time.
    takeovers: int = 0
    taken_over_at: int | None = None
    #: Times the sweeper published the run, in all (no claim resets it), and the last time.
    republishes: int = 0
    republished_at: int | None = None
    #: The latest checkpoint (JSON text) and when it was saved (DB clock).
    checkpoint: str | None = None
    checkpoint_at: int | None = None
    #: The body's last reported progress, and when a renewal wrote it (DB clock).
    progress_done: float | None = None
    progress_total: float | None = None
    progress_note: str | None = None
    progress_at: int | None = None
    #: The last claimer's W3C ``traceparent``, then that of the attempt it took
    #: over from (``celery-lease[otel]``); None when it traced nothing.
    trace_context: str | None = None
    #: Raised only by ``lease rerun --force`` of a succeeded run (idempotency keys).
    generation: int = 0
    #: Celery's ``retries`` of the stored message: a delivery under the run's task id
    #: with fewer is an older copy of it, refused by the claim.
    payload_retries: int = 0

    @property
    def terminal(self) -> bool:
        """True once the run is succeeded, failed or cancelled."""
        return self.status in TERMINAL_STATUSES


@dataclasses.dataclass(frozen=True)
class Activity:
    """What :meth:`RunReads.activity` counted; times are epoch ms (DB clock).

    ``counts``: live runs per status (queued, running, retrying).
    ``ended_recently``: runs that ended within the window, per terminal status.
    ``retried_recently``: runs that went ``retrying`` within the window and
    wait for their next claim (a retry claimed again already is running).
    ``running_retries``: running runs past their first attempt.
    ``expired_leases``: running runs whose lease has expired.
    """

    now: int
    window_ms: int
    counts: dict[str, int]
    ended_recently: dict[str, int]
    retried_recently: int
    running_retries: int
    expired_leases: int


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """A run as a list shows it: no stored message, result or error text; epoch ms."""

    id: str
    task_name: str
    status: str
    lease_owner: str | None
    lease_expires_at: int | None
    heartbeat_at: int | None
    attempt: int
    max_attempts: int
    cancel_requested_at: int | None
    started_at: int | None
    finished_at: int | None
    failure_code: str | None
    created_at: int
    updated_at: int
    progress_done: float | None = None
    progress_total: float | None = None
    #: The Celery task id of the delivery that claimed the run last (a bulk rerun links
    #: the new one to it).
    task_id: str | None = None

    @property
    def terminal(self) -> bool:
        """True once the run is succeeded, failed or cancelled."""
        return self.status in TERMINAL_STATUSES


@dataclasses.dataclass(frozen=True)
class RunPageQuery:
    """What :meth:`RunReads.page_runs` lists: filters and the keyset bound of a page.

    ``id_prefix`` lists the runs whose id (a keyed run's ``task:key``) starts with it,
    ordered by id, and pages by ``after_id`` alone; otherwise runs come newest first
    and a page starts after ``(after_created, after_id)``, the last row of the one
    before. ``created_since``: epoch ms (DB clock); older runs are left out.
    ``finished_since``: epoch ms (DB clock); only runs that finished then or later.
    """

    status: str | None = None
    task_name: str | None = None
    id_prefix: str | None = None
    created_since: int | None = None
    finished_since: int | None = None
    after_created: int | None = None
    after_id: str | None = None
    limit: int = 50


#: The failure codes of a run ended because its lease expired on its last attempt
#: (``lease_expired``) or its message was never claimed (``undeliverable``).
EXPIRED_ENDINGS = ("lease_expired", "undeliverable")


@dataclasses.dataclass(frozen=True)
class TaskCounts:
    """What :meth:`RunReads.task_counts` counted for one task (DB clock, one window).

    ``live``: runs per live status. ``ended_recently``: runs that finished within the
    window, per terminal status. ``expired_leases``: running runs whose lease has
    expired (awaiting takeover or the sweeper). Within the window: ``taken_over``, runs
    a claim took over from an expired lease; ``republished``, runs the sweeper
    published again (an expired lease, or a message never claimed); ``ended_expired``,
    runs that ended ``failed`` because their lease expired on the last attempt or
    their message was never claimed (:data:`EXPIRED_ENDINGS`). Each counts runs (a run
    taken over twice in the window counts once).
    """

    task_name: str
    live: dict[str, int]
    ended_recently: dict[str, int]
    expired_leases: int = 0
    taken_over: int = 0
    republished: int = 0
    ended_expired: int = 0


@dataclasses.dataclass(frozen=True)
class RateBucket:
    """One fleet-wide rate bucket (``celery_lease_rates``): a task, its rate key (``""``
    for none) and the theoretical arrival time of its next delivery, epoch ms (DB clock);
    ``now`` is the database clock when it was read."""

    task_name: str
    rate_key: str
    tat: int
    now: int


@dataclasses.dataclass(frozen=True)
class HeldRecord:
    """One delivery held back by flow control (``celery_lease_held``); times epoch ms.

    ``reason`` is ``paused`` or ``rate``; ``flow_key`` the concurrency key (paused)
    or rate key (rate), ``""`` for none. ``now`` is the database clock when it was taken.
    """

    seq: int
    reason: str
    task_name: str
    flow_key: str
    run_id: str
    task_id: str
    payload: bytes
    payload_content_type: str
    available_at: int
    created_at: int
    now: int


@dataclasses.dataclass(frozen=True)
class Pause:
    """One pause: a task, a concurrency key (``""``: every key), why, since when (epoch ms),
    and how many deliveries it holds back now."""

    task_name: str
    key: str
    reason: str | None
    paused_at: int
    waiting: int


@dataclasses.dataclass(frozen=True)
class FlowCounts:
    """Deliveries held back now, per ``(task name, key)``: ``paused`` and ``deferred``
    (waiting for their turn under a rate limit); ``now`` is the database clock."""

    now: int
    paused: dict[tuple[str, str], int]
    deferred: dict[tuple[str, str], int]


@dataclasses.dataclass(frozen=True)
class FollowupMessage:
    """One follow-up task to record in a fenced transaction: its derived task id, its
    task name and its signature, serialized (``payload``, ``payload_content_type``)."""

    task_id: str
    task_name: str
    payload: bytes
    payload_content_type: str


@dataclasses.dataclass(frozen=True)
class OutboxRecord:
    """One follow-up taken from ``celery_lease_outbox`` to publish; times epoch ms
    (DB clock)."""

    task_id: str
    run_id: str
    task_name: str
    payload: bytes
    payload_content_type: str
    created_at: int
