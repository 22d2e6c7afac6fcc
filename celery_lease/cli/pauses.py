"""``lease pause``, ``resume`` and ``paused``: flow control across every worker."""

from __future__ import annotations

import contextlib
from typing import Any

import click

from ..actions import pause_task, resume_task
from ..display import format_relative
from .common import (
    _echo_json,
    _Failure,
    _open_store,
    _operator_errors,
    format_time,
    lease,
    render_table,
)


@lease.command()
@click.argument("task_name")
@click.option("--key", default=None, metavar="KEY", help="Only runs of this concurrency key.")
@click.option("--reason", default=None, metavar="TEXT", help="Why (shown by `lease paused`).")
@click.option(
    "--cancel-running",
    is_flag=True,
    help="Also cancel its running runs (as `lease cancel`); else they finish.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Pause a name this app does not register and no run carries (a task to come).",
)
@click.pass_context
@_operator_errors
def pause(
    ctx: click.Context,
    task_name: str,
    key: str | None,
    reason: str | None,
    cancel_running: bool,
    force: bool,
) -> None:
    """Pause TASK_NAME on every worker: its deliveries are kept, not run, until resume.

    With --cancel-running it says how many running runs it asked to stop. A name
    the app does not register and no run in the lease database carries is refused
    (a typo would pause nothing) unless --force.
    """
    store = _open_store(ctx)
    if not force and not _known_task(ctx.obj.app, store, task_name):
        raise _Failure(
            f"no task named {task_name!r}: the app does not register it and no run carries "
            "it (check the name with `celery -A <app> inspect registered`; --force pauses "
            "it anyway)"
        )
    result = pause_task(
        ctx.obj.app, store, task_name, key=key, reason=reason, cancel_running=cancel_running
    )
    click.echo(result.message)


def _known_task(app: Any, store: Any, task_name: str) -> bool:
    """True when ``app`` registers ``task_name`` (its task modules imported, as a worker
    imports them) or a run in the lease database carries it."""
    with contextlib.suppress(Exception):  # a module that fails to import: the runs decide
        app.loader.import_default_modules()
    if task_name in app.tasks:
        return True
    return bool(store.reads.list_runs(task_name=task_name, limit=1))


@lease.command()
@click.argument("task_name")
@click.option("--key", default=None, metavar="KEY", help="The concurrency key paused.")
@click.pass_context
@_operator_errors
def resume(ctx: click.Context, task_name: str, key: str | None) -> None:
    """Resume TASK_NAME: publish the deliveries its pause kept, in the order they came."""
    click.echo(resume_task(ctx.obj.app, _open_store(ctx), task_name, key=key).message)


@lease.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@click.pass_context
@_operator_errors
def paused(ctx: click.Context, as_json: bool) -> None:
    """List what is paused: task, key, since when, why, and how many deliveries wait."""
    store = _open_store(ctx)
    now = store.now_ms()
    found = store.flow.list_pauses()
    if as_json:
        data: list[dict[str, Any]] = [
            {
                "task_name": p.task_name,
                "key": p.key or None,
                "reason": p.reason,
                "paused_at": p.paused_at,
                "waiting": p.waiting,
            }
            for p in found
        ]
        _echo_json(data)
        return
    if not found:
        click.echo("nothing is paused")
        return
    rows = [
        (
            p.task_name,
            p.key or "(all)",
            f"{format_time(p.paused_at)} ({format_relative(p.paused_at, now)})",
            str(p.waiting),
            p.reason or "",
        )
        for p in found
    ]
    click.echo(render_table(("TASK", "KEY", "SINCE", "WAITING", "REASON"), rows))
