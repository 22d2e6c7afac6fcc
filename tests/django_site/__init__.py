"""A minimal Django project with a leased Celery task (see docs/django.md).

``celery -A tests.django_site worker`` loads :mod:`tests.django_site.celery`,
which reads every ``CELERY_*`` setting, ``CELERY_LEASE_*`` included, from
:mod:`tests.django_site.settings`.
"""

from .celery import app as celery_app

__all__ = ("celery_app",)
