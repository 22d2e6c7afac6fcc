"""Where the shop keeps its data and how fast leases move, read from the environment.

``EXAMPLE_DATABASE_URL`` (the shop's tables and the lease table, one database)
and ``EXAMPLE_BROKER_URL`` pick the servers; without them the shop runs on the
embedded default: a SQLite file and Celery's ``filesystem://`` broker under
``EXAMPLE_WORKDIR`` (default: the working directory).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from kombu import Queue  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class Timings:
    """Lease and recovery timings, in seconds."""

    lease_seconds: float
    sweep_interval: float
    retry_backoff: float
    retry_backoff_max: float
    #: A pending order whose capture never started is submitted again after this.
    resubmit_after: float
    resubmit_interval: float
    #: The shop's bookkeeping between the gateway's reply and the commit (a fraud
    #: score, a ledger lookup): the window in which the demo kills a worker.
    after_reply: float = 0.0


#: Production-like timings (the celery-lease defaults, a 5-minute resubmit).
PRODUCTION = Timings(30.0, 60.0, 2.0, 600.0, 300.0, 60.0)
#: Short timings so the demo shows expiry, sweeping and takeover in seconds.
DEMO = Timings(3.0, 1.0, 0.5, 2.0, 15.0, 2.0, after_reply=0.25)
TIMINGS = {"production": PRODUCTION, "demo": DEMO}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The shop's settings. Build with :meth:`from_env`."""

    database_url: str
    broker_url: str
    broker_folder: Path | None
    queue: str
    timings: Timings

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read ``EXAMPLE_*`` variables (see the module docstring and README)."""
        env = os.environ if environ is None else environ
        workdir = Path(env.get("EXAMPLE_WORKDIR") or os.getcwd()).resolve()
        database_url = env.get("EXAMPLE_DATABASE_URL") or f"sqlite:///{workdir / 'shop.sqlite3'}"
        broker_url = env.get("EXAMPLE_BROKER_URL") or "filesystem://"
        folder = None
        if broker_url.startswith("filesystem://"):
            folder = Path(env.get("EXAMPLE_BROKER_FOLDER") or workdir / "broker").resolve()
        timings_name = env.get("EXAMPLE_TIMINGS") or "production"
        if timings_name not in TIMINGS:
            raise ValueError(
                f"EXAMPLE_TIMINGS must be one of {', '.join(TIMINGS)}, got {timings_name!r}"
            )
        return cls(
            database_url=database_url,
            broker_url=broker_url,
            broker_folder=folder,
            queue=env.get("EXAMPLE_QUEUE") or "shop-payments",
            timings=TIMINGS[timings_name],
        )

    def celery_conf(self) -> dict[str, object]:
        """The ``app.conf`` values for these settings."""
        t = self.timings
        conf: dict[str, object] = {
            "broker_url": self.broker_url,
            "broker_connection_retry_on_startup": True,
            "task_default_queue": self.queue,
            # Recovery gets a queue of its own, so a backlog of captures cannot
            # delay the sweeper; workers consume both.
            "task_queues": [Queue(self.queue), Queue(self.maintenance_queue)],  # type: ignore[no-untyped-call]
            "task_routes": {
                "celery_lease.sweep": {"queue": self.maintenance_queue},
                "example_project.resubmit_stalled_captures": {"queue": self.maintenance_queue},
                # Long exports run on workers of their own (``-Q`` this queue).
                "example_project.export_orders": {"queue": self.export_queue},
            },
            # Long tasks: take one message at a time, acknowledge it when done.
            "task_acks_late": True,
            "worker_prefetch_multiplier": 1,
            "worker_enable_remote_control": False,
            "task_ignore_result": True,
            "lease_database_url": self.database_url,
            "lease_seconds": t.lease_seconds,
            "lease_sweep_interval": t.sweep_interval,
            "lease_retry_backoff": t.retry_backoff,
            "lease_retry_backoff_max": t.retry_backoff_max,
        }
        if self.broker_folder is not None:
            # The filesystem transport needs its folders spelled out; in and
            # out are the same folder so producers and workers share it.
            conf["broker_transport"] = "celery_lease.contrib.fs_transport:Transport"
            conf["broker_transport_options"] = {
                "data_folder_in": str(self.broker_folder),
                "data_folder_out": str(self.broker_folder),
                "control_folder": str(self.broker_folder / "control"),
                # Poll the folder every 0.1 s instead of every second.
                "polling_interval": 0.1,
            }
        return conf

    @property
    def maintenance_queue(self) -> str:
        """The queue of the sweeper and the resubmission task."""
        return f"{self.queue}-maintenance"

    @property
    def export_queue(self) -> str:
        """The queue of the export job, consumed only by workers started with ``-Q`` it."""
        return f"{self.queue}-exports"

    def make_folders(self) -> None:
        """Create the filesystem broker's folders (nothing to do for a server broker)."""
        if self.broker_folder is not None:
            (self.broker_folder / "control").mkdir(parents=True, exist_ok=True)
