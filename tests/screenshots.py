"""The web view's screenshots in docs/images/, from the example project's data.

``python -m tests.screenshots`` runs the example project's demo (two workers, one
frozen past its lease and one killed, so some runs were taken over and some
re-published by the sweeper), serves its lease database with ``celery -A
example_project.app lease web`` and saves, in headless Chromium: the runs page
while it runs and the page of a run that was taken over; then, as on call during
a payment gateway outage, the capture task paused with a reason while a worker
holds three new orders' deliveries: the overview and the task's page.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from celery_lease.store import LeaseStore
from tests.browser import WebServer, browser
from tests.helpers import REPO, wait_for

IMAGES = REPO / "docs" / "images"
CAPTURE = "example_project.capture_payment"
REASON = "payment gateway 503s (INC-44)"


def main() -> int:
    """Run the demo, take the runs page while it runs and a taken-over run's page after it,
    then pause the capture task and take the overview and its page; exit status 0 when all
    four were saved."""
    with tempfile.TemporaryDirectory(prefix="lease-shots-") as folder:
        workdir = Path(folder)
        demo = subprocess.Popen(
            [sys.executable, "-m", "example_project", "demo", "--workdir", str(workdir), "--keep"],
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
        )
        env = {
            "EXAMPLE_WORKDIR": str(workdir),
            "EXAMPLE_TIMINGS": "demo",
            # A relative URL, served from the demo's folder: no machine path in the images.
            "EXAMPLE_DATABASE_URL": "sqlite:///shop.sqlite3",
            "CELERY_LEASE_WEB_TOKEN": "screenshot-token-0123456789",
        }
        store = LeaseStore.from_url(f"sqlite:///{workdir / 'shop.sqlite3'}")
        server = driver = None
        try:
            # Mid-run: a few leases held, so the page shows owners and time left.
            wait_for(
                lambda: (
                    (workdir / "shop.sqlite3").exists()
                    and store.has_schema()
                    and len(store.reads.live_leases(10)) >= 2
                ),
                timeout=120,
                interval=0.2,
                what="the demo's first leases",
            )
            server = WebServer("example_project.app", env, workdir)
            driver = browser("1280,760")
            IMAGES.mkdir(parents=True, exist_ok=True)
            driver.get(server.url + "/runs")
            driver.save_screenshot(str(IMAGES / "web-runs.png"))
            demo.wait(timeout=200)
            taken_over = max(store.reads.list_runs(limit=1000), key=lambda r: (r.attempt, r.id))
            driver.get(server.url + "/run?id=" + taken_over.id)
            driver.save_screenshot(str(IMAGES / "web-run.png"))
            hold_captures(workdir, store)
            driver.set_window_size(1280, 900)
            driver.get(server.url + "/")
            driver.save_screenshot(str(IMAGES / "web-overview.png"))
            driver.get(server.url + "/task?name=" + CAPTURE)
            driver.save_screenshot(str(IMAGES / "web-task.png"))
        finally:
            if driver is not None:
                driver.quit()
            if server is not None:
                server.stop()
            if demo.poll() is None:
                demo.terminate()
                demo.wait(30)
            store.dispose()
    names = ", ".join(f"web-{n}.png" for n in ("runs", "run", "overview", "task"))
    print(f"saved {names} in {IMAGES} (run {taken_over.id})")
    return 0


def hold_captures(workdir: Path, store: LeaseStore) -> None:
    """Pause the capture task with a reason (``lease pause``), start a worker, and place
    three orders: the worker holds their deliveries until resume."""
    os.environ.update({"EXAMPLE_WORKDIR": str(workdir), "EXAMPLE_TIMINGS": "demo"})
    os.environ.pop("EXAMPLE_DATABASE_URL", None)
    from example_project import tasks
    from example_project.demo import merchant_of
    from example_project.processes import CeleryProcess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pause = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "example_project.app", "lease", "pause",
         CAPTURE, "--reason", REASON],
        env=env, cwd=str(workdir), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    print(pause.stdout.strip())
    worker = CeleryProcess.worker("echo", env, workdir)
    try:
        worker.wait_ready()
        for n in range(1, 4):
            order = f"ord-oncall-{n:03d}"
            tasks.place_order(order, merchant_of(n), 1000 + n)
            tasks.submit_capture(order, merchant_of(n))
        wait_for(
            lambda: sum(store.flow.flow_counts().paused.values()) == 3,
            timeout=60,
            interval=0.2,
            what="three held deliveries",
        )
    finally:
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
