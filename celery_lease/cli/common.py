"""The ``lease`` command group and what its commands share: errors, the store, formatting.

``celery -A proj lease ...``: the operator's commands.

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
import math
import shlex
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import click
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ..config import LeaseConfig, celery_command, check_setting_names
from ..display import format_duration
from ..errors import LeaseDatabaseError, LeaseError
from ..owner import Owner
from ..sanitize import safe_url, sanitize
from ..schema import (
    RUNNING,
    TABLE_NAME,
    gaps_text,
)
from ..store import LeaseStore, RunNotFound, RunRecord
from ..store.databases import backend_of, database_for

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
    # Celery's retries of the stored message: an older copy of it is dropped.
    "payload_retries",
    "created_at",
    "updated_at",
    # The run's recovery history (never reset): takeovers of an expired lease by a
    # claim, and the sweeper's publishes of it, each with the last time.
    "takeovers",
    "taken_over_at",
    "republishes",
    "republished_at",
    "trace_context",
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
        "taken_over_at",
        "republished_at",
    }
)


class _Failure(click.ClickException):
    """One clear line on stderr and exit status 1 (click prints ``Error: ...``)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


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
        except ImportError as exc:
            url = click.get_current_context().meta.get(_URL_KEY)
            if url is None:
                raise
            database = database_for(backend_of(url))  # its driver, imported on first use
            raise _Failure(f"lease database {url} {database.missing_driver(exc)}") from None
        except RunNotFound as exc:
            raise _Failure(f"no run with id {exc.run_id!r}") from None
        except LeaseDatabaseError as exc:
            url = click.get_current_context().meta.get(_URL_KEY, "?")
            raise _Failure(f"lease database {url}: {sanitize(str(exc))}") from None
        except LeaseError as exc:
            raise _Failure(sanitize(str(exc))) from None

    return cast(F, wrapper)


# -- resolving the database -----------------------------------------------------


def _database_url(ctx: click.Context) -> str:
    """The lease database URL: ``--database-url`` or the app's ``lease_database_url``."""
    override: str | None = ctx.find_root().meta.get("celery_lease.override")
    check_setting_names(ctx.obj.app)  # a misspelled key is refused, as by the worker
    if override is None:
        url = LeaseConfig.from_app(ctx.obj.app).database_url
    else:
        url = LeaseConfig.from_mapping({"lease_database_url": override}).database_url
    ctx.meta[_URL_KEY] = safe_url(url)
    return url


def _missing_database(url: str) -> str | None:
    """Why the database ``url`` names does not exist, where its class can tell without
    connecting (a SQLite file: connecting would create an empty one)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    return database_for(parsed.get_backend_name()).missing(parsed)


def _database_urls(ctx: click.Context) -> list[str]:
    """Every lease database the app uses: ``--database-url`` alone, or the app's
    ``lease_database_url`` then each leased task's own (``lease_database_url``)."""
    if ctx.find_root().meta.get("celery_lease.override") is not None:
        return [_database_url(ctx)]
    from ..runtime import task_configs

    urls = [_database_url(ctx)]
    for config in task_configs(ctx.obj.app):
        if config.database_url not in urls:
            urls.append(config.database_url)
    return urls


def _open_store(ctx: click.Context, url: str | None = None) -> LeaseStore:
    """A store on the lease database (``url``, else the app's), which must exist and hold
    the runs table."""
    url = _database_url(ctx) if url is None else url
    shown = safe_url(url)
    ctx.meta[_URL_KEY] = shown
    missing = _missing_database(url)
    if missing is not None:
        raise _Failure(f"lease database {shown}: {missing}")
    store = LeaseStore.from_url(url)
    ctx.call_on_close(store.dispose)
    present = store.has_schema()
    # A missing table of one feature (the sweeps' record, say) fails that step, with a hint.
    gaps = store.schema_gaps(runs_only=True) if present else []
    if not present or gaps:
        override = ctx.find_root().meta.get("celery_lease.override")
        database = "" if override is None else f" --database-url {shlex.quote(shown)}"
        what = (
            f"holds an older celery-lease schema (it lacks {gaps_text(gaps)})"
            if present
            else f"has no {TABLE_NAME} table"
        )
        on_sqlite = " (or start a worker)" if backend_of(url) == "sqlite" else ""
        raise _Failure(
            f"lease database {shown} {what}: run "
            f"`{celery_command(ctx.obj.app)} lease{database} migrate`{on_sqlite}"
        )
    return store


# -- formatting -------------------------------------------------------------------


def format_time(ms: int | None) -> str:
    """Epoch milliseconds as ``YYYY-MM-DD HH:MM:SS.mmmZ`` (UTC); ``-`` for None."""
    if ms is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


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
    data["checkpoint_bytes"] = (
        None if record.checkpoint is None else len(record.checkpoint.encode())
    )
    data["checkpoint_at"] = record.checkpoint_at
    for name in ("progress_done", "progress_total", "progress_note", "progress_at"):
        data[name] = getattr(record, name)
    data["db_now"] = now
    return data


def _short_owner(owner: str | None) -> str:
    """``host:pid`` of an owner (its random part only matters to the guard)."""
    return Owner.parse(owner).short() if owner else "-"


#: The widest run id a table shows without ``--wide``: a task id (a UUID, 36) fits;
#: a hashed id (``prefix:sha256:<hex>``, 172) is cut in the middle.
ID_WIDTH = 40
#: Characters kept from the end of a cut id (its hash or the distinctive part of a key).
_ID_TAIL = 12
_ELLIPSIS = "..."
#: Printed under a table in which an id was cut.
WIDE_HINT = f"(ids over {ID_WIDTH} characters are cut at {_ELLIPSIS!r}: --wide shows them whole)"


def short_id(run_id: str, wide: bool = False) -> str:
    """``run_id`` for a table: whole with ``wide``, else at most :data:`ID_WIDTH` characters,
    cut in the middle with an ASCII ellipsis (its start and its end tell ids apart; ASCII,
    since a terminal's encoding may not have U+2026)."""
    if wide or len(run_id) <= ID_WIDTH:
        return run_id
    head = ID_WIDTH - len(_ELLIPSIS) - _ID_TAIL
    return f"{run_id[:head]}{_ELLIPSIS}{run_id[-_ID_TAIL:]}"


def wide_option(fun: F) -> F:
    """The ``--wide`` flag of a command that prints run ids in a table."""
    return click.option(
        "--wide",
        is_flag=True,
        help=f"Show run ids whole (a table cuts those over {ID_WIDTH} characters).",
    )(fun)


def shown(cell: str) -> str:
    """``cell`` with each character a terminal would act on (a newline, a NUL, an escape)
    written as its Python escape: a crafted run id or task name cannot forge table rows."""
    if cell.isprintable():
        return cell
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in cell)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain, left-aligned text table (cells as :func:`shown`)."""
    rows = [[shown(cell) for cell in row] for row in rows]
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


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
#: The longest duration option (100 years): a longer one overflowed the clock arithmetic.
MAX_DURATION_SECONDS = 100 * 365 * 86_400
#: The largest ``--limit``: a larger one overflowed the database's integer.
MAX_LIMIT = 1_000_000


class _Seconds(click.FloatRange):
    """A number of seconds from 0.1 to an hour; ``nan`` (which every comparison lets
    through) is refused too."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0.1, max=3600)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


#: ``lease top --interval``.
SECONDS_BETWEEN = _Seconds()


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """A duration option in seconds (``--older-than``, ``--since``): ``90s``, ``15m``,
    ``12h``, ``7d``, ``1d12h``, ``3600``; None when not given."""
    if value is None:
        return None
    seconds = _parse_duration(value.strip().lower())
    if seconds is None:
        raise click.BadParameter(
            f"{value!r} is not a duration: use a number with a unit, e.g. 90s, 15m, 12h, 7d, "
            "2w or 1d12h (a bare number is seconds)"
        )
    if not seconds > 0:
        raise click.BadParameter(f"{value!r}: the duration must be more than zero")
    if seconds > MAX_DURATION_SECONDS:
        raise click.BadParameter(f"{value!r}: the duration must be at most 100 years")
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
