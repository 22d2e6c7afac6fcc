"""The shop's tasks and the functions that place orders and submit their captures.

``capture_payment`` is a ``LeasedTask``: its run id is the order (an
idempotency key, so submitting an order twice is one run), at most two
captures per merchant run at a time (a concurrency key), the gateway gets the
run's idempotency key (one charge, however many attempts), and its writes
commit only while the worker still holds the lease (``self.lease.fence``),
together with the receipt follow-up, which is sent only once they committed.
``export_orders`` is a resumable job: each chunk of exported orders commits
with its checkpoint, so a killed worker's successor resumes where it stopped.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import Engine, insert, select, update

from celery_lease import LeasedTask, store_for

from . import gateway
from .app import app, settings
from .tables import exports, orders, payments, receipts

logger = logging.getLogger(__name__)

#: At most this many captures per merchant at once (the gateway's rate limit).
MAX_CAPTURES_PER_MERCHANT = 2


def capture_run_id(order_id: str, merchant_id: str) -> str:
    """The idempotency key: one capture run per order, however often it is submitted."""
    return order_id


def merchant_key(order_id: str, merchant_id: str) -> str:
    """The concurrency key: captures of one merchant share its slots."""
    return f"merchant-{merchant_id}"


def shop_engine() -> Engine:
    """An engine on the lease database, which also holds the shop's tables.

    ``store_for(app).engine`` is the lease store's own engine (on SQLite it is
    set up for many writer processes), and ``fence()`` needs a connection to
    exactly that database.
    """
    return store_for(app).engine


def read_engine() -> Engine:
    """The same database for reads that need no transaction.

    On SQLite the lease engine opens every transaction with ``BEGIN IMMEDIATE``
    (the write lock), so plain reads run in autocommit instead.
    """
    return shop_engine().execution_options(isolation_level="AUTOCOMMIT")


class UnknownOrder(Exception):
    """The order to capture does not exist."""


@app.task(  # type: ignore[untyped-decorator]
    base=LeasedTask,
    bind=True,
    name="example_project.capture_payment",
    lease_key=capture_run_id,
    lease_namespace="capture",  # run ids read "capture:<order id>"
    lease_concurrency_key=merchant_key,
    lease_max_concurrency=MAX_CAPTURES_PER_MERCHANT,
)
def capture_payment(self: LeasedTask, order_id: str, merchant_id: str) -> str:
    """Capture an order's payment at the gateway and record it, exactly once."""
    lease = self.lease
    body_started_at = time.time()
    with read_engine().connect() as conn:
        order = conn.execute(select(orders).where(orders.c.id == order_id)).one_or_none()
    if order is None:
        raise UnknownOrder(order_id)
    gateway_ref = gateway.capture(
        order_id,
        order.amount_cents,
        # The same in every attempt of this run ("capture:<order>:capture:0"): a retry
        # after a crash past this call gets the first charge back, never a second one.
        idempotency_key=lease.idempotency_key("capture"),
        attempt=lease.attempt,
        checkpoint=lease.check,  # LeaseLost / RunCancelled as soon as the heartbeat knows
        engine=shop_engine(),
    )
    time.sleep(settings.timings.after_reply)  # bookkeeping before the commit
    with shop_engine().begin() as conn:
        # Lock the run row, prove we still own it and mark it succeeded, all in
        # this transaction: the payment and the completion commit together, or
        # (lease lost) neither does. The receipt is recorded in it too, and sent
        # once it has committed.
        lease.fence(conn, complete=True, send=[send_receipt.s(order_id)])
        conn.execute(
            insert(payments).values(
                order_id=order_id,
                merchant_id=merchant_id,
                amount_cents=order.amount_cents,
                gateway_ref=gateway_ref,
                fencing_token=lease.attempt,
                captured_by=lease.owner,
                body_started_at=body_started_at,
                committed_at=time.time(),
            )
        )
        conn.execute(update(orders).where(orders.c.id == order_id).values(status="captured"))
    return gateway_ref


@app.task(  # type: ignore[untyped-decorator]
    base=LeasedTask, bind=True, name="example_project.send_receipt"
)
def send_receipt(self: LeasedTask, order_id: str) -> str:
    """Send an order's receipt (a row in ``shop_receipts``), as a follow-up of its capture.

    A ``LeasedTask``: its run id is the task id the capture's lease derived, so if the
    sweeper ever publishes it a second time, this lease drops the copy.
    """
    with shop_engine().begin() as conn:
        self.lease.fence(conn, complete=True)
        conn.execute(insert(receipts).values(order_id=order_id, run_id=self.lease.run_id))
    return order_id


#: Orders per fenced transaction of the export (one checkpoint each).
EXPORT_CHUNK = 10


@app.task(  # type: ignore[untyped-decorator]
    base=LeasedTask,
    bind=True,
    name="example_project.export_orders",
    lease_key=lambda prefix, pause=0.0: prefix,
    lease_namespace="export",  # run ids read "export:<prefix>"
)
def export_orders(self: LeasedTask, prefix: str, pause: float = 0.0) -> int:
    """Export every order whose id starts with ``prefix`` to the warehouse, exactly once.

    Each chunk's rows and the checkpoint (how many orders are done) commit in
    one fenced transaction: a successor of a killed worker resumes at the
    first order not exported, and no order is exported twice. ``pause``: the
    warehouse's latency per order, in seconds.
    """
    lease = self.lease
    with read_engine().connect() as conn:
        ids = list(
            conn.execute(
                select(orders.c.id).where(orders.c.id.like(prefix + "%")).order_by(orders.c.id)
            ).scalars()
        )
    done = int(lease.last_checkpoint or 0)
    if done:
        logger.info(
            "export %s: attempt %d resumes at order %d of %d from its checkpoint",
            prefix,
            lease.attempt,
            done,
            len(ids),
        )
    while done < len(ids):
        chunk = ids[done : done + EXPORT_CHUNK]
        time.sleep(pause * len(chunk))  # sending them to the warehouse
        with shop_engine().begin() as conn:
            lease.fence(conn, checkpoint=done + len(chunk))
            conn.execute(
                insert(exports),
                [
                    {"order_id": i, "attempt": lease.attempt, "exported_by": lease.owner}
                    for i in chunk
                ],
            )
        done += len(chunk)
        lease.progress(done, len(ids), "orders exported")
    return done


@app.task(name="example_project.resubmit_stalled_captures")  # type: ignore[untyped-decorator]
def resubmit_stalled_captures() -> int:
    """Submit again every pending order whose capture never started.

    A publish can be lost (a broker outage, or kombu's filesystem transport
    racing a consumer) before any worker saw it; then no lease row exists and
    celery-lease's sweeper cannot know about the order. Runs that did start are
    the sweeper's job. Submitting again is safe: the run id is the order.
    """
    store = store_for(app)
    cutoff = store.now_ms() - round(settings.timings.resubmit_after * 1000)
    with read_engine().connect() as conn:
        stalled = conn.execute(
            select(orders.c.id, orders.c.merchant_id).where(
                orders.c.status == "pending", orders.c.submitted_at_ms < cutoff
            )
        ).all()
    resubmitted = 0
    for order_id, merchant_id in stalled:
        if store.get(capture_payment.lease_run_id(order_id, merchant_id)) is None:
            logger.warning("order %s: capture never started; submitting it again", order_id)
            submit_capture(order_id, merchant_id)
            resubmitted += 1
    return resubmitted


def place_order(order_id: str, merchant_id: str, amount_cents: int, currency: str = "EUR") -> None:
    """Record a new pending order."""
    store = store_for(app)
    with shop_engine().begin() as conn:
        conn.execute(
            insert(orders).values(
                id=order_id,
                merchant_id=merchant_id,
                amount_cents=amount_cents,
                currency=currency,
                status="pending",
                submitted_at_ms=store.now_ms(),
            )
        )


def submit_capture(order_id: str, merchant_id: str) -> None:
    """Enqueue the capture of an order (any number of times: it runs once)."""
    now = store_for(app).now_ms()
    with shop_engine().begin() as conn:
        conn.execute(update(orders).where(orders.c.id == order_id).values(submitted_at_ms=now))
    capture_payment.apply_async(args=(order_id, merchant_id))
