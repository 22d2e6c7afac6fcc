"""docs/quickstart.md, run as written: its files, its commands, real workers and no beat.

The page's code blocks are extracted and executed in a scratch directory, and the log
lines it quotes are checked against the worker's log, so the page cannot rot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.docpages import Page, argv, reader_env, run, write_files
from tests.helpers import Worker, wait_for

pytestmark = pytest.mark.slow  # each test runs a project with workers of its own

PAGE = Page("quickstart.md", after="## A leased task")


@pytest.mark.timeout(150)
def test_quickstart_runs_as_written_and_a_worker_recovers_a_killed_run(tmp_path: Path) -> None:
    """The quickstart's tasks.py, commands and Python snippet work as written: the run
    succeeds once, a second enqueue is dropped, `lease show/runs` and the snippet read it,
    and after kill -9 of the worker mid-run (it was also the one sweeping), the new worker
    takes over the sweeper and re-enqueues the run, which it runs as attempt 2. No beat
    runs: the page has none."""
    files = PAGE.files()
    snippets = [code for name, code in files.items() if name != "tasks.py"]
    assert snippets and all("from tasks import app" in code for code in snippets)
    write_files({"tasks.py": files["tasks.py"]}, tmp_path)
    cmds = PAGE.commands()
    (worker_cmd,) = [c for c in cmds if c[:4] == ["celery", "-A", "tasks", "worker"]]
    assert not [c for c in cmds if "beat" in c or "-B" in c]  # recovery needs no beat
    (enqueue,) = [c for c in cmds if c[0] == "python"]
    cli = [c for c in cmds if c[:4] == ["celery", "-A", "tasks", "lease"]]
    assert len(cli) == 2, cmds
    env = reader_env()

    def start(name: str, command: list[str], ready: bool = True) -> Worker:
        process = Worker(
            env, tmp_path / f"{name}.log", name=name, app="tasks", command=command[3:], cwd=tmp_path
        )
        return process.wait_ready(60) if ready else process

    log_lines = PAGE.quoted("run capture:42")
    assert len(log_lines) >= 3, log_lines  # claimed, completed, dropped
    (reenqueued,) = PAGE.quoted("run capture:43")
    worker = start("first", worker_cmd)
    try:
        run(argv(enqueue), tmp_path, env)
        wait_for(lambda: "capture:42 attempt 1: completing -> completed" in worker.log(), 30)
        run(argv(enqueue), tmp_path, env)
        wait_for(lambda: "run capture:42 is already succeeded" in worker.log(), 30)
        for line in log_lines:
            assert line in worker.log(), line
        # No result backend on the page: the drop reports no outcome anywhere, nor says so.
        assert "reported under" not in worker.log()
        shown = run(argv(cli[0]), tmp_path, env)
        assert "capture:42" in shown and "succeeded" in shown
        assert "capture:42" in run(argv(cli[1]), tmp_path, env)
        for code in snippets:
            assert run([sys.executable, "-c", code], tmp_path, env).startswith("succeeded 1 ")

        # kill -9 mid-run: the run stays `running` until the new worker's sweep re-enqueues it,
        # or, when the dead worker had not acknowledged the message yet, until the message
        # (back in its queue) claims it once the lease expires, as the page says.
        run(argv([*enqueue[:-1], enqueue[-1].replace("(42)", "(43)")]), tmp_path, env)
        wait_for(lambda: "run capture:43: claimed attempt 1" in worker.log(), 30)
        worker.kill9()
        worker.stop()
        worker = start("second", worker_cmd)
        wait_for(lambda: "capture:43 attempt 2: completing -> completed" in worker.log(), 60)
        assert reenqueued in worker.log() or "busy" in worker.log(), worker.log()
    finally:
        worker.stop()
    engine = create_engine(f"sqlite:///{tmp_path / 'celery-lease.sqlite3'}")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT order_id, attempt FROM captures ORDER BY order_id"))
        assert rows.all() == [(42, 1), (43, 2)]
    engine.dispose()
