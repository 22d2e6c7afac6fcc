"""What an operator does to a run: cancel it, run it again.

``celery lease cancel``/``rerun`` and the web view's buttons call these functions,
so a run is changed the same way whichever surface the operator uses. Each
returns an :class:`ActionResult` whose ``message`` says what happened, or raises
:class:`~celery_lease.errors.ActionFailed` with the one line to show.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from celery import Celery

from .config import LeaseConfig
from .errors import ActionFailed, RunNotFound, RunNotRerunnable
from .requeue import requeue, rerun_headers
from .run.outcome import record_outcome
from .run.runids import fit_run_id
from .run.task import LeasedTask
from .sanitize import describe_exception
from .schema import CANCELLED, QUEUED, RETRYING, RUNNING, SUCCEEDED
from .store import LeaseStore


@dataclasses.dataclass(frozen=True)
class ActionResult:
    """What an action did: the run, the status it has now, and the sentence to show."""

    run_id: str
    status: str
    message: str


def cancel_run(app: Celery, store: LeaseStore, run_id: str) -> ActionResult:
    """Cancel a run: queued/retrying end ``cancelled`` at once (the caller holding its task
    id sees ``REVOKED``); a running run gets a cancel request its worker sees within one
    heartbeat.

    Raises:
        RunNotFound: no run has this id.
        ActionFailed: the run has ended already.
    """
    status = store.cancel(run_id)
    if status == CANCELLED:
        # The caller holding its task id sees REVOKED (a chord counts it, as Celery's revoke).
        record_outcome(app, store.get(run_id))
        return ActionResult(run_id, status, f"run {run_id} is cancelled")
    if status == RUNNING:
        return ActionResult(
            run_id,
            status,
            f"run {run_id} is running: cancel requested; its worker stops it within one "
            "heartbeat and it ends cancelled (or, if that worker is gone, at the next sweep)",
        )
    raise ActionFailed(run_id, f"run {run_id} already {status}: nothing to cancel")


def rerun_run(
    app: Celery,
    store: LeaseStore,
    run_id: str,
    *,
    force: bool = False,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    attempts: int | None = None,
    from_scratch: bool = False,
) -> ActionResult:
    """Run a failed or cancelled run (a succeeded one with ``force``) again: back to
    ``queued`` with fresh attempts, published from its stored message under a new task id,
    or with ``args``/``kwargs`` when given. The run's checkpoint is kept (the body
    resumes from it) unless ``from_scratch``.

    Raises:
        RunNotFound: no run has this id.
        ActionFailed: the run is live, succeeded without ``force``, the arguments do not
            give this run, or the broker refused the message (the run is queued then).
    """
    record = store.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    refuse_rerun(run_id, record.status, force)
    task = app.tasks.get(record.task_name)
    leased = isinstance(task, LeasedTask)
    publish = args is not None or kwargs is not None
    task_id = record.task_id or record.id
    if publish:
        if not leased:
            raise ActionFailed(
                run_id,
                f"task {record.task_name!r} is not a LeasedTask of this app (-A): cannot "
                "publish it with --args/--kwargs",
            )
        expected = _rerun_run_id(task, run_id, args or [], kwargs or {})
        if expected != run_id:
            raise ActionFailed(
                run_id,
                f"these arguments make run {expected!r}, not {run_id!r}: the task's "
                "lease_key must give the run's own key",
            )
    if attempts is None:
        config = task.lease_config() if leased else LeaseConfig.from_app(app)
        attempts = config.max_attempts
    # A new task id, linked to the old one by a header: Celery's revoke list may hold
    # the old one (a revoked or expired run), and would cancel the rerun at once.
    new_task_id = str(uuid.uuid4()) if publish or record.payload is not None else None
    try:
        after = store.rerun(
            run_id,
            attempts=attempts,
            force=force,
            task_id=new_task_id,
            from_scratch=from_scratch,
        )
    except RunNotRerunnable as exc:  # it changed between the read and the update
        refuse_rerun(run_id, exc.status, force)
        raise
    tries = f"attempts {after.attempt + 1}..{after.max_attempts}"
    if after.checkpoint is not None:
        tries += ", resuming from its checkpoint"
    elif from_scratch:
        tries += ", from scratch"
    try:
        if publish:
            headers = rerun_headers(run_id, task_id, None)
            task.apply_async(args or [], kwargs or {}, task_id=new_task_id, headers=headers)
        elif after.payload is not None:
            requeue(app, after, rerun_of=task_id)
    except Exception as exc:
        raise ActionFailed(
            run_id,
            f"run {run_id} is queued again ({tries}) but could not be published "
            f"({describe_exception(exc)}): run `lease rerun` again once the broker is back "
            f"(after `lease cancel {run_id}`), or `lease cancel {run_id}` to undo",
        ) from None
    if publish:
        message = (
            f"run {run_id} is queued again ({tries}) and published as task {new_task_id} "
            f"(following {task_id}) with the given arguments"
        )
    elif after.payload is not None:
        message = (
            f"run {run_id} is queued again ({tries}) and published from its stored message "
            f"as task {new_task_id} (following {task_id})"
        )
    else:
        how = (
            f"send {record.task_name} again with arguments that give this run's lease_key"
            if leased and task.lease_config().key is not None
            else f"send {record.task_name} again with task_id={task_id!r}"
        )
        message = (
            f"run {run_id} is queued again ({tries}), but it has no stored message "
            f"(a succeeded run keeps no task arguments), so nothing was published: {how}, or use "
            f"`lease rerun` with --args/--kwargs next time (`lease cancel {run_id}` undoes this)"
        )
    return ActionResult(run_id, after.status, message)


def refuse_rerun(run_id: str, status: str, force: bool) -> None:
    """Raise :class:`ActionFailed` if a rerun of a run in ``status`` is refused."""
    if status in (QUEUED, RUNNING, RETRYING):
        raise ActionFailed(
            run_id,
            f"run {run_id} is {status}: it is live, nothing to rerun "
            f"(`lease cancel {run_id}` first if it must start over)",
        )
    if status == SUCCEEDED and not force:
        raise ActionFailed(run_id, f"run {run_id} succeeded: pass --force to run it again")


def _rerun_run_id(task: Any, run_id: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The run id a rerun of ``run_id`` with these arguments claims: ``run_id`` itself for
    a task without ``lease_key`` (the rerun's header names it), else the key's."""
    if task.lease_config().key is None:
        return run_id  # the rerun's header names it: any arguments give this run
    try:
        return str(fit_run_id(task.lease_run_id(*args, **kwargs)))
    except TypeError as exc:
        raise ActionFailed(run_id, f"the arguments do not fit {task.name}: {exc}") from None
