"""Keep a run's result; count the sweeper's re-publishes; record each sweep.

- ``result`` and ``result_content_type``: the body's return value, serialized
  with the task's result serializer and bounded in size, so the run's outcome
  can be recorded in Celery's result backend from the row (a crash between the
  lease's commit and Celery's, a duplicate under another task id).
- ``requeues``: how many times the sweeper published the run since a worker
  last claimed it (bounded by the run's attempts).
- ``celery_lease_sweeps``: one row per sweeper name, the last sweep's time and
  what it did (``lease stats``, the liveness warning, metrics).

Columns are added nullable or with a constant default (no table rewrite on
PostgreSQL 11+, in place on MySQL/MariaDB); the new table locks nothing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl
from celery_lease.schema import PayloadType

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"


def upgrade() -> None:
    """Add the result and re-publish columns, and the sweeps table."""
    change = ddl()
    change.add_column(TABLE, sa.Column("result", PayloadType, nullable=True))
    change.add_column(TABLE, sa.Column("result_content_type", sa.String(64), nullable=True))
    change.add_column(
        TABLE, sa.Column("requeues", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    op.create_table(
        "celery_lease_sweeps",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("swept_at", sa.BigInteger, nullable=False),
        sa.Column("took_ms", sa.Integer, nullable=False),
        sa.Column("sweeper", sa.String(255), nullable=False),
        sa.Column("requeued", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        sa.Column("cancelled", sa.Integer, nullable=False),
        sa.Column("purged", sa.Integer, nullable=False),
        sa.Column("errors", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    """Drop the sweeps table and the added columns."""
    op.drop_table("celery_lease_sweeps")
    for column in ("requeues", "result_content_type", "result"):
        op.drop_column(TABLE, column)
