"""``lease top``: a live view of running leases."""

from __future__ import annotations

import sys
import time

import click

from ..display import format_duration, format_relative, progress_text
from ..errors import LeaseError
from ..schema import (
    QUEUED,
    RETRYING,
    RUNNING,
)
from ..store import LeaseStore
from . import common
from .common import _URL_KEY, _open_store, _operator_errors, lease

#: ANSI: cursor home and clear the screen; alternate screen on/off; cursor off/on.
_HOME_CLEAR = "\x1b[H\x1b[2J"
_ALT_ON, _ALT_OFF = "\x1b[?1049h", "\x1b[?1049l"
_CURSOR_OFF, _CURSOR_ON = "\x1b[?25l", "\x1b[?25h"


def render_top(store: LeaseStore, shown_url: str, limit: int, wide: bool = False) -> str:
    """One frame of ``lease top``: live counts, recent activity, the live leases.

    Run ids longer than :data:`~celery_lease.cli.common.ID_WIDTH` are cut unless ``wide``.
    """
    activity = store.activity(store.now_ms())
    try:
        flow = store.flow_counts()
        paused_tasks = store.list_pauses()
    except LeaseError:  # no flow-control tables yet: `lease migrate` adds them
        flow, paused_tasks = None, []
    leases = store.live_leases(limit)
    now = activity.now
    counts = activity.counts
    ended = activity.ended_recently
    lines = [
        f"celery lease top  {shown_url}  {common.format_time(now)} (database clock)",
        f"live      queued {counts[QUEUED]}  running {counts[RUNNING]} "
        f"(expired {activity.expired_leases}, past attempt 1: {activity.running_retries})  "
        f"retrying {counts[RETRYING]}",
        "last 60s  "
        + "  ".join(f"{status} {ended[status]}" for status in sorted(ended))
        + f"  retries/min {activity.retried_recently}",
    ]
    if paused_tasks:
        lines.append(
            "paused    "
            + "  ".join(p.task_name + (f"[{p.key}]" if p.key else "") for p in paused_tasks)
        )
    if flow is not None and (flow.paused or flow.deferred):
        held = sorted({*flow.paused, *flow.deferred})
        lines.append(
            "held      "
            + "  ".join(
                f"{task}{f'[{key}]' if key else ''} paused {flow.paused.get((task, key), 0)}"
                f" deferred {flow.deferred.get((task, key), 0)}"
                for task, key in held
            )
        )
    lines.append("")
    rows = []
    for r in leases:
        left = "-" if r.lease_expires_at is None else r.lease_expires_at - now
        rows.append(
            (
                common.short_id(r.id, wide),
                r.task_name,
                common._short_owner(r.lease_owner),
                f"{r.attempt}/{r.max_attempts}",
                left if isinstance(left, str) else _time_left(left),
                "-" if r.heartbeat_at is None else format_duration(now - r.heartbeat_at),
                "-"
                if r.cancel_requested_at is None
                else format_relative(r.cancel_requested_at, now),
                "-" if r.started_at is None else format_duration(now - r.started_at),
                progress_text(r.progress_done, r.progress_total),
            )
        )
    if rows:
        headers = (
            "ID",
            "TASK",
            "OWNER",
            "ATTEMPT",
            "LEFT",
            "HEARTBEAT",
            "CANCEL",
            "RUNNING",
            "DONE",
        )
        lines.append(common.render_table(headers, rows))
        if any(row[0] != r.id for row, r in zip(rows, leases, strict=True)):
            lines.append(common.WIDE_HINT)
        if counts[RUNNING] > len(rows):
            lines.append(f"... {counts[RUNNING] - len(rows)} more (--limit)")
    else:
        lines.append("no live leases")
    return "\n".join(lines)


def _time_left(ms: int) -> str:
    """A lease's time left, or how long ago it expired."""
    return format_duration(ms) if ms > 0 else f"expired {format_duration(ms)} ago"


@lease.command()
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="Live leases shown (soonest expiry first).",
)
@click.option("--once", is_flag=True, help="Print one frame, without terminal control codes.")
@common.wide_option
@click.pass_context
@_operator_errors
def top(ctx: click.Context, interval: float, limit: int, once: bool, wide: bool) -> None:
    """A live view of the leases, refreshed in place, until Ctrl-C.

    Shows the running runs (owner, attempt, lease time left, heartbeat age,
    cancel request, progress), the live runs per status, and what ended or went
    retrying in the last minute; all times by the database clock.
    """
    store = _open_store(ctx)
    shown = str(ctx.meta.get(_URL_KEY, "?"))
    if once:
        click.echo(render_top(store, shown, limit, wide))
        return
    out = sys.stdout
    tty = out.isatty()
    if tty:
        out.write(_ALT_ON + _CURSOR_OFF)
    try:
        while True:
            frame = render_top(store, shown, limit, wide)
            # Piped (a log, `watch`-less scripts): frames one after another, no codes.
            out.write((_HOME_CLEAR if tty else "") + frame + "\n\n")
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if tty:
            out.write(_CURSOR_ON + _ALT_OFF)
            out.flush()
