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
import socket
import time
import uuid
import weakref
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url

from .config import LeaseConfig, celery_command, check_app_settings, check_task_options
from .errors import LeaseDatabaseError
from .flow import wake_pumps
from .liveness import SweepWatch, watch_sweeps
from .requeue import SweepReport, requeue_all
from .run.outcome import record_ended
from .run.runids import run_id_of
from .run.task import LeasedTask
from .runtime import WorkerInstance, app_config, app_runtime, runtime_for, shutting_down
from .sanitize import describe_exception, protect_loggers, safe_url, sanitize
from .store import RunNotFound
from .store.databases import database_for
from .sweeper import register_sweep_task

logger = logging.getLogger(__name__)


class LeaseBootstep(bootsteps.Step):  # type: ignore[misc]
    """Checks lease settings and the lease database before the worker forks its pool.

    A permanent problem stops ``celery worker`` with one line on stderr and
    exit status 1 (a ``SystemExit``, which Celery lets through without a
    traceback); a signal receiver cannot do this.
    """

    name = "celery_lease.LeaseBootstep"

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
        super().__init__(parent, **kwargs)


#: How long a worker retries an unreachable lease database at start-up.
STARTUP_RETRY_SECONDS = 4.0


def _check_worker_startup(app: Celery, pool: Any) -> None:
    """Every start-up check; raises ImproperlyConfigured on a permanent problem.

    ``pool`` is the worker's pool class (Celery resolves ``pool_cls`` before it
    builds the bootsteps); its public ``is_green`` says whether it runs green
    threads (gevent, eventlet).
    """
    check_app_settings(app)
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
            getattr(pool, "__name__", pool),
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
        extra={"lease_event": "database", "run_id": None},
    )
    if backend == "sqlite":
        path = url.database
        if path and path != ":memory:" and not path.startswith("file:"):
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ImproperlyConfigured(
                    f"lease_database_url ({shown}): directory {folder} does not exist"
                )
    elif url.host and not url.host.startswith("/"):
        try:
            socket.getaddrinfo(url.host, url.port)
        except socket.gaierror as exc:
            if exc.errno != getattr(socket, "EAI_AGAIN", None):  # AGAIN: DNS itself is down
                raise ImproperlyConfigured(
                    f"lease_database_url ({shown}): host {url.host!r} does not resolve "
                    f"({exc.strerror})"
                ) from None
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    delay = 0.25
    while True:
        try:
            store = runtime_for(app, config).store
            present = store.has_schema()  # runtime_for prepared an embedded one
            break
        except ImportError as exc:
            extra = database_for(backend).driver_extra or backend
            raise ImproperlyConfigured(
                f"lease_database_url ({shown}) needs a database driver that is not "
                f"installed ({describe_exception(exc, 200)}): pip install "
                f"'celery-lease[{extra}]'"
            ) from None
        except LeaseDatabaseError as exc:
            driver_error = exc.__cause__
            problem = _permanent_problem(driver_error if driver_error is not None else exc)
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
                    extra={"lease_event": "database_unreachable", "run_id": None},
                )
                return
            logger.warning(
                "celery-lease: lease database %s unreachable at startup, retrying in %.2fs: %s",
                shown,
                delay,
                describe_exception(exc, 500),
                extra={"lease_event": "database_unreachable", "run_id": None},
            )
            time.sleep(delay)
            delay *= 2
    if not present:
        raise ImproperlyConfigured(
            f"lease_database_url ({shown}) has no celery_lease_runs table: run "
            f"`{celery_command(app)} lease migrate` first"
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

    watches: list[SweepWatch] = []

    def ready(**kwargs: Any) -> None:
        found = ref()
        if found is not None and not watches:
            try:
                watches.append(watch_sweeps(found))
            except Exception as exc:  # a hook never takes the worker down
                logger.warning("celery-lease: sweep watch not started: %s", exc)
            try:
                wake_pumps(found)  # rate-limited deliveries held by workers gone since
            except Exception as exc:
                logger.warning("celery-lease: flow pump not started: %s", exc)

    def shutting_down(sender: Any = None, how: str = "Warm", **kwargs: Any) -> None:
        for watch in watches:
            watch.stop()
        found = ref()
        if found is not None:
            _on_worker_shutting_down(found, how)

    def process_shutdown(**kwargs: Any) -> None:
        found = ref()
        if found is not None:
            _on_worker_process_shutdown(found)

    signals.worker_process_init.connect(process_init, weak=False)
    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutting_down.connect(shutting_down, weak=False)
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
    """The worker begins to shut down: claim nothing new; on a cold one, hand leases back.

    A warm shutdown waits for running bodies, so their leases stay held and
    they finish under them. On a cold shutdown the worker stops consuming
    (:func:`_stop_consuming`), then its runs become ``retrying``, available
    now, and are re-enqueued, so another worker takes them over at once
    instead of after expiry. Celery 5.5 and later have cancelled the running
    bodies by then; on 5.4 they are terminated just after, and a body that
    reaches its lease first finds it lost. Only leases whose owner carries
    this worker's id are touched.
    """
    instance = app_runtime(app).worker
    if instance is None:
        return
    instance.flag[0] = 1
    if how != "Cold":
        return
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
    if kwargs.get("terminated") and _terminated_by_shutdown(sender.app, request.id):
        return  # the shutdown's hand-back gives the run back: no one asked to cancel it
    try:
        run_id = run_id_of(sender, request)
        store = runtime_for(sender.app, sender.lease_config()).store
        status = store.cancel(run_id, task_id=request.id, running=not expired)
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
        ("left running (an expired copy)" if expired else "cancel-requested")
        if status == "running"
        else status,
        extra={"lease_event": "revoked", "run_id": run_id},
    )


def _terminated_by_shutdown(app: Celery, task_id: str) -> bool:
    """True for a body Celery itself terminated in a cold shutdown (its pool child killed,
    reported as ``Terminated``): no ``revoke()`` named the task id."""
    from celery.worker import state

    return shutting_down(app) and task_id not in state.revoked


def _on_worker_process_shutdown(app: Celery) -> None:
    """A process of the worker exits: stop its heartbeats."""
    for runtime in list(app_runtime(app).databases.values()):
        if runtime.pid == os.getpid():
            runtime.heartbeat.stop(timeout=2.0)
