"""The web view's screenshots in docs/images/, from the example project's data.

``python -m tests.screenshots`` runs the example project's demo (two workers, one
frozen past its lease and one killed, so some runs were taken over), serves its
lease database with ``celery -A example_project.app lease web`` and saves the runs
page and the page of a run that was taken over, in headless Chromium.
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


def main() -> int:
    """Run the demo, take the runs page while it runs and a taken-over run's page after it;
    exit status 0 when both were saved."""
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
                    and len(store.live_leases(10)) >= 2
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
            taken_over = max(store.list_runs(limit=1000), key=lambda r: (r.attempt, r.id))
            driver.get(server.url + "/run?id=" + taken_over.id)
            driver.save_screenshot(str(IMAGES / "web-run.png"))
        finally:
            if driver is not None:
                driver.quit()
            if server is not None:
                server.stop()
            if demo.poll() is None:
                demo.terminate()
                demo.wait(30)
            store.dispose()
    print(f"saved {IMAGES / 'web-runs.png'} and {IMAGES / 'web-run.png'} (run {taken_over.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
