"""The history checker: what every run's rows and effects must say after chaos."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from sqlalchemy import select

from tests.cluster import Cluster
from tests.workerapp import effects


@dataclasses.dataclass
class History:
    """Per-scenario verdict; every count but ``runs`` and ``retried`` must be 0."""

    runs: int = 0
    double_commits: int = 0
    lost: int = 0
    not_terminal: int = 0
    bad_attempt: int = 0
    retried: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no invariant failed."""
        return not (self.double_commits or self.lost or self.not_terminal or self.bad_attempt)

    def line(self, name: str) -> str:
        """The one summary line the suite prints per scenario."""
        return (
            f"chaos[{name}]: runs={self.runs} double_commits={self.double_commits} "
            f"lost={self.lost} not_terminal={self.not_terminal} "
            f"bad_attempt={self.bad_attempt} retried={self.retried}"
        )


def check(cluster: Cluster, run_ids: list[str]) -> History:
    """Check each run: succeeded, exactly one committed effect, made by its last attempt.

    ``attempt`` must be consistent with the history: the row's attempt is at
    least every attempt that started, and the committing attempt is the row's.
    """
    history = History(runs=len(run_ids))
    with cluster.engine.connect() as conn:
        rows = conn.execute(select(effects).where(effects.c.run_id.in_(run_ids))).all()
    by_run: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        by_run[row.run_id].append(row)
    for run_id in run_ids:
        record = cluster.store.get(run_id)
        commits = [e for e in by_run[run_id] if e.kind == "commit"]
        starts = [e.attempt for e in by_run[run_id] if e.kind == "start"]
        if record is None or record.status != "succeeded":
            status = None if record is None else record.status
            if record is None or status in ("running", "retrying", "queued"):
                history.not_terminal += 1
            history.lost += 1 if not commits else 0
            history.problems.append(f"{run_id}: status {status}, {len(commits)} commits")
            continue
        if len(commits) != 1:
            history.double_commits += len(commits) > 1
            history.lost += not commits
            history.problems.append(f"{run_id}: {len(commits)} commits")
            continue
        if commits[0].attempt != record.attempt or (starts and max(starts) > record.attempt):
            history.bad_attempt += 1
            history.problems.append(
                f"{run_id}: row attempt {record.attempt}, commit by {commits[0].attempt}, "
                f"starts {sorted(starts)}"
            )
        if record.attempt > 1:
            history.retried += 1
    return history


def guarded_overlaps(cluster: Cluster, run_ids: list[str]) -> list[str]:
    """Side effects guarded by ``check()`` alone that an attempt made after a later attempt
    of the same run had started: the double effects a stale lease holder must never make.

    An attempt's ``guarded`` effect is fine before the next attempt's ``start`` (its lease
    was live, then lost before the commit; the next attempt redoes the work, as any retry
    does). After it, two owners acted at once.
    """
    with cluster.engine.connect() as conn:
        rows = conn.execute(
            select(effects).where(
                effects.c.run_id.in_(run_ids), effects.c.kind.in_(("start", "guarded"))
            )
        ).all()
    starts: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row.kind == "start":
            first = starts[row.run_id].get(row.attempt)
            starts[row.run_id][row.attempt] = row.at if first is None else min(first, row.at)
    found = []
    for row in rows:
        if row.kind != "guarded":
            continue
        later = [at for attempt, at in starts[row.run_id].items() if attempt > row.attempt]
        if later and row.at > min(later):
            found.append(
                f"{row.run_id}: attempt {row.attempt} wrote its guarded effect "
                f"{row.at - min(later):.3f}s after a later attempt started"
            )
    return found
