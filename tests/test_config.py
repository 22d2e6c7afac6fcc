"""Settings validation: every invalid value names its key."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_lease import LeaseConfig, LeasedTask
from celery_lease.config import check_app_settings
from celery_lease.run.runids import run_id_of

INVALID: list[tuple[str, Any]] = [
    ("lease_seconds", -1),
    ("lease_seconds", 0),
    ("lease_seconds", "30"),
    ("lease_seconds", float("nan")),
    ("lease_heartbeat_interval", 0),
    ("lease_heartbeat_interval", 1e-6),  # under 0.1 s: a renewal statement per microsecond
    ("lease_heartbeat_interval", 27),  # at/after the local deadline (26.97 s of 30 s)
    ("lease_heartbeat_interval", 30),
    ("lease_heartbeat_interval", 45),
    ("lease_seconds", 0.001),  # under 1 s: the store's waits follow the shortest lease
    ("lease_max_attempts", 0),
    ("lease_max_attempts", 2.5),
    ("lease_max_attempts", True),
    ("lease_retry_backoff", -2),
    ("lease_retry_backoff_max", 0),
    ("lease_retry_backoff_max", 1),
    ("lease_busy_policy", "wait"),
    ("lease_lost_policy", "ignore"),
    ("lease_interrupt", "yes"),
    ("lease_key", "order_id"),
    ("lease_namespace", ""),
    ("lease_namespace", 7),
    ("lease_namespace", "a\x00b"),
    ("lease_namespace", "a\ud800b"),
    ("lease_rate_limit", "1e-300/s"),  # a slot interval no BIGINT holds
    ("lease_concurrency_key", 3),
    ("lease_max_concurrency", 0),
    ("lease_sweep_interval", -5),
    ("lease_database_url", "not a url"),
    ("lease_database_url", "oracle://scott@db/orcl"),
    ("lease_database_url", ""),
    ("lease_database_url", "postgresql://u:p@ss:w/rd@db/x"),
]


@pytest.mark.parametrize(("key", "value"), INVALID, ids=[f"{k}={v!r}" for k, v in INVALID])
def test_invalid_value_names_the_key(key: str, value: Any) -> None:
    """Each invalid value raises ImproperlyConfigured whose message names the key."""
    settings = {key: value}
    if key == "lease_retry_backoff_max" and value == 1:
        settings["lease_retry_backoff"] = 2
    with pytest.raises(ImproperlyConfigured) as err:
        LeaseConfig.from_mapping(settings)
    assert key in str(err.value)


def test_heartbeat_must_leave_two_renewals_before_the_local_deadline() -> None:
    """The heartbeat is bounded by half the lease's local deadline (lease minus its safety
    margin), so one failed renewal never loses a lease: L = 3 s refuses 2.69 s (accepted
    before, and then lost its lease) and 1.4 s, in one line naming the key; 1.3 s is kept."""
    for interval in (2.69, 1.4):
        with pytest.raises(ImproperlyConfigured) as err:
            LeaseConfig.from_mapping({"lease_seconds": 3, "lease_heartbeat_interval": interval})
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(
            f"lease_heartbeat_interval ({interval}) must be at most 1.349s, half the local "
            "deadline of a 3.0s lease"
        )
        assert "safety margin" in message
    assert (
        LeaseConfig.from_mapping(
            {"lease_seconds": 3, "lease_heartbeat_interval": 1.3}
        ).heartbeat_interval
        == 1.3
    )


def test_defaults() -> None:
    """Defaults follow DESIGN.md: 30 s lease, heartbeat a third of it, 5 attempts."""
    config = LeaseConfig.from_mapping({})
    assert config.lease_seconds == 30 and config.heartbeat_interval == 10
    assert config.max_attempts == 5 and config.retry_backoff == 2
    assert config.retry_backoff_max == 600 and config.sweep_interval == 60
    assert (config.busy_policy, config.lost_policy, config.interrupt) == ("retry", "retry", True)
    assert config.database_url.startswith("sqlite:///") and config.database_url.endswith(
        "celery-lease.sqlite3"
    )


def test_task_options_override_app_settings(tmp_path: Any) -> None:
    """Per-task lease_* options win over app.conf; a shorter lease rescales the heartbeat."""
    app = Celery("cfg", set_as_current=False)
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"
    app.conf.lease_seconds = 60

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        lease_seconds=6,
        lease_key=lambda order: f"o-{order}",
    )
    def charge(self: LeasedTask, order: int) -> None:
        return None

    config = charge.lease_config()
    assert config.lease_seconds == 6 and config.heartbeat_interval == 2
    assert (
        run_id_of(charge.name, charge.lease_config(), charge.request, (7,), {})
        == "tests.test_config.charge:o-7"
    )
    assert LeaseConfig.from_app(app).lease_seconds == 60


def test_invalid_task_option_names_the_key(tmp_path: Any) -> None:
    """A bad per-task option is reported with its task and its key."""
    app = Celery("cfg2", set_as_current=False)
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"

    @app.task(base=LeasedTask, bind=True, shared=False, lease_busy_policy="sometimes")
    def job(self: LeasedTask) -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match=rf"^task {job.name}: lease_busy_policy"):
        job.lease_config()


def test_unknown_lease_key_suggests_the_close_match() -> None:
    """A misspelled lease_* key is refused with the key it was probably meant to be."""
    app = Celery("typo", set_as_current=False, broker="memory://")
    app.conf.lease_secnds = 3
    with pytest.raises(ImproperlyConfigured, match=r"lease_secnds; did you mean lease_seconds\?"):
        check_app_settings(app)


def test_every_unknown_lease_key_is_reported_in_one_line() -> None:
    """Two misspelled keys: both named, each with its close match, in one line."""
    app = Celery("typos", set_as_current=False, broker="memory://")
    app.conf.lease_secnds = 3
    app.conf.lease_max_atempts = 2
    app.conf.lease_frobnicate = 1
    with pytest.raises(ImproperlyConfigured) as err:
        check_app_settings(app)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("3 unknown settings: "), message
    assert "lease_secnds (did you mean lease_seconds?)" in message
    assert "lease_max_atempts (did you mean lease_max_attempts?)" in message
    assert "lease_frobnicate" in message


def test_unknown_key_in_a_celery_namespace_is_named_as_spelled() -> None:
    """Under config_from_object(namespace="CELERY") the key and hint keep the prefix."""

    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_LEASE_DATABASE_URL = "sqlite:///x.db"
        CELERY_LEASE_SECONDS = 12
        CELERY_LEASE_HEARTBEAT_INTERVL = 2
        LEASE_UNRELATED = 1  # not in the namespace: not celery-lease's

    app = Celery("django", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    assert (
        LeaseConfig.from_mapping({"lease_seconds": app.conf.get("lease_seconds")}).lease_seconds
        == 12
    )
    with pytest.raises(
        ImproperlyConfigured,
        match="CELERY_LEASE_HEARTBEAT_INTERVL; did you mean CELERY_LEASE_HEARTBEAT_INTERVAL",
    ):
        check_app_settings(app)
    del Settings.CELERY_LEASE_HEARTBEAT_INTERVL
    good = Celery("django2", set_as_current=False)
    good.config_from_object(Settings, namespace="CELERY")
    check_app_settings(good)


@pytest.mark.parametrize(
    "broker", ["redis://cache:6379/0", "rediss://c/0", "amqp://guest@mq//", "sqs://", None]
)
def test_default_sqlite_behind_network_broker_is_refused(broker: str | None) -> None:
    """Without lease_database_url, a broker spanning hosts (or Celery's amqp default) is refused."""
    app = Celery("net", set_as_current=False, broker=broker)
    with pytest.raises(ImproperlyConfigured, match="lease_database_url is not set"):
        check_app_settings(app)
    app.conf.lease_database_url = "sqlite:///one-host.db"  # explicit: the operator chose it
    check_app_settings(app)


@pytest.mark.parametrize("broker", ["memory://", "filesystem://", "sqla+sqlite:///b.db"])
def test_default_sqlite_with_a_local_broker_is_fine(broker: str) -> None:
    """The embedded default (one host) keeps working without any setting."""
    check_app_settings(Celery("local", set_as_current=False, broker=broker))


def test_unknown_task_option_is_refused_at_worker_start(tmp_path: Any) -> None:
    """A misspelled lease_* task option, which Celery would keep silently, is refused."""
    from celery_lease.worker import _check_worker_startup

    app = Celery("opt", set_as_current=False, broker="memory://")
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"

    @app.task(base=LeasedTask, bind=True, shared=False, lease_secnds=5)
    def charge(self: LeasedTask) -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match="unknown option lease_secnds; did you mean"):
        _check_worker_startup(app, "prefork")


def test_an_app_setting_given_as_a_task_option_is_named_as_such(tmp_path: Any) -> None:
    """``lease_retention=5`` on a task: refused as an app setting, not as a misspelling of
    some task option ("did you mean lease_retry_errors?", before)."""
    from celery_lease.worker import _check_worker_startup

    app = Celery("appopt", set_as_current=False, broker="memory://")
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"

    @app.task(base=LeasedTask, bind=True, shared=False, lease_retention=5)
    def charge(self: LeasedTask) -> None:
        return None

    with pytest.raises(ImproperlyConfigured) as err:
        _check_worker_startup(app, "prefork")
    message = str(err.value)
    assert "lease_retention is an app setting (app.conf.lease_retention)" in message
    assert "did you mean" not in message


def test_every_unknown_task_option_is_reported_in_one_line(tmp_path: Any) -> None:
    """Two misspelled task options: both named in one line, with their close matches."""
    from celery_lease.worker import _check_worker_startup

    app = Celery("opts", set_as_current=False, broker="memory://")
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"

    @app.task(base=LeasedTask, bind=True, shared=False, lease_secnds=5, lease_max_atempts=2)
    def charge(self: LeasedTask) -> None:
        return None

    with pytest.raises(ImproperlyConfigured) as err:
        _check_worker_startup(app, "prefork")
    message = str(err.value)
    assert "2 unknown options: " in message and "\n" not in message
    assert "lease_secnds (did you mean lease_seconds?)" in message
    assert "lease_max_atempts (did you mean lease_max_attempts?)" in message


def test_green_pool_is_found_by_the_pool_class_not_its_name(tmp_path: Any) -> None:
    """Celery's pool classes say whether they run green threads (``is_green``): on one,
    lease_interrupt=True is refused at worker start, and unset it is turned off."""
    from celery.concurrency.base import BasePool

    from celery_lease.runtime import app_runtime
    from celery_lease.worker import _check_worker_startup

    class GreenPool(BasePool):  # type: ignore[misc]
        is_green = True

    class ThreadPool(BasePool):  # type: ignore[misc]
        pass

    app = Celery("green", set_as_current=False, broker="memory://")
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"
    _check_worker_startup(app, ThreadPool)
    assert not app_runtime(app).green_pool
    _check_worker_startup(app, GreenPool)
    assert app_runtime(app).green_pool
    app.conf.lease_interrupt = True
    with pytest.raises(ImproperlyConfigured, match="gevent/eventlet"):
        _check_worker_startup(app, GreenPool)


def test_celery_command_names_the_app_outside_the_command_line() -> None:
    """Without Celery's command line, a message's ``celery -A`` names the app's main module."""
    from celery_lease.config import celery_command

    assert celery_command(Celery("proj", set_as_current=False)) == "celery -A proj"
    assert celery_command(Celery(set_as_current=False)) == "celery -A <app>"


def test_worker_sweeper_setting_is_a_boolean_checked_at_start() -> None:
    """``lease_worker_sweeper`` is a known app setting: True or False (default True); any
    other value is refused at worker start, naming the key."""
    from celery_lease.config import worker_sweeper

    app = Celery("sweeperflag", set_as_current=False, broker="memory://")
    assert worker_sweeper(app.conf) is True
    app.conf.lease_worker_sweeper = False
    check_app_settings(app)
    assert worker_sweeper(app.conf) is False
    app.conf.lease_worker_sweeper = "no"
    with pytest.raises(ImproperlyConfigured, match="lease_worker_sweeper must be True or False"):
        check_app_settings(app)
