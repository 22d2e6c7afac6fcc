"""OpenTelemetry spans, span events and links for leased runs (extra ``celery-lease[otel]``).

On whenever ``opentelemetry-api`` is installed (``lease_tracing = False`` turns it
off); without it nothing here imports OpenTelemetry and a task costs what it did.
Spans go to the tracer provider the process has set (the SDK's, by the user); with
the API alone they are the no-op tracer's.

:class:`LeaseTracing` is a feature on the run path (a
:class:`~celery_lease.hooks.RunHook`). Before each claim it starts the
``celery_lease.claim`` span (a child of the current span: the task's, under
``opentelemetry-instrumentation-celery``) and keeps an :class:`AttemptTrace`
for the delivery, when the span records. The claim stores the span's
``traceparent`` with the run in its one statement; a claim that takes the run
over gets the ``traceparent`` of the attempt it continues back and links to
it. The lease's ``complete``, ``fence`` and ``checkpoint`` get their spans
through the hook's ``around``.

Lease events become events of the task's span: :class:`LeaseTracing` listens on
the app's :class:`~celery_lease.events.EventBus` (as the metrics do) and finds
the attempt by run id and attempt; they may come from the heartbeat or watchdog
thread, so the task's span is kept on the :class:`AttemptTrace`, not taken from
the current context. Renewals are not events.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.exceptions import ImproperlyConfigured

from .errors import LeaseLost
from .events import Event, EventBus, LeaseState, Transition
from .hooks import RunHook
from .lease.lease import DEADLINE_PASSED
from .run.delivery import Delivery
from .runtime import app_runtime
from .schema import TRACEPARENT_LENGTH
from .store import ClaimResult

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext, Tracer, TracerProvider

SETTING = "lease_tracing"
#: The instrumentation scope of every span.
SCOPE = "celery_lease"

RUN_ID = "celery_lease.run_id"
ATTEMPT = "celery_lease.attempt"
OWNER = "celery_lease.owner"
TASK = "celery_lease.task"
OUTCOME = "celery_lease.outcome"
REASON = "celery_lease.reason"

#: The claim span's outcome for each claim outcome not named the same.
_CLAIM_OUTCOMES = {"finished": "duplicate"}


def format_traceparent(context: SpanContext) -> str:
    """A span context as a W3C ``traceparent`` (version 00: 55 characters)."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The span context of a W3C ``traceparent`` (version 00), or None if it is not one."""
    if value is None or len(value) != TRACEPARENT_LENGTH:
        return None
    parts = value.split("-")
    if len(parts) != 4 or parts[0] != "00" or [len(part) for part in parts] != [2, 32, 16, 2]:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    try:
        trace_id, span_id, flags = (int(part, 16) for part in parts[1:])
    except ValueError:
        return None
    context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return context if context.is_valid else None


def continued_context(trace_context: str | None) -> SpanContext | None:
    """The attempt a claim continues, from the ``trace_context`` the claim returned
    (its own ``traceparent``, a space, the previous attempt's)."""
    if not trace_context:
        return None
    _, _, previous = trace_context.partition(" ")
    return parse_traceparent(previous or None)


class AttemptTrace:
    """One delivery's spans: its claim span, the lease's spans, its task span's events.

    Made by :meth:`LeaseTracing.before_claim` with the claim span started and kept
    in the delivery's ``feature_state``; the hook ends the claim span with
    :meth:`claimed` or :meth:`claim_failed`, opens the lease's spans with
    :meth:`span`, and calls :meth:`end` when the delivery is over.

    Attributes:
        task_span: the span current when the claim began (the task's under the
            Celery instrumentation); lease events are added to it.
        traceparent: the claim span's W3C ``traceparent``, stored with the run.
        attributes: ``celery_lease.run_id``, ``.owner``, ``.task`` and, once
            claimed, ``.attempt``: on every span of this delivery.
    """

    def __init__(
        self, tracing: LeaseTracing, claim_span: Span, task_span: Span, attributes: dict[str, Any]
    ) -> None:
        self.tracing = tracing
        self.task_span = task_span
        self.attributes = attributes
        self.traceparent = format_traceparent(claim_span.get_span_context())
        self._claim_span = claim_span
        self._claim_open = True
        self._key: tuple[str, int] | None = None

    def claimed(self, claim: ClaimResult) -> None:
        """End the claim span with the claim's outcome; link it to the attempt it continues."""
        self._claim_open = False
        span = self._claim_span
        outcome = str(claim.outcome)
        span.set_attribute(OUTCOME, _CLAIM_OUTCOMES.get(outcome, outcome))
        if claim.reason:
            span.set_attribute(REASON, claim.reason)
        if outcome == "claimed":
            self.attributes[ATTEMPT] = claim.attempt
            span.set_attribute(ATTEMPT, claim.attempt)
            previous = continued_context(claim.trace_context)
            if previous is not None:
                span.add_link(previous, {"celery_lease.link": "continues"})
            self._key = (str(self.attributes[RUN_ID]), claim.attempt)
            self.tracing.watch(self._key, self)
        span.end()

    def claim_failed(self, error: BaseException) -> None:
        """End the claim span: the claim raised ``error`` (the body does not run)."""
        from opentelemetry.trace import Status, StatusCode

        self._claim_open = False
        span = self._claim_span
        span.set_attribute(OUTCOME, "error")
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end()

    @contextlib.contextmanager
    def span(self, name: str, outcome: str) -> Iterator[None]:
        """A ``celery_lease.<name>`` span around the block: ``outcome`` when it returns,
        ``lost`` when it raises :class:`~celery_lease.LeaseLost`, ``error`` otherwise."""
        from opentelemetry.trace import Status, StatusCode

        span = self.tracing.tracer.start_span(f"celery_lease.{name}", attributes=self.attributes)
        try:
            yield
        except LeaseLost as exc:
            span.set_attribute(OUTCOME, "lost")
            span.set_attribute(REASON, exc.reason)
            span.set_status(Status(StatusCode.ERROR, "lease lost"))
            raise
        except BaseException as exc:
            span.set_attribute(OUTCOME, "error")
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        else:
            span.set_attribute(OUTCOME, outcome)
        finally:
            span.end()

    def event(self, name: str, **attributes: Any) -> None:
        """Add the ``celery_lease.<name>`` event to the task's span (from any thread)."""
        self.task_span.add_event(
            f"celery_lease.{name}",
            {**self.attributes, **{f"celery_lease.{k}": v for k, v in attributes.items()}},
        )

    def end(self, outcome: str) -> None:
        """The delivery is over: no more events for its task span. A claim span still open
        (the delivery stopped before its claim, e.g. ``rate_limited``: deferred to its
        turn under ``lease_rate_limit``) ends with ``outcome``."""
        if self._claim_open:
            self._claim_open = False
            self._claim_span.set_attribute(OUTCOME, outcome)
            self._claim_span.end()
        if self._key is not None:
            self.tracing.unwatch(self._key, self)


class LeaseTracing(RunHook[Delivery]):
    """An app's tracing, a run hook: starts each delivery's claim span, wraps the lease's
    operations in spans, and adds the lease events of the attempts being traced to their
    task spans.

    Listens on the app's :class:`~celery_lease.events.EventBus` once the first
    attempt records (with the API alone, nothing ever records: no listener, the
    events stay on their fast path).

    Args:
        tracer_provider: where spans go (default: the global provider, as set now
            or later, e.g. in ``worker_process_init``).
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from opentelemetry import trace

        self.tracer: Tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        self._current_span = trace.get_current_span
        self._lock = threading.Lock()
        self._attempts: dict[tuple[str, int], AttemptTrace] = {}
        self._bus: EventBus | None = None
        self._listening = False

    def before_claim(self, delivery: Delivery) -> str | None:
        """Start the delivery's claim span; its ``traceparent`` goes with the claim."""
        attributes: dict[str, Any] = {
            RUN_ID: delivery.run_id,
            OWNER: delivery.owner,
            TASK: delivery.task_name,
        }
        span = self.tracer.start_span("celery_lease.claim", attributes=attributes)
        if not span.is_recording():
            return None  # nothing records: nothing to trace for this delivery
        if not self._listening:
            self._listen()
        trace = AttemptTrace(self, span, self._current_span(), attributes)
        delivery.feature_state[self] = trace
        delivery.claim_values["trace_context"] = trace.traceparent
        return None

    def claimed(self, delivery: Delivery, claim: ClaimResult) -> None:
        """End the claim span: the claim took the run."""
        trace = delivery.feature_state.get(self)
        if isinstance(trace, AttemptTrace):
            trace.claimed(claim)

    def refused(self, delivery: Delivery, claim: ClaimResult) -> None:
        """End the claim span with the refusal (busy, paused, duplicate)."""
        self.claimed(delivery, claim)

    def claim_failed(self, delivery: Delivery, error: BaseException) -> None:
        """End the claim span: the claim raised ``error``."""
        trace = delivery.feature_state.get(self)
        if isinstance(trace, AttemptTrace):
            trace.claim_failed(error)

    def around(
        self, delivery: Delivery, operation: str, outcome: str
    ) -> contextlib.AbstractContextManager[None] | None:
        """The ``celery_lease.<operation>`` span around the lease's operation; a fence's
        only for the share ``lease_trace_fence`` of the task's fences."""
        trace = delivery.feature_state.get(self)
        if not isinstance(trace, AttemptTrace):
            return None
        if operation == "fence":
            share = delivery.config.trace_fence
            if share < 1.0 and (share <= 0.0 or random.random() >= share):
                return None
        return trace.span(operation, outcome)

    def finished(self, delivery: Delivery, outcome: str) -> None:
        """The delivery is over: its task span gets no more lease events."""
        trace = delivery.feature_state.get(self)
        if isinstance(trace, AttemptTrace):
            trace.end(outcome)

    def watch(self, key: tuple[str, int], trace: AttemptTrace) -> None:
        """Add the lease events of attempt ``key`` (run id, attempt) to ``trace``."""
        with self._lock:
            self._attempts[key] = trace

    def unwatch(self, key: tuple[str, int], trace: AttemptTrace) -> None:
        """Stop adding attempt ``key``'s events to ``trace``."""
        with self._lock:
            if self._attempts.get(key) is trace:
                del self._attempts[key]

    def __call__(self, event: Event, fields: dict[str, Any]) -> None:
        """The :meth:`~celery_lease.events.EventBus.add_listener` hook."""
        if event is Event.INTERRUPT_SENT:
            found = self._attempts.get((str(fields.get("run_id")), int(fields.get("attempt", 0))))
            if found is not None:
                found.event("interrupt_sent")
        elif event is Event.HEARTBEAT_ERROR:
            reason = str(fields.get("error", ""))
            for run_id, _owner, attempt in fields.get("keys", ()):
                found = self._attempts.get((run_id, attempt))
                if found is not None:
                    found.event("renew_failed", reason=reason)

    def on_transition(self, transition: Transition) -> None:
        """The :meth:`~celery_lease.events.EventBus.add_transition_listener` hook."""
        state = transition.state
        if state is not LeaseState.LOST and state is not LeaseState.CANCELLED:
            return
        found = self._attempts.get((transition.run_id, transition.attempt))
        if found is None:
            return
        if state is LeaseState.CANCELLED:
            found.event("cancelled")
            return
        if transition.reason.startswith(DEADLINE_PASSED):
            found.event("deadline_passed")
        found.event("lost", reason=transition.reason)

    def subscribe(self, events: EventBus) -> None:
        """Trace the attempts of ``events``'s app (listening once one records)."""
        with self._lock:
            self._bus = events
            self._listening = False

    def unsubscribe(self, events: EventBus) -> None:
        """Stop listening on ``events``."""
        events.remove_listener(self)
        events.remove_transition_listener(self.on_transition)
        with self._lock:
            if self._bus is events:
                self._bus = None

    def _listen(self) -> None:
        with self._lock:
            bus, self._listening = self._bus, True
        if bus is not None:
            bus.add_listener(self)
            bus.add_transition_listener(self.on_transition)


def enable(app: Celery, tracer_provider: TracerProvider | None = None) -> LeaseTracing:
    """Trace ``app``'s leased runs in this process (to ``tracer_provider``, default global).

    Raises ImportError, saying how to install the extra, when ``opentelemetry-api``
    is missing.
    """
    try:
        tracing = LeaseTracing(tracer_provider)
    except ImportError as exc:
        raise ImportError(
            "celery-lease tracing needs opentelemetry-api: pip install 'celery-lease[otel]' "
            f"(or set {SETTING} = False)"
        ) from exc
    app_runtime(app).use_feature(tracing, LeaseTracing)
    return tracing


def disable(app: Celery) -> None:
    """Stop tracing ``app``'s runs in this process."""
    app_runtime(app).use_feature(None, LeaseTracing)


def enable_from_app(app: Celery) -> LeaseTracing | None:
    """Trace when ``app.conf.lease_tracing`` allows it; validate the setting.

    None (the default): on when ``opentelemetry-api`` is installed, and then only
    is it imported. True: on, or ImportError without the extra. False: off.
    Tracing enabled already (by :func:`enable`) is kept.

    Raises:
        ImproperlyConfigured: ``lease_tracing`` is not None, True or False.
    """
    value = app.conf.get(SETTING)
    if value is False:
        return None
    tracing = app_runtime(app).feature(LeaseTracing)
    if tracing is not None:
        return tracing  # enabled already (with its own provider, say)
    if value is not None and value is not True:
        raise ImproperlyConfigured(f"{SETTING} must be True, False or None, got {value!r}")
    if value is None:
        try:
            if importlib.util.find_spec("opentelemetry.trace") is None:
                return None
        except ImportError:  # no ``opentelemetry`` package at all
            return None
    return enable(app)
