"""``lease runs``, ``show``, ``cancel`` and ``rerun``: one run or a list of them."""

from __future__ import annotations

import json
import uuid
from typing import Any

import click

from ..config import LeaseConfig
from ..run.outcome import record_outcome
from ..sanitize import describe_exception
from ..schema import (
    CANCELLED,
    QUEUED,
    RETRYING,
    RUNNING,
    STATUSES,
    SUCCEEDED,
)
from ..store import RunNotFound, RunNotRerunnable, RunRecord
from .common import (
    RECORD_FIELDS,
    TIME_FIELDS,
    WIDE_HINT,
    _echo_json,
    _Failure,
    _open_store,
    _operator_errors,
    _short_owner,
    format_duration,
    format_relative,
    format_time,
    lease,
    lease_left,
    progress_text,
    record_data,
    render_table,
    short_id,
    wide_option,
)


@lease.command()
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only this status.")
@click.option("--task", "task_name", default=None, metavar="NAME", help="Only this task name.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@wide_option
@click.pass_context
@_operator_errors
def runs(
    ctx: click.Context,
    status: str | None,
    task_name: str | None,
    limit: int,
    as_json: bool,
    wide: bool,
) -> None:
    """List runs, newest first."""
    store = _open_store(ctx)
    now = store.now_ms()
    records = store.list_runs(status=status, task_name=task_name, limit=limit)
    if as_json:
        _echo_json([record_data(r, now) for r in records])
        return
    if not records:
        click.echo("no runs match")
        return
    rows = [
        (
            short_id(r.id, wide),
            r.task_name,
            r.status + (" (cancel requested)" if r.cancel_requested_at and not r.terminal else ""),
            f"{r.attempt}/{r.max_attempts}",
            _short_owner(r.lease_owner) if r.status == RUNNING else "-",
            lease_left(r, now),
            format_relative(r.updated_at, now),
            r.failure_code or "",
        )
        for r in records
    ]
    headers = ("ID", "TASK", "STATUS", "ATTEMPT", "OWNER", "LEASE", "UPDATED", "FAILURE")
    click.echo(render_table(headers, rows))
    if any(row[0] != r.id for row, r in zip(rows, records, strict=True)):
        click.echo(WIDE_HINT)


@lease.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@click.option(
    "--payload", "show_payload", is_flag=True, help="Also print the stored task arguments."
)
@click.option(
    "--checkpoint", "show_checkpoint", is_flag=True, help="Also print the checkpoint's JSON."
)
@click.pass_context
@_operator_errors
def show(
    ctx: click.Context, run_id: str, as_json: bool, show_payload: bool, show_checkpoint: bool
) -> None:
    """Show every column of one run, with its lease's time left by the database clock,
    its progress (done/total) and its checkpoint's size and age."""
    store = _open_store(ctx)
    now = store.now_ms()
    record = store.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    data = record_data(record, now)
    if show_payload and record.payload is not None:
        data["payload"] = record.payload.decode("utf-8", errors="replace")
    if show_checkpoint and record.checkpoint is not None:
        data["checkpoint"] = json.loads(record.checkpoint)
    if as_json:
        _echo_json(data)
        return
    lines: list[tuple[str, str]] = []
    for name in RECORD_FIELDS:
        value = data[name]
        if name in TIME_FIELDS and value is not None:
            text = f"{format_time(value)}  ({format_relative(value, now)})"
        elif name == "lease_ms":
            text = f"{value} ({format_duration(value)})"
        else:
            text = "-" if value is None else str(value)
        lines.append((name, text))
    lines.insert(5, ("lease_left", lease_left(record, now)))
    lines.append(("payload", _payload_text(record, data["payload_bytes"])))
    if "payload" in data:
        lines[-1] = ("payload", str(data["payload"]))
    progress = progress_text(record)
    if record.progress_at is not None:
        progress += f"  (written {format_relative(record.progress_at, now)})"
    lines.append(("progress", progress))
    lines.append(("checkpoint", _checkpoint_text(record, data["checkpoint_bytes"], now)))
    if "checkpoint" in data:
        lines[-1] = ("checkpoint", json.dumps(data["checkpoint"], ensure_ascii=False))
    lines.append(("db_now", format_time(now)))
    width = max(len(name) for name, _ in lines)
    for name, text in lines:
        click.echo(f"{name.ljust(width)}  {text}")


def _checkpoint_text(record: RunRecord, size: int | None, now: int) -> str:
    """What ``show`` says about the checkpoint: its size and age."""
    if size is None:
        if record.status == SUCCEEDED:
            return "- (cleared: the run succeeded)"
        return "- (none saved)"
    saved = (
        ""
        if record.checkpoint_at is None
        else f", saved {format_relative(record.checkpoint_at, now)}"
    )
    return f"{size} bytes{saved} (use --checkpoint to print)"


def _payload_text(record: RunRecord, size: int | None) -> str:
    """What ``show`` says about the stored message."""
    if size is not None:
        return f"{size} bytes (use --payload to print)"
    if record.status == SUCCEEDED:
        return "cleared (run succeeded: its arguments are not kept)"
    if record.failure_code in ("expired", "payload_not_accepted"):
        return f"cleared (the message was refused: {record.failure_code})"
    return "- (none stored: a direct call or eager apply(), never sent to workers)"


@lease.command()
@click.argument("run_id")
@click.pass_context
@_operator_errors
def cancel(ctx: click.Context, run_id: str) -> None:
    """Cancel a run: queued/retrying at once; a running run stops within one heartbeat."""
    store = _open_store(ctx)
    status = store.cancel(run_id)
    if status == CANCELLED:
        # The caller holding its task id sees REVOKED (a chord counts it, as Celery's revoke).
        record_outcome(ctx.obj.app, store.get(run_id))
        click.echo(f"run {run_id} is cancelled")
    elif status == RUNNING:
        click.echo(
            f"run {run_id} is running: cancel requested; its worker stops it within one "
            "heartbeat and it ends cancelled (or, if that worker is gone, at the next sweep)"
        )
    else:
        raise _Failure(f"run {run_id} already {status}: nothing to cancel")


# -- rerun ---------------------------------------------------------------------------


def _json_option(value: str | None, kind: type, name: str) -> Any:
    """``--args``/``--kwargs``: JSON of the given kind, or a usage error (exit 2)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from None
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {kind.__name__}", param_hint=name)
    return parsed


@lease.command()
@click.argument("run_id")
@click.option("--force", is_flag=True, help="Also run a succeeded run again.")
@click.option(
    "--args",
    "args_json",
    default=None,
    metavar="JSON",
    help="Publish the run with these positional arguments (a JSON list).",
)
@click.option(
    "--kwargs",
    "kwargs_json",
    default=None,
    metavar="JSON",
    help="Publish the run with these keyword arguments (a JSON object).",
)
@click.option(
    "--attempts",
    type=click.IntRange(min=1),
    default=None,
    help="Fresh attempts to give it (default: the task's lease_max_attempts).",
)
@click.option(
    "--from-scratch",
    is_flag=True,
    help="Clear the run's checkpoint (and progress): the body starts from the beginning.",
)
@click.pass_context
@_operator_errors
def rerun(
    ctx: click.Context,
    run_id: str,
    force: bool,
    args_json: str | None,
    kwargs_json: str | None,
    attempts: int | None,
    from_scratch: bool,
) -> None:
    """Run a failed or cancelled run again: back to queued, with fresh attempts.

    The run is published again from the message stored in its row, under a
    new task id (a header links it to the old one, which Celery's revoke list
    may hold) and without the stored expires; the run keeps its id. With
    --args/--kwargs it is published with those arguments
    instead (checked against a keyed task's lease_key). A run with no stored
    message (a succeeded run, with --force) waits, queued, until the task is
    sent again with the same key (or task id). The run's checkpoint is kept,
    so the body resumes from it (self.lease.last_checkpoint), unless
    --from-scratch.
    """
    from ..requeue import requeue, rerun_headers
    from ..run.task import LeasedTask

    args = _json_option(args_json, list, "--args")
    kwargs = _json_option(kwargs_json, dict, "--kwargs")
    app = ctx.obj.app
    store = _open_store(ctx)
    record = store.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    _refuse_rerun(run_id, record.status, force)
    task = app.tasks.get(record.task_name)
    leased = isinstance(task, LeasedTask)
    publish = args is not None or kwargs is not None
    task_id = record.task_id or record.id
    if publish:
        if not leased:
            raise _Failure(
                f"task {record.task_name!r} is not a LeasedTask of this app (-A): cannot "
                "publish it with --args/--kwargs"
            )
        expected = _rerun_run_id(task, run_id, args or [], kwargs or {})
        if expected != run_id:
            raise _Failure(
                f"these arguments make run {expected!r}, not {run_id!r}: the task's "
                "lease_key must give the run's own key"
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
        _refuse_rerun(run_id, exc.status, force)
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
        raise _Failure(
            f"run {run_id} is queued again ({tries}) but could not be published "
            f"({describe_exception(exc)}): run `lease rerun` again once the broker is back "
            f"(after `lease cancel {run_id}`), or `lease cancel {run_id}` to undo"
        ) from None
    if publish:
        click.echo(
            f"run {run_id} is queued again ({tries}) and published as task {new_task_id} "
            f"(following {task_id}) with the given arguments"
        )
    elif after.payload is not None:
        click.echo(
            f"run {run_id} is queued again ({tries}) and published from its stored message "
            f"as task {new_task_id} (following {task_id})"
        )
    else:
        how = (
            f"send {record.task_name} again with arguments that give this run's lease_key"
            if leased and task.lease_config().key is not None
            else f"send {record.task_name} again with task_id={task_id!r}"
        )
        click.echo(
            f"run {run_id} is queued again ({tries}), but it has no stored message "
            f"(a succeeded run keeps no task arguments), so nothing was published: {how}, or use "
            f"`lease rerun` with --args/--kwargs next time (`lease cancel {run_id}` undoes this)"
        )


def _refuse_rerun(run_id: str, status: str, force: bool) -> None:
    """Raise the refusal of ``lease rerun`` for a run in ``status``, if it is refused."""
    if status in (QUEUED, RUNNING, RETRYING):
        raise _Failure(
            f"run {run_id} is {status}: it is live, nothing to rerun "
            f"(`lease cancel {run_id}` first if it must start over)"
        )
    if status == SUCCEEDED and not force:
        raise _Failure(f"run {run_id} succeeded: pass --force to run it again")


def _rerun_run_id(task: Any, run_id: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The run id a rerun of ``run_id`` with these arguments claims: ``run_id`` itself for
    a task without ``lease_key`` (the rerun's header names it), else the key's."""
    from ..run.runids import fit_run_id

    if task.lease_config().key is None:
        return run_id  # the rerun's header names it: any arguments give this run
    try:
        return str(fit_run_id(task.lease_run_id(*args, **kwargs)))
    except TypeError as exc:
        raise _Failure(f"the arguments do not fit {task.name}: {exc}") from None


# -- top -------------------------------------------------------------------------------
