"""Prometheus multiprocess mode under ``celery worker -P prefork -c 4``, scraped over HTTP."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for

RUNS = 24
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value; fails on a series that appears twice."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        series = match.group(1) + (match.group(2) or "")
        assert series not in found, f"duplicate series {series}"
        found[series] = float(match.group(3))
    return found


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(180)
def test_prefork_children_counts_sum_in_one_scrape(
    cluster: Cluster, workers: list[Worker], tmp_path: Path
) -> None:
    """N leased runs drained by 4 pool children (recycled every 3 tasks): one scrape of the
    main process's endpoint shows each counter summed to N, every series once."""
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    port = free_port()
    env = {
        **cluster.env,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "CL_METRICS_PORT": str(port),
    }
    # Children are replaced every 3 tasks: an exited child's counts must stay in the sum.
    worker = Worker(
        env,
        tmp_path / "w.log",
        name="w1",
        concurrency=4,
        app="tests.metricsapp",
        extra_args=("--max-tasks-per-child", "3"),
    )
    workers.append(worker)
    worker.wait_ready(60)
    run_ids = [cluster.send("workerapp.work", 0.2) for _ in range(RUNS)]
    for run_id in run_ids:
        wait_for(lambda r=run_id: cluster.status(r) == "succeeded", 90, what=f"{run_id} to end")
    pids = {e.pid for e in cluster.effects_of_kind("commit")}
    assert len(pids) >= RUNS // 3, f"children were not recycled: {pids}"

    def settled() -> dict[str, float] | None:
        found = samples(scrape(port))
        return found if found.get("celery_lease_completed_total") == RUNS else None

    found = wait_for(settled, 30, 0.2, "the completions to be scraped")
    assert found["celery_lease_claims_total"] == RUNS
    assert found['celery_lease_failures_total{outcome="retrying"}'] == 0
    assert found["celery_lease_lease_lost_total"] == 0
    assert found["celery_lease_heartbeat_seconds_count"] >= 0
    text = scrape(port)
    for name in ("celery_lease_claims", "celery_lease_completed", "celery_lease_heartbeat_seconds"):
        assert len(re.findall(rf"^# TYPE {name}(_total)? ", text, re.M)) == 1, (name, text)
    assert len(list(metrics_dir.glob("counter_*.db"))) > RUNS // 3  # the main process + children
