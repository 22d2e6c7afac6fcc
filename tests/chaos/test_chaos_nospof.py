"""No single point of failure, under chaos: LeaseScheduler beats and sweeping workers killed
(kill -9) and stopped (SIGSTOP) at random for a few minutes while runs and ticks flow.

On PostgreSQL + Redis, without ``acks_late``: a run a killed worker had started is
gone from the broker, so only a sweep brings it back; a message it had only prefetched
(never started, never acknowledged) Redis restores after its visibility timeout (5 s).
(Not on the filesystem broker: there a prefetched message dies with its worker, before
any lease exists.) Asserts 0 runs lost or committed twice, and 0 ticks doubled or
skipped.
"""

from __future__ import annotations

import itertools
import random
import re
import time
from collections import Counter
from datetime import datetime

import pytest

from tests.chaos.history import check
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for

pytestmark = pytest.mark.chaos

ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
TIMING = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_VISIBILITY_TIMEOUT": "5"}
CONF = {
    "lease_retry_backoff": 0.2,
    "lease_retry_backoff_max": 2.0,
    "lease_max_attempts": 20,
    "lease_sweep_interval": 1.0,
}
#: A LeaseScheduler's log line for a tick it sent.
SENT = re.compile(r"celery-lease beat: sent (\S+) \(\S+\) due (\S+) as ")
#: Seconds of chaos.
DURATION = 150.0


def _ticks(cluster: Cluster) -> Counter[str]:
    return Counter(effect.run_id for effect in cluster.effects_of_kind("tick"))


def _slots(ticks: Counter[str], entry: str) -> list[int]:
    return sorted(int(key.split("@")[1]) for key in ticks if key.startswith(f"{entry}@"))


def _sent(beats: list[Worker]) -> Counter[tuple[str, int]]:
    """How many times the beats logged sending each ``(entry, slot due ms)``."""
    sent: Counter[tuple[str, int]] = Counter()
    for beat in beats:
        for entry, due in SENT.findall(beat.log()):
            sent[entry, round(datetime.fromisoformat(due).timestamp() * 1000)] += 1
    return sent


def _gaps(slots: list[int], step: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in itertools.pairwise(slots) if b - a != step]


@ON_PG
@pytest.mark.slow  # about 160 s, the longest chaos scenario: first
@pytest.mark.timeout(600)
def test_random_kills_and_stops_of_beats_and_workers(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three sweeping workers and three LeaseScheduler beats; every 2-5 s one of them is
    killed -9 (and replaced at once) or SIGSTOPped for 3-5 s, for DURATION seconds, while
    runs are sent (six at a time, just before each action, so it hits running bodies).
    Every run commits exactly once; no tick of any entry ran twice; the beats sent every
    slot of the 1 s and every-minute entries of a leased task."""
    rng = random.Random(20261205)
    workers = [cluster.start(f"w{i}", conf=CONF, **TIMING) for i in range(3)]
    beats = [cluster.start_lease_beat(f"b{i}", conf=CONF, **TIMING) for i in range(3)]
    every_beat = list(beats)
    actions: Counter[str] = Counter()
    run_ids: list[str] = []
    # The window of DURATION seconds opens at the first tick run, not when the beats
    # were spawned: a beat takes seconds to start on a loaded machine, and counting
    # from its spawn found 149 slots in 150 s with no gap (the ticks before the first
    # one were never due to a running beat).
    wait_for(
        lambda: _slots(_ticks(cluster), "every-second") != [],
        60,
        interval=0.2,
        what="the first every-second tick",
    )
    started = time.monotonic()
    generation = itertools.count(1)
    while time.monotonic() - started < DURATION:
        run_ids += [cluster.send("workerapp.effect", rng.uniform(1.0, 3.0)) for _ in range(6)]
        time.sleep(rng.uniform(0.3, 1.0))  # bodies are running: the action hits some
        kind = rng.choice(["worker", "beat"])
        group: list[Worker] = workers if kind == "worker" else beats
        index = rng.randrange(len(group))
        victim = group[index]
        if rng.random() < 0.6:
            victim.kill9()
            name = f"{kind[0]}{index}-r{next(generation)}"
            group[index] = (
                cluster.start(name, conf=CONF, **TIMING)
                if kind == "worker"
                else cluster.start_lease_beat(name, conf=CONF, **TIMING)
            )
            if kind == "beat":
                every_beat.append(group[index])
            actions[f"kill9 {kind}"] += 1
        else:
            victim.pause()
            time.sleep(rng.uniform(3.0, 5.0))
            victim.resume()
            actions[f"sigstop {kind}"] += 1
        time.sleep(rng.uniform(1.5, 3.0))
    wait_for(
        lambda: all(cluster.status(r) in ("succeeded", "failed") for r in run_ids),
        180,
        interval=1.0,
        what="every run to end",
    )

    def window_run() -> bool:
        slots = _slots(_ticks(cluster), "every-second")
        return bool(slots) and slots[-1] - slots[0] >= (DURATION + 1) * 1000

    # The beats stop once the ticks run span DURATION + 1 s from the first: the count
    # then has a margin, and a missed tick inside the window shows as a gap.
    wait_for(window_run, 30, interval=0.5, what="DURATION seconds of every-second ticks")
    for beat in beats:
        beat.stop()
    ticks = _ticks(cluster)

    def settled() -> bool:
        nonlocal ticks
        before, ticks = ticks, _ticks(cluster)
        return before == ticks

    wait_for(settled, 60, interval=3.0, what="the last ticks to run")
    history = check(cluster, run_ids)
    # A leased tick's body runs once, whatever the broker does; a plain task's message
    # may be delivered twice by Redis itself (a SIGSTOPped worker's, after the visibility
    # timeout): that is Celery's at-least-once, so a plain tick counts as doubled only
    # when a beat sent it twice.
    logged = _sent(every_beat)
    doubled = {slot: n for slot, n in ticks.items() if n > 1 and not slot.startswith("plain-")}
    doubled.update({f"{e}@{due} sent": n for (e, due), n in logged.items() if n > 1 and
                    e == "plain-every-second"})  # fmt: skip
    ran = {e: _slots(ticks, e) for e in ("every-second", "every-minute", "plain-every-second")}
    # Sent: logged as sent by a beat, or run (a beat killed just after a send never logs it).
    sent = {
        e: sorted({due for (name, due) in logged if name == e} | set(slots))
        for e, slots in ran.items()
    }
    # A tick sent but never run: its message was prefetched by a worker killed before it
    # started it (no lease yet), and Redis gave it back after its visibility timeout.
    not_run = {e: sorted(set(sent.get(e, [])) - set(slots)) for e, slots in ran.items()}
    with capsys.disabled():
        print(
            f"\n{history.line('nospof ' + ', '.join(f'{k} x{n}' for k, n in actions.items()))}"
            f"\nchaos[nospof ticks]: sent every-second={len(sent['every-second'])} "
            f"gaps={_gaps(sent['every-second'], 1000)} every-minute={len(sent['every-minute'])} "
            f"gaps={_gaps(sent['every-minute'], 60_000)} plain={len(sent['plain-every-second'])} "
            f"gaps={len(_gaps(sent['plain-every-second'], 1000))}; ran doubled={len(doubled)}, "
            f"sent but not run={ {e: len(v) for e, v in not_run.items()} }"
        )
    assert history.ok, history.problems[:20]
    assert history.retried >= 5  # the kills and stops did hit running bodies
    assert doubled == {}
    assert _gaps(sent["every-second"], 1000) == [] and len(sent["every-second"]) >= DURATION
    assert _gaps(sent["every-minute"], 60_000) == [] and len(sent["every-minute"]) >= 2
    # A plain task's tick is at most once: a beat killed between recording and sending
    # it loses that one.
    assert len(_gaps(sent["plain-every-second"], 1000)) <= actions["kill9 beat"]
    assert sum(actions.values()) >= 20 and actions["kill9 beat"] and actions["kill9 worker"]
