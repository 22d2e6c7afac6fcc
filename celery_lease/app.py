"""The entry point: :func:`install` connects celery-lease to a Celery app."""

from __future__ import annotations

from celery import Celery

from .config import beat_sweep_interval
from .metrics import enable_from_app
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


def install(app: Celery) -> None:
    """Connect celery-lease to ``app``: the worker bootstep, the beat entry, metrics, tracing.

    Idempotent. ``LeasedTask`` calls it when it is bound to an app, so
    ``base=LeasedTask`` alone is enough.
    """
    protect_loggers()  # every module's logger exists once the package is imported
    runtime = app_runtime(app)
    if runtime.installed:
        return
    # lease_metrics = True; a clear ImportError without the extra
    enable_from_app(app)
    # lease_tracing: on when opentelemetry-api is installed (imported only then)
    trace_from_app(app)
    runtime.mark_installed()
    app.steps["worker"].add(BOOTSTEP)  # it connects the signal receivers
    _add_beat_entry(app)
