"""A stand-in for a card payment gateway (no network; it sleeps instead).

A real gateway call would send ``idempotency_key`` (the lease run id) so that a
stale worker repeating a call cannot charge twice at the gateway either: the
lease fences the shop's own database, the key fences the gateway.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable


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
) -> str:
    """Capture the payment and return the gateway's reference.

    Takes 0.8 to 1.8 s, calling ``checkpoint`` every 50 ms (the task passes
    ``self.lease.check``). Every eighth order times out on its first attempt,
    like a gateway under load.
    """
    number = order_number(order_id)
    deadline = time.monotonic() + 0.8 + (number % 5) * 0.25
    while time.monotonic() < deadline:
        checkpoint()
        time.sleep(0.05)
    if number % 8 == 5 and attempt == 1:
        raise GatewayTimeout(f"gateway timed out capturing {order_id}")
    digest = hashlib.sha256(f"{idempotency_key}:{amount_cents}".encode()).hexdigest()
    return f"gw_{digest[:20]}"
