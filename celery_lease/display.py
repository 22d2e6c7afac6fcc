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
