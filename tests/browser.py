"""Headless Debian Chromium for the web view's tests and screenshots, and a ``lease web``
server process to point it at."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import REPO, require, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser(window: str = "1400,900") -> Any:
    """Headless Debian Chromium through its chromedriver (a ``window`` of ``width,height``);
    skip without them (fail in CI)."""
    found = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
    require(found, "chromium and chromedriver (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:  # pragma: no cover - the test extras hold selenium
        require(None, "selenium (the test extras)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={window}",
        "--disable-gpu",
    ):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WebServer:
    """``celery -A <app> lease web`` in a process of its own, stopped by PID."""

    def __init__(self, app: str, env: dict[str, str], cwd: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / f"web-{self.port}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    app,
                    "lease",
                    "web",
                    "--port",
                    str(self.port),
                ],
                env={**os.environ, "PYTHONPATH": str(REPO), **env},
                cwd=str(cwd),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.ready, timeout=30, what=f"lease web on port {self.port}")

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
