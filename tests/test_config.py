"""Settings validation: every invalid value names its key."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_lease import LeaseConfig, LeasedTask

INVALID: list[tuple[str, Any]] = [
    ("lease_seconds", -1),
    ("lease_seconds", 0),
    ("lease_seconds", "30"),
    ("lease_seconds", float("nan")),
    ("lease_heartbeat_interval", 0),
    ("lease_heartbeat_interval", 30),
    ("lease_heartbeat_interval", 45),
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
    ("lease_concurrency_key", 3),
    ("lease_max_concurrency", 0),
    ("lease_sweep_interval", -5),
    ("lease_database_url", "not a url"),
    ("lease_database_url", "oracle://scott@db/orcl"),
    ("lease_database_url", ""),
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
    assert charge.run_id_for((7,), {}) == "tests.test_config.charge:o-7"
    assert LeaseConfig.from_app(app).lease_seconds == 60


def test_invalid_task_option_names_the_key(tmp_path: Any) -> None:
    """A bad per-task option is reported with its key too."""
    app = Celery("cfg2", set_as_current=False)
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'x.db'}"

    @app.task(base=LeasedTask, bind=True, shared=False, lease_busy_policy="sometimes")
    def job(self: LeasedTask) -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match="lease_busy_policy"):
        job.lease_config()
