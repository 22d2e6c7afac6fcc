"""The shop's own tables (SQLAlchemy Core), kept in the lease database.

They live next to ``celery_lease_runs`` so that a capture's writes and its
lease check (``self.lease.fence(conn)``) happen in one transaction.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Integer, MetaData, String, Table, text

metadata = MetaData()

#: One row per order; ``status`` goes ``pending`` -> ``captured``.
orders = Table(
    "shop_orders",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("merchant_id", String(32), nullable=False),
    Column("amount_cents", Integer, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("status", String(16), nullable=False, default="pending"),
    # Database clock, epoch milliseconds (LeaseStore.now_ms), like the lease table.
    Column("submitted_at_ms", BigInteger, nullable=False),
)

#: One row per committed capture. There is deliberately no UNIQUE(order_id):
#: the demo counts double commits instead of letting a constraint hide them.
#: A production schema should add that constraint as a second line of defence.
payments = Table(
    "shop_payments",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False, index=True),
    Column("merchant_id", String(32), nullable=False),
    Column("amount_cents", Integer, nullable=False),
    Column("gateway_ref", String(64), nullable=False),
    # The lease attempt that wrote this row: the fencing token.
    Column("fencing_token", Integer, nullable=False),
    Column("captured_by", String(255), nullable=False),
    # Worker wall clock, only used by the demo to measure per-merchant overlap.
    Column("body_started_at", Float, nullable=False),
    Column("committed_at", Float, nullable=False),
)

#: One row per order the export job sent to the warehouse. Again no UNIQUE(order_id):
#: the demo counts orders exported twice instead.
exports = Table(
    "shop_exports",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False, index=True),
    # The lease attempt that exported it, and its owner.
    Column("attempt", Integer, nullable=False),
    Column("exported_by", String(255), nullable=False),
)

#: One row per order receipt sent: the follow-up task ``send_receipt`` writes it with its
#: run's success. Again no UNIQUE(order_id): the demo counts receipts sent twice.
receipts = Table(
    "shop_receipts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False, index=True),
    # The follow-up's task id (its run id), derived from the capture's run.
    Column("run_id", String(255), nullable=False),
)

#: The stand-in gateway's own record (see gateway.py): one row per charge, keyed by the
#: idempotency key the capture sent. Kept in the shop's database only for the demo's
#: convenience; a real gateway is another system, which no lease transaction includes.
gateway_charges = Table(
    "gateway_charges",
    metadata,
    Column("idempotency_key", String(255), primary_key=True),
    Column("order_id", String(64), nullable=False, index=True),
    Column("amount_cents", Integer, nullable=False),
    Column("ref", String(64), nullable=False),
    # Calls that came again with this key: answered with the first charge.
    Column("replays", Integer, nullable=False, server_default=text("0")),
)
