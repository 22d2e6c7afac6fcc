"""RabbitMQ + PostgreSQL with acks_late: redelivery on connection close, quorum queues.

RabbitMQ hands an unacknowledged message back the moment its consumer's
connection closes, so after a ``kill -9`` the message is redelivered while the
dead worker's lease is still live. That delivery must find the run busy,
re-publish itself, and claim only once the lease has expired.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.cluster import AMQP_ID, AMQP_SETUP, Cluster
from tests.helpers import wait_for

ON_AMQP = pytest.mark.parametrize("cluster", [AMQP_SETUP], ids=[AMQP_ID], indirect=True)
FAST_RETRY = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}


def _parent(pid: int) -> int:
    """The parent PID of ``pid`` (a pool process's worker)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


def busy_lines(log: str, run_id: str) -> list[str]:
    """The worker's log lines for busy deliveries of ``run_id``."""
    return re.findall(rf"delivery \S+ of {run_id} busy: held by another worker[^\n]*", log)


@ON_AMQP
@pytest.mark.timeout(90)
def test_kill9_redelivered_at_once_claims_only_after_lease_expires(cluster: Cluster) -> None:
    """kill -9 the worker running a run (acks_late, no beat, no sweeper): RabbitMQ
    redelivers the message at once; the new delivery finds the run busy while the dead
    worker's lease lives, re-publishes itself, and claims attempt 2 only after the lease
    expired. One commit."""
    lease, beat = 5.0, 0.5
    timing = {"CL_LEASE_SECONDS": str(lease), "CL_HEARTBEAT": str(beat), "CL_ACKS_LATE": "1"}
    pair = [cluster.start(f"w{i}", conf=FAST_RETRY, concurrency=1, **timing) for i in (1, 2)]
    run_id = cluster.send("workerapp.work", 3.0)
    (start,) = wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    w1, w2 = pair if _parent(start.pid) == pair[0].pid else pair[::-1]
    time.sleep(2 * beat)  # w1 renews its lease at least once more
    w1.kill9()
    # The redelivery reaches w2 well within the lease the dead worker still holds.
    wait_for(lambda: busy_lines(w2.log(), run_id), lease - beat, what="the redelivery")
    row = cluster.store.get(run_id)
    assert row is not None and (row.status, row.attempt) == ("running", 1)
    assert row.lease_expires_at is not None
    expired_at = row.lease_expires_at / 1000  # the database clock: this host's
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="recovery")
    starts = cluster.effects(run_id, "start")
    assert [e.attempt for e in starts] == [1, 2]
    assert starts[1].at >= expired_at - 0.05  # not one moment before the lease ran out
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 2 and row.lease_owner.startswith("w2@")


@ON_AMQP
@pytest.mark.timeout(120)
def test_quorum_queue_delivery_limit_spares_busy_republish(cluster: Cluster) -> None:
    """A quorum queue with ``x-delivery-limit: 1`` drops a message returned to it twice.
    A busy run's delivery is re-published as a new message and the old one acked, so
    its delivery count never grows: six busy rounds later the run still runs, once."""
    from kombu import Connection

    cluster.use_queue_arguments({"x-queue-type": "quorum", "x-delivery-limit": 1})
    queue = cluster.producer.conf.task_queues[0]
    # The limit is live on this queue: a message requeued twice is gone.
    with Connection(cluster.env["CL_BROKER_URL"]) as conn:
        bound = queue(conn.default_channel)
        bound.declare()
        conn.Producer().publish({"probe": 1}, exchange=queue.exchange, routing_key=queue.name)
        for _ in range(2):
            message = wait_for(lambda: bound.get(no_ack=False), 5, what="the probe")
            message.requeue()
        time.sleep(0.3)
        assert bound.get(no_ack=False) is None, "x-delivery-limit did not drop the probe"

    held = cluster.store.claim(
        "busy-run", "ghost", task_name="workerapp.work", lease_ms=120_000, max_attempts=5
    )
    assert held.outcome == "claimed"
    conf = {"lease_retry_backoff": 0.1, "lease_retry_backoff_max": 0.3}
    w1 = cluster.start("w1", conf=conf, CL_ACKS_LATE="1", CL_LEASE_SECONDS="5")
    cluster.send("workerapp.work", 0.0, task_id="busy-run")
    wait_for(lambda: len(busy_lines(w1.log(), "busy-run")) >= 6, 30, what="six busy rounds")
    cluster.store.release("busy-run", "ghost", 1)
    wait_for(lambda: cluster.status("busy-run") == "succeeded", 30, what="the run")
    assert [e.attempt for e in cluster.effects("busy-run", "start")] == [2]
    assert len(cluster.effects("busy-run", "commit")) == 1


@ON_AMQP
@pytest.mark.timeout(120)
def test_quorum_delivery_limit_drops_killed_run_sweeper_recovers_it(cluster: Cluster) -> None:
    """A quorum queue with ``x-delivery-limit: 0`` drops a message the first time it is
    returned: kill -9 the worker running a run (acks_late) and RabbitMQ redelivers
    nothing. The run's row holds its message, so the sweeper publishes it again once the
    lease expired; attempt 2 commits, once."""
    cluster.use_queue_arguments({"x-queue-type": "quorum", "x-delivery-limit": 0})
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_ACKS_LATE": "1"}
    w1 = cluster.start("w1", conf=FAST_RETRY, concurrency=1, **timing)
    run_id = cluster.send("workerapp.work", 3.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    # Killed at once, w2 started after: a worker start can take longer than the 3 s body
    # on a loaded machine, and w1 then finished attempt 1 before the kill (seen once in CI).
    w1.kill9()
    assert cluster.effects(run_id, "commit") == []
    w2 = cluster.start("w2", conf=FAST_RETRY, concurrency=1, **timing)
    time.sleep(2.5)  # past the lease: a redelivery would have reached w2 by now
    assert busy_lines(w2.log(), run_id) == []
    assert cluster.effects(run_id, "start")[-1].attempt == 1
    cluster.start_beat({"lease_sweep_interval": 1.0})
    wait_for(lambda: cluster.status(run_id) == "succeeded", 40, what="the sweeper's recovery")
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2]
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]


@ON_AMQP
@pytest.mark.parametrize("exchange_type", ["direct", "topic"])
@pytest.mark.timeout(120)
def test_quorum_busy_duplicate_waits_in_worker_or_broker(
    cluster: Cluster, exchange_type: str
) -> None:
    """A busy duplicate is re-published with a countdown (the lease's time left). On a
    quorum queue the worker's prefetch is static: on a direct exchange the worker holds
    that message until its ETA, and with ``-c 1`` no other run reaches it meanwhile. On a
    topic exchange Celery's native delayed delivery parks it in the broker instead, and
    the next run starts at once."""
    cluster.use_queue_arguments({"x-queue-type": "quorum"}, exchange_type)
    held = cluster.store.claim(
        "busy-run", "ghost", task_name="workerapp.work", lease_ms=8_000, max_attempts=5
    )
    assert held.outcome == "claimed"
    w1 = cluster.start("w1", concurrency=1, CL_ACKS_LATE="1")
    cluster.send("workerapp.work", 0.0, task_id="busy-run")
    wait_for(lambda: busy_lines(w1.log(), "busy-run"), 30, what="the busy delivery")
    received = "Task workerapp.work[busy-run] received"
    if exchange_type == "direct":  # the re-published message reaches the worker at once
        wait_for(lambda: w1.log().count(received) == 2, 10, what="the re-published message")
    else:  # it waits in the broker's delay queues
        time.sleep(1.0)
        assert w1.log().count(received) == 1
    sent_at = time.time()
    other = cluster.send("workerapp.work", 0.0)
    wait_for(lambda: cluster.status(other) == "succeeded", 40, what="the other run")
    waited = cluster.effects(other, "start")[0].at - sent_at
    wait_for(lambda: cluster.status("busy-run") == "succeeded", 40, what="the busy run")
    if exchange_type == "direct":
        assert waited > 4.0
    else:
        assert waited < 3.0


@ON_AMQP
@pytest.mark.timeout(90)
def test_quorum_topic_sub_second_busy_countdown_is_published(cluster: Cluster) -> None:
    """Celery's native delayed delivery (quorum queue, topic exchange) takes whole seconds
    and refuses a countdown under 1 s. A busy duplicate whose lease has under a second
    left is still re-published at once (its countdown rounded up to 1 s), not left for
    a sweeper: with none running, the run is taken over within seconds."""
    cluster.use_queue_arguments({"x-queue-type": "quorum"}, "topic")
    w1 = cluster.start("w1", CL_ACKS_LATE="1")
    held = cluster.store.claim(
        "short-left", "ghost", task_name="workerapp.work", lease_ms=900, max_attempts=5
    )
    assert held.outcome == "claimed"
    cluster.send("workerapp.work", 0.0, task_id="short-left")
    wait_for(lambda: busy_lines(w1.log(), "short-left"), 10, what="the busy delivery")
    assert re.search(r"it runs in 0\.\d+s", busy_lines(w1.log(), "short-left")[0])
    wait_for(lambda: cluster.status("short-left") == "succeeded", 15, what="the takeover")
    assert "kept in the lease database" not in w1.log()
    assert [e.attempt for e in cluster.effects("short-left", "start")] == [2]
