"""What celery-lease keeps for one Celery app in this process: one :class:`AppRuntime`.

It holds the app's validated settings, each task's settings, a store and a
heartbeat per lease database, the app's event bus and metrics, and the
``celery worker`` this process belongs to. :meth:`AppRuntime.reset` drops all of it (for tests).

The runtimes are kept in a :class:`weakref.WeakKeyDictionary` keyed by the app
itself: nothing is written into the app, and a runtime goes away with its app.
A pool child inherits its parent's runtimes and builds a fresh store and
heartbeat only when it first uses one (:func:`runtime_for`).
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from celery import Celery
from celery.exceptions import ImproperlyConfigured
from kombu.serialization import prepare_accept_content

from .config import LeaseConfig
from .events import EventBus
from .hooks import Hooks, RunHook
from .lease.heartbeat import Heartbeat
from .store import LeaseStore

F = TypeVar("F", bound=RunHook[Any])

_runtime_lock = threading.Lock()


@runtime_checkable
class Subscriber(Protocol):
    """What listens on an app's events (:class:`celery_lease.metrics.LeaseMetrics`,
    :class:`celery_lease.tracing.LeaseTracing`)."""

    def subscribe(self, events: EventBus) -> None:
        """Start listening on ``events``."""
        ...

    def unsubscribe(self, events: EventBus) -> None:
        """Stop listening on ``events``."""
        ...


class Pump(Protocol):
    """What publishes held deliveries as they come due (:class:`celery_lease.flow.FlowPump`)."""

    def wake(self) -> None:
        """A delivery was held: make sure the pump runs."""
        ...

    def stop(self, timeout: float) -> None:
        """Stop the pump's thread, waiting at most ``timeout`` seconds."""
        ...


class AppRuntime:
    """Everything celery-lease keeps for one app in this process."""

    def __init__(self) -> None:
        #: The app's validated ``lease_*`` settings, once read.
        self.config: LeaseConfig | None = None
        #: Each task's settings (the app's with its options applied), by task name.
        self.task_configs: dict[str, tuple[object, LeaseConfig]] = {}
        #: How the app's results are serialized, accepted and kept, once read.
        self.result_format: ResultFormat | None = None
        #: A store and a heartbeat per lease database URL.
        self.databases: dict[str, Runtime] = {}
        #: The ``celery worker`` this process belongs to (set by its bootstep).
        self.worker: WorkerInstance | None = None
        #: True on the gevent/eventlet pools: no asynchronous interrupt of a body.
        self.green_pool = False
        #: The app's lease events: its tasks, leases, heartbeats and sweeps emit here.
        self.events = EventBus()
        self._metrics: Subscriber | None = None
        #: The run features the app turned on (tracing), in order: each task's hooks
        #: are theirs and the run path's own (``celery_lease.run.task.task_hooks``).
        self.features: tuple[RunHook[Any], ...] = ()
        #: Each task's run hooks, by task name, with the settings they were made for.
        self.task_hooks: dict[str, tuple[LeaseConfig, Hooks[Any]]] = {}
        self.installed = False
        #: The flow pump of each lease database in this process: ``(pid, pump)``.
        self.pumps: dict[str, tuple[int, Pump]] = {}

    @property
    def metrics(self) -> Subscriber | None:
        """Counters of ``lease_metrics``, when on (listening on :attr:`events`)."""
        return self._metrics

    def count_with(self, metrics: Subscriber | None) -> None:
        """Count this app's events with ``metrics`` (None: stop); the previous ones stop."""
        previous = self._metrics
        if previous is not None and previous is not metrics:
            previous.unsubscribe(self.events)
        self._metrics = metrics
        if metrics is not None:
            metrics.subscribe(self.events)

    def feature(self, kind: type[F]) -> F | None:
        """The app's run feature of class ``kind``, if on."""
        for found in self.features:
            if isinstance(found, kind):
                return found
        return None

    def use_feature(self, feature: RunHook[Any] | None, kind: type[RunHook[Any]]) -> None:
        """Turn on ``feature`` (None: off) in place of the app's feature of class ``kind``;
        one that listens on events (a :class:`Subscriber`) is subscribed to the app's bus,
        the one it replaces unsubscribed. Every task's hooks are made again."""
        with _runtime_lock:
            previous = self.feature(kind)
            if previous is feature:
                return
            kept = tuple(found for found in self.features if found is not previous)
            self.features = kept if feature is None else (*kept, feature)
            self.task_hooks = {}
        if isinstance(previous, Subscriber):
            previous.unsubscribe(self.events)
        if isinstance(feature, Subscriber):
            feature.subscribe(self.events)

    def mark_installed(self) -> None:
        """:func:`celery_lease.install` has run for this app (until :meth:`reset`)."""
        self.installed = True

    def attach_worker(self, worker: WorkerInstance) -> bool:
        """This process now belongs to ``worker``; True if it belonged to none before."""
        first, self.worker = self.worker is None, worker
        return first

    def use_green_pool(self) -> None:
        """The worker runs gevent/eventlet: bodies are never interrupted asynchronously."""
        self.green_pool = True

    def forget_settings(self) -> None:
        """Read the app's and tasks' settings again on next use."""
        self.config = None
        self.task_configs.clear()
        self.task_hooks = {}
        self.result_format = None

    def pump_for(self, url: str, make: Callable[[], Pump]) -> Pump:
        """This process's pump for lease database ``url``, made by ``make`` on first use
        (a forked child makes its own: threads do not survive a fork)."""
        pid = os.getpid()
        with _runtime_lock:
            found = self.pumps.get(url)
            if found is None or found[0] != pid:
                found = self.pumps[url] = (pid, make())
        return found[1]

    def reset(self) -> None:
        """Stop the heartbeats, close the stores, forget the settings, drop the listeners.

        For tests. The metrics stop counting and tracing stops too;
        :func:`celery_lease.install` (or :func:`celery_lease.metrics.enable`,
        :func:`celery_lease.tracing.enable`) turns them on again.
        """
        self.events.clear()
        self._metrics = None
        self.features = ()
        self.installed = False
        pumps = [pump for pid, pump in self.pumps.values() if pid == os.getpid()]
        self.pumps.clear()
        for pump in pumps:
            pump.stop(5.0)
        databases = list(self.databases.values())
        self.databases.clear()
        for runtime in databases:
            runtime.heartbeat.stop(timeout=5.0)
            runtime.store.dispose()
        self.forget_settings()


_app_runtimes: weakref.WeakKeyDictionary[Celery, AppRuntime] = weakref.WeakKeyDictionary()


def app_runtime(app: Celery) -> AppRuntime:
    """The app's runtime in this process, made on first use."""
    runtime = _app_runtimes.get(app)
    if runtime is None:
        with _runtime_lock:
            runtime = _app_runtimes.setdefault(app, AppRuntime())
    return runtime


def app_config(app: Celery) -> LeaseConfig:
    """The app's settings, validated once (:meth:`LeaseConfig.from_app`) and kept."""
    runtime = app_runtime(app)
    if runtime.config is None:
        runtime.config = LeaseConfig.from_app(app)
    return runtime.config


@dataclasses.dataclass(frozen=True)
class ResultFormat:
    """How the app's results are serialized, decoded and kept, read once from ``app.conf``.

    Attributes:
        serializer: ``result_serializer``.
        accept: the content types a result is decoded under: ``result_accept_content``,
            else ``accept_content`` (as Celery's result backends choose).
        backend: False without a result backend (nobody can ask for a result).
        expires_ms: ``result_expires`` in milliseconds; None when results never expire.
    """

    serializer: str
    accept: frozenset[str]
    backend: bool
    expires_ms: int | None


def result_format(app: Celery) -> ResultFormat:
    """The app's :class:`ResultFormat`, read once and kept (``app.conf`` lookups cost more
    than the rest of encoding a small result)."""
    runtime = app_runtime(app)
    if runtime.result_format is None:
        conf = app.conf
        accept = conf.result_accept_content
        if accept is None:
            accept = conf.accept_content
        expires = conf.result_expires
        if isinstance(expires, datetime.timedelta):
            expires = expires.total_seconds()
        backend = conf.result_backend
        runtime.result_format = ResultFormat(
            serializer=conf.result_serializer or "json",
            accept=frozenset(prepare_accept_content(accept)),  # type: ignore[no-untyped-call]
            backend=bool(backend) and backend != "disabled",
            expires_ms=round(float(expires) * 1000) if expires else None,
        )
    return runtime.result_format


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The store and heartbeat this process uses for one lease database."""

    store: LeaseStore
    heartbeat: Heartbeat
    pid: int
    #: The app's event bus (the same object as ``app_runtime(app).events``).
    events: EventBus


def runtime_for(app: Celery, config: LeaseConfig) -> Runtime:
    """This process's store and heartbeat for ``config.database_url``.

    Created on first use and kept in the app's :class:`AppRuntime`. The store's
    wait bounds and the heartbeat's interval are those of the shortest lease
    among the app's tasks that use this database (:func:`database_settings`),
    whichever task uses it first. In a forked child the parent's pooled
    connections are dropped without closing them (they belong to the parent)
    and a fresh heartbeat is made, since threads do not survive a fork.
    """
    pid = os.getpid()
    app_state = app_runtime(app)
    registry = app_state.databases
    runtime = registry.get(config.database_url)
    if runtime is not None and runtime.pid == pid:
        return runtime
    lease_seconds, heartbeat_interval = database_settings(app, config)
    with _runtime_lock:
        runtime = registry.get(config.database_url)
        if runtime is not None and runtime.pid == pid:
            return runtime
        if runtime is not None:
            runtime.store.dispose_after_fork()
            store = runtime.store
        else:
            store = LeaseStore.from_url(config.database_url, lease_seconds=lease_seconds)
            store.prepare()  # SQLite, the embedded default, needs no migrate step
        events = app_state.events
        heartbeat = Heartbeat(store, heartbeat_interval, events=events)
        runtime = Runtime(store, heartbeat, pid, events)
        registry[config.database_url] = runtime
        return runtime


def database_settings(app: Celery, config: LeaseConfig) -> tuple[float, float]:
    """The shortest ``lease_seconds`` and heartbeat interval among ``config`` and the
    settings of every task of ``app`` that uses ``config.database_url``.

    One store and one heartbeat serve every task on a database, so both must keep
    the promise of the shortest lease: a renewal never waits past a third of it.
    A task whose settings are invalid is left out (the worker refuses it at start).
    """
    configs = [config] + [
        found for found in task_configs(app) if found.database_url == config.database_url
    ]
    return (
        min(each.lease_seconds for each in configs),
        min(each.heartbeat_interval for each in configs),
    )


def task_configs(app: Celery) -> list[LeaseConfig]:
    """The settings of every leased task registered on ``app`` (``lease_config()``).

    A task whose settings are invalid is left out (the worker refuses it at start).
    """
    try:
        tasks = list(app.tasks.values())
    except RuntimeError:  # an app that must not finalize yet: its tasks are not known
        tasks = []
    configs: list[LeaseConfig] = []
    for task in tasks:
        settings = getattr(task, "lease_config", None)  # LeasedTask's public method
        if not callable(settings):
            continue
        try:
            found = settings()
        except ImproperlyConfigured:
            continue
        if isinstance(found, LeaseConfig):
            configs.append(found)
    return configs


def lease_databases(app: Celery) -> list[LeaseConfig]:
    """One settings object per lease database ``app`` uses: the app's
    ``lease_database_url`` first, then each task's own, in registration order.

    Each is the app's settings, or the first task's that names that database.
    """
    config = app_config(app)
    found = {config.database_url: config}
    for each in task_configs(app):
        found.setdefault(each.database_url, each)
    return list(found.values())


def store_for(app: Celery) -> LeaseStore:
    """The app's lease store (for tools, tests and operators)."""
    return runtime_for(app, app_config(app)).store


@dataclasses.dataclass(frozen=True)
class WorkerInstance:
    """One ``celery worker``: its random id and its shutdown flag, shared with its pool.

    Made in the worker's main process before the pool forks; the flag is an
    anonymous shared mapping, so a shutdown seen by the main process is seen
    at once by every pool child. ``controller`` returns Celery's worker
    (``WorkController``) while it lives, in the main process.
    """

    id: str
    flag: mmap.mmap
    controller: Callable[[], object] = lambda: None


def worker_id(app: Celery) -> str | None:
    """The id of the worker this process belongs to (main or pool child), else None.

    ``Owner.new`` appends it to every owner, so a worker hands back
    exactly the leases its own processes took, whatever its node name.
    """
    instance = app_runtime(app).worker
    return None if instance is None else instance.id


def shutting_down(app: Celery) -> bool:
    """True once this process's worker began a warm or cold shutdown.

    Seen in the main process and in every pool child (prefork included). A
    worker that is shutting down must not claim a new run.
    """
    instance = app_runtime(app).worker
    if instance is not None and instance.flag[0]:
        return True
    from celery.worker import state

    # The same test as Celery's own state.maybe_shutdown(): 0 (EX_OK) means stop too.
    return any(
        flag is not None and flag is not False
        for flag in (state.should_stop, state.should_terminate)
    )
