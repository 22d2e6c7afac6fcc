"""Keep each run's recovery history: takeovers and the sweeper's re-publishes, in all.

- ``takeovers`` and ``taken_over_at``: how many times a claim took the run over
  from an expired lease, and when it last did (epoch ms, DB clock).
- ``republishes`` and ``republished_at``: how many times the sweeper published
  the run (an expired lease handed back, or a message that was never claimed),
  and when it last did. Unlike ``requeues`` (the re-publishes since the last
  claim, which bound a run no worker takes), no claim resets them.

Written by the statements that already run (the claim's takeover, the sweep's
hand-back and re-enqueue), so the web view counts real takeovers and sweeps.
Columns are added nullable or with a constant default (no table rewrite on
PostgreSQL 11+, in place on MySQL/MariaDB); workers of the previous version keep
working on the new schema (they leave the columns at their defaults).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"

COLUMNS = ("takeovers", "taken_over_at", "republishes", "republished_at")


def upgrade() -> None:
    """Add the takeover and re-publish history columns."""
    change = ddl()
    for counter, moment in (("takeovers", "taken_over_at"), ("republishes", "republished_at")):
        change.add_column(
            TABLE, sa.Column(counter, sa.Integer, nullable=False, server_default=sa.text("0"))
        )
        change.add_column(TABLE, sa.Column(moment, sa.BigInteger, nullable=True))


def downgrade() -> None:
    """Drop the history columns."""
    for column in reversed(COLUMNS):
        op.drop_column(TABLE, column)
