"""Celery's own semantics on request, with real workers (issue 28, finding 12).

(a) ``lease_retry_errors = False``: a raising body fails at once, as in plain Celery,
unless ``autoretry_for`` or ``self.retry()`` asks for a retry. (b) A task id that
already ran is never run again, but a caller applying it again (a frozen signature,
a frozen chord: the patterns of Celery's own integration suite, which applies the
same frozen canvas twice) gets the outcome: its ``AsyncResult`` resolves and its
``link``, ``link_error`` and chord continuation fire, as they do in plain Celery.

Each runs on the embedded default (SQLite, filesystem broker, database results:
``chord_unlock``) and on PostgreSQL + Redis (native chord counters).
"""

from __future__ import annotations

import uuid

import pytest
from celery import chain, chord

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for
from tests.test_canvas import commits, sig

pytestmark = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)

FAST = {"lease_retry_backoff": 0.1, "lease_retry_backoff_max": 0.2}


@pytest.mark.timeout(120)
def test_frozen_signature_applied_twice_resolves_and_fires_its_link(cluster: Cluster) -> None:
    """The second apply of a frozen signature does not run the body again; its caller's
    result resolves with the run's result and its link fires again (plain Celery runs
    the task twice and fires the link twice)."""
    cluster.start("w1", conf=FAST)
    tag = f"link-{uuid.uuid4().hex[:8]}"
    step = sig(cluster, "step", 5)
    step.link(sig(cluster, "mark", tag=tag))
    step.freeze()
    first = step.apply_async()
    assert first.get(timeout=30) == 6
    wait_for(lambda: len(cluster.effects(tag, "linked")) == 1, 30, what="the first link")
    again = step.apply_async()
    assert again.id == first.id
    assert again.get(timeout=30) == 6
    wait_for(lambda: len(cluster.effects(tag, "linked")) == 2, 30, what="the link again")
    assert commits(cluster, first.id) == [1]


@pytest.mark.timeout(120)
def test_frozen_failing_signature_applied_twice_fires_its_link_error(cluster: Cluster) -> None:
    """A frozen signature of a run that failed, applied again: the caller's result is the
    failure and ``link_error`` fires again; the body does not run again."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 1})
    tag = f"err-{uuid.uuid4().hex[:8]}"
    failing = sig(cluster, "raises", tag)
    failing.link_error(sig(cluster, "on_error", tag=tag))
    failing.freeze()
    first = failing.apply_async()
    with pytest.raises(ValueError, match="boom"):
        first.get(timeout=30)
    wait_for(lambda: len(cluster.effects(tag, "errback")) == 1, 30, what="the first errback")
    again = failing.apply_async()
    with pytest.raises(ValueError, match="boom"):
        again.get(timeout=30)
    wait_for(lambda: len(cluster.effects(tag, "errback")) == 2, 30, what="the errback again")
    assert len(cluster.effects(first.id, "start")) == 1


@pytest.mark.timeout(120)
def test_frozen_chain_applied_twice_runs_on_to_its_end(cluster: Cluster) -> None:
    """A frozen chain applied again: its leased steps report their outcomes (no body runs
    again), so the chain reaches its plain last step again and resolves."""
    cluster.start("w1", conf=FAST)
    tag = f"chain-{uuid.uuid4().hex[:8]}"
    canvas = chain(sig(cluster, "step", 1), sig(cluster, "step"), sig(cluster, "mark", tag=tag))
    canvas.freeze()
    first = canvas.apply_async()
    assert first.get(timeout=60) == 3
    again = canvas.apply_async()
    assert again.id == first.id
    wait_for(lambda: len(cluster.effects(tag, "linked")) == 2, 60, what="the chain's end again")
    assert again.get(timeout=30) == 3
    assert commits(cluster, first.parent.id) == [1]
    assert commits(cluster, first.parent.parent.id) == [1]


@pytest.mark.timeout(150)
def test_frozen_chord_applied_twice_fires_its_body_again(cluster: Cluster) -> None:
    """A frozen chord applied again: no header step runs again, the header's outcomes are
    reported again, so the chord's body fires again and the new result resolves."""
    cluster.start("w1", conf=FAST)
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    header = [sig(cluster, "step", i) for i in range(3)]
    canvas = chord(header, sig(cluster, "tsum", tag=tag))
    canvas.freeze()
    first = canvas.apply_async()
    assert first.get(timeout=60) == 1 + 2 + 3
    wait_for(lambda: len(cluster.effects(tag, "fired")) == 1, 30, what="the first body")
    again = canvas.apply_async()
    assert again.get(timeout=60) == 1 + 2 + 3
    wait_for(lambda: len(cluster.effects(tag, "fired")) == 2, 60, what="the body again")
    starts = cluster.effects_of_kind("start")
    assert len(starts) == 3, starts


@pytest.mark.timeout(120)
def test_retry_errors_off_fails_a_raising_body_at_once(cluster: Cluster) -> None:
    """``lease_retry_errors = False``: a raising body ends FAILURE on its first attempt;
    ``self.retry()`` and ``autoretry_for`` still retry, as in Celery."""
    cluster.start("w1", conf={**FAST, "lease_retry_errors": False, "lease_max_attempts": 3})
    failing = sig(cluster, "raises", "once").apply_async()
    with pytest.raises(ValueError, match="boom once"):
        failing.get(timeout=30)
    row = cluster.store.get(failing.id)
    assert row is not None and row.status == "failed" and row.attempt == 1
    assert len(cluster.effects(failing.id, "start")) == 1
    retried = sig(cluster, "retry_later", 0.1).apply_async()
    assert retried.get(timeout=30) == "retried"
    auto = sig(cluster, "auto_fail").apply_async()
    with pytest.raises(ValueError):
        auto.get(timeout=60)
    assert len(cluster.effects(auto.id, "start")) == 3


@pytest.mark.timeout(120)
def test_retry_errors_default_retries_a_raising_body(cluster: Cluster) -> None:
    """The default (``lease_retry_errors = True``): a raising body is retried with backoff
    up to ``lease_max_attempts``, then FAILURE."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 3})
    failing = sig(cluster, "raises", "thrice").apply_async()
    with pytest.raises(ValueError, match="boom thrice"):
        failing.get(timeout=60)
    row = cluster.store.get(failing.id)
    assert row is not None and row.status == "failed" and row.attempt == 3
    assert len(cluster.effects(failing.id, "start")) == 3
