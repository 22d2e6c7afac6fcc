"""A run's times and reported progress as text, the same in the CLI and the web view."""

from __future__ import annotations


def format_count(value: float) -> str:
    """A progress count: an integer without its ``.0``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def progress_text(done: float | None, total: float | None, note: str | None = None) -> str:
    """``done/total`` (or ``done``), the percentage and the note of a run's last reported
    progress (``self.lease.progress()``), or ``-``."""
    if done is None:
        return "-"
    text = format_count(done)
    if total is not None:
        text += f"/{format_count(total)}"
        if total > 0:
            text += f" ({100 * done / total:.0f}%)"
    if note:
        text += f" {note}"
    return text


def run_progress_text(
    status: str, finished: bool, done: float | None, total: float | None, note: str | None = None
) -> str:
    """What a run shows for its progress: while it is live, its last reported progress
    (:func:`progress_text`); once ``finished``, its outcome, never a mid-way count: a
    succeeded run shows ``succeeded``, a run that ended otherwise where its body stopped
    (``failed at 37/50 (74%)``: the checkpoint a rerun resumes from is near there)."""
    if not finished:
        return progress_text(done, total, note)
    if done is None or status == "succeeded":
        return status
    return f"{status} at {progress_text(done, total)}"


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
    """``ms`` relative to the database's ``now``: ``12.0s ago`` or ``in 3.1s``; ``-``."""
    if ms is None:
        return "-"
    delta = ms - now
    return f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(delta)} ago"


def leader_text(
    owner: str | None, term: int, acquired_at: int, renewed_at: int, expires_at: int, now: int
) -> str:
    """Who holds a leader lease (the sweeper of a database, a beat) and since when, or that
    nobody does; ``owner`` is shown as ``host:pid`` (a worker's: ``node@host:pid``)."""
    if owner is None:
        return "nobody has led yet"
    who = ":".join(owner.split(":")[:2])
    if expires_at <= now:
        ago = format_duration(now - expires_at)
        return f"nobody: the lease of {who} (term {term}) expired {ago} ago"
    return (
        f"{who} since {format_relative(acquired_at, now)} (term {term}), "
        f"renewed {format_relative(renewed_at, now)}"
    )
