"""``celery -A proj lease ...``: the operator's commands.

Installed as a ``celery.commands`` entry point, so it runs with the app Celery
loaded from ``-A`` and reads ``lease_database_url`` from its settings (or from
``--database-url``). Times stored in the run row are epoch milliseconds taken
from the database clock; they are shown in UTC, with ages and lease time left
computed against the database's clock too, never this machine's.

Every failure an operator can cause (unknown run id, unreachable database,
bad URL or settings, missing table) ends with one line on stderr and exit
status 1; usage errors exit 2. Database URLs are always shown without password.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import click
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from .config import LeaseConfig
from .errors import LeaseDatabaseError, LeaseError
from .sanitize import describe_exception, safe_url, sanitize
from .schema import (
    CANCELLED,
    QUEUED,
    RETRYING,
    RUNNING,
    STATUSES,
    SUCCEEDED,
    TABLE_NAME,
    TERMINAL_STATUSES,
)
from .store import PURGE_BATCH, LeaseStore, RunNotFound, RunNotRerunnable, RunRecord

F = TypeVar("F", bound=Callable[..., Any])

_URL_KEY = "celery_lease.database_url"

#: The columns of ``runs`` and ``show --json``; ``payload`` is summarized, not printed.
RECORD_FIELDS = (
    "id",
    "task_name",
    "status",
    "lease_owner",
    "lease_expires_at",
    "lease_ms",
    "heartbeat_at",
    "attempt",
    "max_attempts",
    "available_at",
    "cancel_requested_at",
    "started_at",
    "finished_at",
    "last_error",
    "failure_code",
    "concurrency_key",
    "payload_content_type",
    "created_at",
    "updated_at",
)
TIME_FIELDS = frozenset(
    {
        "lease_expires_at",
        "heartbeat_at",
        "available_at",
        "cancel_requested_at",
        "started_at",
        "finished_at",
        "created_at",
        "updated_at",
    }
)


class _Failure(click.ClickException):
    """One clear line on stderr and exit status 1 (click prints ``Error: ...``)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def _first_line(exc: BaseException) -> str:
    """The driver's own message, first line only, sanitized."""
    inner = getattr(exc, "orig", None) or exc
    text = str(inner).strip().splitlines()
    return sanitize(f"{type(inner).__name__}: {text[0] if text else ''}".rstrip(": "), 300)


def _operator_errors(fun: F) -> F:
    """Turn the failures an operator can cause into one line and exit status 1."""

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fun(*args, **kwargs)
        except click.ClickException:
            raise
        except ImproperlyConfigured as exc:
            raise _Failure(sanitize(str(exc))) from None
        except RunNotFound as exc:
            raise _Failure(f"no run with id {exc.run_id!r}") from None
        except LeaseDatabaseError as exc:
            url = click.get_current_context().meta.get(_URL_KEY, "?")
            raise _Failure(f"lease database {url}: {sanitize(str(exc))}") from None
        except LeaseError as exc:
            raise _Failure(sanitize(str(exc))) from None
        except SQLAlchemyError as exc:
            url = click.get_current_context().meta.get(_URL_KEY, "?")
            raise _Failure(f"lease database {url}: {_first_line(exc)}") from None

    return cast(F, wrapper)


# -- resolving the database -----------------------------------------------------


def _database_url(ctx: click.Context) -> str:
    """The lease database URL: ``--database-url`` or the app's ``lease_database_url``."""
    override: str | None = ctx.find_root().meta.get("celery_lease.override")
    if override is None:
        url = LeaseConfig.from_app(ctx.obj.app).database_url
    else:
        url = LeaseConfig.from_mapping({"lease_database_url": override}).database_url
    ctx.meta[_URL_KEY] = safe_url(url)
    return url


def _sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names (None for other databases or in-memory)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return str(parsed.database)


def _open_store(ctx: click.Context) -> LeaseStore:
    """A store on the lease database, which must exist and hold the runs table."""
    url = _database_url(ctx)
    shown = safe_url(url)
    path = _sqlite_file(url)
    if path is not None and not os.path.exists(path):
        # Connecting would silently create an empty file; say what is wrong instead.
        raise _Failure(
            f"lease database {shown}: SQLite file does not exist (check lease_database_url "
            "and the working directory)"
        )
    store = LeaseStore.from_url(url)
    ctx.call_on_close(store.dispose)
    if not store.has_schema():
        raise _Failure(
            f"lease database {shown} has no {TABLE_NAME} table: run "
            "`celery -A <app> lease migrate` (or start a worker, on SQLite)"
        )
    return store


# -- formatting -------------------------------------------------------------------


def format_time(ms: int | None) -> str:
    """Epoch milliseconds as ``YYYY-MM-DD HH:MM:SS.mmmZ`` (UTC); ``-`` for None."""
    if ms is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def format_duration(ms: int) -> str:
    """A short human duration: ``850ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``."""
    ms = abs(ms)
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_relative(ms: int | None, now: int) -> str:
    """``ms`` relative to the database's ``now``: ``12.0s ago`` or ``in 3.1s``."""
    if ms is None:
        return "-"
    delta = ms - now
    return f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(delta)} ago"


def lease_left(record: RunRecord, now: int) -> str:
    """The lease's time left by the database clock, for a running run."""
    if record.status != RUNNING or record.lease_expires_at is None:
        return "-"
    left = record.lease_expires_at - now
    return f"{format_duration(left)} left" if left > 0 else f"expired {format_duration(left)} ago"


def record_data(record: RunRecord, now: int) -> dict[str, Any]:
    """A run as JSON-ready data: every column (times as epoch ms) plus derived fields."""
    data: dict[str, Any] = {name: getattr(record, name) for name in RECORD_FIELDS}
    if data["last_error"] is not None:
        data["last_error"] = sanitize(data["last_error"])
    data["payload_bytes"] = None if record.payload is None else len(record.payload)
    # A finished run's arguments are cleared when it ends (they are often personal data).
    data["payload_cleared"] = record.terminal and record.payload is None
    data["lease_left_ms"] = (
        record.lease_expires_at - now
        if record.status == RUNNING and record.lease_expires_at is not None
        else None
    )
    data["db_now"] = now
    return data


def _short_owner(owner: str | None) -> str:
    """``host:pid`` of an owner (its random part only matters to the guard)."""
    if not owner:
        return "-"
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    return f"{host}:{pid}" if pid else owner


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain, left-aligned text table."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    return "\n".join(lines)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


# -- the commands -------------------------------------------------------------------


@click.group(name="lease", invoke_without_command=False)
@click.option(
    "--database-url",
    metavar="URL",
    default=None,
    help="Lease database to use instead of the app's lease_database_url.",
)
@click.pass_context
def lease(ctx: click.Context, /, database_url: str | None, **kwargs: Any) -> None:
    """Inspect and operate celery-lease runs (the celery_lease_runs table)."""
    ctx.find_root().meta["celery_lease.override"] = database_url


@lease.command()
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only this status.")
@click.option("--task", "task_name", default=None, metavar="NAME", help="Only this task name.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@click.pass_context
@_operator_errors
def runs(
    ctx: click.Context, status: str | None, task_name: str | None, limit: int, as_json: bool
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
            r.id,
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


@lease.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (times in epoch ms).")
@click.option(
    "--payload", "show_payload", is_flag=True, help="Also print the stored task arguments."
)
@click.pass_context
@_operator_errors
def show(ctx: click.Context, run_id: str, as_json: bool, show_payload: bool) -> None:
    """Show every column of one run, with its lease's time left by the database clock."""
    store = _open_store(ctx)
    now = store.now_ms()
    record = store.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    data = record_data(record, now)
    if show_payload and record.payload is not None:
        data["payload"] = record.payload.decode("utf-8", errors="replace")
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
    lines.append(("db_now", format_time(now)))
    width = max(len(name) for name, _ in lines)
    for name, text in lines:
        click.echo(f"{name.ljust(width)}  {text}")


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
        click.echo(f"run {run_id} is cancelled")
    elif status == RUNNING:
        click.echo(
            f"run {run_id} is running: cancel requested; its worker stops it within one "
            "heartbeat and it ends cancelled (or, if that worker is gone, at the next sweep)"
        )
    else:
        raise _Failure(f"run {run_id} already {status}: nothing to cancel")


@lease.command()
@click.option("--limit", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
@_operator_errors
def sweep(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Run the sweeper once: recover runs whose lease expired, and print what it did."""
    from .sweeper import sweep as run_sweep

    store = _open_store(ctx)
    report = run_sweep(ctx.obj.app, store, limit=limit)
    data = {
        "requeued": list(report.requeued),
        "failed": list(report.failed),
        "cancelled": list(report.cancelled),
        "errors": list(getattr(report, "errors", [])),
    }
    purged = {status: n for status, n in report.purged.items() if n}
    if as_json:
        _echo_json({**data, "purged": purged})
    else:
        labels = {
            "requeued": "re-enqueued (retrying)",
            "failed": "failed (lease expired, attempts spent)",
            "cancelled": "cancelled (cancel was requested)",
            "errors": "could not be re-enqueued",
        }
        if not any(data.values()) and not purged:
            click.echo("nothing to sweep")
        if purged:
            counts = ", ".join(f"{status} {n}" for status, n in purged.items())
            click.echo(f"deleted (finished, older than lease_retention): {counts}")
        for key, ids in data.items():
            if ids:
                click.echo(f"{labels[key]}: {len(ids)}")
                for run_id in ids:
                    click.echo(f"  {run_id}")
    if data["errors"]:
        ctx.exit(1)


@lease.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds to wait for another migrate run on the same database to finish.",
)
@click.pass_context
@_operator_errors
def migrate(ctx: click.Context, revision: str, lock_timeout: float) -> None:
    """Apply the shipped migrations (version table: celery_lease_alembic_version).

    Runs at once on one database are safe: each takes the database's migration
    lock, so one migrates and the others wait, then find the schema current.
    """
    from .migrations import upgrade

    url = _database_url(ctx)
    shown = safe_url(url)
    result = upgrade(url, revision, lock_timeout=lock_timeout)
    if result.adopted:
        click.echo(
            f"{shown}: existing {TABLE_NAME} matches this version; recorded it at revision "
            f"{result.after}"
        )
    elif result.before == result.after:
        click.echo(f"{shown}: already at revision {result.after}")
    else:
        click.echo(f"{shown}: migrated {result.before or '(empty)'} -> {result.after}")


@lease.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_operator_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Counts per status, live leases, the oldest running run, recent lease expiries."""
    store = _open_store(ctx)
    data = store.stats()
    now: int = data["now"]
    counts: dict[str, int] = {status: data["counts"].get(status, 0) for status in STATUSES}
    oldest: RunRecord | None = data["oldest_running"]
    not_recorded = (
        "a worker that loses its lease writes nothing to the table, so lease losses seen by "
        "workers are not counted here: use the celery_lease_lease_lost_total metric or log "
        "records with lease_event=lost"
    )
    if as_json:
        _echo_json(
            {
                "db_now": now,
                "counts": counts,
                "total": sum(counts.values()),
                "live_leases": data["live_leases"],
                "expired_leases": data["expired_leases"],
                "oldest_running": None if oldest is None else record_data(oldest, now),
                "lease_expired_last_hour": data["lease_expired_recent"],
                "lease_lost_at_workers": None,
                "note": not_recorded,
            }
        )
        return
    click.echo(f"lease database   {ctx.meta[_URL_KEY]}")
    click.echo(f"database clock   {format_time(now)}")
    click.echo("")
    width = max(len(s) for s in STATUSES)
    for status in STATUSES:
        click.echo(f"  {status.ljust(width)}  {counts[status]}")
    click.echo(f"  {'total'.ljust(width)}  {sum(counts.values())}")
    click.echo("")
    if oldest is None:
        oldest_text = "-"
    else:
        oldest_text = (
            f"{oldest.id} ({oldest.task_name}), started {format_relative(oldest.started_at, now)},"
            f" attempt {oldest.attempt}/{oldest.max_attempts}, lease {lease_left(oldest, now)}"
        )
    facts = [
        ("live leases", str(data["live_leases"])),
        (
            "expired leases",
            f"{data['expired_leases']} (running rows whose lease ran out: the next claim "
            "or sweep takes them)",
        ),
        ("oldest running", oldest_text),
        (
            "lease expired, last hour",
            f"{data['lease_expired_recent']} (runs with failure_code=lease_expired updated in "
            "the last hour; a run re-claimed and finished since no longer carries it)",
        ),
        ("lease lost at workers", f"not recorded: {not_recorded}"),
    ]
    label_width = max(len(label) for label, _ in facts)
    for label, text in facts:
        click.echo(f"{label.ljust(label_width)}  {text}")


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
@click.pass_context
@_operator_errors
def rerun(
    ctx: click.Context,
    run_id: str,
    force: bool,
    args_json: str | None,
    kwargs_json: str | None,
    attempts: int | None,
) -> None:
    """Run a failed or cancelled run again: back to queued, with fresh attempts.

    A finished run keeps no task arguments (they are cleared when it ends), so
    the run is published again only with --args/--kwargs (checked against a
    keyed task's lease_key); without them it waits, queued, for the caller to
    send the task again with the same key (or task id).
    """
    from .requeue import requeue
    from .task import LeasedTask

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
        expected = _rerun_run_id(task, task_id, args or [], kwargs or {})
        if expected != run_id:
            raise _Failure(
                f"these arguments make run {expected!r}, not {run_id!r}: the task's "
                "lease_key must give the run's own key"
            )
    if attempts is None:
        config = task.lease_config() if leased else LeaseConfig.from_app(app)
        attempts = config.max_attempts
    try:
        after = store.rerun(run_id, attempts=attempts, force=force)
    except RunNotRerunnable as exc:  # it changed between the read and the update
        _refuse_rerun(run_id, exc.status, force)
        raise
    tries = f"attempts {after.attempt + 1}..{after.max_attempts}"
    try:
        if publish:
            task.apply_async(args or [], kwargs or {}, task_id=task_id)
        elif after.payload is not None:
            requeue(app, after)
    except Exception as exc:
        raise _Failure(
            f"run {run_id} is queued again ({tries}) but could not be published "
            f"({describe_exception(exc)}): send {record.task_name} again under task id "
            f"{task_id}, or `lease cancel {run_id}` to undo"
        ) from None
    if publish:
        click.echo(
            f"run {run_id} is queued again ({tries}) and published as task {task_id} "
            "with the given arguments"
        )
    elif after.payload is not None:
        click.echo(f"run {run_id} is queued again ({tries}) and published from its stored message")
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


def _rerun_run_id(task: Any, task_id: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The run id a delivery of ``task`` with these arguments and ``task_id`` claims."""
    from .task import fit_run_id

    if task.lease_config().key is None:
        return fit_run_id(task_id)
    try:
        return str(fit_run_id(task.lease_run_id(*args, **kwargs)))
    except TypeError as exc:
        raise _Failure(f"the arguments do not fit {task.name}: {exc}") from None


# -- top -------------------------------------------------------------------------------

#: ANSI: cursor home and clear the screen; alternate screen on/off; cursor off/on.
_HOME_CLEAR = "\x1b[H\x1b[2J"
_ALT_ON, _ALT_OFF = "\x1b[?1049h", "\x1b[?1049l"
_CURSOR_OFF, _CURSOR_ON = "\x1b[?25l", "\x1b[?25h"


def render_top(store: LeaseStore, shown_url: str, limit: int) -> str:
    """One frame of ``lease top``: live counts, recent activity, the live leases."""
    activity = store.activity(store.now_ms())
    leases = store.live_leases(limit)
    now = activity.now
    counts = activity.counts
    ended = activity.ended_recently
    lines = [
        f"celery lease top  {shown_url}  {format_time(now)} (database clock)",
        f"live      queued {counts[QUEUED]}  running {counts[RUNNING]} "
        f"(expired {activity.expired_leases}, past attempt 1: {activity.running_retries})  "
        f"retrying {counts[RETRYING]}",
        "last 60s  "
        + "  ".join(f"{status} {ended[status]}" for status in sorted(ended))
        + f"  retries/min {activity.retried_recently}",
        "",
    ]
    rows = []
    for r in leases:
        left = "-" if r.lease_expires_at is None else r.lease_expires_at - now
        rows.append(
            (
                r.id,
                r.task_name,
                _short_owner(r.lease_owner),
                f"{r.attempt}/{r.max_attempts}",
                left if isinstance(left, str) else _time_left(left),
                "-" if r.heartbeat_at is None else format_duration(now - r.heartbeat_at),
                "-"
                if r.cancel_requested_at is None
                else format_relative(r.cancel_requested_at, now),
                "-" if r.started_at is None else format_duration(now - r.started_at),
            )
        )
    if rows:
        headers = ("ID", "TASK", "OWNER", "ATTEMPT", "LEFT", "HEARTBEAT", "CANCEL", "RUNNING FOR")
        lines.append(render_table(headers, rows))
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
@click.pass_context
@_operator_errors
def top(ctx: click.Context, interval: float, limit: int, once: bool) -> None:
    """A live view of the leases, refreshed in place, until Ctrl-C.

    Shows the running runs (owner, attempt, lease time left, heartbeat age,
    cancel request), the live runs per status, and what ended or went
    retrying in the last minute; all times by the database clock.
    """
    store = _open_store(ctx)
    shown = str(ctx.meta.get(_URL_KEY, "?"))
    if once:
        click.echo(render_top(store, shown, limit))
        return
    out = sys.stdout
    tty = out.isatty()
    if tty:
        out.write(_ALT_ON + _CURSOR_OFF)
    try:
        while True:
            frame = render_top(store, shown, limit)
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


# -- retention -------------------------------------------------------------------

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """``--older-than`` in seconds: ``90s``, ``15m``, ``12h``, ``7d``, ``1d12h``, ``3600``."""
    seconds = _parse_duration(value.strip().lower())
    if seconds is None:
        raise click.BadParameter(
            f"{value!r} is not a duration: use a number with a unit, e.g. 90s, 15m, 12h, 7d, "
            "2w or 1d12h (a bare number is seconds)"
        )
    if not seconds > 0:
        raise click.BadParameter(f"{value!r}: the age must be more than zero")
    return seconds


def _parse_duration(text: str) -> float | None:
    """Seconds in ``text`` (``7d``, ``1d12h``, ``3600``), or None when it is not a duration."""
    try:
        return float(text) if text and text.replace(".", "", 1).isdigit() else _units(text)
    except ValueError:
        return None


def _units(text: str) -> float | None:
    total, number = 0.0, ""
    for char in text:
        if char.isdigit() or char == ".":
            number += char
        elif char in _DURATION_UNITS and number:
            total += float(number) * _DURATION_UNITS[char]
            number = ""
        else:
            return None
    return None if number or not text else total


def _status_counts(removed: dict[str, int]) -> str:
    return ", ".join(f"{status} {n}" for status, n in removed.items())


@lease.command()
@click.option(
    "--older-than",
    "older_than",
    callback=_duration,
    required=True,
    metavar="AGE",
    help="Only runs that finished longer ago than this (e.g. 7d, 12h, 90m; DB clock).",
)
@click.option(
    "--status",
    "statuses",
    type=click.Choice(STATUSES),
    multiple=True,
    metavar="STATUS",
    help="Only this finished status: succeeded, failed or cancelled (repeatable; default: all).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--batch",
    type=click.IntRange(min=1, max=100_000),
    default=PURGE_BATCH,
    show_default=True,
    help="Rows per delete statement (each its own short transaction).",
)
@click.option(
    "--throttle/--no-throttle",
    default=True,
    show_default=True,
    help="Pause after each batch as long as it took, so claims keep their latency.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
@_operator_errors
def purge(
    ctx: click.Context,
    older_than: float,
    statuses: tuple[str, ...],
    dry_run: bool,
    batch: int,
    throttle: bool,
    as_json: bool,
) -> None:
    """Delete finished runs older than --older-than, in batches; print what was removed.

    Live runs (queued, running, retrying) are never deleted. A duplicate
    delivery of a run whose row is gone runs again, as after lease_retention.
    """
    from . import retention

    live = [s for s in statuses if s not in TERMINAL_STATUSES]
    if live:
        raise click.BadParameter(
            f"{', '.join(live)} {'is' if len(live) == 1 else 'are'} live: only finished runs "
            f"({', '.join(retention.FINISHED)}) can be purged; cancel a live run first",
            param_hint="'--status'",
        )
    wanted = statuses or retention.FINISHED
    store = _open_store(ctx)
    now = store.now_ms()
    cutoff = format_time(now - round(older_than * 1000))
    if dry_run:
        report = retention.count(store, older_than, wanted)
    else:
        report = retention.purge(
            store,
            older_than,
            statuses=wanted,
            batch=batch,
            progress=_Progress(as_json),
            throttle=throttle,
        )
    removed = {status: report.removed[status] for status in retention.FINISHED if status in wanted}
    if as_json:
        _echo_json(
            {
                "dry_run": dry_run,
                "older_than_seconds": older_than,
                "finished_before": now - round(older_than * 1000),
                "removed": removed,
                "total": sum(removed.values()),
                "batches": report.batches,
            }
        )
        return
    verb = "would delete" if dry_run else "deleted"
    total = sum(removed.values())
    click.echo(
        f"{verb} {total} finished run{'' if total == 1 else 's'} that finished before "
        f"{cutoff} ({_status_counts(removed)})"
    )


class _Progress:
    """A progress line on stderr every few seconds of a long purge."""

    EVERY = 2.0

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started = time.monotonic()
        self.shown = self.started

    def __call__(self, report: Any) -> None:
        now = time.monotonic()
        if self.quiet or now - self.shown < self.EVERY:
            return
        self.shown = now
        rate = report.total / max(now - self.started, 1e-9)
        click.echo(
            f"... {report.total} deleted so far ({_status_counts(report.removed)}), "
            f"{rate:.0f} rows/s",
            err=True,
        )
