"""The per-process runtime of an app: its stores and heartbeats, and the worker it belongs to."""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading

from celery import Celery

from .config import LeaseConfig
from .heartbeat import Heartbeat
from .store import LeaseStore

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


@dataclasses.dataclass(frozen=True)
class WorkerInstance:
    """One ``celery worker``: its random id and its shutdown flag, shared with its pool.

    Made in the worker's main process before the pool forks; the flag is an
    anonymous shared mapping, so a shutdown seen by the main process is seen
    at once by every pool child.
    """

    id: str
    flag: mmap.mmap


def worker_id(app: Celery) -> str | None:
    """The id of the worker this process belongs to (main or pool child), else None.

    ``task.new_owner`` appends it to every owner, so a worker hands back
    exactly the leases its own processes took, whatever its node name.
    """
    instance: WorkerInstance | None = app.__dict__.get("_celery_lease_worker")
    return None if instance is None else instance.id


def shutting_down(app: Celery) -> bool:
    """True once this process's worker began a warm or cold shutdown.

    Seen in the main process and in every pool child (prefork included). A
    worker that is shutting down must not claim a new run.
    """
    instance: WorkerInstance | None = app.__dict__.get("_celery_lease_worker")
    if instance is not None and instance.flag[0]:
        return True
    from celery.worker import state

    # The same test as Celery's own state.maybe_shutdown(): 0 (EX_OK) means stop too.
    return any(
        flag is not None and flag is not False
        for flag in (state.should_stop, state.should_terminate)
    )
