"""``lease sweep``, ``migrate``, ``stats`` and ``purge``: the table as a whole."""

from __future__ import annotations

import time
from typing import Any

import click
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url

from .. import dberrors
from ..display import format_duration, format_relative, leader_text
from ..errors import LeaseError
from ..sanitize import safe_url, sanitize
from ..schema import (
    STATUSES,
    TABLE_NAME,
    TERMINAL_STATUSES,
)
from ..store import PURGE_BATCH, LeaseStore, RunRecord
from ..store.databases import database_for
from .common import (
    MAX_LIMIT,
    _database_url,
    _database_urls,
    _duration,
    _echo_json,
    _Failure,
    _open_store,
    _operator_errors,
    format_time,
    lease,
    record_data,
)

_SWEEP_LABELS = {
    "requeued": "re-enqueued (retrying)",
    "failed": "failed (lease expired, attempts spent, or undeliverable)",
    "cancelled": "cancelled (cancel was requested)",
    "errors": "could not be re-enqueued",
}


@lease.command()
@click.option("--limit", type=click.IntRange(min=1, max=MAX_LIMIT), default=500, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
@_operator_errors
def sweep(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Run the sweeper once on every lease database of the app (its lease_database_url and
    each task's own; or --database-url alone): recover runs whose lease expired, and print
    what it did on each."""
    from ..sweeper import sweep as run_sweep

    reports: list[dict[str, Any]] = []
    for index, url in enumerate(_database_urls(ctx)):
        shown = safe_url(url)
        try:
            store = _open_store(ctx, url)
            report = run_sweep(ctx.obj.app, store, limit=limit, name="cli")
        except (click.ClickException, LeaseError) as exc:
            if index == 0:
                raise  # the app's own database: the one-line error of every command
            text = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
            reports.append({"database": shown, "error": sanitize(text)})
            continue
        reports.append(
            {
                "database": shown,
                "requeued": list(report.requeued),
                "failed": list(report.failed),
                "cancelled": list(report.cancelled),
                "errors": list(report.errors),
                "steps_failed": list(report.steps_failed),
                "purged": {status: n for status, n in report.purged.items() if n},
                "error": None,
            }
        )
    if as_json:
        total: dict[str, Any] = {key: [] for key in _SWEEP_LABELS}
        purged: dict[str, int] = {}
        for each in reports:
            for key in _SWEEP_LABELS:
                total[key].extend(each.get(key, []))
            for status, n in each.get("purged", {}).items():
                purged[status] = purged.get(status, 0) + n
        steps = [step for each in reports for step in each.get("steps_failed", [])]
        _echo_json({**total, "purged": purged, "steps_failed": steps, "databases": reports})
    else:
        for each in reports:
            _print_sweep(each, len(reports) > 1)
    if any(each["error"] or each["errors"] or each.get("steps_failed") for each in reports):
        ctx.exit(1)


def _print_sweep(report: dict[str, Any], header: bool) -> None:
    """What one database's sweep did, as text (under its URL when there are several)."""
    if header:
        click.echo(f"lease database {report['database']}")
    if report["error"]:
        click.echo(f"  could not sweep: {report['error']}", err=True)
        return
    purged = report["purged"]
    for step in report["steps_failed"]:
        click.echo(f"  step failed: {step}", err=True)
    if not any(report[key] for key in _SWEEP_LABELS) and not purged:
        said = "nothing to sweep" if not report["steps_failed"] else "no run to recover"
        click.echo(said if header else f"{said} on {report['database']}")
    if purged:
        counts = ", ".join(f"{status} {n}" for status, n in purged.items())
        click.echo(f"deleted (finished, older than lease_retention): {counts}")
    for key, label in _SWEEP_LABELS.items():
        ids = report[key]
        if ids:
            click.echo(f"{label}: {len(ids)}")
            for run_id in ids:
                click.echo(f"  {run_id}")


@lease.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0, max=86_400, min_open=True),
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
    No schema change holds lease writes back longer than a tenth of the shortest
    lease in use (the app's and its tasks' lease_seconds, or that of a run running
    or ended within the hour).
    """
    from ..migrations import upgrade

    url = _database_url(ctx)
    shown = safe_url(url)
    parsed = make_url(url)
    unreachable = database_for(parsed.get_backend_name()).unreachable(parsed)
    if unreachable is not None:  # as the worker says it (a SQLite file's missing directory)
        raise _Failure(f"lease database {shown}: {unreachable}")
    shortest = _shortest_lease(ctx, url)
    with dberrors.translated(url):
        result = upgrade(url, revision, lock_timeout=lock_timeout, shortest_lease=shortest)
    if result.adopted:
        click.echo(
            f"{shown}: existing {TABLE_NAME} matches this version; recorded it at revision "
            f"{result.after}"
        )
    elif result.before == result.after and revision not in ("head", "heads", result.after):
        click.echo(
            f"{shown}: at revision {result.after}, past {revision} already "
            "(migrate never downgrades): nothing to do"
        )
    elif result.before == result.after:
        click.echo(f"{shown}: already at revision {result.after}")
    else:
        click.echo(f"{shown}: migrated {result.before or '(empty)'} -> {result.after}")


def _shortest_lease(ctx: click.Context, url: str) -> float | None:
    """The shortest ``lease_seconds`` of the app and its leased tasks on ``url`` (all of them
    with ``--database-url``); None when the app's settings cannot be read."""
    from ..config import LeaseConfig
    from ..runtime import task_configs

    override = ctx.find_root().meta.get("celery_lease.override") is not None
    try:
        configs = [LeaseConfig.from_app(ctx.obj.app), *task_configs(ctx.obj.app)]
    except ImproperlyConfigured:
        return None
    found = [c.lease_seconds for c in configs if override or c.database_url == url]
    return min(found, default=None)


_NOT_RECORDED = (
    "a worker that loses its lease writes nothing to the table, so lease losses seen by "
    "workers are not counted here: use the celery_lease_lease_lost_total metric or log "
    "records with lease_event=lost"
)


@lease.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_operator_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Per lease database of the app (its lease_database_url and each task's own, or
    --database-url alone): counts per status, live leases, the oldest running run,
    recent lease expiries and the last sweep."""
    found: list[dict[str, Any]] = []
    for index, url in enumerate(_database_urls(ctx)):
        try:
            store = _open_store(ctx, url)
            found.append(_stats_of(store, safe_url(url)))
        except (click.ClickException, LeaseError) as exc:
            if index == 0:
                raise  # the app's own database: the one-line error of every command
            text = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
            found.append({"database": safe_url(url), "error": sanitize(text)})
    if as_json:
        _echo_json({**found[0], "databases": found})
        return
    for index, data in enumerate(found):
        if index:
            click.echo("")
        _print_stats(data)
    if any(data.get("error") for data in found):
        ctx.exit(1)


def _stats_of(store: LeaseStore, shown: str) -> dict[str, Any]:
    """``lease stats --json`` of one database."""
    data = store.reads.stats()
    now: int = data["now"]
    counts: dict[str, int] = {status: data["counts"].get(status, 0) for status in STATUSES}
    oldest: RunRecord | None = data["oldest_running"]
    try:
        last = store.reads.last_sweep()
    except LeaseError:  # no celery_lease_sweeps table yet: `lease migrate` adds it
        last = None
    try:
        leaders = store.leaders.list_all()
    except LeaseError:  # no celery_lease_leaders table yet: `lease migrate` adds it
        leaders = []
    try:
        held = store.flow.flow_counts()
        paused_tasks = store.flow.list_pauses()
    except LeaseError:  # no flow-control tables yet: `lease migrate` adds them
        held, paused_tasks = None, []
    return {
        "database": shown,
        "error": None,
        "db_now": now,
        "flow": {
            "paused": [
                {"task_name": p.task_name, "key": p.key or None, "since": p.paused_at}
                for p in paused_tasks
            ],
            "held": []
            if held is None
            else [
                {
                    "task_name": task,
                    "key": key or None,
                    "paused": held.paused.get((task, key), 0),
                    "deferred": held.deferred.get((task, key), 0),
                }
                for task, key in sorted({*held.paused, *held.deferred})
            ],
        },
        "counts": counts,
        "total": sum(counts.values()),
        "live_leases": data["live_leases"],
        "expired_leases": data["expired_leases"],
        "oldest_running": None if oldest is None else record_data(oldest, now),
        "lease_expired_last_hour": data["lease_expired_recent"],
        "lease_lost_at_workers": None,
        "note": _NOT_RECORDED,
        "leaders": [
            {
                "name": leader.name,
                "owner": leader.owner,
                "term": leader.term,
                "live": leader.live,
                "text": leader_text(
                    leader.owner,
                    leader.term,
                    leader.acquired_at,
                    leader.renewed_at,
                    leader.expires_at,
                    leader.now,
                ),
            }
            for leader in leaders
        ],
        "last_sweep": None
        if last is None
        else {
            "name": last["name"],
            "swept_at": last["swept_at"],
            "age_ms": max(0, last["now"] - last["swept_at"]),
            "took_ms": last["took_ms"],
            "sweeper": last["sweeper"],
            **{key: last[key] for key in ("requeued", "failed", "cancelled", "purged", "errors")},
        },
    }


def _print_stats(data: dict[str, Any]) -> None:
    """One database's ``lease stats``, as text."""
    click.echo(f"lease database   {data['database']}")
    if data["error"]:
        click.echo(f"  could not read it: {data['error']}", err=True)
        return
    now: int = data["db_now"]
    click.echo(f"database clock   {format_time(now)}")
    click.echo("")
    width = max(len(s) for s in STATUSES)
    counts = data["counts"]
    for status in STATUSES:
        click.echo(f"  {status.ljust(width)}  {counts[status]}")
    click.echo(f"  {'total'.ljust(width)}  {data['total']}")
    click.echo("")
    oldest = data["oldest_running"]
    if oldest is None:
        oldest_text = "-"
    else:
        started = format_relative(oldest["started_at"], now)
        left = oldest["lease_left_ms"]
        lease_text = (
            "-"
            if left is None
            else (
                f"{format_duration(left)} left"
                if left > 0
                else f"expired {format_duration(left)} ago"
            )
        )
        oldest_text = (
            f"{oldest['id']} ({oldest['task_name']}), started {started},"
            f" attempt {oldest['attempt']}/{oldest['max_attempts']}, lease {lease_text}"
        )
    last = data["last_sweep"]
    if last is None:
        sweep_text = (
            "never recorded (every worker sweeps unless lease_worker_sweeper = False; "
            "or run `lease sweep`)"
        )
    else:
        sweep_text = (
            f"{format_duration(last['age_ms'])} ago by {last['sweeper']} ({last['name']}, "
            f"took {format_duration(last['took_ms'])}: re-enqueued {last['requeued']}, "
            f"failed {last['failed']}, cancelled {last['cancelled']}, "
            f"purged {last['purged']}, errors {last['errors']})"
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
            f"{data['lease_expired_last_hour']} (runs with failure_code=lease_expired updated "
            "in the last hour; a run re-claimed and finished since no longer carries it)",
        ),
        ("sweeper", _leader_of(data["leaders"], "sweeper")),
        ("last sweep", sweep_text),
        *(
            (leader["name"], leader["text"])
            for leader in data["leaders"]
            if leader["name"] != "sweeper"
        ),
        ("paused", _paused_text(data["flow"])),
        ("held deliveries", _held_text(data["flow"])),
        ("lease lost at workers", f"not recorded: {_NOT_RECORDED}"),
    ]
    label_width = max(len(label) for label, _ in facts)
    for label, text in facts:
        click.echo(f"{label.ljust(label_width)}  {text}")


def _leader_of(leaders: list[dict[str, Any]], name: str) -> str:
    """Who leads ``name`` (the in-worker sweeper), for ``lease stats``."""
    found = next((leader for leader in leaders if leader["name"] == name), None)
    if found is None:
        return "no worker has led it (lease_worker_sweeper = False on every worker?)"
    return str(found["text"])


def _paused_text(flow: dict[str, Any]) -> str:
    """What is paused, for ``lease stats``."""
    paused = [
        p["task_name"] + ("" if p["key"] is None else f" (key {p['key']})") for p in flow["paused"]
    ]
    return ", ".join(paused) if paused else "nothing"


def _held_text(flow: dict[str, Any]) -> str:
    """Deliveries held per task and key, paused and deferred (rate limit), for ``lease stats``."""
    held = [
        h["task_name"]
        + ("" if h["key"] is None else f" (key {h['key']})")
        + f": paused {h['paused']}, deferred {h['deferred']}"
        for h in flow["held"]
    ]
    return "; ".join(held) if held else "none"


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
    Follow-up tasks recorded longer ago than --older-than and never published
    are deleted too, and so are the rate buckets of idle rate keys (whose last
    slot has passed, whatever --older-than says: they carry nothing). The results
    kept in succeeded rows for a replay are dropped once the app's result_expires
    has passed, as the sweep does (the rows stay).
    """
    from .. import followups, retention
    from ..runtime import result_format

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
    unsent = followups.purge(store, older_than, dry_run=dry_run)
    idle_rates = retention.purge_rates(store, None, dry_run=dry_run)
    expires_ms = result_format(ctx.obj.app).expires_ms
    expired = retention.expire_results(store, expires_ms, None, dry_run=dry_run)
    if as_json:
        _echo_json(
            {
                "dry_run": dry_run,
                "older_than_seconds": older_than,
                "finished_before": now - round(older_than * 1000),
                "removed": removed,
                "total": sum(removed.values()),
                "batches": report.batches,
                "unsent_followups": unsent,
                "idle_rate_keys": idle_rates,
                "expired_results": expired,
            }
        )
        return
    verb = "would delete" if dry_run else "deleted"
    total = sum(removed.values())
    click.echo(
        f"{verb} {total} finished run{'' if total == 1 else 's'} that finished before "
        f"{cutoff} ({_status_counts(removed)})"
    )
    if unsent:
        click.echo(
            f"{verb} {unsent} follow-up task{'' if unsent == 1 else 's'} recorded before "
            f"{cutoff} and never published"
        )
    if idle_rates:
        click.echo(
            f"{verb} {idle_rates} idle rate key{'' if idle_rates == 1 else 's'} "
            "(rate buckets whose last slot has passed)"
        )
    if expired and expires_ms is not None:
        click.echo(
            f"{'would drop' if dry_run else 'dropped'} {expired} kept result"
            f"{'' if expired == 1 else 's'} older than result_expires ({expires_ms / 1000:g}s; "
            "the runs stay)"
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
