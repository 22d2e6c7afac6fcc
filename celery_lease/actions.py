"""What an operator does: cancel a run, run it again, rerun many, pause or resume a task.

``celery lease cancel``/``rerun``/``pause``/``resume`` and the web view's buttons call
these functions, so a run is changed the same way whichever surface the operator
uses. Each returns a result whose ``message`` says what happened, or raises
:class:`~celery_lease.errors.ActionFailed` with the one line to show.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from . import flow
from .config import LeaseConfig
from .display import format_duration
from .errors import ActionFailed, RunNotFound, RunNotRerunnable
from .events import Event
from .requeue import requeue, rerun_headers
from .run.outcome import record_outcome
from .run.runids import fit_run_id
from .run.task import LeasedTask
from .runtime import app_runtime
from .sanitize import describe_exception
from .schema import CANCELLED, FAILED, QUEUED, RETRYING, RUNNING, SUCCEEDED
from .store import LeaseStore, RunPageQuery


@dataclasses.dataclass(frozen=True)
class ActionResult:
    """What an action did: the run (``""`` for an action on a task), the status it has
    now, and the sentence to show."""

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
            "heartbeat and it ends cancelled (or, if that worker is gone, at the next sweep), "
            "unless its body completes first",
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
    config = task.lease_config() if leased else LeaseConfig.from_app(app)
    if attempts is None:
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
    # A claim allows attempts up to the greater of the row's and the task's maximum.
    last = max(after.max_attempts, config.max_attempts)
    tries = f"attempts {after.attempt + 1}..{last}"
    if last > after.max_attempts:
        tries += f": the task's lease_max_attempts, {config.max_attempts}, is the least it gets"
    if after.checkpoint is not None:
        tries += ", resuming from its checkpoint"
    elif from_scratch:
        tries += ", from scratch"
    try:
        if publish and new_task_id is not None:
            headers = rerun_headers(run_id, task_id, new_task_id, None)
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


# -- many runs -------------------------------------------------------------------------

#: Runs one bulk step reruns: one guarded ``UPDATE`` and one read, then their publishes.
BULK_BATCH = 100
#: Runs a dry run names.
BULK_SAMPLE = 10
#: Statuses a bulk rerun takes.
BULK_STATUSES = (FAILED, CANCELLED)


@dataclasses.dataclass(frozen=True)
class BulkRerun:
    """What :func:`rerun_runs` did, or with ``dry_run`` would do.

    ``matched``: runs the filters matched when it started; ``with_message``: those
    keeping a stored message (the only ones that can be published again). ``rerun``:
    runs queued again and published; ``unpublished``: queued again, but the broker
    refused them; ``skipped``: matched runs left alone (no stored message, or changed
    meanwhile); ``sample``: the first runs a dry run would take; ``more``: it stopped at
    its ``limit`` with matching runs left. ``message``: the sentence to show.
    """

    task_name: str
    status: str
    matched: int
    with_message: int
    rerun: list[str]
    unpublished: list[str]
    skipped: int
    sample: list[str]
    dry_run: bool
    more: bool
    message: str


def rerun_runs(
    app: Celery,
    store: LeaseStore,
    task_name: str,
    status: str,
    *,
    finished_within: float | None = None,
    created_within: float | None = None,
    id_prefix: str | None = None,
    dry_run: bool = False,
    limit: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BulkRerun:
    """Run every ``status`` (failed or cancelled) run of ``task_name`` again, as
    :func:`rerun_run` does one: back to ``queued`` with fresh attempts, published from its
    stored message under a new task id (its checkpoint kept).

    Filters: ended within ``finished_within`` seconds, created within ``created_within``
    seconds (the web view's age), run ids starting ``id_prefix`` (by the database clock).
    Runs without a stored message are left alone (and counted). Newest first, in steps
    of :data:`BULK_BATCH`, each a guarded statement (a run that changed meanwhile is
    left alone); ``progress(done, matched)`` is called after each. With ``limit``, at
    most that many runs. With ``dry_run``, nothing changes: the counts and the first runs.

    Raises:
        ActionFailed: no task named, a status other than failed or cancelled, a negative
            window; or the broker refused a publish (the step's runs published so far are
            counted, the rest named, and nothing further is done).
    """
    if not task_name:
        raise ActionFailed("", "name the task whose runs to rerun (--task)")
    if status not in BULK_STATUSES:
        raise ActionFailed(
            "", f"only failed or cancelled runs are rerun in bulk, not {status!r} ones"
        )
    for name, seconds in (("finished within", finished_within), ("created within", created_within)):
        if seconds is not None and not seconds > 0:
            raise ActionFailed("", f"{name} must be more than zero seconds, got {seconds!r}")
    now = store.now_ms()
    query = RunPageQuery(
        status=status,
        task_name=task_name,
        id_prefix=id_prefix or None,
        finished_since=None if finished_within is None else now - round(finished_within * 1000),
        created_since=None if created_within is None else now - round(created_within * 1000),
        limit=BULK_BATCH if limit is None else max(1, min(BULK_BATCH, limit)),
    )
    window = _bulk_window(finished_within, created_within, id_prefix)
    what = f"{status} runs of {task_name}{window}"

    def runs_of(n: int) -> str:
        return f"{n} {status} run{'' if n == 1 else 's'} of {task_name}{window}"

    cap = None if limit is None else limit + 1
    matched, with_message = store.reads.count_runs(query, cap)
    more = limit is not None and matched > limit
    matched = min(matched, limit) if limit is not None else matched
    if dry_run or not matched:
        first = store.reads.page_runs(dataclasses.replace(query, limit=BULK_SAMPLE))
        sample = [r.id for r in first]
        if not matched and task_name not in app.tasks:
            what += f" (no task named {task_name!r} is registered in this app: a typo?)"
        return BulkRerun(
            task_name,
            status,
            matched,
            with_message,
            [],
            [],
            0,
            sample,
            dry_run,
            more,
            _dry_message(what, runs_of(matched), matched, with_message, sample, more),
        )
    task = app.tasks.get(task_name)
    config = task.lease_config() if isinstance(task, LeasedTask) else LeaseConfig.from_app(app)
    rerun: list[str] = []
    unpublished: list[str] = []
    done = 0
    page = query
    while limit is None or done < limit:
        rows = store.reads.page_runs(page)
        if limit is not None:
            rows = rows[: limit - done]
        if not rows:
            break
        previous = {r.id: r.task_id or r.id for r in rows}
        new_ids = {r.id: str(uuid.uuid4()) for r in rows}
        for record in store.rerun_many(new_ids, status=status, attempts=config.max_attempts):
            try:
                requeue(app, record, rerun_of=previous[record.id])
            except Exception:
                unpublished.append(record.id)
            else:
                rerun.append(record.id)
        done += len(rows)
        if progress is not None:
            progress(done, matched)
        if unpublished or len(rows) < page.limit:
            break
        last = rows[-1]
        page = dataclasses.replace(
            page,
            after_id=last.id,
            after_created=None if query.id_prefix else last.created_at,
        )
    skipped = done - len(rerun) - len(unpublished)
    app_runtime(app).events.emit(
        Event.RERUN_BULK,
        None,
        "celery-lease: %d %s queued again and published (%d left alone, %d not published)",
        len(rerun),
        what,
        skipped,
        len(unpublished),
        task=task_name,
        status=status,
        rerun=len(rerun),
        skipped=skipped,
        unpublished=len(unpublished),
    )
    message = (
        f"{runs_of(len(rerun))} queued again with fresh attempts ({config.max_attempts} each) "
        "and published from their stored messages under new task ids"
    )
    if skipped:
        message += f"; {skipped} left alone (no stored message to publish, or changed meanwhile)"
    if unpublished:
        shown = ", ".join(unpublished[:BULK_SAMPLE]) + (
            ", ..." if len(unpublished) > BULK_SAMPLE else ""
        )
        raise ActionFailed(
            "",
            f"{message}; stopped: the broker refused {len(unpublished)} of them, which are "
            f"queued but not published ({shown}): once the broker is back, `lease cancel` "
            "each and run this rerun again (with --status cancelled)",
        )
    if more:
        message += f"; stopped at {limit}: more match, rerun again for the next ones"
    return BulkRerun(
        task_name, status, matched, with_message, rerun, [], skipped, [], False, more, message
    )


def _bulk_window(
    finished_within: float | None, created_within: float | None, id_prefix: str | None
) -> str:
    """The filters of a bulk rerun, as words."""
    parts = []
    if finished_within is not None:
        parts.append(f" that ended in the last {format_duration(round(finished_within * 1000))}")
    if created_within is not None:
        parts.append(f" created in the last {format_duration(round(created_within * 1000))}")
    if id_prefix:
        parts.append(f" with ids starting {id_prefix!r}")
    return ",".join(parts)


def _dry_message(
    what: str, counted: str, matched: int, with_message: int, sample: list[str], more: bool
) -> str:
    """What a bulk rerun would do (``counted``: the matching runs, with their number)."""
    if not matched:
        return f"no {what}: nothing to rerun"
    text = f"more than {counted}" if more else counted
    text += f" match{'es' if matched == 1 and not more else ''}; {with_message} keep"
    text += f"{'s' if with_message == 1 else ''} a stored message and would be rerun"
    if matched > with_message:
        bare = matched - with_message
        text += f", {bare} {'has' if bare == 1 else 'have'} none and would be left alone"
    shown = ", ".join(sample) + (", ..." if matched > len(sample) else "")
    return f"{text} (newest first: {shown})"


# -- tasks ---------------------------------------------------------------------------


def pause_task(
    app: Celery,
    store: LeaseStore,
    task_name: str,
    *,
    key: str | None = None,
    reason: str | None = None,
    cancel_running: bool = False,
) -> ActionResult:
    """Pause ``task_name`` (its runs of concurrency ``key``) on every worker
    (:func:`celery_lease.pause`); with ``cancel_running``, also ask its running runs to
    stop; the message says how many were asked."""
    if not task_name:
        raise ActionFailed("", "name the task to pause")
    fresh, asked = flow.pause_counted(
        app, task_name, key, reason, cancel_running=cancel_running, store=store
    )
    what = task_name + ("" if key is None else f" (key {key})")
    message = (
        f"paused {what} on every worker: its new deliveries are kept until resume"
        if fresh
        else f"{what} was paused already" + ("" if reason is None else " (reason updated)")
    )
    if cancel_running:
        message += (
            f"; cancel requested for {asked} running run{'' if asked == 1 else 's'}: each stops "
            "within one heartbeat and ends cancelled, unless its body completes first"
            if asked
            else "; no running run to cancel"
        )
    elif fresh:
        message += "; running bodies finish"
    return ActionResult("", "paused", message)


def resume_task(
    app: Celery, store: LeaseStore, task_name: str, *, key: str | None = None
) -> ActionResult:
    """Resume ``task_name`` (its concurrency ``key``) and publish the deliveries its pause
    kept, in the order they came (:func:`celery_lease.resume`)."""
    if not task_name:
        raise ActionFailed("", "name the task to resume")
    was_paused, sent = flow.lift(app, task_name, key, store=store)
    what = task_name + ("" if key is None else f" (key {key})")
    published = f"{sent} held deliver{'y' if sent == 1 else 'ies'} published in the order they came"
    if not was_paused:
        # Still published: deliveries a resume that died halfway left held.
        return ActionResult(
            "",
            "resumed",
            f"{what} was not paused" + (f"; {published}" if sent else ": nothing to resume"),
        )
    return ActionResult("", "resumed", f"resumed {what}: {published}")
