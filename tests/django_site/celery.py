"""The project's Celery app: settings from Django's, under the ``CELERY_`` namespace."""

import os

from celery import Celery

import celery_lease

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_site.settings")

app = Celery("django_site")
# CELERY_BROKER_URL -> broker_url, CELERY_LEASE_SECONDS -> lease_seconds, ...
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Validates the lease_* settings when a worker starts, before it forks its pool.
celery_lease.install(app)
