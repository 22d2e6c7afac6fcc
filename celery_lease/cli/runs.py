"""``lease runs``, ``show``, ``cancel`` and ``rerun``: one run or a list of them."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..actions import BULK_BATCH, BULK_STATUSES, cancel_run, rerun_run, rerun_runs
from ..config import MAX_ATTEMPTS
from ..display import format_duration, format_relative, run_progress_text
from ..schema import (
    RUNNING,
    STATUSES,
    SUCCEEDED,
)
from ..store import RunNotFound, RunRecord
from .common import (
    MAX_LIMIT,
    RECORD_FIELDS,
    TIME_FIELDS,
    WIDE_HINT,
    _duration,
    _echo_json,
    _open_store,
    _operator_errors,
    _short_owner,
    format_time,
    lease,
    lease_left,
    record_data,
    render_table,
    short_id,
    wide_option,
)


@lease.command()
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only this status.")
@click.option("--task", "task_name", default=None, metavar="NAME", help="Only this task name.")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_LIMIT), default=50, show_default=True)
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
    records = store.reads.list_runs(status=status, task_name=task_name, limit=limit)
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
    progress = run_progress_text(
        record.status,
        record.terminal,
        record.progress_done,
        record.progress_total,
        record.progress_note,
    )
    if record.progress_at is not None and not record.terminal:
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
    click.echo(cancel_run(ctx.obj.app, _open_store(ctx), run_id).message)


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
@click.argument("run_id", required=False)
@click.option(
    "--task",
    "task_name",
    default=None,
    metavar="NAME",
    help="Rerun every run of this task in --status (instead of one RUN_ID).",
)
@click.option(
    "--status",
    type=click.Choice(BULK_STATUSES),
    default=None,
    help="With --task: rerun its runs in this status.",
)
@click.option(
    "--since",
    callback=_duration,
    default=None,
    metavar="DURATION",
    help="With --task: only runs that ended within this long (e.g. 90m, 2h, 1d; DB clock).",
)
@click.option(
    "--dry-run", is_flag=True, help="With --task: say what would be rerun, change nothing."
)
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
    type=click.IntRange(min=1, max=MAX_ATTEMPTS),
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
    run_id: str | None,
    task_name: str | None,
    status: str | None,
    since: float | None,
    dry_run: bool,
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

    In bulk: `--task NAME --status cancelled|failed [--since DURATION]` reruns
    every such run of the task (newest first, each as above; runs without a
    stored message are left alone and counted); --dry-run says how many and
    which, changing nothing.
    """
    if task_name is not None or status is not None or since is not None or dry_run:
        one_run = (force, args_json, kwargs_json, attempts, from_scratch)
        _check_bulk(run_id, task_name, status, *one_run)
        assert task_name is not None and status is not None
        _rerun_bulk(ctx, task_name, status, since, dry_run)
        return
    if run_id is None:
        raise click.UsageError(
            "give a RUN_ID, or --task NAME --status cancelled|failed to rerun in bulk"
        )
    args = _json_option(args_json, list, "--args")
    kwargs = _json_option(kwargs_json, dict, "--kwargs")
    result = rerun_run(
        ctx.obj.app,
        _open_store(ctx),
        run_id,
        force=force,
        args=args,
        kwargs=kwargs,
        attempts=attempts,
        from_scratch=from_scratch,
    )
    click.echo(result.message)


def _check_bulk(run_id: str | None, task_name: str | None, status: str | None, *one: Any) -> None:
    """Refuse a bulk rerun's options mixed with a RUN_ID's, or missing --task/--status."""
    if run_id is not None:
        raise click.UsageError(
            "give a RUN_ID or --task/--status (with --since, --dry-run), not both"
        )
    if any(one):
        raise click.UsageError(
            "--force, --args, --kwargs, --attempts and --from-scratch apply to one RUN_ID, "
            "not to a bulk rerun (--task)"
        )
    if task_name is None or not task_name.strip():
        raise click.UsageError("a bulk rerun needs --task NAME (and --status cancelled|failed)")
    if status is None:
        raise click.UsageError(
            f"--task {task_name} needs --status cancelled or --status failed: which runs to rerun"
        )


def _rerun_bulk(
    ctx: click.Context, task_name: str, status: str, since: float | None, dry_run: bool
) -> None:
    """``lease rerun --task``: the runs rerun, with progress on stderr past one step."""
    tty = sys.stderr.isatty()
    shown = [False]

    def progress(done: int, total: int) -> None:
        if total <= BULK_BATCH:
            return
        shown[0] = True
        line = f"rerun: {done} of {total} {status} runs of {task_name} handled"
        click.echo(("\r" + line) if tty else line, nl=not tty, err=True)

    result = rerun_runs(
        ctx.obj.app,
        _open_store(ctx),
        task_name,
        status,
        finished_within=since,
        dry_run=dry_run,
        progress=progress,
    )
    if shown[0] and tty:
        click.echo("", err=True)
    click.echo(("dry run: " if dry_run else "") + result.message)
