"""``lease top``: a live view of running leases."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from ..display import format_duration, format_relative, run_progress_text
from ..errors import LeaseError
from ..sanitize import sanitize
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
    activity = store.reads.activity(store.now_ms())
    try:
        flow = store.flow.flow_counts()
        paused_tasks = store.flow.list_pauses()
    except LeaseError:  # no flow-control tables yet: `lease migrate` adds them
        flow, paused_tasks = None, []
    leases = store.reads.live_leases(limit)
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
        + f"  retried {activity.retried_recently}",
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
                "-" if r.started_at is None else format_relative(r.started_at, now),
                run_progress_text(r.status, r.terminal, r.progress_done, r.progress_total),
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
            "STARTED",
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
    type=common.SECONDS_BETWEEN,
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=common.MAX_LIMIT),
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

    def frame() -> str:
        # During an incident the view stays up: a frame the database cannot give says so,
        # and the next refresh tries again.
        try:
            return render_top(store, shown, limit, wide)
        except LeaseError as exc:
            return (
                f"celery lease top  {shown}\n\nthe lease database does not answer: "
                f"{sanitize(str(exc), 300)}\ntrying again every {interval:g}s (Ctrl-C stops)"
            )

    _live(frame, interval)


def _live(render: Callable[[], str], interval: float) -> None:
    """Show ``render()``'s frames every ``interval`` s until SIGINT; then restore the
    terminal and end the process with status 0 at once.

    Frames are rendered on a daemon thread, so neither a slow read (a locked table, a
    stalled database) nor the machine's load stands between Ctrl-C and the exit: the
    main thread only waits for frames and writes them. A rendering error is raised
    here, in the main thread, as if rendered here.
    """
    out = sys.stdout
    tty = out.isatty()
    frames: queue.Queue[str | BaseException] = queue.Queue(maxsize=1)
    stop = threading.Event()
    interrupted: list[int] = []

    def produce() -> None:
        while not stop.is_set():
            try:
                frame: str | BaseException = render()
            except BaseException as exc:  # handed to the main thread, which raises it
                frame = exc
            while not stop.is_set():
                try:
                    frames.put(frame, timeout=0.5)
                    break
                except queue.Full:
                    continue
            if isinstance(frame, BaseException):
                return
            stop.wait(interval)

    def on_sigint(signum: int, frame: Any) -> None:
        # The flag ends the loop even if the exception below lands in code that
        # swallows it (a __del__, a weakref callback: "Exception ignored in ...").
        interrupted.append(signum)
        if len(interrupted) == 1:  # a second Ctrl-C must not break the terminal's restore
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    if tty:
        out.write(_ALT_ON + _CURSOR_OFF)
        out.flush()
    threading.Thread(target=produce, name="lease-top-render", daemon=True).start()
    try:
        while not interrupted:
            try:
                item = frames.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            # Piped (a log, `watch`-less scripts): frames one after another, no codes.
            out.write((_HOME_CLEAR if tty else "") + item + "\n\n")
            out.flush()
    except KeyboardInterrupt:
        interrupted.append(signal.SIGINT)
    finally:
        stop.set()
        signal.signal(signal.SIGINT, previous)
        if tty:
            out.write(_CURSOR_ON + _ALT_OFF)
        out.flush()
    if interrupted:
        # Nothing is left to do but the interpreter's teardown, which walks every
        # object the app imported (0.3-0.8 s of CPU measured, several seconds on a
        # loaded machine) and would race the render thread's read: skip it.
        sys.stderr.flush()
        os._exit(0)
