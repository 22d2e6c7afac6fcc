"""The Celery app ``tests/test_cli.py`` runs ``celery -A tests.cli_app lease ...`` against.

Configured from environment variables: ``CL_LEASE_DB`` (lease database URL),
``CL_BROKER_URL`` and ``CL_FS_DIR`` (a ``filesystem://`` broker folder, so the
sweeper can re-enqueue without any server), ``CL_WEB_HOSTS`` (``lease_web_hosts``,
comma-separated), ``CL_CONF`` (more settings, as a JSON object).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_lease import LeasedTask

app = Celery("cli_app")
app.conf.update(
    broker_url=os.environ.get("CL_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ.get("CL_LEASE_DB"),
)
if os.environ.get("CL_CONF"):
    app.conf.update(json.loads(os.environ["CL_CONF"]))  # more settings, as JSON
if os.environ.get("CL_WEB_HOSTS"):
    app.conf.lease_web_hosts = os.environ["CL_WEB_HOSTS"].split(",")
if os.environ.get("CL_FS_DIR"):
    folder = os.environ["CL_FS_DIR"]
    app.conf.broker_transport_options = {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": os.path.join(folder, "control"),
    }


@app.task(base=LeasedTask, bind=True, name="cli_app.charge")
def charge(self: LeasedTask, order_id: int) -> int:
    """A leased task whose runs the CLI tests create by claiming rows directly."""
    return order_id


if os.environ.get("CL_TASK_DB"):

    @app.task(
        base=LeasedTask,
        bind=True,
        name="cli_app.own_db",
        lease_database_url=os.environ["CL_TASK_DB"],
    )
    def own_db(self: LeasedTask, order_id: int) -> int:
        """A leased task whose runs live in its own lease database (``CL_TASK_DB``)."""
        return order_id
