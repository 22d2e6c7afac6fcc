"""Real ``celery worker`` / ``celery beat`` subprocesses, each stopped by its own PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

#: The directory that holds the ``example_project`` package.
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class CeleryProcess:
    """One ``celery -A example_project.app ...`` process in a session of its own.

    A new session makes its PID the process group id, so the pool children can
    be signalled through the group this process created, and a Ctrl-C in the
    terminal reaches only the demo, which then stops everything it started.
    """

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> None:
        self.name = name
        self.log_path = log_path
        pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project.app", *command],
            env={**env, "PYTHONPATH": pythonpath},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(cwd),
        )
        self.pid = self.proc.pid

    @classmethod
    def worker(
        cls,
        name: str,
        env: dict[str, str],
        workdir: Path,
        *,
        queues: list[str] | None = None,
        concurrency: int = 2,
    ) -> CeleryProcess:
        """A prefork worker with two pool processes (or ``concurrency``), node name
        ``name@host``, consuming the app's queues (or only ``queues``)."""
        command = [
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            *(["-Q", ",".join(queues)] if queues else []),
            "-n",
            f"{name}@%h",
            "-l",
            "INFO",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ]
        return cls(name, command, env, workdir / f"{name}.log", workdir)

    @classmethod
    def beat(cls, env: dict[str, str], workdir: Path) -> CeleryProcess:
        """``celery beat``: schedules the lease sweeper and the shop's resubmission."""
        command = ["beat", "-s", str(workdir / "beat-schedule"), "-l", "INFO"]
        return cls("beat", command, env, workdir / "beat.log", workdir)

    def log(self) -> str:
        """Everything the process has logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        """True while the main process has not exited."""
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the worker logs `` ready.``; raise with its log if it exits or stalls."""
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process and its pool children (the group it leads)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole worker, like a VM or container frozen by its host."""
        self.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole worker."""
        self.signal_group(signal.SIGCONT)

    def kill9(self) -> None:
        """SIGKILL the worker and its pool children, and reap it."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL the group if anything lingers."""
        if self.alive():
            self.signal_group(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()
