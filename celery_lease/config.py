"""Settings: the ``lease_*`` keys of ``app.conf``, overridable per task.

:meth:`LeaseConfig.from_app` validates every value and raises
:class:`celery.exceptions.ImproperlyConfigured` naming the offending key.
``install(app)`` runs that validation in a worker bootstep, so a worker with a
bad setting exits before it forks its pool instead of failing mid-task.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import click
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .lease.lease import safety_margin
from .store.databases import DATABASES

BUSY_POLICIES = ("retry", "skip", "fail")
LOST_POLICIES = ("retry", "abort")

DEFAULT_SQLITE_FILE = "celery-lease.sqlite3"

DAY = 86_400.0
#: Upper bounds, checked at startup. ``lease_seconds`` must also fit the 32-bit
#: ``lease_ms`` column (24.8 days); a week is the sane ceiling for a lease that a
#: heartbeat renews anyway, and the longest a crashed worker's run would wait.
MAX_LEASE_SECONDS = 7 * DAY
#: The shortest lease: the store bounds every database wait of a process by a share of
#: the shortest lease its tasks use, so a shorter one would cut every task's statements.
MIN_LEASE_SECONDS = 1.0
#: The shortest heartbeat: one renewal statement per tick for the whole process.
MIN_HEARTBEAT_SECONDS = 0.1
MAX_BACKOFF_SECONDS = DAY
MAX_SWEEP_INTERVAL = DAY
MAX_ATTEMPTS = 10_000
MAX_CONCURRENCY = 100_000
#: The fastest ``lease_rate_limit``: one slot per millisecond, the clock's resolution.
MAX_RATE_PER_SECOND = 1000.0
#: At least one slot a day: a slower rate's interval overflows the slot arithmetic.
MIN_RATE_PER_SECOND = 1 / 86400
MAX_RATE_BURST = 100_000
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: ``lease_retention`` when unset: a week of finished rows (see the settings docs).
DEFAULT_RETENTION_SECONDS = 7 * DAY
#: Ten years: a week given in milliseconds (19 years) is caught as a unit mistake.
MAX_RETENTION_SECONDS = 3650 * DAY

KeyFunc = Callable[..., Any]

#: Setting names a task may override with a class attribute of the same name.
SETTING_NAMES = (
    "lease_database_url",
    "lease_seconds",
    "lease_heartbeat_interval",
    "lease_max_attempts",
    "lease_retry_errors",
    "lease_retry_backoff",
    "lease_retry_backoff_max",
    "lease_busy_policy",
    "lease_lost_policy",
    "lease_interrupt",
    "lease_key",
    "lease_namespace",
    "lease_concurrency_key",
    "lease_max_concurrency",
    "lease_sweep_interval",
    "lease_rate_limit",
    "lease_rate_key",
    "lease_rate_burst",
    "lease_trace_fence",
)


#: Every ``lease_*`` key celery-lease reads from ``app.conf``; any other is a typo.
APP_SETTING_NAMES = (
    *SETTING_NAMES,
    "lease_retention",
    "lease_metrics",
    "lease_tracing",
    "lease_web_hosts",
    "lease_web_token",
    "lease_worker_sweeper",
)

#: The environment variable that gives ``lease web`` its write token when the setting is unset.
WEB_TOKEN_ENV = "CELERY_LEASE_WEB_TOKEN"
#: The shortest write token ``lease web`` accepts: a guessable one is no credential.
MIN_WEB_TOKEN_LENGTH = 16

#: Broker transports that live on this host only; any other broker spans hosts.
LOCAL_BROKER_SCHEMES = frozenset({"memory", "filesystem", "sqla+sqlite", "sqlite"})


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The SQLAlchemy URL of a SQLite file (made absolute)."""
    return "sqlite:///" + os.path.abspath(os.fspath(path))


def default_database_url() -> str:
    """A SQLite file in the current working directory, as an absolute URL."""
    return sqlite_url(DEFAULT_SQLITE_FILE)


def sweep_interval(conf: Mapping[str, Any]) -> float:
    """``lease_sweep_interval``, validated: seconds between two sweeps."""
    return _positive(conf, "lease_sweep_interval", 60.0, MAX_SWEEP_INTERVAL)


def beat_sweep_interval(conf: Mapping[str, Any]) -> float:
    """The sweep's beat interval: the default for a bad value, which the worker reports."""
    try:
        return sweep_interval(conf)
    except ImproperlyConfigured:
        return 60.0


def worker_sweeper(conf: Mapping[str, Any]) -> bool:
    """``lease_worker_sweeper``, validated: True (the default) when every worker takes part
    in sweeping its lease databases (one at a time per database, by a leader lease)."""
    return _boolean(conf, "lease_worker_sweeper", True)


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    """Validated lease settings. Build with :meth:`from_app` or :meth:`from_mapping`."""

    database_url: str
    lease_seconds: float = 30.0
    heartbeat_interval: float = 10.0
    max_attempts: int = 5
    #: A raising body is retried by the lease (True), or fails at once as in Celery (False).
    retry_errors: bool = True
    retry_backoff: float = 2.0
    retry_backoff_max: float = 600.0
    busy_policy: str = "retry"
    lost_policy: str = "retry"
    interrupt: bool = True
    key: KeyFunc | None = None
    namespace: str | None = None
    concurrency_key: KeyFunc | None = None
    max_concurrency: int | None = None
    sweep_interval: float = 60.0
    #: Seconds a finished run's row is kept (the de-duplication window); None: forever.
    retention: float | None = DEFAULT_RETENTION_SECONDS
    #: ``lease_rate_limit`` as given (``"20/s"``), None: unlimited.
    rate_limit: str | None = None
    rate_key: KeyFunc | None = None
    rate_burst: int = 1
    #: Share of ``fence()`` calls traced with a ``celery_lease.fence`` span (1.0: all, 0: none).
    trace_fence: float = 1.0

    @property
    def rate_period_ms(self) -> int | None:
        """Milliseconds between two slots of ``lease_rate_limit``; None when unlimited."""
        if self.rate_limit is None:
            return None
        return max(1, round(1000.0 / parse_rate(self.rate_limit)))

    @property
    def lease_ms(self) -> int:
        """The lease length in milliseconds, as stored in the run row."""
        return max(1, round(self.lease_seconds * 1000))

    @classmethod
    def from_mapping(cls, conf: Mapping[str, Any]) -> LeaseConfig:
        """Validate ``lease_*`` keys from any mapping (``app.conf``, a dict)."""
        lease_seconds = _positive(
            conf, "lease_seconds", 30.0, MAX_LEASE_SECONDS, minimum=MIN_LEASE_SECONDS
        )
        heartbeat = conf.get("lease_heartbeat_interval")
        heartbeat_interval = (
            lease_seconds / 3.0
            if heartbeat is None
            else _positive(
                conf, "lease_heartbeat_interval", heartbeat, minimum=MIN_HEARTBEAT_SECONDS
            )
        )
        # A renewal moves the local deadline to its send time + lease_seconds - margin;
        # the next is sent a heartbeat later, and a failed or slow one is tried again
        # at most a heartbeat after that. Two renewals must fit before the local
        # deadline, so that one failed tick never costs a lease.
        local_deadline = lease_seconds - safety_margin(lease_seconds)
        if heartbeat_interval * 2 > local_deadline:
            raise ImproperlyConfigured(
                f"lease_heartbeat_interval ({heartbeat_interval!r}) must be at most "
                f"{local_deadline / 2:.4g}s, half the local deadline of a {lease_seconds!r}s "
                f"lease (lease_seconds minus its {safety_margin(lease_seconds):.3g}s safety "
                "margin): two renewals must fit before it, so that one failed or slow "
                "renewal does not lose the lease (the default is lease_seconds / 3)"
            )
        backoff = _positive(conf, "lease_retry_backoff", 2.0, MAX_BACKOFF_SECONDS)
        backoff_max = _positive(conf, "lease_retry_backoff_max", 600.0, MAX_BACKOFF_SECONDS)
        if backoff_max < backoff:
            raise ImproperlyConfigured(
                f"lease_retry_backoff_max ({backoff_max!r}) must be >= "
                f"lease_retry_backoff ({backoff!r})"
            )
        max_concurrency = conf.get("lease_max_concurrency")
        if max_concurrency is not None:
            max_concurrency = _positive_int(conf, "lease_max_concurrency", None, MAX_CONCURRENCY)
        return cls(
            database_url=_database_url(conf.get("lease_database_url")),
            lease_seconds=lease_seconds,
            heartbeat_interval=heartbeat_interval,
            max_attempts=_positive_int(conf, "lease_max_attempts", 5, MAX_ATTEMPTS),
            retry_errors=_boolean(conf, "lease_retry_errors", True),
            retry_backoff=backoff,
            retry_backoff_max=backoff_max,
            busy_policy=_choice(conf, "lease_busy_policy", BUSY_POLICIES),
            lost_policy=_choice(conf, "lease_lost_policy", LOST_POLICIES),
            interrupt=_boolean(conf, "lease_interrupt", True),
            key=_callable(conf, "lease_key"),
            namespace=_name(conf, "lease_namespace"),
            concurrency_key=_callable(conf, "lease_concurrency_key"),
            max_concurrency=max_concurrency,
            sweep_interval=sweep_interval(conf),
            retention=_retention(conf),
            rate_limit=_rate_limit(conf),
            rate_key=_callable(conf, "lease_rate_key"),
            rate_burst=_positive_int(conf, "lease_rate_burst", 1, MAX_RATE_BURST),
            trace_fence=_share(conf, "lease_trace_fence"),
        )

    @classmethod
    def from_app(cls, app: Celery) -> LeaseConfig:
        """The app's settings, validated (each call reads ``app.conf`` again).

        The worker and tasks keep the result in the app's runtime
        (:func:`celery_lease.runtime.app_config`).
        """
        try:
            return cls.from_mapping(_app_settings(app))
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(_as_spelled(app, str(exc))) from None

    def with_overrides(self, overrides: Mapping[str, Any]) -> LeaseConfig:
        """This config with per-task ``lease_*`` values applied and re-validated."""
        if not overrides:
            return self
        merged = self.as_settings()
        merged.update(overrides)
        if "lease_seconds" in overrides and "lease_heartbeat_interval" not in overrides:
            # A task that shortens its lease gets a heartbeat scaled to it.
            merged["lease_heartbeat_interval"] = None
        return LeaseConfig.from_mapping(merged)

    def as_settings(self) -> dict[str, Any]:
        """This config as ``lease_*`` keys, the inverse of :meth:`from_mapping`."""
        return {
            "lease_database_url": self.database_url,
            "lease_seconds": self.lease_seconds,
            "lease_heartbeat_interval": self.heartbeat_interval,
            "lease_max_attempts": self.max_attempts,
            "lease_retry_errors": self.retry_errors,
            "lease_retry_backoff": self.retry_backoff,
            "lease_retry_backoff_max": self.retry_backoff_max,
            "lease_busy_policy": self.busy_policy,
            "lease_lost_policy": self.lost_policy,
            "lease_interrupt": self.interrupt,
            "lease_key": self.key,
            "lease_namespace": self.namespace,
            "lease_concurrency_key": self.concurrency_key,
            "lease_max_concurrency": self.max_concurrency,
            "lease_sweep_interval": self.sweep_interval,
            "lease_retention": self.retention,
            "lease_rate_limit": self.rate_limit,
            "lease_rate_key": self.rate_key,
            "lease_rate_burst": self.rate_burst,
            "lease_trace_fence": self.trace_fence,
        }


_UNSET = object()


def _app_settings(app: Celery) -> dict[str, Any]:
    conf = app.conf
    settings = {name: conf.get(name) for name in SETTING_NAMES if conf.get(name) is not None}
    # None is a value here (keep finished rows forever), not "unset".
    retention = conf.get("lease_retention", _UNSET)
    if retention is not _UNSET:
        settings["lease_retention"] = retention
    return settings


def _retention(conf: Mapping[str, Any]) -> float | None:
    """``lease_retention`` in seconds: a number or a timedelta; None (given) keeps rows forever."""
    if "lease_retention" not in conf:
        return DEFAULT_RETENTION_SECONDS
    value = conf["lease_retention"]
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImproperlyConfigured(
            f"lease_retention must be a number of seconds, a timedelta or None, got {value!r}"
        )
    seconds = float(value)
    if not seconds > 0 or not math.isfinite(seconds):
        raise ImproperlyConfigured(
            f"lease_retention must be positive and finite (None keeps rows forever), got {value!r}"
        )
    if seconds > MAX_RETENTION_SECONDS:
        raise ImproperlyConfigured(
            f"lease_retention must be at most {MAX_RETENTION_SECONDS:g} seconds (10 years; "
            f"None keeps rows forever), got {value!r}"
        )
    return seconds


def parse_rate(text: str) -> float:
    """Slots per second of a rate such as ``"20/s"``, ``"300/m"``, ``"1.5/h"``.

    Raises:
        ValueError: not ``N/s``, ``N/m`` or ``N/h`` with N a positive number.
    """
    amount, slash, unit = text.strip().partition("/")
    if not slash or unit.strip() not in _RATE_UNITS:
        raise ValueError(f"{text!r} is not N/s, N/m or N/h")
    try:
        value = float(amount)
    except ValueError:
        raise ValueError(f"{text!r}: {amount.strip()!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{text!r}: the rate must be positive")
    return value / _RATE_UNITS[unit.strip()]


def _rate_limit(conf: Mapping[str, Any]) -> str | None:
    """``lease_rate_limit``: ``"N/s"``, ``"N/m"`` or ``"N/h"``, at most 1000 per second."""
    value = conf.get("lease_rate_limit")
    if value is None:
        return None
    if not isinstance(value, str):
        raise ImproperlyConfigured(
            f"lease_rate_limit must be a string such as '20/s', '300/m' or '100/h', got {value!r}"
        )
    try:
        per_second = parse_rate(value)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"lease_rate_limit must look like '20/s', '300/m' or '100/h': {exc}"
        ) from None
    if per_second < MIN_RATE_PER_SECOND:
        raise ImproperlyConfigured(f"lease_rate_limit must be at least one per day, got {value!r}")
    if per_second > MAX_RATE_PER_SECOND:
        raise ImproperlyConfigured(
            f"lease_rate_limit must be at most {MAX_RATE_PER_SECOND:g}/s (one slot per "
            f"millisecond, the lease clock's resolution), got {value!r}"
        )
    return value


def _number(conf: Mapping[str, Any], key: str, default: float) -> float:
    value = conf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImproperlyConfigured(f"{key} must be a number of seconds, got {value!r}")
    return float(value)


def _positive(
    conf: Mapping[str, Any],
    key: str,
    default: float,
    maximum: float | None = None,
    minimum: float | None = None,
) -> float:
    value = _number(conf, key, default)
    if not value > 0 or value != value or value == float("inf"):
        raise ImproperlyConfigured(f"{key} must be a positive, finite number, got {value!r}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{key} must be at most {maximum:g} seconds, got {value!r}")
    if minimum is not None and value < minimum:
        unit = "second" if minimum == 1 else "seconds"
        raise ImproperlyConfigured(f"{key} must be at least {minimum:g} {unit}, got {value!r}")
    return value


def _positive_int(
    conf: Mapping[str, Any], key: str, default: int | None = None, maximum: int | None = None
) -> int:
    value = conf.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ImproperlyConfigured(f"{key} must be an integer >= 1, got {value!r}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{key} must be at most {maximum}, got {value!r}")
    return value


def _choice(conf: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = conf.get(key)
    if value is None:
        return choices[0]
    if value not in choices:
        raise ImproperlyConfigured(f"{key} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _boolean(conf: Mapping[str, Any], key: str, default: bool) -> bool:
    value = conf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{key} must be True or False, got {value!r}")
    return value


def _share(conf: Mapping[str, Any], key: str) -> float:
    """True (1.0, the default), False (0.0), or a share from 0 to 1."""
    value = conf.get(key)
    if value is None or value is True:
        return 1.0
    if value is False:
        return 0.0
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 <= value <= 1.0
    ):
        return float(value)
    raise ImproperlyConfigured(
        f"{key} must be True, False or a share from 0 to 1 (e.g. 0.01), got {value!r}"
    )


def _name(conf: Mapping[str, Any], key: str) -> str | None:
    value = conf.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 100 or not value.isprintable():
        raise ImproperlyConfigured(
            f"{key} must be a non-empty string of <= 100 printable chars, got {value!r}"
        )
    return value


def _callable(conf: Mapping[str, Any], key: str) -> KeyFunc | None:
    value = conf.get(key)
    if value is None:
        return None
    if not callable(value):
        raise ImproperlyConfigured(
            f"{key} must be a callable taking the task's arguments, got {value!r}"
        )
    return value  # type: ignore[no-any-return]


def _database_url(value: Any) -> str:
    if value is None:
        return default_database_url()
    if not isinstance(value, str) or not value:
        raise ImproperlyConfigured(f"lease_database_url must be a database URL, got {value!r}")
    try:
        url = make_url(value)
    except (ArgumentError, ValueError) as exc:
        raise ImproperlyConfigured(
            "lease_database_url is not a valid SQLAlchemy URL (expected e.g. "
            "postgresql+psycopg://user@host/db; percent-encode @ : / in a password)"
        ) from exc
    backend = url.get_backend_name()
    if backend not in DATABASES:
        raise ImproperlyConfigured(
            f"lease_database_url uses {backend!r}; supported: sqlite, postgresql, "
            "mysql (and mariadb)"
        )
    return value


def web_token(conf: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str | None:
    """The web view's write token: ``lease_web_token``, else ``$CELERY_LEASE_WEB_TOKEN``;
    None (read-only) when neither is set or either is empty.

    Raises:
        ImproperlyConfigured: the token is not a string, or shorter than 16 characters.
    """
    value = conf.get("lease_web_token")
    name = "lease_web_token"
    if value is None:
        value, name = environ.get(WEB_TOKEN_ENV), WEB_TOKEN_ENV
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ImproperlyConfigured(f"{name} must be a string, got {type(value).__name__}")
    if len(value) < MIN_WEB_TOKEN_LENGTH or value.strip() != value:
        raise ImproperlyConfigured(
            f"{name} must be at least {MIN_WEB_TOKEN_LENGTH} characters with no surrounding "
            "spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return value


#: The Host names the web view answers by default: the loopback ones.
DEFAULT_WEB_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def web_hosts(conf: Mapping[str, Any]) -> tuple[str, ...]:
    """The Host header values the web view answers: the loopback names
    (:data:`DEFAULT_WEB_HOSTS`; no other site can make a browser send them) and
    ``lease_web_hosts``: lowercase names or addresses, without a port (an IPv6
    address in brackets), ``*`` for any.

    Raises:
        ImproperlyConfigured: not a list of non-empty strings (or one comma-separated string).
    """
    value = conf.get("lease_web_hosts")
    if value is None:
        return DEFAULT_WEB_HOSTS
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ImproperlyConfigured(
            "lease_web_hosts must be a list of host names (e.g. ['leases.example.com']), "
            f"got {value!r}"
        )
    hosts = tuple(h.strip().lower() for h in value if h.strip())
    if not hosts:
        raise ImproperlyConfigured("lease_web_hosts is empty: name at least one host, or '*'")
    for host in hosts:
        if any(c in host for c in " /@?#\\") or host.count(":") == 1:
            raise ImproperlyConfigured(
                f"lease_web_hosts: {host!r} is not a host name (no port, scheme or path; "
                "an IPv6 address in brackets)"
            )
    return (*DEFAULT_WEB_HOSTS, *(h for h in hosts if h not in DEFAULT_WEB_HOSTS))


def check_app_settings(app: Celery) -> None:
    """Start-up checks beyond single values: unknown ``lease_*`` keys, and coordination.

    Raises:
        ImproperlyConfigured: a ``lease_*`` key celery-lease does not know (with
            the close match, as the key was spelled, namespace included), a
            ``lease_worker_sweeper`` that is not a boolean, or the
            default per-host SQLite file behind a broker that spans hosts.
    """
    check_setting_names(app)
    worker_sweeper(app.conf)
    if app.conf.get("lease_database_url") is None:
        schemes = network_broker_schemes(app)
        if schemes:
            raise ImproperlyConfigured(
                f"lease_database_url is not set, so each host would use its own SQLite file "
                f"({default_database_url()}) while the {'/'.join(schemes)} broker spans "
                "hosts: workers would not coordinate; set lease_database_url (e.g. "
                "postgresql+psycopg://app@db/app, or this SQLite URL to keep one host)"
            )


def check_setting_names(app: Celery) -> None:
    """Refuse a ``lease_*`` key of ``app``'s configuration that celery-lease does not know.

    Raises:
        ImproperlyConfigured: naming each such key as it was spelled (namespace
            included), with the close match.
    """
    unknown: list[tuple[str, str]] = []
    for spelled, name in _lease_keys(app.conf):
        if name in APP_SETTING_NAMES:
            continue
        close = difflib.get_close_matches(name, APP_SETTING_NAMES, n=1)
        hint = ""
        if close:
            head = spelled[: len(spelled) - len(name)]  # the namespace prefix, if any
            tail = close[0].upper() if spelled[len(head) :].isupper() else close[0]
            hint = f"{head}{tail}"
        unknown.append((spelled, hint))
    if unknown:
        raise ImproperlyConfigured(_unknown_message("unknown setting", unknown))


def check_task_options(task_name: str, options: list[str], known: set[str]) -> None:
    """Refuse a ``lease_*`` task option that is neither a setting nor in ``known``.

    Raises:
        ImproperlyConfigured: naming the task and the option, with the close match.
    """
    unknown: list[tuple[str, str]] = []
    app_only: list[str] = []
    for option in options:
        if not option.startswith("lease_") or option in SETTING_NAMES or option in known:
            continue
        if option in APP_SETTING_NAMES:
            app_only.append(option)
            continue
        close = difflib.get_close_matches(option, SETTING_NAMES, n=1)
        unknown.append((option, close[0] if close else ""))
    problems = [
        f"{option} is an app setting (app.conf.{option}), not a task option" for option in app_only
    ]
    if unknown:
        problems.append(_unknown_message("unknown option", unknown))
    if problems:
        raise ImproperlyConfigured(f"task {task_name}: " + "; ".join(problems))


def _unknown_message(what: str, names: list[tuple[str, str]]) -> str:
    """Every unknown key with its close match, if any, in one line.

    One: ``unknown setting a; did you mean b?``. Several: ``2 unknown settings:
    a (did you mean b?), c``.
    """
    if len(names) == 1:
        ((name, close),) = names
        return f"{what} {name}" + (f"; did you mean {close}?" if close else "")
    listed = ", ".join(
        f"{name} (did you mean {close}?)" if close else name for name, close in names
    )
    return f"{len(names)} {what}s: {listed}"


def celery_command(app: Celery) -> str:
    """``celery -A <what names this app>``, for messages that tell the user what to run.

    The ``-A`` value (or ``CELERY_APP``) this process was started with when it runs
    under Celery's command line; else the app's main module name.
    """
    context = click.get_current_context(silent=True)
    named = context.find_root().params.get("app") if context is not None else None
    if not isinstance(named, str) or not named:
        # Celery before 5.5 keeps the loaded app there, not the name it was given.
        named = _app_argument(sys.argv) or os.environ.get("CELERY_APP") or None
    if not named:
        named = app.main if app.main and app.main != "__main__" else None
    return f"celery -A {'<app>' if named is None else shlex.quote(named)}"


def _app_argument(argv: list[str]) -> str | None:
    """The value of ``-A``/``--app`` in a ``celery`` command line, if any."""
    for i, arg in enumerate(argv):
        if arg in ("-A", "--app") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--app="):
            return arg.partition("=")[2]
        if arg.startswith("-A") and len(arg) > 2:
            return arg[2:]
    return None


def network_broker_schemes(app: Celery) -> list[str]:
    """The schemes of the app's broker URLs that reach beyond this host (e.g. ``redis``)."""
    conf = app.conf
    urls: list[str] = []
    for value in (conf.broker_url, conf.broker_read_url, conf.broker_write_url):
        if isinstance(value, str):
            urls += value.split(";")
        elif isinstance(value, (list, tuple)):
            urls += [str(item) for item in value]
    if not urls:
        urls = ["amqp://"]  # Celery's default broker
    schemes: list[str] = []
    for url in urls:
        scheme = url.strip().partition("://")[0].lower() or "amqp"
        if scheme not in LOCAL_BROKER_SCHEMES and scheme not in schemes:
            schemes.append(scheme)
    return schemes


def _as_spelled(app: Celery, message: str) -> str:
    """``message`` with each setting named as the user spelled it (``CELERY_LEASE_SECONDS``
    with Django's ``namespace="CELERY"``), not as celery-lease reads it."""
    for spelled, name in _lease_keys(app.conf):
        if spelled != name:
            message = re.sub(rf"\b{re.escape(name)}\b", spelled, message)
    return message


def _lease_keys(conf: Any) -> Iterator[tuple[str, str]]:
    """``(key as spelled, key as read)`` for each ``lease_*`` key the user set.

    With ``config_from_object(..., namespace="CELERY")`` Celery reads
    ``lease_seconds`` from ``CELERY_LEASE_SECONDS`` (and from ``lease_seconds``).
    """
    prefix: str | None = getattr(conf, "prefix", None)
    user_maps = conf.maps[:-1] if len(conf.maps) > 1 else conf.maps
    seen: set[str] = set()
    for mapping in user_maps:
        for key in list(mapping):
            if not isinstance(key, str) or key in seen:
                continue
            seen.add(key)
            if prefix and key.upper().startswith(prefix.upper()):
                name = key[len(prefix) :].lower()
            elif key.startswith("lease_"):
                name = key
            else:
                continue
            if name.startswith("lease_"):
                yield key, name
