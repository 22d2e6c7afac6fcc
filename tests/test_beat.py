"""Beat on every host: ``celery beat -S celery_lease.beat:LeaseScheduler`` in two and three
processes at once, on the embedded default and on PostgreSQL + Redis. One sends at a time;
kill -9 and SIGSTOP of the leader neither skip nor double a tick."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for

TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
#: The beats' leader lease: 2 s (a standby takes over within 2 s of the leader's death).
TIMING = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
SCHEDULER = "beat:workerapp"


def _leader(cluster: Cluster, beats: list[Worker]) -> Worker | None:
    """The beat process that holds the schedule's leader lease now, if any."""
    for record in cluster.store.leaders.list_all():
        if record.name == SCHEDULER and record.live:
            pid = int(record.owner.split(":")[1])
            return next((b for b in beats if b.pid == pid), None)
    return None


def _ticks(cluster: Cluster) -> Counter[str]:
    """How many times a body ran for each ``<entry>@<due ms>`` slot."""
    return Counter(effect.run_id for effect in cluster.effects_of_kind("tick"))


def _slots(ticks: Counter[str], entry: str) -> list[int]:
    return sorted(int(key.split("@")[1]) for key in ticks if key.startswith(f"{entry}@"))


def _gaps(slots: list[int], step: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in itertools.pairwise(slots) if b - a != step]


def _wait_until_second(second: int) -> None:
    """Sleep until the wall clock's seconds read ``second`` (at most a minute)."""
    time.sleep((second - time.time() % 60) % 60)


@TWO_SETUPS
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.timeout(240)
def test_beats_send_each_tick_once_through_kill9_and_sigstop(
    cluster: Cluster, count: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """N LeaseScheduler beats with a 1 s interval entry and an every-minute crontab entry of
    a leased task, and a 1 s entry of a plain task. The leader is killed -9 two seconds
    before a minute boundary (and restarted, as a supervisor would), then the next leader
    is SIGSTOPped for 5 s: every slot of
    the leased entries ran exactly once with no slot missing (the crontab's boundary slot
    included), and no slot of the plain task ran twice."""
    cluster.start("w1", concurrency=4, **TIMING)
    beats = [cluster.start_lease_beat(f"beat{i}", **TIMING) for i in range(count)]
    first = wait_for(lambda: _leader(cluster, beats), 30, what="a beat to lead")
    wait_for(lambda: len(_slots(_ticks(cluster), "every-second")) >= 3, 30, what="first ticks")
    _wait_until_second(58)
    first.kill9()
    killed_at = time.time()
    second = wait_for(
        lambda: (found := _leader(cluster, beats)) is not first and found, 10, what="a takeover"
    )
    took_over = time.time() - killed_at
    beats.append(cluster.start_lease_beat(f"beat{count}", **TIMING))  # its supervisor's restart
    time.sleep(6.0)
    second.pause()
    wait_for(
        lambda: _leader(cluster, beats) not in (None, second, first),
        10,
        what="a takeover from the stopped leader",
    )
    time.sleep(5.0)
    second.resume()
    time.sleep(5.0)
    for beat in beats:
        beat.stop()
    stopped_at = time.time()
    ticks = _ticks(cluster)

    def settled() -> bool:
        nonlocal ticks
        before, ticks = ticks, _ticks(cluster)
        return before == ticks

    wait_for(settled, 30, interval=2.0, what="the last ticks to run")
    doubled = {slot: n for slot, n in ticks.items() if n > 1}
    seconds = _slots(ticks, "every-second")
    minutes = _slots(ticks, "every-minute")
    plain = _slots(ticks, "plain-every-second")
    with capsys.disabled():
        shown = [time.strftime("%H:%M", time.gmtime(m / 1000)) for m in minutes]
        print(
            f"\n{count} beats: took over in {took_over:.2f} s; every-second {len(seconds)} "
            f"slots, every-minute {shown}, plain {len(plain)} slots "
            f"(gaps {_gaps(plain, 1000)}); doubled {doubled}"
        )
    assert doubled == {}
    assert _gaps(seconds, 1000) == []
    assert seconds[-1] >= (stopped_at - 3) * 1000  # the schedule ran to the end
    boundary = (int(killed_at) // 60 + 1) * 60_000  # the minute after the kill
    assert boundary in minutes and _gaps(minutes, 60_000) == []
    assert len(_gaps(plain, 1000)) <= 1  # a plain task's tick is at most once
    assert second.log().count("this beat no longer leads") <= 1
    text = "".join(beat.log() for beat in beats)
    assert "Traceback" not in text
