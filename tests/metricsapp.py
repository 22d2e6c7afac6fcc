"""``tests.workerapp`` with Prometheus metrics exported the way ``docs/operations.md`` says.

Multiprocess mode: the worker runs with ``PROMETHEUS_MULTIPROC_DIR`` set, every
process (main and pool children) writes its counts there, and the main process
serves ``/metrics`` from a registry holding only a ``MultiProcessCollector``.
The port is ``CL_METRICS_PORT`` on 127.0.0.1.
"""

from __future__ import annotations

import os
from typing import Any

from celery import signals

from tests.workerapp import app

app.conf.lease_metrics = True


@signals.worker_init.connect
def serve_metrics(**kwargs: Any) -> None:
    """In the worker's main process, before the pool forks: one HTTP endpoint for all."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(int(os.environ["CL_METRICS_PORT"]), addr="127.0.0.1", registry=registry)


@signals.worker_process_shutdown.connect
def forget_child(pid: int | None = None, **kwargs: Any) -> None:
    """A pool child exits: its live gauges go (counters and histograms keep their counts)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid or os.getpid())


__all__ = ["app"]
