"""Settings of the example Django project.

The tests choose the database and the broker folder with environment
variables (``DJ_DATABASE``: a ``DATABASES["default"]`` entry as JSON;
``DJ_FS_DIR``; ``DJ_EXTRA``: more settings as JSON, e.g. a bad one).
"""

import json
import os
from pathlib import Path

from celery_lease.contrib.django import lease_database_url

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = "example-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["tests.django_site.orders"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": json.loads(os.environ["DJ_DATABASE"])
    if os.environ.get("DJ_DATABASE")
    else {"ENGINE": "django.db.backends.sqlite3", "NAME": str(BASE_DIR / "db.sqlite3")}
}

# Celery, read by app.config_from_object("django.conf:settings", namespace="CELERY").
CELERY_BROKER_URL = "filesystem://"
# Whole-file publishes for the filesystem broker (kombu's own can lose a message).
CELERY_BROKER_TRANSPORT = "celery_lease.contrib.fs_transport:Transport"
_folder = os.environ.get("DJ_FS_DIR", str(BASE_DIR / "broker"))
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "data_folder_in": _folder,
    "data_folder_out": _folder,
    "control_folder": os.path.join(_folder, "control"),
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

# celery-lease: the run table lives in the project's own database.
CELERY_LEASE_DATABASE_URL = lease_database_url(DATABASES["default"])
CELERY_LEASE_SECONDS = 10
CELERY_LEASE_MAX_ATTEMPTS = 3

globals().update(json.loads(os.environ.get("DJ_EXTRA", "{}")))
