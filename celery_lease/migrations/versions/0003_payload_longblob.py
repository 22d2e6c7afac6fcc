"""Store the message in LONGBLOB on MySQL/MariaDB (BLOB stops at 64 KiB).

InnoDB cannot change a column's type in place: the table is copied, and writes
wait for the copy (reads go on). The wait for its metadata lock is bounded
(see :mod:`celery_lease.migrations.online`).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from celery_lease.migrations.online import ddl

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

MYSQL = ("mysql", "mariadb")


def upgrade() -> None:
    """Widen ``payload`` to LONGBLOB on MySQL; other dialects' type already holds it."""
    if op.get_context().dialect.name in MYSQL:
        ddl().bounded(
            lambda: op.alter_column(
                "celery_lease_runs",
                "payload",
                existing_type=sa.LargeBinary(),
                type_=mysql.LONGBLOB(),
                existing_nullable=True,
            )
        )


def downgrade() -> None:
    """Back to BLOB on MySQL (fails on rows whose payload exceeds 64 KiB)."""
    if op.get_context().dialect.name in MYSQL:
        op.alter_column(
            "celery_lease_runs",
            "payload",
            existing_type=mysql.LONGBLOB(),
            type_=sa.LargeBinary(),
            existing_nullable=True,
        )
