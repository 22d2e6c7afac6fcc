"""Wiring into a Celery app: :func:`install`, the per-process runtime, the worker bootstep."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.exc import SQLAlchemyError

from .config import LeaseConfig
from .heartbeat import Heartbeat
from .sanitize import describe_exception, safe_url
from .store import LeaseStore
from .sweeper import BEAT_ENTRY_NAME, SWEEP_TASK_NAME, SweepReport, register_sweep_task, requeue_all

logger = logging.getLogger(__name__)

_runtime_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The store and heartbeat this process uses for one lease database."""

    store: LeaseStore
    heartbeat: Heartbeat
    pid: int


def runtime_for(app: Celery, config: LeaseConfig) -> Runtime:
    """This process's store and heartbeat for ``config.database_url``.

    Created on first use and cached on the app. In a forked child the parent's
    pooled connections are dropped without closing them (they belong to the
    parent) and a fresh heartbeat is made, since threads do not survive a fork.
    """
    pid = os.getpid()
    registry: dict[str, Runtime] = app.__dict__.setdefault("_celery_lease_runtimes", {})
    runtime = registry.get(config.database_url)
    if runtime is not None and runtime.pid == pid:
        return runtime
    with _runtime_lock:
        runtime = registry.get(config.database_url)
        if runtime is not None and runtime.pid == pid:
            return runtime
        if runtime is not None:
            runtime.store.dispose_after_fork()
            store = runtime.store
        else:
            store = LeaseStore.from_url(config.database_url, lease_seconds=config.lease_seconds)
            if store.dialect == "sqlite":
                store.create_schema()  # the embedded default needs no migrate step
        runtime = Runtime(store, Heartbeat(store, config.heartbeat_interval), pid)
        registry[config.database_url] = runtime
        return runtime


def store_for(app: Celery) -> LeaseStore:
    """The app's lease store (for tools, tests and operators)."""
    return runtime_for(app, LeaseConfig.from_app(app)).store


class LeaseBootstep(bootsteps.Step):  # type: ignore[misc]
    """Validates lease settings before the worker forks its pool.

    Raising here makes ``celery worker`` exit non-zero with the message, which
    a signal receiver cannot do.
    """

    name = "celery_lease.LeaseBootstep"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        app = parent.app
        config = LeaseConfig.from_app(app)
        from .task import LeasedTask

        for task in list(app.tasks.values()):
            if isinstance(task, LeasedTask):
                task.lease_config()  # raises ImproperlyConfigured naming the key
        pool = str(getattr(parent, "pool_cls", "") or "").lower()
        if "gevent" in pool or "eventlet" in pool:
            # Green threads share one OS thread: an asynchronous exception
            # would land in whichever greenlet runs next, not the leased body.
            if app.conf.get("lease_interrupt") is True:
                raise ImproperlyConfigured(
                    "lease_interrupt=True cannot work on the gevent/eventlet pools (green "
                    "threads share one OS thread); unset it and call self.lease.check()"
                )
            app._celery_lease_green_pool = True
            logger.info(
                "celery-lease: lease_interrupt is off on the %s pool; bodies should call "
                "self.lease.check()",
                pool,
            )
        try:
            store = runtime_for(app, config).store
            if store.dialect != "sqlite" and not store.has_schema():
                raise ImproperlyConfigured(
                    f"lease_database_url ({safe_url(config.database_url)}) has no "
                    "celery_lease_runs table: run `celery -A <app> lease migrate` first"
                )
        except SQLAlchemyError as exc:
            # Fail closed per task, not per worker: tasks retry until it is back.
            logger.warning(
                "celery-lease: lease database %s unreachable at startup: %s",
                safe_url(config.database_url),
                describe_exception(exc),
            )
        register_sweep_task(app)
        super().__init__(parent, **kwargs)


def _on_worker_process_init(**kwargs: Any) -> None:
    """A new pool child: drop the parent's connections and heartbeat right away."""
    for app in list(_installed_apps):
        try:
            runtime_for(app, LeaseConfig.from_app(app))
        except Exception as exc:  # a hook never takes the worker down
            logger.warning("celery-lease: process init failed: %s", describe_exception(exc))


def _on_worker_shutting_down(sender: Any = None, **kwargs: Any) -> None:
    """Warm (or cold) shutdown: hand back every lease this worker node holds.

    The runs become ``retrying``, available now, and are re-enqueued, so
    another worker takes them over at once instead of after expiry. The bodies
    still running here see the loss on their next heartbeat (and are
    interrupted where ``lease_interrupt`` is on); their completions are refused.
    """
    if not sender:
        return
    for app in list(_installed_apps):
        config = LeaseConfig.from_app(app)
        try:
            released = runtime_for(app, config).store.release_owned_by(f"{sender}:")
        except SQLAlchemyError as exc:
            logger.warning(
                "celery-lease: could not hand back leases at shutdown: %s",
                describe_exception(exc),
            )
            continue
        requeue_all(app, released, SweepReport(), "handoff")


def _on_worker_process_shutdown(**kwargs: Any) -> None:
    for app_runtimes in _all_runtimes():
        for runtime in list(app_runtimes.values()):
            if runtime.pid == os.getpid():
                runtime.heartbeat.stop(timeout=2.0)


_installed_apps: list[Celery] = []


def _all_runtimes() -> list[dict[str, Runtime]]:
    return [app.__dict__.get("_celery_lease_runtimes", {}) for app in _installed_apps]


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
