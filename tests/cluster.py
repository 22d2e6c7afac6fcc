"""A lease database plus broker queue, and the real workers a test starts on them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from celery_lease import LeaseStore
from tests.helpers import Worker, plain_engine, queue_for
from tests.workerapp import effects, effects_metadata

#: (lease database, broker) pairs the worker tests run on.
SETUPS = [("sqlite", "filesystem"), ("sqlite", "redis"), ("postgresql", "redis")]
SETUP_IDS = ["sqlite-fs", "sqlite-redis", "pg-redis"]
#: PostgreSQL behind PgBouncer (transaction pooling) + Redis, for a chosen subset of tests.
PGBOUNCER_SETUP = ("pgbouncer", "redis")
PGBOUNCER_ID = "pgbouncer-redis"
#: PostgreSQL + RabbitMQ, for the tests about redelivery (acks_late, kill -9, busy re-publish).
AMQP_SETUP = ("postgresql", "amqp")
AMQP_ID = "pg-amqp"
#: MariaDB + Redis, for the worker tests whose statements differ on a MySQL-family database
#: (claims, takeovers, sweeps, hand-backs, checkpoints, flow control).
MARIADB_SETUP = ("mysql", "redis")
MARIADB_ID = "mariadb-redis"
#: SQLite + filesystem, PostgreSQL + Redis and MariaDB + Redis.
TWO_SETUPS_AND_MARIADB = pytest.mark.parametrize(
    "cluster",
    [SETUPS[0], SETUPS[2], MARIADB_SETUP],
    ids=[SETUP_IDS[0], SETUP_IDS[2], MARIADB_ID],
    indirect=True,
)
#: PostgreSQL + Redis and MariaDB + Redis.
PG_AND_MARIADB = pytest.mark.parametrize(
    "cluster", [SETUPS[2], MARIADB_SETUP], ids=[SETUP_IDS[2], MARIADB_ID], indirect=True
)


class Cluster:
    """A lease database, a broker queue, and the workers a test starts on them."""

    def __init__(
        self, db_url: str, broker_env: dict[str, str], tmp_path: Path, workers: list[Worker]
    ) -> None:
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.queue = f"q{uuid.uuid4().hex[:8]}"
        self.env = {**broker_env, "CL_LEASE_DB": db_url, "CL_QUEUE": self.queue}
        self.amqp = broker_env["CL_BROKER_URL"].startswith("amqp")
        self._workers = workers
        self.store = LeaseStore.from_url(db_url)
        self.store.create_schema()
        self.engine = plain_engine(db_url)
        effects_metadata.create_all(self.engine)
        self.producer = Celery("producer")
        self.producer.conf.update(
            broker_url=broker_env["CL_BROKER_URL"],
            result_backend=broker_env.get("CL_RESULT_BACKEND"),
            task_default_queue=self.queue,
            broker_connection_retry_on_startup=True,
        )
        if self.amqp:
            # One vhost for every test: this test's control exchange is its own.
            self.producer.conf.control_exchange = f"{self.queue}.ctl"
        if "CL_FS_DIR" in broker_env:
            folder = broker_env["CL_FS_DIR"]
            self.producer.conf.broker_transport = "celery_lease.contrib.fs_transport:Transport"
            self.producer.conf.broker_transport_options = {
                "data_folder_in": folder,
                "data_folder_out": folder,
                "control_folder": f"{folder}/control",
            }

    def use_queue_arguments(self, arguments: dict[str, Any], exchange_type: str = "direct") -> None:
        """Declare this cluster's queue with ``arguments`` (e.g. a quorum queue) on an
        exchange of ``exchange_type``, in the producer and in every worker started from
        now on (RabbitMQ refuses a queue declared again with other arguments)."""
        self.env["CL_QUEUE_ARGS"] = json.dumps(arguments)
        self.env["CL_QUEUE_EXCHANGE_TYPE"] = exchange_type
        self.producer.conf.task_queues = [queue_for(self.queue, arguments, exchange_type)]

    def start(
        self,
        name: str,
        *,
        conf: dict[str, Any] | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: list[str] | None = None,
        node: str | None = None,
        **env: str,
    ) -> Worker:
        """Start a worker on this cluster and wait until it is ready.

        ``queues`` limits what it consumes (``-Q``; by default the cluster's
        queue); ``node`` is its node name (``-n``).
        """
        if conf:
            env["CL_CONF"] = json.dumps(conf)
        worker = Worker(
            {**self.env, **env},
            self.tmp_path / f"{name}.log",
            name=name,
            pool=pool,
            concurrency=concurrency,
            extra_args=("-Q", ",".join(queues)) if queues else (),
            node=node,
        )
        self._workers.append(worker)
        return worker.wait_ready()

    def start_beat(self, conf: dict[str, Any]) -> Worker:
        """Start ``celery beat`` (it schedules ``celery_lease.sweep``)."""
        env = {**self.env, "CL_CONF": json.dumps(conf)}
        beat = Worker(
            env,
            self.tmp_path / "beat.log",
            name="beat",
            command=["beat", "-s", str(self.tmp_path / "beat-schedule"), "-l", "INFO"],
        )
        self._workers.append(beat)
        return beat

    def start_lease_beat(self, name: str, conf: dict[str, Any] | None = None, **env: str) -> Worker:
        """Start ``celery beat -S celery_lease.beat:LeaseScheduler`` with the test app's beat
        schedule (``CL_BEAT_SCHEDULE``); it does not wait (beat logs no "ready")."""
        env = {**self.env, "CL_BEAT_SCHEDULE": "1", **env}
        if conf:
            env["CL_CONF"] = json.dumps(conf)
        beat = Worker(
            env,
            self.tmp_path / f"{name}.log",
            name=name,
            command=["beat", "-S", "celery_lease.beat:LeaseScheduler", "-l", "INFO"],
        )
        self._workers.append(beat)
        return beat

    def send(self, task: str, *args: Any, task_id: str | None = None) -> str:
        """Publish ``task`` by name (``workerapp.`` may be left out); returns its task id."""
        task = task if "." in task else f"workerapp.{task}"
        task_id = task_id or uuid.uuid4().hex
        self.producer.send_task(task, args=args, task_id=task_id, queue=self.queue)
        return task_id

    def effects(self, run_id: str, kind: str | None = None) -> list[Any]:
        query = select(effects).where(effects.c.run_id == run_id).order_by(effects.c.id)
        if kind:
            query = query.where(effects.c.kind == kind)
        with self.engine.connect() as conn:
            return list(conn.execute(query).all())

    def effects_of_kind(self, kind: str) -> list[Any]:
        """Every effect of ``kind``, across runs."""
        query = select(effects).where(effects.c.kind == kind).order_by(effects.c.id)
        with self.engine.connect() as conn:
            return list(conn.execute(query).all())

    def status(self, run_id: str) -> str | None:
        row = self.store.get(run_id)
        return None if row is None else row.status

    def close(self) -> None:
        # The test has made its assertions by now: kill the workers at once (a warm shutdown
        # of any Celery worker takes ~2.5 s on Redis, ~6 s on RabbitMQ), before the scratch
        # database is dropped and, on RabbitMQ, before the queue is deleted (a consumer whose
        # queue is deleted reconnects and declares it again).
        for worker in self._workers:
            worker.discard()
        if self.amqp:
            delete_amqp_entities(self.producer, self.queue)
        self.producer.close()
        self.store.dispose()
        self.engine.dispose()


def delete_amqp_entities(app: Celery, queue: str) -> None:
    """Delete a test's queue, its exchange and its control exchanges from RabbitMQ."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.queue_delete(queue)
        for exchange in (queue, f"{queue}.ctl.pidbox", f"reply.{queue}.ctl.pidbox"):
            channel.exchange_delete(exchange)
