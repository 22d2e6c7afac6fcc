"""Idempotency keys and follow-up task ids (celery_lease/lease/keys.py), and the generation
the claim reads for them (every database)."""

from __future__ import annotations

import random
import re

import pytest

from celery_lease import Lease, LeaseStore
from celery_lease.errors import LeaseInputError
from celery_lease.lease.keys import check_step, followup_task_id, idempotency_key
from tests.helpers import driver_statements, held

KEY = re.compile(r"[A-Za-z0-9._:-]{1,255}")


@pytest.mark.timeout(10)
def test_key_is_the_run_step_and_generation_and_differs_in_each() -> None:
    """``<run id>:<step>:<generation>``: the same inputs give the same key, any other input
    another key."""
    assert idempotency_key("capture:900", 0, "charge") == "capture:900:charge:0"
    assert idempotency_key("capture:900", 0) == "capture:900::0"
    keys = {
        idempotency_key(run, generation, step)
        for run in ("capture:900", "capture:901", "capture:900:charge", "a")
        for generation in (0, 1, 12)
        for step in ("", "charge", "refund", "0")
    }
    assert len(keys) == 4 * 3 * 4


@pytest.mark.timeout(10)
def test_any_run_id_gives_a_valid_key_and_distinct_ids_distinct_keys() -> None:
    """Run ids with spaces, non-ASCII, ``/`` or 255 characters are hashed (SHA-256) into
    the key; the key is always 1-255 characters of [A-Za-z0-9._:-]."""
    rng = random.Random(31)
    alphabet = "ab:-._/ é€\u0000Z9"
    run_ids = {"x" * 255, "y" * 255, "ünïcode", "a b", "a/b", "a:b", "a:b ", "\ud800"}
    run_ids |= {
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(500)
    }
    keys = {}
    for run_id in run_ids:
        for step in ("", "charge", "s" * 64):
            key = idempotency_key(run_id, 2**31 - 1, step)
            assert KEY.fullmatch(key), (run_id, key)
            keys[key] = (run_id, step)
    assert len(keys) == len(run_ids) * 3
    hashed = idempotency_key("a b", 0, "charge")
    assert re.fullmatch(r"[0-9a-f]{64}:charge:h0", hashed)


@pytest.mark.parametrize(
    ("step", "says"),
    [
        (None, "must be a str, got NoneType"),
        (7, "must be a str, got int"),
        (b"charge", "must be a str, got bytes"),
        ("charge:1", "holds ':'"),
        ("a b/c", "holds ' /'"),
        ("ü", "holds 'ü'"),
        ("s" * 65, "is 65 characters long; at most 64"),
    ],
)
@pytest.mark.timeout(10)
def test_a_step_a_key_cannot_carry_is_refused_saying_why(step: object, says: str) -> None:
    """LeaseInputError on ``step``, naming its type, its characters or its length."""
    with pytest.raises(LeaseInputError) as raised:
        check_step(step)
    assert raised.value.field == "step" and says in str(raised.value)


@pytest.mark.timeout(10)
def test_followup_task_ids_are_distinct_per_attempt_and_position_and_fit_a_run_id() -> None:
    """``<run id>:followup:<attempt>.<position>``; hashed when it would pass 255 characters."""
    assert followup_task_id("pay:1", 3, 0) == "pay:1:followup:3.0"
    ids = {
        followup_task_id(r, a, p)
        for r in ("pay:1", "pay:1:followup:3")
        for a in (1, 3, 31)
        for p in (0, 1, 10)
    }
    assert len(ids) == 18
    long = followup_task_id("r" * 250, 1, 0)
    assert len(long) <= 255 and long.endswith(":followup:h1.0")


@pytest.mark.timeout(60)
def test_claim_reads_the_generation_and_only_a_forced_rerun_of_a_success_raises_it(
    store: LeaseStore,
) -> None:
    """The claim returns the generation in its own statement; every attempt keeps the key
    (takeover, a rerun of a failed run); a forced rerun of a succeeded run changes it."""
    first = held(store, "g")
    key = first.idempotency_key("charge")
    assert first.generation == 0 and key == "g:charge:0"
    store.fail("g", first.owner, first.attempt, error="x", failure_code="x", retry_in=None)
    store.rerun("g", attempts=2)
    second = _claim(store, "g", "o2")
    assert second.attempt == 2 and second.idempotency_key("charge") == key
    store.complete("g", second.owner, second.attempt)
    store.rerun("g", attempts=2, force=True)
    third = _claim(store, "g", "o3")
    assert third.generation == 1 and third.idempotency_key("charge") == "g:charge:1"
    assert store.expire("g")
    fourth = _claim(store, "g", "o4")  # a takeover keeps the generation
    assert fourth.attempt == 4 and fourth.idempotency_key("charge") == "g:charge:1"
    assert store.get("g").generation == 1  # type: ignore[union-attr]


@pytest.mark.timeout(30)
def test_idempotency_key_runs_no_sql(store: LeaseStore) -> None:
    """The generation came with the claim: deriving keys sends nothing to the database."""
    lease = held(store, "nosql")
    with driver_statements(store.engines) as seen:
        for step in ("", "charge", "refund"):
            lease.idempotency_key(step)
        with pytest.raises(LeaseInputError):
            lease.idempotency_key("bad step")
    assert seen == []


def _claim(store: LeaseStore, run_id: str, owner: str) -> Lease:
    result = store.claim(run_id, owner, task_name="t", lease_ms=2000, max_attempts=5)
    assert result.outcome == "claimed", result
    return Lease(
        store,
        run_id,
        owner,
        result.attempt,
        lease_seconds=2,
        heartbeat_interval=0.5,
        generation=result.generation,
    )
