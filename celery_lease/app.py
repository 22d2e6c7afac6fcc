"""The entry point: :func:`install` connects celery-lease to a Celery app."""

from __future__ import annotations

import contextlib

from celery import Celery

from .config import beat_sweep_interval
from .metrics import MetricsDirectoryMissing, enable_from_app
from .runtime import app_runtime
from .sanitize import protect_loggers
from .sweeper import BEAT_ENTRY_NAME, SWEEP_TASK_NAME
from .tracing import enable_from_app as trace_from_app

#: The worker bootstep, by name: Celery imports ``celery_lease.worker`` when a
#: worker starts. (Imported here it would close a circle: worker -> task -> app.)
BOOTSTEP = "celery_lease.worker:LeaseBootstep"


def _add_beat_entry(app: Celery) -> None:
    """Schedule ``celery_lease.sweep`` in beat every ``lease_sweep_interval`` seconds."""
    schedule = dict(app.conf.beat_schedule or {})
    if BEAT_ENTRY_NAME in schedule:
        return
    interval = beat_sweep_interval(app.conf)
    schedule[BEAT_ENTRY_NAME] = {"task": SWEEP_TASK_NAME, "schedule": interval}
    app.conf.beat_schedule = schedule


def check_extras(app: Celery) -> None:
    """Turn on what ``lease_metrics`` and ``lease_tracing`` ask for (each idempotent).

    Raises:
        ImproperlyConfigured: a setting is not a valid value.
        ImportError: ``lease_metrics = True`` without ``celery-lease[prometheus]``, or
            ``lease_tracing = True`` without ``celery-lease[otel]`` (the message names it).
    """
    # lease_metrics = True: prometheus-client imported, or ImportError naming the extra
    enable_from_app(app)
    # lease_tracing: on when opentelemetry-api is installed (imported only then)
    trace_from_app(app)


def install(app: Celery) -> None:
    """Connect celery-lease to ``app``: the worker bootstep, the beat entry, metrics, tracing.

    Idempotent. ``LeasedTask`` calls it when it is bound to an app, so
    ``base=LeasedTask`` alone is enough.
    """
    protect_loggers()  # every module's logger exists once the package is imported
    runtime = app_runtime(app)
    if runtime.installed:
        return
    # A missing extra or metrics directory is not raised here: install() runs while
    # the tasks' module is imported, where it would be a long traceback (and would stop
    # `celery lease` commands, which need no metrics). The worker's start-up check
    # (check_extras) stops it with one line naming the problem.
    with contextlib.suppress(ImportError, MetricsDirectoryMissing):
        check_extras(app)
    runtime.mark_installed()
    app.steps["worker"].add(BOOTSTEP)  # it connects the signal receivers
    _add_beat_entry(app)
