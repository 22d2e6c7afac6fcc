"""A leased task whose ORM write and run completion commit together."""

from typing import Any

from celery import shared_task

from celery_lease import LeasedTask
from celery_lease.contrib.django import fenced_atomic

from .models import Order


@shared_task(base=LeasedTask, bind=True, lease_key=lambda number: f"order:{number}")
def place_order(self: Any, number: str) -> str:
    """Create the order once: the row and the run's success commit in one transaction."""
    with fenced_atomic(self.lease):  # complete=True: the run is succeeded with the row
        Order.objects.create(number=number, attempt=self.lease.attempt)
    return number
