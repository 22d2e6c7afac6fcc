"""docs/quickstart.md, run as written: its files, its commands, a real worker with beat.

The page's code blocks are extracted and executed in a scratch directory, and the log
lines it quotes are checked against the worker's log, so the page cannot rot.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.helpers import REPO, Worker, wait_for

PAGE = REPO / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    """The page's ``lang`` code blocks after its install section, in order."""
    body = PAGE.read_text().split("## A leased task", 1)[1]
    return [code for kind, code in FENCE.findall(body) if kind == lang]


def commands() -> list[list[str]]:
    """Every shell command of the page (after the install section), as argv."""
    return [
        shlex.split(line, comments=True)
        for code in blocks("bash")
        for line in code.splitlines()
        if line.strip()
    ]


def quoted(prefix: str) -> list[str]:
    """The inline-code phrases of the page that start with ``prefix`` (quoted log lines)."""
    prose = FENCE.sub("", PAGE.read_text())
    return [m for m in re.findall(r"`([^`]+)`", prose.replace("\n", " ")) if m.startswith(prefix)]


def argv(command: list[str]) -> list[str]:
    """``command`` with ``celery``/``python`` run by this interpreter."""
    if command[0] == "celery":
        return [sys.executable, "-m", "celery", *command[1:]]
    assert command[0] == "python", command
    return [sys.executable, *command[1:]]


@pytest.mark.timeout(150)
def test_quickstart_runs_as_written_and_beat_recovers_a_killed_run(tmp_path: Path) -> None:
    """The quickstart's tasks.py, commands and Python snippet work as written: the run
    succeeds once, a second enqueue is dropped, `lease show/runs` and the snippet read it,
    and after kill -9 mid-run the worker's embedded beat sweeps the run to attempt 2."""
    python = blocks("python")
    (tasks_py,) = [code for code in python if code.startswith("# tasks.py\n")]
    snippets = [code for code in python if code != tasks_py]
    assert snippets and all("from tasks import app" in code for code in snippets)
    (tmp_path / "tasks.py").write_text(tasks_py)
    cmds = commands()
    (worker_cmd,) = [c for c in cmds if c[:4] == ["celery", "-A", "tasks", "worker"]]
    assert "-B" in worker_cmd
    (enqueue,) = [c for c in cmds if c[0] == "python"]
    cli = [c for c in cmds if c[:4] == ["celery", "-A", "tasks", "lease"]]
    assert [c for c in cmds if c[:4] == ["celery", "-A", "tasks", "beat"]]
    assert len(cli) == 2, cmds
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}

    def run(command: list[str]) -> str:
        proc = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"{command}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def start(name: str) -> Worker:
        return Worker(
            env,
            tmp_path / f"{name}.log",
            name=name,
            app="tasks",
            command=worker_cmd[3:],
            cwd=tmp_path,
        ).wait_ready(60)

    log_lines = quoted("run capture:42")
    assert len(log_lines) >= 4, log_lines  # claimed, completed, dropped, re-enqueued
    worker = start("first")
    try:
        run(argv(enqueue))
        wait_for(lambda: "capture:42 attempt 1: completing -> completed" in worker.log(), 30)
        run(argv(enqueue))
        wait_for(lambda: "run capture:42 is already succeeded" in worker.log(), 30)
        for line in log_lines[:-1]:
            assert line in worker.log(), line
        assert "capture:42" in run(argv(cli[0])) and "succeeded" in run(argv(cli[0]))
        assert "capture:42" in run(argv(cli[1]))
        for code in snippets:
            assert run([sys.executable, "-c", code]).startswith("succeeded 1 ")

        # kill -9 mid-run: the run stays `running` until beat's sweeper re-enqueues it.
        run(argv([*enqueue[:-1], enqueue[-1].replace("(42)", "(43)")]))
        wait_for(lambda: "run capture:43: claimed attempt 1" in worker.log(), 30)
        worker.kill9()
        worker.stop()
        worker = start("second")
        wait_for(lambda: "capture:43 attempt 2: completing -> completed" in worker.log(), 60)
        assert log_lines[-1].replace("42", "43") in worker.log()
    finally:
        worker.stop()
    engine = create_engine(f"sqlite:///{tmp_path / 'celery-lease.sqlite3'}")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT order_id, attempt FROM captures ORDER BY order_id"))
        assert rows.all() == [(42, 1), (43, 2)]
    engine.dispose()
