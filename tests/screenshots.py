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
from tests.helpers import REPO

IMAGES = REPO / "docs" / "images"


def main() -> int:
    """Run the demo, then take both screenshots; exit status 0 when both were saved."""
    with tempfile.TemporaryDirectory(prefix="lease-shots-") as folder:
        workdir = Path(folder)
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "example_project",
                "demo",
                "--orders",
                "16",
                "--workdir",
                str(workdir),
                "--keep",
            ],
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=200,
        )
        if not (workdir / "shop.sqlite3").exists():
            return demo.returncode or 1
        if demo.returncode:  # its story's timing missed on a busy machine: the rows are real
            print("the demo's checks failed; its runs are shown all the same", file=sys.stderr)
        env = {
            "EXAMPLE_WORKDIR": str(workdir),
            "EXAMPLE_TIMINGS": "demo",
            "CELERY_LEASE_WEB_TOKEN": "screenshot-token-0123456789",
        }
        store = LeaseStore.from_url(f"sqlite:///{workdir / 'shop.sqlite3'}")
        taken_over = max(store.list_runs(limit=1000), key=lambda r: (r.attempt, r.id))
        store.dispose()
        server = WebServer("example_project.app", env, workdir)
        driver = browser("1280,760")
        try:
            IMAGES.mkdir(parents=True, exist_ok=True)
            driver.get(server.url + "/runs")
            driver.save_screenshot(str(IMAGES / "web-runs.png"))
            driver.get(server.url + "/run?id=" + taken_over.id)
            driver.save_screenshot(str(IMAGES / "web-run.png"))
        finally:
            driver.quit()
            server.stop()
    print(f"saved {IMAGES / 'web-runs.png'} and {IMAGES / 'web-run.png'} (run {taken_over.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
