"""The app .ci/extras-check.sh runs in a venv holding only celery-lease[postgres,redis].

A Redis broker and result backend, a PostgreSQL lease database, one leased task. The
worker it starts must run that task to SUCCESS: proof that the extras work alone.
"""

import os
import sys

from celery import Celery

from celery_lease import LeasedTask

app = Celery("extras_app")
app.conf.update(
    broker_url=os.environ["EXTRAS_REDIS_URL"],
    result_backend=os.environ["EXTRAS_REDIS_URL"],
    task_default_queue=os.environ["EXTRAS_QUEUE"],
    worker_enable_remote_control=False,  # the Redis may be shared: no broadcast traffic
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ["EXTRAS_PG_URL"],
    lease_seconds=6,
)


@app.task(base=LeasedTask, bind=True, lease_key=lambda n: n, lease_namespace="extras")
def double(self, n):
    self.lease.check()
    # Without celery-lease[otel] nothing of OpenTelemetry is imported, in the worker too.
    assert not [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]
    return n * 2
