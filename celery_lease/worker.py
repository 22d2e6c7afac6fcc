"""The worker's wiring: the bootstep, its start-up checks and the signal receivers.

:func:`celery_lease.install` adds :class:`LeaseBootstep` to the app by name;
Celery imports this module when a worker starts. The bootstep checks the
settings and the database, then connects this app's signal receivers: a pool
child builds runtimes only for the app of its own worker.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import time
import uuid
import weakref
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url

from .app import check_extras
from .chainsteps import keep_next_step
from .config import (
    LeaseConfig,
    celery_command,
    check_app_settings,
    check_task_options,
    worker_sweeper,
)
from .errors import LeaseDatabaseError
from .events import Event
from .flow import wake_pumps
from .liveness import SweepWatch, watch_sweeps
from .requeue import SweepReport, requeue_all
from .run.outcome import record_ended
from .run.runids import run_id_of
from .run.task import LeasedTask
from .runtime import (
    WorkerInstance,
    app_config,
    app_runtime,
    lease_databases,
    runtime_for,
    worker_id,
)
from .sanitize import describe_exception, protect_loggers, safe_url, sanitize
from .schema import gaps_text
from .store import OTHER_DELIVERY, RunNotFound
from .store.databases import database_for
from .sweeper import register_sweep_task
from .worker_sweeper import WorkerSweeper

logger = logging.getLogger(__name__)


class LeaseBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker's lease services, from its start-up checks to its shutdown.

    Made before the worker forks its pool, it checks lease settings and the lease
    database: a permanent problem stops ``celery worker`` with one line on stderr
    and exit status 1 (a ``SystemExit``, which Celery lets through without a
    traceback); a signal receiver cannot do this. Started after the pool (so
    its threads stay in the main process), it starts the worker's services: the
    in-worker sweeper of each lease database (:class:`WorkerSweeper`; or, with
    ``lease_worker_sweeper = False``, the :class:`SweepWatch`) and the flow
    pumps of deliveries held by workers gone since. A warm shutdown (``stop``)
    stops them and marks the worker as shutting down; a cold one
    (``terminate``) also hands the worker's leases back. Celery calls these from
    ``celery worker`` and from ``celery.contrib.testing``'s ``start_worker``
    alike, which sends no ``worker_ready``/``worker_shutting_down`` signal.
    """

    name = "celery_lease.LeaseBootstep"
    #: Started after the pool forks its children, stopped before the pool stops.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        app = parent.app
        protect_loggers()
        try:
            _check_worker_startup(app, getattr(parent, "pool_cls", None))
        except ImproperlyConfigured as exc:
            message = " ".join(str(exc).split())  # one line, whatever the driver wrote
            raise SystemExit(
                f"celery-lease: worker not started: ImproperlyConfigured: {sanitize(message)}"
            ) from None
        # Receivers are connected once per app: they read the current worker.
        instance = WorkerInstance(uuid.uuid4().hex, mmap.mmap(-1, 1), weakref.ref(parent))
        if app_runtime(app).attach_worker(instance):
            _connect_receivers(app)
        register_sweep_task(app)
        self.app = app
        self.instance = instance
        self.sweepers: list[WorkerSweeper] = []
        self.watch: SweepWatch | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        """Start the sweepers (or the sweep watch) and wake the flow pumps; a failure is
        logged, never raised (a hook never takes the worker down)."""
        app = self.app
        if worker_sweeper(app.conf):
            for config in lease_databases(app):
                try:
                    sweeper = WorkerSweeper(
                        app, config, hostname=parent.hostname, worker=self.instance.id
                    )
                    sweeper.start()
                except Exception as exc:
                    logger.warning(
                        "celery-lease: in-worker sweeper of %s not started: %s",
                        safe_url(config.database_url),
                        describe_exception(exc),
                    )
                    continue
                self.sweepers.append(sweeper)
        else:
            try:
                self.watch = watch_sweeps(app)
            except Exception as exc:
                logger.warning("celery-lease: sweep watch not started: %s", exc)
        try:
            wake_pumps(app)  # rate-limited deliveries held by workers gone since
        except Exception as exc:
            logger.warning("celery-lease: flow pump not started: %s", exc)

    def stop(self, parent: Any) -> None:
        """Warm shutdown: claim nothing new, stop the services (resigning the sweeper's
        lead); running bodies finish under their leases."""
        self.instance.flag[0] = 1
        self._stop_services()

    def terminate(self, parent: Any) -> None:
        """Cold shutdown: as :meth:`stop`, then hand this worker's leases back."""
        self.stop(parent)
        _hand_back(self.app, self.instance)

    def _stop_services(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        sweepers, self.sweepers = self.sweepers, []
        for sweeper in sweepers:
            sweeper.stop(timeout=2.0)


#: How long a worker retries an unreachable lease database at start-up.
STARTUP_RETRY_SECONDS = 4.0


def _check_worker_startup(app: Celery, pool: Any) -> None:
    """Every start-up check; raises ImproperlyConfigured on a permanent problem.

    ``pool`` is the worker's pool class (Celery resolves ``pool_cls`` before it
    builds the bootsteps); its public ``is_green`` says whether it runs green
    threads (gevent, eventlet).
    """
    check_app_settings(app)
    try:
        check_extras(app)
    except ImportError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    config = app_config(app)
    configs = {config.database_url: config}
    for task in list(app.tasks.values()):
        if isinstance(task, LeasedTask):
            options = [name for klass in type(task).__mro__ for name in vars(klass)]
            check_task_options(task.name, options, set(dir(LeasedTask)))
            task_config = task.lease_config()  # raises ImproperlyConfigured naming the key
            configs.setdefault(task_config.database_url, task_config)
    if getattr(pool, "is_green", False):
        # Green threads share one OS thread: an asynchronous exception
        # would land in whichever greenlet runs next, not the leased body.
        if app.conf.get("lease_interrupt") is True:
            raise ImproperlyConfigured(
                "lease_interrupt=True cannot work on the gevent/eventlet pools (green "
                "threads share one OS thread); unset it and call self.lease.check()"
            )
        app_runtime(app).use_green_pool()
        logger.info(
            "celery-lease: lease_interrupt is off on the %s pool; bodies should call "
            "self.lease.check()",
            # celery.concurrency.gevent.TaskPool: the module names the pool.
            str(getattr(pool, "__module__", pool)).rpartition(".")[2],
        )
    for database_config in configs.values():
        _check_database(app, database_config)


def _check_database(app: Celery, config: LeaseConfig) -> None:
    """Log the lease database; refuse a permanent problem; wait out a short outage."""
    shown = safe_url(config.database_url)
    url = make_url(config.database_url)
    backend = url.get_backend_name()
    logger.info(
        "celery-lease: lease database %s",
        shown,
        extra={"lease_event": Event.DATABASE, "run_id": None},
    )
    problem = database_for(backend).unreachable(url)
    if problem is not None:
        raise ImproperlyConfigured(f"lease_database_url ({shown}): {problem}")
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    delay = 0.25
    while True:
        try:
            store = runtime_for(app, config).store
            present = store.has_schema()  # runtime_for prepared an embedded one
            gaps = store.schema_gaps() if present else []
            break
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"lease_database_url ({shown}) {database_for(backend).missing_driver(exc)}"
            ) from None
        except LeaseDatabaseError as exc:
            driver_error = exc.__cause__
            problem = _permanent_problem(driver_error if driver_error is not None else exc)
            if problem is None and not exc.transient:
                # Classified permanent by the database (read-only SQLite, a permission):
                # waiting will not fix it, whatever the driver's message says.
                problem = f"{exc.cause}: {describe_exception(driver_error or exc, 300)}"
            if problem is not None:
                raise ImproperlyConfigured(f"lease_database_url ({shown}): {problem}") from None
            if time.monotonic() + delay > deadline:
                # Fail closed per task, not per worker: tasks retry until it is back.
                logger.warning(
                    "celery-lease: lease database %s still unreachable after %.0fs; starting "
                    "anyway, tasks will not run until it is back: %s",
                    shown,
                    STARTUP_RETRY_SECONDS,
                    describe_exception(exc, 500),
                    extra={"lease_event": Event.DATABASE_UNREACHABLE, "run_id": None},
                )
                return
            logger.warning(
                "celery-lease: lease database %s unreachable at startup, retrying in %.2fs: %s",
                shown,
                delay,
                describe_exception(exc, 500),
                extra={"lease_event": Event.DATABASE_UNREACHABLE, "run_id": None},
            )
            time.sleep(delay)
            delay *= 2
    if not present:
        raise ImproperlyConfigured(
            f"lease_database_url ({shown}) has no celery_lease_runs table: run "
            f"`{celery_command(app)} lease migrate` first"
        )
    if gaps:
        # Every claim would fail for good on the first missing column: refuse instead.
        raise ImproperlyConfigured(
            f"lease_database_url ({shown}) holds an older celery-lease schema (it lacks "
            f"{gaps_text(gaps)}): run `{celery_command(app)} lease migrate` first"
        )


#: Driver messages of problems that waiting will not fix, and what to call them.
_PERMANENT_MESSAGES = (
    (
        re.compile(
            r"(?i)could not translate host name|name or service not known|"
            r"nodename nor servname|no address associated|unknown (?:mysql server )?host"
        ),
        "host does not resolve",
    ),
    (
        re.compile(
            r"(?i)password authentication failed|authentication failed|access denied|"
            r"role \S+ does not exist|no password supplied|peer authentication"
        ),
        "authentication failed",
    ),
    (re.compile(r"(?i)database \S+ does not exist|unknown database"), "database does not exist"),
    (re.compile(r"(?i)unable to open database file"), "cannot open the SQLite file"),
)

#: MySQL/MariaDB error numbers of the same problems.
_PERMANENT_MYSQL_CODES = {
    1044: "authentication failed",
    1045: "authentication failed",
    1698: "authentication failed",
    1049: "database does not exist",
    2005: "host does not resolve",
}


def _permanent_problem(exc: BaseException) -> str | None:
    """What is permanently wrong, for a start-up error that waiting will not fix, else None.

    Connection refused and timeouts are transient (a database restarting);
    failed authentication, an unknown database or host, or an unopenable SQLite
    file are not.
    """
    orig = getattr(exc, "orig", None) or exc
    sqlstate = str(getattr(orig, "sqlstate", None) or "")
    args = getattr(orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    what: str | None = None
    if sqlstate.startswith("28"):
        what = "authentication failed"
    elif sqlstate == "3D000":
        what = "database does not exist"
    elif code in _PERMANENT_MYSQL_CODES:
        what = _PERMANENT_MYSQL_CODES[code]
    elif "temporary failure" not in str(orig).lower():  # EAI_AGAIN: DNS itself is down
        text = str(orig)
        what = next((name for pattern, name in _PERMANENT_MESSAGES if pattern.search(text)), None)
    if what is None:
        return None
    return f"{what}: {describe_exception(orig, 300)}"


def _connect_receivers(app: Celery) -> None:
    """Connect the worker signal receivers of ``app`` (they hold it weakly)."""
    ref = weakref.ref(app)

    def process_init(**kwargs: Any) -> None:
        found = ref()
        if found is not None:
            _on_worker_process_init(found)

    def shutting_down(sender: Any = None, how: str = "Warm", **kwargs: Any) -> None:
        found = ref()
        if found is not None:
            _on_worker_shutting_down(found, how)

    def process_shutdown(**kwargs: Any) -> None:
        found = ref()
        if found is not None:
            _on_worker_process_shutdown(found)

    def before_publish(
        body: Any = None,
        exchange: Any = None,
        routing_key: Any = None,
        headers: Any = None,
        properties: Any = None,
        **kwargs: Any,
    ) -> None:
        found = ref()
        if found is not None:
            keep_next_step(found, body, exchange, routing_key, headers, properties)

    signals.worker_process_init.connect(process_init, weak=False)
    signals.worker_shutting_down.connect(shutting_down, weak=False)
    signals.before_task_publish.connect(before_publish, weak=False)
    signals.worker_process_shutdown.connect(process_shutdown, weak=False)
    signals.task_revoked.connect(
        _on_task_revoked, weak=False, dispatch_uid="celery_lease.task_revoked"
    )


def _on_worker_process_init(app: Celery) -> None:
    """A new pool child: drop the parent's connections and heartbeat right away."""
    try:
        runtime_for(app, app_config(app))
    except Exception as exc:  # a hook never takes the worker down
        logger.warning("celery-lease: process init failed: %s", describe_exception(exc))


def _on_worker_shutting_down(app: Celery, how: str) -> None:
    """``celery worker`` begins to shut down (its signal handler, before the bootstep
    hears of it): claim nothing new; on a cold one, hand leases back at once.

    A warm shutdown waits for running bodies, so their leases stay held and
    they finish under them. A cold one is handed back here, as early as it can
    be (a warm shutdown turned cold by a second signal never reaches the
    bootstep's ``terminate``), and again, finding nothing left, by the bootstep.
    """
    instance = app_runtime(app).worker
    if instance is None:
        return
    instance.flag[0] = 1
    if how == "Cold":
        _hand_back(app, instance)


def _hand_back(app: Celery, instance: WorkerInstance) -> None:
    """Hand back every lease this worker's processes hold: cold shutdown.

    The worker stops consuming first (:func:`_stop_consuming`), then its runs
    become ``retrying``, available now, and are re-enqueued, so another worker
    takes them over at once instead of after expiry. Celery 5.5 and later have
    cancelled the running bodies by then; on 5.4 they are terminated just
    after, and a body that reaches its lease first finds it lost. Only leases
    whose owner carries this worker's id are touched; a second call finds
    nothing left to hand back.
    """
    _stop_consuming(instance)
    pid = os.getpid()
    for runtime in list(app_runtime(app).databases.values()):
        if runtime.pid != pid:
            continue
        try:
            released = runtime.store.release_owned_by(instance.id)
        except LeaseDatabaseError as exc:
            logger.warning(
                "celery-lease: could not hand back leases at shutdown: %s",
                describe_exception(exc),
            )
            continue
        handed = SweepReport()
        requeue_all(app, released, handed, "handoff", runtime.store)
        record_ended(app, runtime.store, handed.failed + handed.cancelled)


def _stop_consuming(instance: WorkerInstance) -> None:
    """Stop the worker's task consumer before its leases are handed back.

    Celery 5.5 and later cancel it themselves before this signal; Celery 5.4
    sends the signal while the worker still consumes, so a run handed back
    would come back to this very worker. A pool child of it, terminated while
    handing that delivery on, could swallow the SIGTERM (billiard raises
    ``SystemExit`` from the handler, and Python drops it inside a garbage
    collection callback) and keep the worker from ever exiting. Cancelling
    again is a no-op; a failure is logged, never raised.
    """
    consumer = getattr(instance.controller(), "consumer", None)
    task_consumer = getattr(consumer, "task_consumer", None)
    if task_consumer is None:
        return
    try:
        task_consumer.cancel()
    except Exception as exc:  # the broker may be gone: the hand-back goes on
        logger.debug("celery-lease: could not stop consuming: %s", describe_exception(exc))


def _on_task_revoked(
    sender: Any = None, request: Any = None, expired: bool = False, **kwargs: Any
) -> None:
    """``revoke()``, ``revoke(terminate=True)`` or an expired message: cancel the run.

    Only the run's own delivery (same task id) cancels it: a revoked or expired
    duplicate of a keyed run leaves the run alone. An expired message cancels a
    run only while it waits (queued, retrying): a running run is another
    delivery's (a redelivered copy of its message expired on arrival), and goes
    on. Runs in the worker's main process; a failure is logged, never raised.
    """
    if not isinstance(sender, LeasedTask) or request is None or not request.id:
        return
    terminated_in = None
    if kwargs.get("terminated"):
        if not _revoke_named(request):
            return  # Celery ended the body itself (a cold shutdown): no one asked to cancel it
        # The body was killed in a process of this worker: its lease ends at once.
        terminated_in = worker_id(sender.app)
    try:
        run_id = run_id_of(sender.name, sender.lease_config(), request)
        store = runtime_for(sender.app, sender.lease_config()).store
        status = store.cancel(
            run_id, task_id=request.id, running=not expired, terminated_in=terminated_in
        )
    except RunNotFound:
        return  # revoked before any claim: nothing recorded, nothing to end
    except Exception as exc:
        logger.warning(
            "celery-lease: could not cancel the run of revoked task %s: %s",
            request.id,
            describe_exception(exc),
        )
        return
    logger.info(
        "celery-lease: task %s revoked: run %s is %s",
        request.id,
        run_id,
        "left alone (not its own delivery)"
        if status == OTHER_DELIVERY
        else ("left running (an expired copy)" if expired else "cancel-requested")
        if status == "running"
        else status,
        extra={"lease_event": Event.REVOKED, "run_id": run_id},
    )


def _revoke_named(request: Any) -> bool:
    """True if a ``revoke()`` named this delivery: by task id, or by a stamped header
    (``revoke_by_stamped_headers``), as the worker's control command records them.

    A body reported as ``Terminated`` that no revoke named was ended by Celery
    itself: a cold shutdown cancels its running bodies before it counts as
    shutting down, and with a threaded pool (a broker without an event loop,
    such as ``filesystem://``) the pool's own thread reports the killed body
    while the shutdown still records its retry in the result backend. Such a
    run is handed back, never cancelled, whatever the timing.
    """
    from celery.worker import state

    if request.id in state.revoked:
        return True
    stamps = getattr(request, "stamps", None) or {}
    for header in getattr(request, "stamped_headers", None) or ():
        revoked = state.revoked_stamps.get(header)
        if revoked is None:
            continue
        revoked = revoked if isinstance(revoked, (list, tuple, set)) else [revoked]
        values = stamps.get(header)
        values = values if isinstance(values, (list, tuple)) else [values]
        if any(value in revoked for value in values):
            return True
    return False


def _on_worker_process_shutdown(app: Celery) -> None:
    """A process of the worker exits: stop its heartbeats."""
    for runtime in list(app_runtime(app).databases.values()):
        if runtime.pid == os.getpid():
            runtime.heartbeat.stop(timeout=2.0)
