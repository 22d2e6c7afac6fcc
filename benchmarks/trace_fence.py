"""What tracing costs a task that fences every item, and what ``lease_trace_fence`` saves.

One process, SQLite, the OpenTelemetry SDK recording into memory: a leased task
fences ``--items`` items, each in its own transaction on the lease database (an
export writing each item exactly once). Printed per setting of
``lease_trace_fence``: spans per run, CPU µs per fenced item, and the same with
tracing off, interleaved over ``--rounds``, medians.

::

    python -m benchmarks.trace_fence [--items N] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lease import LeasedTask, testing, tracing

SETTINGS: list[tuple[str, Any]] = [
    ("tracing off", None),
    ("lease_trace_fence = True", True),
    ("lease_trace_fence = 0.01", 0.01),
    ("lease_trace_fence = False", False),
]


def _run(items: int, share: Any, folder: Path, round_no: int) -> tuple[float, int]:
    """CPU µs per fenced item and the spans one run records, for one setting."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    app = Celery(f"trace-fence-{round_no}-{share}", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.lease_tracing = share is not None
    testing.use_lease_database(app, str(folder / f"{round_no}-{share}.sqlite3"))
    exporter = InMemorySpanExporter()
    if share is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing.enable(app, tracer_provider=provider)

    options: dict[str, Any] = {} if share is None else {"lease_trace_fence": share}

    @app.task(base=LeasedTask, bind=True, shared=False, name="bench.export", **options)  # type: ignore[untyped-decorator]
    def export(self: LeasedTask, n: int) -> int:
        for _ in range(n):
            with self.lease.transaction() as conn:
                self.lease.fence(conn)
        return n

    export.apply((10,))  # warm up: engines, statements compiled
    exporter.clear()
    started = time.process_time()
    export.apply((items,))
    cpu = time.process_time() - started
    spans = len(exporter.get_finished_spans())
    testing.shutdown_leases(app)
    return cpu / items * 1e6, spans


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.trace_fence``: the table, printed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_fence")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="celery-lease-trace-fence-"))
    cpu: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    spans: dict[str, int] = {}
    for round_no in range(args.rounds):
        for name, share in SETTINGS:
            per_item, count = _run(args.items, share, folder, round_no)
            cpu[name].append(per_item)
            spans[name] = count
    base = statistics.median(cpu["tracing off"])
    print(f"## {args.items} fenced items in one run, {args.rounds} rounds (SQLite, SDK in memory)")
    print("| setting | spans per run | CPU µs / fenced item | added by tracing |")
    print("| --- | --- | --- | --- |")
    for name, _ in SETTINGS:
        median = statistics.median(cpu[name])
        print(f"| {name} | {spans[name]} | {median:.1f} | {median - base:+.1f} |")


if __name__ == "__main__":
    main()
