"""A run's reported progress as text, the same in ``lease show``, ``lease top`` and the web view."""

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
