"""A stand-in for a card payment gateway (no network; it sleeps instead).

It behaves as real payment providers do with an ``Idempotency-Key``: the first
call with a key charges, and any later call with the same key gets the first
charge back without charging again. The capture task sends
``self.lease.idempotency_key("capture")``, which every attempt of a run derives
the same, so a worker killed after the gateway charged and before the shop
committed is followed by an attempt that charges nothing. (``self.lease.attempt``
would charge twice: it is a fencing token, different in every attempt.) The lease
fences the shop's own database; the key fences the gateway.

Its charges are rows of ``gateway_charges``, written in a transaction and a
thread of their own, as another system's would be: an exception raised into the
caller while it waits (the lease's interrupt) leaves the gateway's side to finish.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from .tables import gateway_charges


class GatewayTimeout(Exception):
    """The gateway did not answer in time; the capture may be retried."""


def order_number(order_id: str) -> int:
    """The trailing number of an order id such as ``ord-1a2b3c-007``."""
    return int(order_id.rsplit("-", 1)[-1])


def capture(
    order_id: str,
    amount_cents: int,
    *,
    idempotency_key: str,
    attempt: int,
    checkpoint: Callable[[], None],
    engine: Engine,
) -> str:
    """Capture the payment and return the gateway's reference.

    Takes 0.6 to 1.6 s, calling ``checkpoint`` every 50 ms (the task passes
    ``self.lease.check``) and once more before the charge is sent: a client frozen
    past its lease finds out then. Every eighth order times out on its first
    attempt, before charging, like a gateway under load. Then it charges, once per
    ``idempotency_key`` (``engine`` holds the gateway's table).
    """
    number = order_number(order_id)
    deadline = time.monotonic() + 0.6 + (number % 5) * 0.25
    while time.monotonic() < deadline:
        checkpoint()
        time.sleep(0.05)
    checkpoint()
    if number % 8 == 5 and attempt == 1:
        raise GatewayTimeout(f"gateway timed out capturing {order_id}")
    return _remote(charge, engine, idempotency_key, order_id, amount_cents)


def _remote(fn: Callable[..., str], *args: Any) -> str:
    """``fn(*args)`` on the gateway's side: in a thread of its own, which the caller waits
    for. Interrupted while waiting, the caller stops; the gateway's work goes on."""
    done: dict[str, Any] = {}

    def work() -> None:
        try:
            done["value"] = fn(*args)
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=work, name="gateway", daemon=True)
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return str(done["value"])


def charge(engine: Engine, idempotency_key: str, order_id: str, amount_cents: int) -> str:
    """Charge once per key: a key seen before returns its charge's reference."""
    digest = hashlib.sha256(f"{idempotency_key}:{amount_cents}".encode()).hexdigest()
    ref = f"gw_{digest[:20]}"
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(gateway_charges).values(
                    idempotency_key=idempotency_key,
                    order_id=order_id,
                    amount_cents=amount_cents,
                    ref=ref,
                )
            )
        return ref
    except IntegrityError:
        pass  # charged before under this key: answer with that charge
    key = gateway_charges.c.idempotency_key == idempotency_key
    with engine.begin() as conn:
        conn.execute(
            update(gateway_charges).where(key).values(replays=gateway_charges.c.replays + 1)
        )
        return str(conn.execute(select(gateway_charges.c.ref).where(key)).scalar_one())
