"""One model the leased task writes."""

from django.db import models


class Order(models.Model):
    """An order placed once per order number, by the attempt that held the lease."""

    number = models.CharField(max_length=64, unique=True)
    attempt = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
