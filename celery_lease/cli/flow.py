"""``lease pause``, ``resume`` and ``paused``: flow control across every worker."""

from __future__ import annotations

from typing import Any

import click

from .. import flow
from ..display import format_relative
from .common import (
    _echo_json,
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
@click.pass_context
@_operator_errors
def pause(
    ctx: click.Context, task_name: str, key: str | None, reason: str | None, cancel_running: bool
) -> None:
    """Pause TASK_NAME on every worker: its deliveries are kept, not run, until resume."""
    store = _open_store(ctx)
    fresh = flow.pause(
        ctx.obj.app, task_name, key, reason, cancel_running=cancel_running, store=store
    )
    what = task_name + ("" if key is None else f" (key {key})")
    click.echo(f"paused {what}" if fresh else f"{what} was paused already")


@lease.command()
@click.argument("task_name")
@click.option("--key", default=None, metavar="KEY", help="The concurrency key paused.")
@click.pass_context
@_operator_errors
def resume(ctx: click.Context, task_name: str, key: str | None) -> None:
    """Resume TASK_NAME: publish the deliveries its pause kept, in the order they came."""
    store = _open_store(ctx)
    sent = flow.resume(ctx.obj.app, task_name, key, store=store)
    what = task_name + ("" if key is None else f" (key {key})")
    click.echo(f"resumed {what}: {sent} held deliveries published")


@lease.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@click.pass_context
@_operator_errors
def paused(ctx: click.Context, as_json: bool) -> None:
    """List what is paused: task, key, since when, why, and how many deliveries wait."""
    store = _open_store(ctx)
    now = store.now_ms()
    found = store.list_pauses()
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
