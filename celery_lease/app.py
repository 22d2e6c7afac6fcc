"""The entry point: :func:`install` connects celery-lease to a Celery app."""

from __future__ import annotations

from celery import Celery, signals

from .runtime import Runtime, WorkerInstance, runtime_for, shutting_down, store_for, worker_id
from .sanitize import protect_loggers
from .sweeper import BEAT_ENTRY_NAME, SWEEP_TASK_NAME
from .worker import (
    LeaseBootstep,
    _installed_apps,
    _on_task_revoked,
    _on_worker_process_init,
    _on_worker_process_shutdown,
    _on_worker_shutting_down,
)

__all__ = [
    "Runtime",
    "WorkerInstance",
    "install",
    "runtime_for",
    "shutting_down",
    "store_for",
    "worker_id",
]


def _add_beat_entry(app: Celery) -> None:
    """Schedule ``celery_lease.sweep`` in beat every ``lease_sweep_interval`` seconds."""
    schedule = dict(app.conf.beat_schedule or {})
    if BEAT_ENTRY_NAME in schedule:
        return
    interval = app.conf.get("lease_sweep_interval") or 60.0
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        interval = 60.0  # the bootstep reports the bad value; beat keeps a sane default
    schedule[BEAT_ENTRY_NAME] = {"task": SWEEP_TASK_NAME, "schedule": float(interval)}
    app.conf.beat_schedule = schedule


def install(app: Celery) -> None:
    """Connect celery-lease to ``app``: signal handlers and the worker bootstep.

    Idempotent. ``LeasedTask`` calls it when it is bound to an app, so
    ``base=LeasedTask`` alone is enough.
    """
    protect_loggers()  # every module's logger exists once the package is imported
    if app.__dict__.get("_celery_lease_installed"):
        return
    from .metrics import enable_from_app

    enable_from_app(app)  # lease_metrics = True; a clear ImportError without the extra
    app._celery_lease_installed = True
    _installed_apps.append(app)
    app.steps["worker"].add(LeaseBootstep)
    signals.worker_process_init.connect(
        _on_worker_process_init, weak=False, dispatch_uid="celery_lease.process_init"
    )
    signals.worker_shutting_down.connect(
        _on_worker_shutting_down, weak=False, dispatch_uid="celery_lease.shutting_down"
    )
    _add_beat_entry(app)
    signals.worker_process_shutdown.connect(
        _on_worker_process_shutdown, weak=False, dispatch_uid="celery_lease.process_shutdown"
    )
    signals.task_revoked.connect(
        _on_task_revoked, weak=False, dispatch_uid="celery_lease.task_revoked"
    )
