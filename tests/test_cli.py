"""``celery -A tests.cli_app lease ...`` as a real subprocess, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_lease.migrations import head, upgrade
from celery_lease.sanitize import safe_url
from celery_lease.schema import SWEEPS_TABLE_NAME
from celery_lease.store import LeaseStore
from tests.helpers import REPO

PAYLOAD = b'{"args": [7], "kwargs": {}, "options": {}}'


class Cli:
    """Runs the ``celery lease`` command against one lease database."""

    def __init__(self, db_url: str, tmp_path: Path) -> None:
        self.db_url = db_url
        self.cwd = tmp_path
        broker = tmp_path / "broker"
        (broker / "control").mkdir(parents=True)
        self.broker = broker
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CL_LEASE_DB": db_url,
            "CL_BROKER_URL": "filesystem://",
            "CL_FS_DIR": str(broker),
        }

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease", *args]
        return subprocess.run(
            cmd,
            env={**self.env, **env},
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ok(self, *args: str) -> str:
        proc = self(*args)
        assert proc.returncode == 0, f"{args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1, one non-empty stderr line starting with ``Error:``, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return Cli(db_url, tmp_path)


@pytest.fixture
def store(cli: Cli) -> Iterator[LeaseStore]:
    """A store on the CLI's database, migrated."""
    upgrade(cli.db_url)
    lease_store = LeaseStore.from_url(cli.db_url)
    yield lease_store
    lease_store.dispose()


def claim(
    store: LeaseStore,
    run_id: str,
    *,
    task: str = "cli_app.charge",
    lease_ms: int = 60_000,
    **kw: int,
) -> int:
    result = store.claim(
        run_id,
        f"host-{run_id}:4242:{run_id}secret",
        task_name=task,
        lease_ms=lease_ms,
        max_attempts=kw.get("max_attempts", 3),
        payload=PAYLOAD,
        payload_content_type="application/json",
    )
    assert result.outcome == "claimed"
    return result.attempt


def test_migrate_creates_schema_then_is_idempotent(cli: Cli) -> None:
    """`lease migrate` creates the table, a second run reports it is already at head."""
    first = cli.ok("migrate")
    assert f"migrated (empty) -> {head()}" in first
    assert f"already at revision {head()}" in cli.ok("migrate")
    store = LeaseStore.from_url(cli.db_url)
    assert store.has_schema()
    store.dispose()


def test_migrate_to_a_revision_not_shipped_is_one_line(cli: Cli) -> None:
    """`lease migrate --revision 9999` names the revisions this version ships, in one line
    (it printed Alembic's traceback), and touches nothing; an older revision than the
    database's says it is past it (it said "already at revision" the newer one)."""
    line = assert_one_line_error(cli("migrate", "--revision", "9999"), "unknown revision '9999'")
    assert f"head: {head()}" in line
    assert "(empty) ->" in cli.ok("migrate", "--revision", "0002")
    assert f"0002 -> {head()}" in cli.ok("migrate")
    assert f"at revision {head()}, past 0002 already" in cli.ok("migrate", "--revision", "0002")


def test_migrate_adopts_table_created_on_first_use(cli: Cli) -> None:
    """`lease migrate` on a table the store auto-created records it instead of crashing."""
    store = LeaseStore.from_url(cli.db_url)
    store.create_schema()
    store.dispose()
    assert f"recorded it at revision {head()}" in cli.ok("migrate")
    assert f"already at revision {head()}" in cli.ok("migrate")


def test_runs_lists_filters_and_prints_json(cli: Cli, store: LeaseStore) -> None:
    """`lease runs` shows a table; --status, --task and --limit filter; --json is parseable."""
    claim(store, "run-a", lease_ms=3_600_000)  # still held after a slow, loaded run
    attempt = claim(store, "run-b", task="cli_app.refund")
    store.complete("run-b", "host-run-b:4242:run-bsecret", attempt)
    table = cli.ok("runs")
    header = table.splitlines()[0].split()
    assert header[:4] == ["ID", "TASK", "STATUS", "ATTEMPT"]
    assert "run-a" in table and "run-b" in table and "left" in table
    assert "run-bsecret" not in table  # only host:pid of an owner is shown
    running = cli.ok("runs", "--status", "running")
    assert "run-a" in running and "run-b" not in running
    assert "run-a" not in cli.ok("runs", "--task", "cli_app.refund")
    data = json.loads(cli.ok("runs", "--json", "--limit", "1"))
    assert len(data) == 1 and data[0]["id"] in ("run-a", "run-b")
    everything = {row["id"]: row for row in json.loads(cli.ok("runs", "--json"))}
    assert everything["run-b"]["status"] == "succeeded"
    assert 0 < everything["run-a"]["lease_left_ms"] <= 3_600_000
    assert "no runs match" in cli.ok("runs", "--status", "cancelled")


def test_tables_cut_long_run_ids_and_wide_shows_them_whole(cli: Cli, store: LeaseStore) -> None:
    """A hashed run id (172 characters) is cut in the middle in `runs` and `top`, which
    then keep their rows within 120 columns and say so; --wide prints it whole."""
    from celery_lease.run.runids import fit_run_id

    long_id = fit_run_id("invoice:" + "x" * 300)
    assert len(long_id) > 150
    claimed = store.claim(
        long_id, "host:4242:secret", task_name="cli_app.charge", lease_ms=60_000, max_attempts=3
    )
    assert claimed.outcome == "claimed"
    short = long_id[:25] + "..." + long_id[-12:]
    for command in (("runs",), ("top", "--once")):
        table = cli.ok(*command)
        assert long_id not in table and short in table, table
        assert "--wide shows them whole" in table
        rows = [line for line in table.splitlines() if line.startswith(("ID ", short))]
        assert len(rows) == 2 and max(len(row) for row in rows) <= 120, table
        wide = cli.ok(*command, "--wide")
        assert long_id in wide and "--wide shows" not in wide


def test_show_prints_every_column_and_time_left(cli: Cli, store: LeaseStore) -> None:
    """`lease show` prints all columns, readable times and the lease's time left (DB clock)."""
    claim(store, "run-s", lease_ms=60_000)
    text = cli.ok("show", "run-s")
    names = {line.split()[0] for line in text.splitlines() if line.strip()}
    for column in ("id", "task_name", "status", "lease_owner", "lease_expires_at", "attempt"):
        assert column in names
    for column in ("heartbeat_at", "available_at", "cancel_requested_at", "failure_code"):
        assert column in names
    assert "lease_left" in names and " left" in text and "Z  (in " in text
    assert "bytes (use --payload to print)" in text and '"args"' not in text
    data = json.loads(cli.ok("show", "run-s", "--json", "--payload"))
    assert 0 < data["lease_left_ms"] <= 60_000
    assert data["lease_expires_at"] - data["db_now"] == data["lease_left_ms"]
    assert json.loads(data["payload"])["args"] == [7]


def test_show_of_a_finished_run_shows_its_outcome_not_mid_way_progress(
    cli: Cli, store: LeaseStore
) -> None:
    """A run whose body reported 37/50 and then succeeded shows ``succeeded`` as its
    progress; a failed one where it stopped; a running one its progress."""
    from celery_lease.store.records import Progress

    for run_id in ("ok", "bad", "live"):
        attempt = claim(store, run_id)
        key = (run_id, f"host-{run_id}:4242:{run_id}secret", attempt)
        store.heartbeat([key], {key: Progress(37, 50, "orders")})
        if run_id == "ok":
            store.complete(run_id, key[1], attempt)
        elif run_id == "bad":
            store.fail(run_id, key[1], attempt, error="x", failure_code="e", retry_in=None)

    def progress(run_id: str) -> str:
        line = next(li for li in cli.ok("show", run_id).splitlines() if li.startswith("progress"))
        return line.split(None, 1)[1]

    assert progress("ok") == "succeeded"
    assert progress("bad") == "failed at 37/50 (74%)"
    assert progress("live").startswith("37/50 (74%) orders  (written ")


def test_show_gives_the_runs_recovery_history(cli: Cli, store: LeaseStore) -> None:
    """`lease show` (text and --json) counts the takeovers of an expired lease and the
    sweeper's publishes, with the last time of each, as the web view's run page does."""
    claim(store, "run-t")
    assert "takeovers" in cli.ok("show", "run-t")
    store.expire("run-t")
    taken = store.claim(
        "run-t",
        "host-b:4243:bsecret",
        task_name="cli_app.charge",
        lease_ms=60_000,
        max_attempts=3,
        payload=PAYLOAD,
        payload_content_type="application/json",
    )
    assert taken.outcome == "claimed" and taken.attempt == 2
    shown = dict(
        line.split(None, 1) for line in cli.ok("show", "run-t").splitlines() if " " in line
    )
    assert shown["takeovers"].strip() == "1" and shown["republishes"].strip() == "0"
    assert shown["taken_over_at"].strip() != "-" and shown["republished_at"].strip() == "-"
    data = json.loads(cli.ok("show", "run-t", "--json"))
    assert data["takeovers"] == 1 and data["taken_over_at"] is not None


def test_show_unknown_run_is_one_line_error(cli: Cli, store: LeaseStore) -> None:
    """An unknown run id ends with one stderr line and exit status 1."""
    assert_one_line_error(cli("show", "no-such-run"), "no run with id 'no-such-run'")
    assert_one_line_error(cli("cancel", "no-such-run"), "no run with id")


def test_cancel_running_and_retrying_runs(cli: Cli, store: LeaseStore) -> None:
    """`lease cancel` requests cancel of a running run and ends a retrying one at once."""
    claim(store, "run-r")
    attempt = claim(store, "run-q")
    store.release("run-q", "host-run-q:4242:run-qsecret", attempt, available_in=60)
    assert "cancel requested" in cli.ok("cancel", "run-r")
    running = store.get("run-r")
    assert running is not None and running.status == "running"
    assert running.cancel_requested_at is not None
    assert "is cancelled" in cli.ok("cancel", "run-q")
    retrying = store.get("run-q")
    assert retrying is not None and retrying.status == "cancelled"
    assert "cancel requested" in cli.ok("runs")
    assert "is cancelled" in cli.ok("cancel", "run-q")  # idempotent
    done = claim(store, "run-d")
    store.complete("run-d", "host-run-d:4242:run-dsecret", done)
    assert_one_line_error(cli("cancel", "run-d"), "already succeeded")


def test_cancel_of_a_finished_run_exit_status(cli: Cli, store: LeaseStore) -> None:
    """`lease cancel` is idempotent on a cancelled run (exit 0, also for a repeated cancel
    request on a running one) and an error (exit 1) on a succeeded or failed run."""
    claim(store, "run-c")
    store.cancel("run-c")
    store.end("run-c", "host-run-c:4242:run-csecret", 1, status="cancelled", failure_code="x")
    assert "is cancelled" in cli.ok("cancel", "run-c")
    assert "is cancelled" in cli.ok("cancel", "run-c")
    claim(store, "run-r")
    assert "cancel requested" in cli.ok("cancel", "run-r")
    assert "cancel requested" in cli.ok("cancel", "run-r")
    claim(store, "run-s")
    store.complete("run-s", "host-run-s:4242:run-ssecret", 1)
    assert_one_line_error(cli("cancel", "run-s"), "run run-s already succeeded")
    claim(store, "run-f", max_attempts=1)
    store.fail(
        "run-f", "host-run-f:4242:run-fsecret", 1, error="boom", failure_code="x", retry_in=None
    )
    assert_one_line_error(cli("cancel", "run-f"), "run run-f already failed")
    statuses = {run_id: store.get(run_id) for run_id in ("run-c", "run-s", "run-f")}
    assert {k: v.status for k, v in statuses.items() if v} == {
        "run-c": "cancelled",
        "run-s": "succeeded",
        "run-f": "failed",
    }


def test_sweep_recovers_expired_leases_and_reports(cli: Cli, store: LeaseStore) -> None:
    """`lease sweep` re-enqueues an expired run, fails one with attempts spent, and says so."""
    claim(store, "run-x")
    claim(store, "run-y", max_attempts=1)
    claim(store, "run-live")
    assert store.expire("run-x") and store.expire("run-y")
    out = cli.ok("sweep")
    assert "re-enqueued (retrying): 1" in out and "  run-x" in out
    assert "failed (lease expired, attempts spent, or undeliverable): 1" in out and "  run-y" in out
    assert "run-live" not in out
    statuses = {r: store.get(r).status for r in ("run-x", "run-y", "run-live")}  # type: ignore[union-attr]
    assert statuses == {"run-x": "retrying", "run-y": "failed", "run-live": "running"}
    assert any(cli.broker.glob("*.msg")), "the re-enqueued message is on the broker"
    assert f"nothing to sweep on {safe_url(cli.db_url)}" in cli.ok("sweep")
    assert json.loads(cli.ok("sweep", "--json"))["requeued"] == []


def test_sweep_that_could_not_do_every_step_exits_1(cli: Cli, store: LeaseStore) -> None:
    """A sweep whose own record fails (its table dropped) still recovers the runs, says
    which step failed, and exits 1 as the operations page promises (it said "nothing to
    sweep" and exited 0); the hint to migrate names a missing table only."""
    claim(store, "run-x")
    assert store.expire("run-x")
    with store.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {SWEEPS_TABLE_NAME}"))
    proc = cli("sweep")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "re-enqueued (retrying): 1" in proc.stdout and "  run-x" in proc.stdout
    assert (
        "step failed: sweep record: LeaseDatabaseError: lease_db_error:missing_table" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    data = json.loads(cli("sweep", "--json").stdout)
    assert [step.split(":")[0] for step in data["steps_failed"]] == ["sweep record"]


def test_stats_counts_and_honest_gaps(cli: Cli, store: LeaseStore) -> None:
    """`lease stats` counts statuses and leases, and says lease losses at workers aren't stored."""
    claim(store, "run-1")
    claim(store, "run-2")
    claim(store, "run-3", max_attempts=1)
    store.expire("run-2")
    store.expire("run-3")
    cli.ok("sweep")  # run-3 ends failed with failure_code lease_expired
    claim(store, "run-4")
    store.expire("run-4")
    data = json.loads(cli.ok("stats", "--json"))
    assert data["counts"]["running"] == 2 and data["counts"]["failed"] == 1
    assert data["counts"]["retrying"] == 1 and data["total"] == 4
    assert data["live_leases"] == 1 and data["expired_leases"] == 1
    assert data["oldest_running"]["id"] in ("run-1", "run-4")
    assert data["lease_expired_last_hour"] == 2  # run-2 (requeued) and run-3 (failed)
    assert data["lease_lost_at_workers"] is None and "not counted" in data["note"]
    text = cli.ok("stats")
    assert "live leases" in text and "oldest running" in text and "not recorded" in text


def test_stats_show_who_sweeps_and_which_beat_leads(cli: Cli, store: LeaseStore) -> None:
    """`lease stats` names the worker leading the in-worker sweeper (and each beat's leader
    lease), or says no worker has led it."""
    assert "no worker has led it" in cli.ok("stats")
    assert store.leaders.create("sweeper", "w1@host-a:4242:token.worker", 60_000)
    assert store.leaders.create("beat:proj", "host-b:77:token", 60_000)
    text = cli.ok("stats")
    assert re.search(r"sweeper\s+w1@host-a:4242 since .* ago \(term 1\), renewed", text), text
    assert re.search(r"beat:proj\s+host-b:77 since", text), text
    data = json.loads(cli.ok("stats", "--json"))
    assert [(lead["name"], lead["live"]) for lead in data["leaders"]] == [
        ("beat:proj", True),
        ("sweeper", True),
    ]


def test_unreachable_database_is_one_line_without_password(cli: Cli) -> None:
    """A database nobody listens on: one line, exit 1, no traceback, password hidden."""
    for command in (("runs",), ("show", "x"), ("stats",), ("migrate",)):
        proc = cli(*command, CL_LEASE_DB="postgresql+psycopg://ops:hunter2@127.0.0.1:1/leases")
        line = assert_one_line_error(proc, "ops:***@127.0.0.1:1")
        assert "hunter2" not in proc.stderr + proc.stdout, line


def test_a_missing_database_driver_is_one_line_naming_the_extra(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A PostgreSQL URL without psycopg installed: each command says which extra to install,
    in one line, as the worker does (they printed a 50-line ModuleNotFoundError traceback)."""
    cli = Cli(sqlite_url, tmp_path)
    shims = f"{REPO / 'tests' / 'shims'}{os.pathsep}{REPO}"
    url = "postgresql+psycopg://ops:hunter2@127.0.0.1:1/leases"
    for command in (("migrate",), ("runs",), ("show", "x"), ("sweep",)):
        proc = cli(*command, CL_LEASE_DB=url, CL_SHIM_HIDE_MODULE="psycopg", PYTHONPATH=shims)
        line = assert_one_line_error(proc, "pip install 'celery-lease[postgres]'", "psycopg")
        assert "ops:***@127.0.0.1:1" in line and "hunter2" not in line


def test_a_misspelled_setting_is_refused_in_one_line(sqlite_url: str, tmp_path: Path) -> None:
    """`lease_secnds` in the app's configuration: every command refuses it in one line, as
    the worker does (migrate ran with the default lease and exited 0)."""
    cli = Cli(sqlite_url, tmp_path)
    cli.env["CL_CONF"] = '{"lease_secnds": 3}'
    for command in (("migrate",), ("runs",)):
        assert_one_line_error(
            cli(*command), "unknown setting lease_secnds; did you mean lease_seconds?"
        )


def test_invalid_url_and_unknown_backend_are_one_line(cli: Cli) -> None:
    """A malformed URL or an unsupported database is rejected in one line naming the key."""
    assert_one_line_error(cli("runs", CL_LEASE_DB="not a url"), "lease_database_url")
    proc = cli("--database-url", "oracle://u:pw@h/db", "stats")
    assert_one_line_error(proc, "lease_database_url", "oracle")


def test_missing_sqlite_file_or_table_is_reported(cli: Cli, tmp_path: Path) -> None:
    """A missing SQLite file is not created by a read; a database without the table says migrate."""
    missing = tmp_path / "nowhere.sqlite3"
    assert_one_line_error(cli("runs", CL_LEASE_DB=f"sqlite:///{missing}"), "does not exist")
    assert not missing.exists()
    engine = create_engine(cli.db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE app_table (x INTEGER)"))
    engine.dispose()
    assert_one_line_error(
        cli("runs"), "has no celery_lease_runs table", "`celery -A tests.cli_app lease migrate`"
    )
    line = assert_one_line_error(cli("--database-url", cli.db_url, "runs"))
    assert "`celery -A tests.cli_app lease --database-url " in line and "migrate`" in line
    # migrate says what the worker says of a SQLite file in a missing directory (it said
    # "lease_db_unavailable: ... unable to open database file").
    nowhere = tmp_path / "no-such-dir" / "l.sqlite3"
    assert_one_line_error(
        cli("migrate", CL_LEASE_DB=f"sqlite:///{nowhere}"),
        f"directory {nowhere.parent} does not exist",
    )


def test_an_earlier_versions_runs_table_is_reported_with_migrate(
    cli: Cli, store: LeaseStore
) -> None:
    """The package upgraded, `lease migrate` not run: the commands name the missing column
    and the migrate command in one line (they printed the driver's error for each read)."""
    with store.engine.begin() as conn:
        conn.execute(text("ALTER TABLE celery_lease_runs DROP COLUMN payload_retries"))
    assert_one_line_error(
        cli("runs"),
        "holds an older celery-lease schema",
        "column celery_lease_runs.payload_retries",
        "`celery -A tests.cli_app lease migrate`",
    )


def test_password_in_url_is_never_printed(cli: Cli, db_url: str) -> None:
    """With a password in the URL, migrate and stats print it masked."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        pytest.skip("SQLite URLs carry no password")
    if url.get_backend_name() == "mysql":
        # MySQL checks passwords (the test PostgreSQL trusts loopback): make a user.
        engine = create_engine(db_url)
        with engine.begin() as conn:
            for host in ("%", "localhost"):  # MariaDB matches loopback as localhost
                conn.execute(
                    text(f"CREATE USER IF NOT EXISTS 'cl_pw'@'{host}' IDENTIFIED BY 's3cr3t-pw'")
                )
                conn.execute(text(f"GRANT ALL ON `{url.database}`.* TO 'cl_pw'@'{host}'"))
        engine.dispose()
        url = url.set(username="cl_pw")
    with_password = url.set(password="s3cr3t-pw").render_as_string(hide_password=False)
    for command in (("migrate",), ("stats",)):
        proc = cli(*command, CL_LEASE_DB=with_password)
        assert proc.returncode == 0, proc.stderr
        assert "s3cr3t-pw" not in proc.stdout + proc.stderr
    assert "***" in cli("stats", CL_LEASE_DB=with_password).stdout


def test_sweep_and_stats_cover_every_lease_database(cli: Cli, store: LeaseStore) -> None:
    """A task with its own lease_database_url: `lease sweep` sweeps that database too and
    `lease stats` lists both, each with its last sweep; URLs are shown masked."""
    task_db = f"sqlite:///{cli.cwd / 'task-leases.sqlite3'}"
    cli.env["CL_TASK_DB"] = task_db
    upgrade(task_db)
    task_store = LeaseStore.from_url(task_db)
    try:
        claim(task_store, "own-1", task="cli_app.own_db")
        assert task_store.expire("own-1")
        out = cli.ok("sweep")
        assert f"lease database {task_db}" in out and "  own-1" in out
        assert task_store.get("own-1").status == "retrying"  # type: ignore[union-attr]
        data = json.loads(cli.ok("stats", "--json"))
        assert [each["database"] for each in data["databases"]][1:] == [task_db]
        for each in data["databases"]:
            assert each["last_sweep"]["name"] == "cli" and each["last_sweep"]["age_ms"] >= 0
        assert data["databases"][1]["counts"]["retrying"] == 1
        assert "last sweep" in cli.ok("stats")
    finally:
        task_store.dispose()


def _ended_rows(store: LeaseStore, rows: list[dict[str, object]]) -> None:
    """Insert finished runs as they stand after their history (test setup only)."""
    from sqlalchemy import insert

    from celery_lease.schema import runs

    now = store.now_ms()
    base = {"lease_ms": 30_000, "attempt": 1, "max_attempts": 1, "available_at": now,
            "updated_at": now, "failure_code": "boom", "task_name": "cli_app.charge",
            "status": "failed", "finished_at": now, "payload": PAYLOAD,
            "payload_content_type": "application/json", "task_id": None}  # fmt: skip
    with store.engine.begin() as conn:
        conn.execute(
            insert(runs),
            [{**base, "created_at": now - i, **row} for i, row in enumerate(rows)],
        )


def _broker_messages(cli: Cli) -> int:
    """Messages the filesystem broker holds (published, not consumed)."""
    return sum(1 for p in cli.broker.iterdir() if p.is_file())


def test_bulk_rerun_with_dry_run_and_progress(cli: Cli, store: LeaseStore) -> None:
    """`lease rerun --task --status failed --since` reruns every failed run of the task that
    ended within the window (230, with progress on stderr), each published once under a
    new task id; --dry-run first says how many and which, changing nothing; runs without
    a stored message, older ones, other tasks and other statuses are left alone."""
    now = store.now_ms()
    _ended_rows(
        store,
        [{"id": f"bulk-{i:03d}", "task_id": f"old-{i}"} for i in range(230)]
        + [
            {"id": "bare", "payload": None, "payload_content_type": None},
            {"id": "old", "finished_at": now - 3 * 3_600_000},
            {"id": "cancelled", "status": "cancelled"},
            {"id": "other", "task_name": "cli_app.other"},
        ],
    )
    dry = cli.ok("rerun", "--task", "cli_app.charge", "--status", "failed", "--since", "1h",
                 "--dry-run")  # fmt: skip
    assert dry.startswith(
        "dry run: 231 failed runs of cli_app.charge that ended in the last 1h00m match; "
        "230 keep a stored message and would be rerun, 1 has none and would be left alone "
        "(newest first: bulk-000, bulk-001,"
    ), dry
    assert store.get("bulk-000").status == "failed"  # type: ignore[union-attr]
    assert _broker_messages(cli) == 0
    proc = cli("rerun", "--task", "cli_app.charge", "--status", "failed", "--since", "1h")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "230 failed runs of cli_app.charge that ended in the last 1h00m queued again with "
        "fresh attempts"
    ), proc.stdout
    assert "1 left alone" in proc.stdout
    progress = [line for line in proc.stderr.splitlines() if line.startswith("rerun: ")]
    assert progress == [
        f"rerun: {n} of 231 failed runs of cli_app.charge handled" for n in (100, 200, 231)
    ], proc.stderr
    for i in (0, 117, 229):
        row = store.get(f"bulk-{i:03d}")
        assert row is not None and row.status == "queued" and row.task_id != f"old-{i}"
    assert _broker_messages(cli) == 230
    for left in ("bare", "old", "other"):
        assert store.get(left).status == "failed"  # type: ignore[union-attr]
    assert store.get("cancelled").status == "cancelled"  # type: ignore[union-attr]
    again = cli.ok("rerun", "--task", "cli_app.charge", "--status", "cancelled")
    assert again.startswith("1 cancelled run of cli_app.charge queued again"), again
    none = cli.ok("rerun", "--task", "cli_app.charge", "--status", "cancelled", "--dry-run")
    assert none == "dry run: no cancelled runs of cli_app.charge: nothing to rerun\n"
    # A task name the app does not know: said so, a typo is likely (it said only "nothing").
    typo = cli.ok("rerun", "--task", "cli_app.chrage", "--status", "failed", "--dry-run")
    assert typo == (
        "dry run: no failed runs of cli_app.chrage (no task named 'cli_app.chrage' is "
        "registered in this app: a typo?): nothing to rerun\n"
    ), typo


def test_bulk_rerun_refuses_bad_input_with_one_line(cli: Cli, store: LeaseStore) -> None:
    """Usage errors exit 2 with what is wrong: no status, a RUN_ID with --task, a status
    other than cancelled or failed, a duration that is not one, one-run options."""
    for args, needle in [
        (("rerun",), "give a RUN_ID, or --task NAME --status cancelled|failed"),
        (("rerun", "--task", "cli_app.charge"), "needs --status cancelled or --status failed"),
        (("rerun", "--status", "failed"), "a bulk rerun needs --task NAME"),
        (("rerun", "r1", "--task", "t", "--status", "failed"), "not both"),
        (("rerun", "--task", "t", "--status", "succeeded"), "'succeeded' is not one of"),
        (("rerun", "--task", "t", "--status", "failed", "--since", "soon"), "not a duration"),
        (("rerun", "--task", "t", "--status", "failed", "--since", "0"), "more than zero"),
        (("rerun", "--task", "t", "--status", "failed", "--force"), "apply to one RUN_ID"),
    ]:
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_numbers_no_database_holds_are_usage_errors(cli: Cli, store: LeaseStore) -> None:
    """A duration past 100 years, a --limit past a million, --attempts past the setting's
    maximum, an interval of nan: exit 2 naming the option (a traceback, a database error
    with exit 1, or for nan a busy loop of frames)."""
    huge = "99999999999999999999"
    for args, needle in [
        (("purge", "--older-than", f"{huge}d"), "at most 100 years"),
        (("rerun", "--task", "t", "--status", "failed", "--since", f"{huge}d"), "100 years"),
        (("runs", "--limit", huge), "--limit"),
        (("sweep", "--limit", huge), "--limit"),
        (("top", "--once", "--limit", huge), "--limit"),
        (("top", "--once", "--interval", "nan"), "is not a number of seconds"),
        (("rerun", "r1", "--attempts", huge), "--attempts"),
    ]:
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_run_ids_with_control_characters_cannot_forge_table_rows(
    cli: Cli, store: LeaseStore
) -> None:
    """`lease runs` prints a newline (or another control character) in a run id escaped:
    it printed it as is, and a crafted id could add rows of its own to the table."""
    claim(store, "evil\nfake-row  x.y  failed")
    out = cli.ok("runs", "--wide")
    assert "evil\\nfake-row" in out, out
    assert not any(line.startswith("fake-row") for line in out.splitlines()), out


def test_rerun_says_the_attempts_the_run_will_get(cli: Cli, store: LeaseStore) -> None:
    """A run failed at attempt 1 of 5 (a permanent error), rerun with --attempts 2: the
    next claims allow attempts up to the task's lease_max_attempts (5), never fewer, and
    the command says so (it said "attempts 2..3" while attempt 3/5 then ran)."""
    attempt = claim(store, "run-p", max_attempts=5)
    store.fail(
        "run-p", "host-run-p:4242:run-psecret", attempt, error="x", failure_code="e", retry_in=None
    )
    out = cli.ok("rerun", "run-p", "--attempts", "2")
    assert "attempts 2..5" in out and "lease_max_attempts, 5" in out, out
    owner = "host-run-p:4242:run-psecret"
    for n in range(2, 6):
        assert claim(store, "run-p", max_attempts=5) == n
        retry_in = None if n == 5 else 0.0
        store.fail("run-p", owner, n, error="x", failure_code="e", retry_in=retry_in)
    out = cli.ok("rerun", "run-p", "--attempts", "2")
    assert "attempts 6..7" in out and "lease_max_attempts" not in out, out
