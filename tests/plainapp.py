"""A Celery app whose only leased task has no rate limit (``tests.workerapp`` has some):
a worker of it has no flow work. Configured from the same environment variables."""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import LeasedTask

app = Celery("plainapp")
app.conf.update(
    broker_url=os.environ.get("CL_BROKER_URL", "memory://"),
    task_default_queue=os.environ.get("CL_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ.get("CL_LEASE_DB") or None,
)
if os.environ.get("CL_FS_DIR"):
    folder = os.environ["CL_FS_DIR"]
    app.conf.broker_transport = "celery_lease.contrib.fs_transport:Transport"
    app.conf.broker_transport_options = {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": f"{folder}/control",
    }


@app.task(base=LeasedTask, bind=True, name="plainapp.hello")
def hello(self: LeasedTask) -> str:
    """Say hello under a lease."""
    return "hello"
