"""Keep each attempt's trace context with its run (``celery-lease[otel]``).

- ``trace_context``: the W3C ``traceparent`` of the attempt holding the run,
  then, after a space, that of the attempt it took the run over from. The
  claim writes it in its one statement; a later claim reads the first part
  back as the span link to the attempt it continues. At most 111 characters
  are written; the column is bounded at 512.

The column is added nullable (no table rewrite on PostgreSQL 11+, in place on
MySQL/MariaDB).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"


def upgrade() -> None:
    """Add the trace context column."""
    ddl().add_column(TABLE, sa.Column("trace_context", sa.String(512), nullable=True))


def downgrade() -> None:
    """Drop the trace context column."""
    op.drop_column(TABLE, "trace_context")
