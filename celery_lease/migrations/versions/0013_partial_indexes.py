"""Make the concurrency and the ``(status, finished_at)`` indexes partial.

A claim inserted every run into both and a completion moved it in both, though
a run without a concurrency key is never read by the first and a running one
never by the second: on SQLite that was a sixth of the lease's CPU per task.
Now the concurrency index holds only runs with a key, the finished index only
runs that ended. PostgreSQL builds each new index concurrently under a
temporary name, drops the old one concurrently and renames the new one, so
queries have one of them throughout; SQLite rebuilds it inside the migration's
write lock. MySQL and MariaDB have no partial indexes: nothing changes there.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

from celery_lease.migrations.online import ddl
from celery_lease.schema import CONCURRENCY_INDEX_WHERE, FINISHED_INDEX_WHERE

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"
INDEXES = {
    "ix_celery_lease_runs_concurrency": (["concurrency_key", "status"], CONCURRENCY_INDEX_WHERE),
    "ix_celery_lease_runs_status_finished": (["status", "finished_at"], FINISHED_INDEX_WHERE),
}


def upgrade() -> None:
    """Rebuild both indexes over the rows their queries read."""
    for name, (columns, where) in INDEXES.items():
        ddl().set_partial(name, TABLE, columns, where)


def downgrade() -> None:
    """Rebuild both indexes over every row."""
    for name, (columns, _) in INDEXES.items():
        ddl().set_partial(name, TABLE, columns, None)
