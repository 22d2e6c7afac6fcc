"""``celery_lease.tracing``: OpenTelemetry spans, task-span events and links across attempts.

In process with the SDK's in-memory exporter (a span opened around the call
stands for the Celery instrumentation's task span), and in real ``celery
worker`` processes with ``opentelemetry-instrumentation-celery`` and a file
exporter (``CL_OTEL_DIR`` in ``tests/workerapp.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import ImproperlyConfigured
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from celery_lease import LeaseConfig, LeasedTask, LeaseLost, install, testing, tracing
from celery_lease.errors import LeaseDatabaseError, LeaseInputError
from celery_lease.runtime import app_config, app_runtime, runtime_for, store_for
from celery_lease.schema import check_claim_inputs
from celery_lease.tracing import continued_context, format_traceparent, parse_traceparent
from tests.cluster import PG_AND_MARIADB, SETUP_IDS, SETUPS, Cluster
from tests.helpers import REPO, driver_statements, wait_for

SQLITE_FS = pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def tracer(provider: TracerProvider) -> Tracer:
    """Stands for the Celery instrumentation: it opens the task's span."""
    return provider.get_tracer("test")


@pytest.fixture
def app(tmp_path: Path, provider: TracerProvider) -> Iterator[Celery]:
    app = Celery("tracing", set_as_current=False)
    app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)
    testing.use_lease_database(
        app, tmp_path / "leases.sqlite3", lease_max_attempts=1, lease_lost_policy="abort"
    )
    tracing.enable(app, provider)
    yield app
    testing.shutdown_leases(app)


def named(spans: Any, name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def one(spans: Any, name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def event_names(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def test_span_tree_of_a_run(app: Celery, exporter: InMemorySpanExporter, tracer: Tracer) -> None:
    """claim, fence and complete are children of the task's span, with the run's attributes."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.ok")
    def ok(self: LeasedTask) -> int:
        with self.lease.transaction() as conn:
            self.lease.fence(conn)
        return 1

    with tracer.start_as_current_span("run/tracing.ok"):
        result = ok.delay()
    assert result.get() == 1
    spans = exporter.get_finished_spans()
    task = one(spans, "run/tracing.ok")
    claim, fence, complete = (
        one(spans, f"celery_lease.{name}") for name in ("claim", "fence", "complete")
    )
    assert [claim.start_time, fence.start_time, complete.start_time] == sorted(
        [claim.start_time, fence.start_time, complete.start_time]
    )
    for span, outcome in ((claim, "claimed"), (fence, "held"), (complete, "succeeded")):
        assert span.parent is not None and span.parent.span_id == task.context.span_id
        assert span.context.trace_id == task.context.trace_id
        assert span.attributes is not None
        assert span.attributes["celery_lease.outcome"] == outcome
        assert span.attributes["celery_lease.run_id"] == result.id
        assert span.attributes["celery_lease.attempt"] == 1
        assert span.attributes["celery_lease.task"] == "tracing.ok"
        assert str(span.attributes["celery_lease.owner"]).endswith(
            store_for(app).get(result.id).lease_owner.rsplit(":", 1)[-1]  # type: ignore[union-attr]
        )
    assert claim.links == ()
    assert task.events == ()  # renewals and a normal end are no events
    row = store_for(app).get(result.id)
    assert row is not None and row.trace_context == format_traceparent(claim.context)


def test_a_claim_that_takes_over_links_to_the_attempt_it_continues(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer
) -> None:
    """The stored traceparent of the dead attempt comes back with the takeover claim
    (same statement) and becomes a link of the new claim span."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.resumed")
    def resumed(self: LeasedTask) -> int:
        return self.lease.attempt

    store = store_for(app)
    with tracer.start_as_current_span("first attempt") as first:
        dead = format_traceparent(first.get_span_context())
    store.claim(
        "run-1",
        "dead-worker",
        task_name="tracing.resumed",
        lease_ms=30_000,
        max_attempts=3,
        trace_context=dead,
    )
    store.expire("run-1")
    with tracer.start_as_current_span("run/tracing.resumed"):
        assert resumed.apply(task_id="run-1").get() == 2
    claim = one(exporter.get_finished_spans(), "celery_lease.claim")
    assert len(claim.links) == 1
    link = claim.links[0]
    assert link.context.trace_id == first.get_span_context().trace_id
    assert link.context.span_id == first.get_span_context().span_id
    assert link.attributes == {"celery_lease.link": "continues"}
    row = store.get("run-1")
    assert row is not None and row.trace_context == f"{format_traceparent(claim.context)} {dead}"


def test_a_duplicate_delivery_claim_span(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer
) -> None:
    """A delivery of a finished run: its claim span says duplicate, nothing else opens."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.once")
    def once(self: LeasedTask) -> str:
        return "done"

    with tracer.start_as_current_span("run/first"):
        once.apply(task_id="run-2").get()
    exporter.clear()
    with tracer.start_as_current_span("run/second"):
        once.apply(task_id="run-2")
    spans = exporter.get_finished_spans()
    claim = one(spans, "celery_lease.claim")
    assert claim.attributes is not None
    assert claim.attributes["celery_lease.outcome"] == "duplicate"
    assert "celery_lease.attempt" not in claim.attributes
    assert named(spans, "celery_lease.complete") == []


def test_a_lost_lease_on_the_task_span(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer
) -> None:
    """A stolen lease: the completion span ends lost and the task span gets the lost event."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.stolen")
    def stolen(self: LeasedTask) -> str:
        testing.steal_lease(store_for(app), self.lease.run_id)
        return "late"

    with tracer.start_as_current_span("run/tracing.stolen"), pytest.raises(LeaseLost):
        stolen.delay()
    spans = exporter.get_finished_spans()
    complete = one(spans, "celery_lease.complete")
    assert complete.attributes is not None
    assert complete.attributes["celery_lease.outcome"] == "lost"
    assert "complete" in str(complete.attributes["celery_lease.reason"])
    task = one(spans, "run/tracing.stolen")
    assert event_names(task) == ["celery_lease.lost"]
    attributes = task.events[0].attributes
    assert attributes is not None and attributes["celery_lease.attempt"] == 1
    assert attributes["celery_lease.reason"] == complete.attributes["celery_lease.reason"]


@pytest.mark.timeout(30)
def test_events_from_the_heartbeat_and_watchdog_threads(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed renewal, the local deadline and the interrupt, all learned on other
    threads, are events of the task's span (not of whatever span those threads hold)."""
    runtime = runtime_for(app, app_config(app))

    def unreachable(*args: Any) -> Any:
        raise LeaseDatabaseError("connection refused")

    monkeypatch.setattr(runtime.store, "heartbeat", unreachable)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.stalled")
    def stalled(self: LeasedTask) -> str:
        lease = self.lease

        def side_thread() -> None:
            runtime.heartbeat.beat_once()
            lease.poll_deadline(lease.deadline + 1.0)

        threading.Thread(target=side_thread).start()
        end = time.monotonic() + 10
        while time.monotonic() < end:  # the interrupt ends this loop
            time.sleep(0.01)
        return "not interrupted"

    with tracer.start_as_current_span("run/tracing.stalled"), pytest.raises(LeaseLost):
        stalled.delay()
    task = one(exporter.get_finished_spans(), "run/tracing.stalled")
    names = event_names(task)
    assert names[0] == "celery_lease.renew_failed"
    assert sorted(names[1:]) == [
        "celery_lease.deadline_passed",
        "celery_lease.interrupt_sent",
        "celery_lease.lost",
    ]
    renew = task.events[0].attributes
    assert renew is not None and "connection refused" in str(renew["celery_lease.reason"])
    lost = task.events[names.index("celery_lease.lost")].attributes
    assert lost is not None and str(lost["celery_lease.reason"]).startswith("local deadline")


@pytest.mark.timeout(30)
def test_a_cancelled_run_on_the_task_span(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer
) -> None:
    """A cancel request seen by a renewal ends the run cancelled: one cancelled event."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.cancelled")
    def cancelled(self: LeasedTask) -> str:
        store_for(app).cancel(self.lease.run_id)
        testing.heartbeat_now(app)
        self.lease.check()
        return "not cancelled"

    with tracer.start_as_current_span("run/tracing.cancelled"):
        cancelled.delay()
    task = one(exporter.get_finished_spans(), "run/tracing.cancelled")
    assert event_names(task) == ["celery_lease.cancelled"]


def test_a_traced_run_still_issues_two_statements(
    app: Celery, exporter: InMemorySpanExporter, tracer: Tracer
) -> None:
    """With spans recorded, the claim still carries the trace context itself: 2 statements."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tracing.add")
    def add(self: LeasedTask, a: int, b: int) -> int:
        return a + b

    store = store_for(app)
    app.conf.update(task_always_eager=False, result_backend="cache+memory://")
    with (
        start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10),
        driver_statements(store.engines) as seen,
    ):
        assert add.delay(1, 1).get(timeout=20) == 2
        seen.clear()
        with tracer.start_as_current_span("producer"):
            result = add.delay(2, 3)
        assert result.get(timeout=20) == 5
    task_thread = {tid for tid, stmt in seen if stmt.lstrip().upper().startswith("INSERT")}
    kinds = [stmt.split()[0].upper() for tid, stmt in seen if tid in task_thread]
    assert kinds == ["INSERT", "UPDATE"]
    assert len(named(exporter.get_finished_spans(), "celery_lease.claim")) == 2
    row = store.get(result.id)
    assert row is not None and row.trace_context is not None


def test_traceparent_round_trip_and_bounds() -> None:
    """Only a well-formed version-00 traceparent is read back; the rest is ignored."""
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = parse_traceparent(good)
    assert context is not None and format_traceparent(context) == good
    for bad in (None, "", good[:-1], good.replace("00-", "01-", 1), "00-" + "0" * 32 + good[35:]):
        assert parse_traceparent(bad) is None
    assert continued_context(f"{good} ") is None
    assert continued_context(f"{good} {good}") == context
    with pytest.raises(LeaseInputError, match="traceparent"):
        check_claim_inputs(
            run_id="r",
            task_name="t",
            owner="o",
            lease_ms=1000,
            max_attempts=1,
            concurrency_key=None,
            payload=None,
            trace_context=good + "x",
        )


def test_lease_tracing_setting(tmp_path: Path) -> None:
    """lease_tracing: None (on with the API installed), False (off), anything else refused."""
    on = Celery("tracing-on", set_as_current=False)
    install(on)
    assert isinstance(app_runtime(on).feature(tracing.LeaseTracing), tracing.LeaseTracing)
    off = Celery("tracing-off", set_as_current=False)
    off.conf.lease_tracing = False
    install(off)
    assert app_runtime(off).feature(tracing.LeaseTracing) is None
    bad = Celery("tracing-bad", set_as_current=False)
    bad.conf.lease_tracing = "yes"
    with pytest.raises(ImproperlyConfigured, match="lease_tracing must be True, False or None"):
        install(bad)


RUN_A_TASK = """
import sys, tempfile
{block}
from celery import Celery
from celery_lease import LeasedTask, testing
from celery_lease.runtime import app_runtime, store_for

app = Celery("fresh", set_as_current=False)
app.conf.update(broker_url="memory://")
testing.use_lease_database(app, tempfile.mkdtemp() + "/leases.sqlite3")

@app.task(base=LeasedTask, bind=True, shared=False, name="fresh.ok")
def ok(self):
    return self.lease.attempt

result = ok.delay()
assert result.get() == 1
bus = app_runtime(app).events
print(json_dumps({{
    "modules": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
    "tracing": [type(f).__name__ for f in app_runtime(app).features],
    "listeners": len(bus._listeners) + len(bus._transition_listeners),
    "trace_context": store_for(app).get(result.id).trace_context,
}}))
testing.shutdown_leases(app)
"""

BLOCK_OPENTELEMETRY = """
import importlib.abc

class NoOpenTelemetry(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
"""


def run_fresh(block: str) -> dict[str, Any]:
    code = "from json import dumps as json_dumps\n" + RUN_A_TASK.format(block=block)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(90)
def test_without_opentelemetry_nothing_is_imported() -> None:
    """A fresh interpreter that cannot import opentelemetry runs a leased task: no module
    of it is imported, no tracing object, no listener, no trace context stored."""
    found = run_fresh(BLOCK_OPENTELEMETRY)
    assert found == {"modules": [], "tracing": [], "listeners": 0, "trace_context": None}


@pytest.mark.timeout(90)
def test_with_the_api_alone_only_the_no_op_tracer_runs() -> None:
    """API installed, no SDK provider set: tracing is on, but nothing records, so no
    listener joins the event bus and the claim stores no trace context."""
    found = run_fresh("")
    assert found["tracing"] == ["LeaseTracing"]
    assert "opentelemetry.sdk" not in found["modules"]
    assert found["listeners"] == 0 and found["trace_context"] is None


# -- real workers ------------------------------------------------------------------------


def worker_spans(folder: Path) -> list[dict[str, Any]]:
    """Every span the traced workers wrote so far (one JSON object per line)."""
    spans = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


def of_run(spans: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["attributes"].get("celery_lease.run_id") == run_id]


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[str]:
    return sorted(s["name"] for s in spans if s.get("parent_id") == parent["context"]["span_id"])


def tracing_env(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "spans"
    folder.mkdir(exist_ok=True)
    return {"CL_OTEL_DIR": str(folder)}


@SQLITE_FS
@pytest.mark.timeout(90)
def test_worker_span_tree_and_a_busy_duplicate(cluster: Cluster, tmp_path: Path) -> None:
    """Under opentelemetry-instrumentation-celery: a run's claim, fence and complete are
    children of its task span; a second delivery of the held run is busy, and once the
    run finished its next delivery is a duplicate."""
    env = tracing_env(tmp_path)
    folder = Path(env["CL_OTEL_DIR"])
    cluster.start("w1", conf={"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}, **env)
    plain = cluster.send("workerapp.work", 0.0)
    wait_for(lambda: cluster.status(plain) == "succeeded", 30, what="the plain run")
    first = cluster.send("workerapp.keyed", 7, 1.5)
    wait_for(lambda: cluster.effects("workerapp.keyed:7", "start"), 30, what="the keyed run")
    cluster.send("workerapp.keyed", 7, 1.5)

    def claim_outcomes() -> list[str]:
        spans = of_run(worker_spans(folder), "workerapp.keyed:7")
        return [
            s["attributes"]["celery_lease.outcome"] for s in spans if s["name"].endswith("claim")
        ]

    wait_for(lambda: "duplicate" in claim_outcomes(), 40, what="the duplicate's claim span")
    assert claim_outcomes().count("claimed") == 1 and "busy" in claim_outcomes()
    spans = worker_spans(folder)
    task = next(
        s
        for s in spans
        if s["name"] == "run/workerapp.work"
        and s["attributes"].get("celery.task_name") == "workerapp.work"
    )
    assert children(spans, task) == [
        "celery_lease.claim",
        "celery_lease.complete",
        "celery_lease.fence",
    ]
    for span in of_run(spans, plain):
        assert span["context"]["trace_id"] == task["context"]["trace_id"]
        assert span["attributes"]["celery_lease.attempt"] == 1
    busy = next(
        s
        for s in of_run(spans, "workerapp.keyed:7")
        if s["attributes"]["celery_lease.outcome"] == "busy"
    )
    assert busy["attributes"]["celery_lease.reason"]
    assert first


@SQLITE_FS
@pytest.mark.timeout(90)
def test_worker_lost_lease_events(cluster: Cluster, tmp_path: Path) -> None:
    """A stalled heartbeat: the local deadline passes, the body is interrupted, and the
    task span carries deadline_passed, lost (with its reason) and interrupt_sent."""
    env = tracing_env(tmp_path)
    folder = Path(env["CL_OTEL_DIR"])
    cluster.start(
        "w1",
        CL_LEASE_SECONDS="2",
        CL_HEARTBEAT="0.5",
        CL_STALL_HEARTBEAT="1",
        CL_LOST_POLICY="abort",
        **env,
    )
    run_id = cluster.send("workerapp.work", 6.0)

    def task_span() -> dict[str, Any] | None:
        return next(
            (
                s
                for s in worker_spans(folder)
                if s["name"] == "run/workerapp.work"
                and any(e["name"] == "celery_lease.lost" for e in s["events"])
            ),
            None,
        )

    wait_for(lambda: task_span() is not None, 40, what="the lost task span")
    span = task_span()
    assert span is not None
    names = {e["name"] for e in span["events"]}
    assert {"celery_lease.deadline_passed", "celery_lease.interrupt_sent"} <= names
    lost = next(e for e in span["events"] if e["name"] == "celery_lease.lost")
    assert lost["attributes"]["celery_lease.run_id"] == run_id
    assert lost["attributes"]["celery_lease.reason"].startswith("local deadline passed")
    assert not any(e["name"].startswith("celery_lease.renew") for e in span["events"])


@PG_AND_MARIADB
@pytest.mark.timeout(120)
def test_kill9_recovery_links_to_the_dead_attempt(cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 a worker mid-run: the sweeper re-publishes it, and the new attempt's claim
    span links to the claim span of the attempt that died (another trace)."""
    env = tracing_env(tmp_path)
    folder = Path(env["CL_OTEL_DIR"])
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_ACKS_LATE": "1"}
    timing["CL_VISIBILITY_TIMEOUT"] = "4"
    w1 = cluster.start("w1", **timing, **env)
    run_id = cluster.send("workerapp.work", 3.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w1.kill9()
    cluster.start("w2", **timing, **env)
    cluster.start_beat({"lease_sweep_interval": 1.0})
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="recovery")

    def claims() -> dict[int, dict[str, Any]]:
        return {
            s["attributes"]["celery_lease.attempt"]: s
            for s in of_run(worker_spans(folder), run_id)
            if s["name"] == "celery_lease.claim"
            and s["attributes"]["celery_lease.outcome"] == "claimed"
        }

    wait_for(lambda: {1, 2} <= set(claims()), 20, what="both claim spans")
    dead, recovered = claims()[1], claims()[2]
    assert dead["context"]["trace_id"] != recovered["context"]["trace_id"]
    assert [
        (link["context"]["trace_id"], link["context"]["span_id"], link["attributes"])
        for link in recovered["links"]
    ] == [
        (
            dead["context"]["trace_id"],
            dead["context"]["span_id"],
            {"celery_lease.link": "continues"},
        )
    ]
    row = cluster.store.get(run_id)
    assert row is not None and row.trace_context is not None
    assert row.trace_context.split(" ")[1][3:35] == dead["context"]["trace_id"][2:]


@pytest.mark.parametrize(("share", "expected"), [(True, 200), (False, 0), (0.1, (5, 45))])
def test_lease_trace_fence_turns_fence_spans_off_or_samples_them(
    app: Celery, exporter: InMemorySpanExporter, share: Any, expected: Any
) -> None:
    """A task that fences 200 items gets 200 fence spans by default, none with
    lease_trace_fence=False and about a tenth with 0.1; claim and complete stay."""

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tracing.export", lease_trace_fence=share
    )
    def export(self: LeasedTask) -> int:
        for _ in range(200):
            with self.lease.transaction() as conn:
                self.lease.fence(conn)
        return 200

    assert export.delay().get() == 200
    spans = exporter.get_finished_spans()
    fences = len(named(spans, "celery_lease.fence"))
    if isinstance(expected, tuple):
        assert expected[0] <= fences <= expected[1]
    else:
        assert fences == expected
    one(spans, "celery_lease.claim")
    one(spans, "celery_lease.complete")


@pytest.mark.parametrize("bad", [1.5, -0.1, "half", float("nan")])
def test_lease_trace_fence_refuses_what_is_not_a_share(bad: Any) -> None:
    """lease_trace_fence is True, False or a share from 0 to 1: anything else is refused,
    naming the key."""
    with pytest.raises(ImproperlyConfigured, match="lease_trace_fence must be True, False"):
        LeaseConfig.from_mapping({"lease_trace_fence": bad})
