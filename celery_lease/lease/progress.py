"""A body's progress reports: :class:`ProgressReport`, one per lease.

``self.lease.progress(done, total, note)`` is checked here, where the body
hands it over, and kept in memory; the next heartbeat renewal writes it in
its own statement (never one of its own) and reports back what it wrote.
"""

from __future__ import annotations

from ..schema import check_progress
from ..store.records import Progress


class ProgressReport:
    """The latest progress a body reported, and the one a renewal last wrote."""

    __slots__ = ("_latest", "_written")

    def __init__(self) -> None:
        self._latest: Progress | None = None
        self._written: Progress | None = None

    def report(self, done: float, total: float | None = None, note: str | None = None) -> None:
        """Keep ``done``/``total``/``note`` for the next renewal.

        Raises:
            LeaseInputError: ``done``/``total`` are not finite numbers a double holds,
                or ``note`` is not a string of at most 200 characters of text (no NUL,
                no lone surrogate).
        """
        self._latest = Progress(*check_progress(done, total, note))

    def pending(self) -> Progress | None:
        """The progress a renewal should write now: reported and not written yet."""
        latest = self._latest
        return None if latest is self._written else latest

    def written(self, progress: Progress) -> None:
        """A confirmed renewal wrote ``progress`` (or dropped it, refused by the database:
        it is not offered again; the body's next report is)."""
        self._written = progress
