"""``Lease``: the local deadline, the one owner of lease state, and interrupt safety."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_lease.lease.interrupt as interrupt_module
import celery_lease.lease.lease as lease_module
from celery_lease import Lease, LeaseError, LeaseLost, LeaseStore, current_lease, testing
from celery_lease.events import EventBus, LeaseState, Transition
from celery_lease.lease.heartbeat import Heartbeat
from celery_lease.lease.interrupt import LeaseInterrupt
from celery_lease.lease.lease import Standalone, bind_current, current_or_none, safety_margin
from celery_lease.lease.watchdog import Watchdog
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import REPO, FakeClock, held, wait_for


@pytest.fixture
def bus() -> EventBus:
    """An app's event bus, to give the leases of a test (``events=bus``)."""
    return EventBus()


@pytest.fixture
def transitions(bus: EventBus) -> list[Transition]:
    """Every lease transition published on ``bus`` during the test."""
    seen: list[Transition] = []
    bus.add_transition_listener(seen.append)
    return seen


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[LeaseStore]:
    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    yield store
    store.dispose()


# -- the local deadline ------------------------------------------------------------


def test_margin_is_a_tenth_of_the_lease_plus_clock_slack() -> None:
    """The safety margin is 10 % of the lease plus 0.1 % for clock rates."""
    assert safety_margin(30.0) == pytest.approx(3.03)
    assert safety_margin(2.0) == pytest.approx(0.202)


def test_deadline_starts_before_the_claim_was_sent(sqlite_store: LeaseStore) -> None:
    """The first deadline counts from started_at (taken before the claim), not from now."""
    clock = FakeClock()
    lease = held(sqlite_store, "r1", 2.0, clock=clock)
    clock.now += 5.0  # constructed long after the claim was sent
    late = Lease(
        Standalone(sqlite_store),
        "r1",
        lease.owner,
        1,
        lease_seconds=2.0,
        heartbeat_interval=0.5,
        started_at=1000.0,
        clock=clock,
    )
    assert late.deadline == pytest.approx(1000.0 + 2.0 - safety_margin(2.0))
    with pytest.raises(LeaseLost):
        late.check()


def test_check_raises_past_the_deadline_whatever_the_heartbeat(
    store: LeaseStore, bus: EventBus, transitions: list[Transition]
) -> None:
    """No heartbeat ever runs: check() passes before the deadline and raises after it,
    and fence() is refused without touching the row."""
    clock = FakeClock()
    lease = held(store, "r1", 2.0, clock=clock, events=bus)
    clock.now += 2.0 - lease.margin - 0.001
    lease.check()
    clock.now += 0.002
    with pytest.raises(LeaseLost, match="local deadline passed"):
        lease.check()
    with pytest.raises(LeaseLost), store.engine.begin() as conn:
        lease.fence(conn)
    assert [t.state for t in transitions] == [LeaseState.LOST]
    row = store.get("r1")
    assert row is not None and row.status == "running"  # the database still says held


def test_watchdog_poll_loses_a_lease_past_its_deadline(sqlite_store: LeaseStore) -> None:
    """The watchdog's pass (no I/O) marks a watched lease lost at its deadline."""
    clock = FakeClock()
    lease = held(sqlite_store, "r1", 2.0, clock=clock)
    dog = Watchdog(clock=clock)
    dog._leases.add(lease)  # watched, without starting the thread
    assert dog.poll() == pytest.approx(lease.deadline)
    clock.now = lease.deadline
    assert dog.poll() is None
    assert lease.lost


@pytest.mark.timeout(30)
def test_watchdog_sleeps_through_a_steady_flow_of_tasks(sqlite_store: LeaseStore) -> None:
    """Tasks started one after another (each deadline later than the last) do not keep
    the watchdog thread polling: neither a watch during a pass nor one after a pass that
    found no lease wakes it again, and a lease watched during a pass is still acted on
    at its deadline."""
    passes = 0
    after_pass: list[Lease] = []

    class Counting(Watchdog):
        def poll(self, now: float | None = None) -> float | None:
            nonlocal passes
            passes += 1
            wake = super().poll(now)
            while after_pass:  # watched after this pass took its snapshot
                self.watch(after_pass.pop())
            return wake

    dog = Counting()
    leases = [
        Lease(Standalone(sqlite_store), f"r{i}", "o", 1, lease_seconds=30.0, heartbeat_interval=7.5)
        for i in range(300)
    ]
    for lease in leases:  # one short task after another
        dog.watch(lease)
        spin_until = time.monotonic() + 0.0003
        while time.monotonic() < spin_until:  # a body holding the GIL
            pass
        dog.unwatch(lease)
        time.sleep(0.001)  # between tasks (a pass here finds no lease at all)
    assert passes <= 5, f"{passes} watchdog passes for 300 tasks"
    # A lease watched while a pass runs is not forgotten: its deadline wakes the thread.
    short = held(sqlite_store, "short", 0.5, watchdog=dog)
    after_pass.append(short)
    dog.nudge()
    wait_for(lambda: short.lost, 5, 0.01, "the short lease's deadline")
    assert passes <= 8


@pytest.mark.timeout(30)
def test_interrupt_fires_at_the_deadline_with_the_heartbeat_stuck(
    sqlite_store: LeaseStore,
) -> None:
    """A body that never checks is interrupted at the local deadline by the watchdog,
    while the heartbeat thread is blocked (here: it never ticks at all)."""
    lease = held(sqlite_store, "r1", 0.6, interrupt=True, watchdog=Watchdog())
    started = time.monotonic()

    def spin() -> None:
        while time.monotonic() - started < 10:
            pass

    with pytest.raises(LeaseInterrupt):
        lease.run_interruptible(spin)
    elapsed = time.monotonic() - started
    assert 0.6 - lease.margin - 0.05 < elapsed < 0.6 + 1.0
    assert lease.lost


# -- one owner for lease state -------------------------------------------------------


def test_rollback_of_fenced_completion_then_takeover_is_detected(
    store: LeaseStore, bus: EventBus, transitions: list[Transition]
) -> None:
    """fence(complete=True) rolled back returns the lease to held; a later takeover is
    then seen by the heartbeat (before: the lease stayed 'completed pending' forever)."""
    lease = held(store, "r1", 5.0, events=bus)
    heartbeat = Heartbeat(store, interval=10)
    heartbeat.register(lease, start=False)
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        lease.fence(conn, complete=True)
        assert lease.state is LeaseState.COMPLETING
        raise RuntimeError("roll back")
    assert lease.state is LeaseState.HELD and not lease.completed_pending
    testing.steal_lease(store, "r1")
    heartbeat.beat_once()
    with pytest.raises(LeaseLost, match="heartbeat refused"):
        lease.check()
    assert [(t.previous, t.state) for t in transitions] == [
        (LeaseState.HELD, LeaseState.COMPLETING),
        (LeaseState.COMPLETING, LeaseState.HELD),
        (LeaseState.HELD, LeaseState.LOST),
    ]


def test_savepoint_rollback_around_the_fence_returns_to_held(sqlite_store: LeaseStore) -> None:
    """Rolling back a savepoint opened before the fence undoes the completion; one
    opened after it does not."""
    store = sqlite_store
    first = held(store, "r1", 5.0)
    with store.engine.begin() as conn:
        savepoint = conn.begin_nested()
        first.fence(conn, complete=True)
        savepoint.rollback()
        assert first.state is LeaseState.HELD
    second = held(store, "r2", 5.0)
    with store.engine.begin() as conn:
        second.fence(conn, complete=True)
        inner = conn.begin_nested()
        inner.rollback()
        assert second.state is LeaseState.COMPLETING
    assert second.state is LeaseState.COMPLETED
    row = store.get("r2")
    assert row is not None and row.status == "succeeded"


def test_complete_and_cancel_are_lease_transitions(
    store: LeaseStore, bus: EventBus, transitions: list[Transition]
) -> None:
    """complete() and mark_cancelled() publish one transition per change; a repeated
    complete() after a fenced commit publishes nothing more."""
    done = held(store, "done", events=bus)
    with store.engine.begin() as conn:
        done.fence(conn, complete=True)
    done.complete()
    done.complete()
    cancelled = held(store, "cancelled", events=bus)
    store.cancel("cancelled")
    cancelled.renewed(time.monotonic(), cancel_requested=True)
    cancelled.mark_cancelled()
    assert [(t.run_id, t.state) for t in transitions] == [
        ("done", LeaseState.COMPLETING),
        ("done", LeaseState.COMPLETED),
        ("cancelled", LeaseState.CANCEL_REQUESTED),
        ("cancelled", LeaseState.CANCELLED),
    ]


def test_fence_refusal_is_a_published_loss(
    store: LeaseStore, bus: EventBus, transitions: list[Transition]
) -> None:
    """A loss found by fence() is a transition like any other (so it is counted)."""
    lease = held(store, "r1", events=bus)
    testing.steal_lease(store, "r1")
    with pytest.raises(LeaseLost), store.engine.begin() as conn:
        lease.fence(conn, complete=True)
    assert [t.state for t in transitions] == [LeaseState.LOST]
    assert not lease.mark_lost("again")  # the first reason wins, once


def test_renewal_after_a_fenced_commit_means_it_did_not_land(sqlite_store: LeaseStore) -> None:
    """A renewal confirmed although it was sent after the fenced completion proves that
    commit failed: the lease is held again, not blind."""
    lease = held(sqlite_store, "r1", 5.0)
    with sqlite_store.engine.begin() as conn:
        lease.fence(conn, complete=True)
    assert lease.state is LeaseState.COMPLETED
    lease.renewed(time.monotonic())
    assert lease.state is LeaseState.HELD


# -- interrupt safety ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_uninterruptible_defers_the_interrupt_until_the_block_ends(
    sqlite_store: LeaseStore,
) -> None:
    """A loss seen while the body is inside uninterruptible() interrupts it right after."""
    lease = held(sqlite_store, "r1", 30.0, interrupt=True, watchdog=Watchdog())
    marks: list[str] = []

    def body() -> None:
        with lease.uninterruptible():
            threading.Thread(target=lease.mark_lost, args=("test",)).start()
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                pass
            marks.append("block done")
        end = time.monotonic() + 5
        while time.monotonic() < end:
            pass
        marks.append("not interrupted")

    with pytest.raises(LeaseInterrupt):
        lease.run_interruptible(body)
    assert marks == ["block done"]


@pytest.mark.timeout(30)
def test_interrupt_waits_until_the_body_is_back_in_its_own_code(
    sqlite_store: LeaseStore,
) -> None:
    """A loss seen while the body waits inside the standard library's queue (a lock and a
    condition shared with other threads) interrupts it only once it is back in its own
    code: the queue's wait ends normally first."""
    import queue

    lease = held(sqlite_store, "r1", 30.0, interrupt=True, watchdog=Watchdog())
    marks: list[str] = []

    def body() -> None:
        threading.Timer(0.1, lease.mark_lost, args=("test",)).start()
        try:
            queue.Queue().get(timeout=0.6)
        except queue.Empty:
            marks.append("get returned")
        end = time.monotonic() + 5
        while time.monotonic() < end:
            pass
        marks.append("not interrupted")

    with pytest.raises(LeaseInterrupt):
        lease.run_interruptible(body)
    assert marks == ["get returned"]


@pytest.mark.timeout(180)
def test_pooled_engine_survives_a_thousand_interrupted_bodies(
    sqlite_store: LeaseStore, pg_url: str
) -> None:
    """1,000 bodies that use a pooled engine in a loop, each interrupted by a lease loss
    at a random moment, leave no connection checked out (the interrupt is raised only at
    the body's own code, never inside SQLAlchemy's pool or the driver)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url, pool_size=2, max_overflow=0, pool_timeout=5)
    dog = Watchdog()
    rng = random.Random(29)
    failures: list[str] = []

    def body() -> None:
        give_up = time.monotonic() + 5.0
        while time.monotonic() < give_up:
            with engine.connect() as conn:
                conn.execute(text("select 1")).scalar()
            for _ in range(5):  # check-outs and check-ins: the pool's own code
                with engine.connect():
                    pass

    try:
        for i in range(1000):
            lease = held(sqlite_store, f"r{i}", 30.0, interrupt=True, watchdog=dog)
            loser = threading.Timer(rng.uniform(0.0, 0.004), lease.mark_lost, args=("test",))
            loser.start()
            try:
                lease.run_interruptible(body)
                failures.append(f"body {i}: never interrupted (the interrupt was swallowed)")
            except LeaseInterrupt:
                pass
            except Exception as exc:  # a broken pool or connection: the defect
                failures.append(f"body {i}: {type(exc).__name__}: {exc}"[:200])
            loser.join()
            if len(failures) >= 3:
                break
        assert failures == []
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_async_exc_count_is_checked(
    sqlite_store: LeaseStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SetAsyncExc reaching several threads is reverted and logged; reaching none disarms."""
    calls: list[tuple[int, object]] = []
    answers = [2, 1]

    def fake(thread_id: int, exc: object) -> int:
        calls.append((thread_id, exc))
        return answers.pop(0) if exc is not None else 1

    monkeypatch.setattr(interrupt_module, "_set_async_exc", fake)
    lease = held(sqlite_store, "r1", 30.0, interrupt=True)
    lease._interrupter.arm(12345)  # as if a body ran in that thread
    with caplog.at_level(logging.WARNING, logger="celery_lease.lease.interrupt"):
        lease.mark_lost("test")
    assert calls == [(12345, LeaseInterrupt), (12345, None)]
    assert "reached 2 threads" in caplog.text
    gone = held(sqlite_store, "r2", 30.0, interrupt=True)
    gone._interrupter.arm(54321)
    answers[:] = [0]
    with caplog.at_level(logging.WARNING, logger="celery_lease.lease.interrupt"):
        gone.mark_lost("test")
    assert gone._interrupter.thread_id is None and "thread is gone" in caplog.text


#: Two threads interrupting bodies (a worker's heartbeat and its watchdog) while the cyclic
#: garbage collector runs a finalizer that hands the GIL to the other one.
GC_WHILE_INTERRUPTING = """
import gc, threading, time
from celery_lease.lease.interrupt import Interrupter, LeaseInterrupt

stop = threading.Event()

class Cycle:
    def __init__(self):
        self.me = self

    def __del__(self):
        if not stop.is_set():
            Cycle()  # always more garbage in a cycle
            time.sleep(0.002)  # the GIL goes to another thread

def body(it, armed):
    it.arm()
    armed.set()
    while not stop.is_set():
        try:
            time.sleep(0.001)
        except LeaseInterrupt:
            pass
    it.disarm()

def deliver(it):
    while not stop.is_set():
        if it.owe():
            it.deliver(True)

interrupters = [Interrupter(f"r{i}", time.monotonic) for i in range(2)]
for it in interrupters:
    armed = threading.Event()
    threading.Thread(target=body, args=(it, armed), daemon=True).start()
    armed.wait()
threads = [threading.Thread(target=deliver, args=(it,), daemon=True) for it in interrupters]
for thread in threads:
    thread.start()
Cycle()
gc.set_threshold(1)  # a collection at nearly every allocation
time.sleep(3.0)
stop.set()
gc.set_threshold(700)
for thread in threads:
    thread.join(5)
print("ended" if not any(thread.is_alive() for thread in threads) else "stuck")
"""


@pytest.mark.timeout(60)
def test_interrupting_while_the_gc_runs_finalizers_never_freezes_the_process() -> None:
    """Interrupts sent from two threads while the garbage collector runs finalizers: the
    process goes on (before: on CPython 3.11 a collection inside ``sys._current_frames()``
    ran a finalizer holding the runtime's thread-list lock, the other thread took the GIL
    and waited for that lock, and every thread froze, as a resumed 20-thread worker did in
    the SIGSTOP chaos scenario; CPython issue gh-106883). Hung 3 of 3 runs before."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", GC_WHILE_INTERRUPTING],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=str(REPO),
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process froze while interrupting bodies during a collection")
    assert done.stdout.strip() == "ended", done.stderr[-2000:]


def test_interrupt_is_off_with_a_warning_outside_cpython(
    sqlite_store: LeaseStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On an interpreter without SetAsyncExc, lease_interrupt is turned off with a warning."""
    monkeypatch.setattr(lease_module, "ASYNC_INTERRUPT_SUPPORTED", False)
    monkeypatch.setattr(lease_module, "_warned_no_interrupt", False)
    with caplog.at_level(logging.WARNING, logger="celery_lease.lease.lease"):
        lease = held(sqlite_store, "r1", 30.0, interrupt=True)
    assert lease.interrupt is False
    assert "needs CPython" in caplog.text


@pytest.mark.timeout(30)
def test_rollback_then_takeover_interrupts_the_body(sqlite_store: LeaseStore) -> None:
    """After a fenced completion rolls back, a takeover seen by the heartbeat interrupts
    the body (once the rollback had its quiet period)."""
    store = sqlite_store
    lease = held(store, "r1", 30.0, heartbeat_interval=0.1, interrupt=True, watchdog=Watchdog())
    heartbeat = Heartbeat(store, interval=0.1)
    heartbeat.register(lease, start=False)
    ready = threading.Event()

    def body() -> None:
        with pytest.raises(RuntimeError), store.engine.begin() as conn:
            lease.fence(conn, complete=True)
            raise RuntimeError("roll back")
        ready.set()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            pass

    def thief() -> None:
        ready.wait(5)
        testing.steal_lease(store, "r1")
        heartbeat.beat_once()

    threading.Thread(target=thief).start()
    started = time.monotonic()
    with pytest.raises(LeaseInterrupt):
        lease.run_interruptible(body)
    assert time.monotonic() - started < 5
    assert lease.lost


# -- a real worker whose heartbeat is stuck -------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
def test_stalled_heartbeat_worker_gives_up_before_a_takeover(cluster: Cluster) -> None:
    """A worker whose heartbeat statement never returns: its check() raises at the local
    deadline, before a second claimer can take attempt 2 (before: check() kept passing),
    and a body that never checks is interrupted."""
    w1 = cluster.start("w1", CL_LEASE_SECONDS="3", CL_HEARTBEAT="0.5", CL_STALL_HEARTBEAT="1")
    watched = cluster.send("workerapp.watch", 20.0)
    spun = cluster.send("workerapp.spin", 20.0)
    wait_for(
        lambda: cluster.effects(watched, "start") and cluster.effects(spun, "start"),
        30,
        what="both bodies to start",
    )
    taken: dict[str, float] = {}

    def take_over() -> bool:
        for run_id in (watched, spun):
            if run_id not in taken:
                claim = cluster.store.claim(
                    run_id, f"thief-{run_id}", task_name="t", lease_ms=30_000, max_attempts=5
                )
                if claim.outcome == "claimed":
                    # 2, or 3 when the stale worker's own re-published delivery won it
                    assert claim.attempt >= 2
                    taken[run_id] = time.time()
        return len(taken) == 2

    wait_for(take_over, 30, interval=0.02, what="the leases to expire by the database clock")
    saw = wait_for(
        lambda: [e for e in cluster.effects(watched, "saw_lost") if e.attempt == 1],
        10,
        what="check() to raise",
    )
    assert saw[0].at < taken[watched], "the stale worker must stop before the takeover"
    wait_for(
        lambda: f"automation_run_lease_lost: run {spun} attempt 1" in w1.log(),
        10,
        what="the interrupt of the body that never checks",
    )
    assert cluster.effects(spun, "body_end") == []
    assert "local deadline passed" in w1.log()


def _blocked_signals(native_id: int) -> int:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_side_threads_never_take_a_process_signal(sqlite_store: LeaseStore) -> None:
    """The watchdog and heartbeat threads block SIGTERM: a pool child killed while it
    reports its exit (SIGTERM masked in its main thread) must not die in a side thread
    holding the pool's pipe lock (it froze the whole prefork pool)."""
    lease = held(sqlite_store, "r1", 30.0)
    dog = Watchdog()
    dog.watch(lease)
    heartbeat = Heartbeat(sqlite_store, interval=0.1)
    heartbeat.register(lease)
    try:
        for thread in (dog._thread, heartbeat._thread):
            assert thread is not None and thread.native_id is not None
            mask = wait_for(lambda t=thread: _blocked_signals(t.native_id), 5, what="the mask")
            assert mask & (1 << (signal.SIGTERM - 1))
        assert not _blocked_signals(threading.main_thread().native_id or 0) & (
            1 << (signal.SIGTERM - 1)
        )
    finally:
        heartbeat.stop()
        dog.unwatch(lease)


def test_bind_current_sets_and_restores_the_current_lease(sqlite_store: LeaseStore) -> None:
    """bind_current(lease) makes it current_lease() inside the block; the previous one
    (or none) is current again after it, also when the block raises."""
    outer = held(sqlite_store, "r1", 30.0)
    inner = held(sqlite_store, "r2", 30.0)
    assert current_or_none() is None
    with bind_current(outer) as bound:
        assert bound is outer and current_lease() is outer
        with pytest.raises(RuntimeError), bind_current(inner):
            assert current_or_none() is inner
            raise RuntimeError("body failed")
        assert current_lease() is outer
    assert current_or_none() is None
    with pytest.raises(LeaseError):
        current_lease()


def test_interrupter_delivers_only_what_it_is_told_is_owed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupter raises only when told an interrupt is owed and still owed at
    delivery; an uninterruptible block withholds it, and the end of the quiet period
    is reported as the next wake-up."""
    raised: list[tuple[int, object]] = []

    def fake(thread_id: int, exc: object) -> int:
        raised.append((thread_id, exc))
        return 1

    monkeypatch.setattr(interrupt_module, "_set_async_exc", fake)
    clock = FakeClock()
    interrupter = interrupt_module.Interrupter("r1", clock)
    assert interrupter.owe() is False  # no body armed: nothing to interrupt
    interrupter.arm(4242)
    assert interrupter.owe() is True
    interrupter.hold()
    assert interrupter.deliver(owed=True) is False and raised == []  # withheld in the block
    interrupter.release()
    assert interrupter.deliver(owed=False) is False and raised == []  # no longer owed: dropped
    assert interrupter.next_wake() is None
    interrupter.quiet_for(2.0)
    assert interrupter.owe() is True
    assert interrupter.deliver(owed=True) is True and raised == []  # quiet: poll again
    assert interrupter.next_wake() == clock() + 2.0
    clock.now += 2.0
    assert interrupter.deliver(owed=True) is False
    assert raised == [(4242, LeaseInterrupt)]
    interrupter.disarm()  # sent, maybe not delivered: withdrawn
    assert raised[-1] == (4242, None) and interrupter.thread_id is None
