"""Keep Celery's ``retries`` of each run's stored message.

- ``payload_retries``: the ``retries`` of the message the row keeps (the claiming
  delivery's, or the retry a body asked for). A delivery under the run's own task
  id with fewer retries is an older copy of that message, such as the original of
  a retry that the broker delivers again because its ack failed; the claim
  refuses it instead of running the body once more with ``request.retries`` one
  lower.

The column is added with a constant default (no table rewrite on PostgreSQL 11+,
in place on MySQL/MariaDB); existing rows read 0, which refuses nothing.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"


def upgrade() -> None:
    """Add the stored message's retries."""
    ddl().add_column(
        TABLE,
        sa.Column("payload_retries", sa.Integer, nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    """Drop the stored message's retries."""
    op.drop_column(TABLE, "payload_retries")
