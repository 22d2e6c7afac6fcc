"""App config."""

from django.apps import AppConfig


class OrdersConfig(AppConfig):
    """The orders app."""

    name = "tests.django_site.orders"
    label = "orders"
