"""``celery lease web``: the pages, their keyset pages, the guards on writes, escaping, and
the real thing in headless Chromium (Debian's ``chromium`` + ``chromium-driver``).

Route and guard tests use Starlette's TestClient on a SQLite lease database; the keyset
walk runs on every database; the browser tests start the real ``celery -A tests.cli_app
lease web`` command and drive it with Selenium.
"""

from __future__ import annotations

import base64
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from sqlalchemy import insert

import celery_lease.web
from celery_lease.config import sqlite_url
from celery_lease.schema import runs
from celery_lease.store import LeaseStore, RunPageQuery
from celery_lease.web import create_app
from celery_lease.web.security import BindRefused, check_bind
from tests.browser import WebServer, browser
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import REPO, env_flag, plain_engine, wait_for

TOKEN = "s3cret-token-for-tests"
#: The base URL of in-process requests: a loopback Host, which the view answers by default.
LOCAL = "http://localhost"
EVIL_TASK = "shop.<script>alert('task')</script>"
EVIL_ERROR = "boom <script>alert('error')</script> password=hunter2"
SECRET_ARGS = b'{"card": "4111-SECRET-ARGS"}'


def add_run(
    engine: Any,
    run_id: str,
    *,
    status: str = "queued",
    task: str = "shop.charge",
    created_at: int = 1_000,
    **values: Any,
) -> None:
    """Insert one run row as it would stand after its history (test setup only)."""
    row = {
        "id": run_id,
        "task_name": task,
        "status": status,
        "lease_ms": 30_000,
        "attempt": 1 if status != "queued" else 0,
        "max_attempts": 3,
        "available_at": created_at,
        "created_at": created_at,
        "updated_at": created_at,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(runs).values(**row))


@pytest.fixture
def lease_db(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A SQLite lease database with its table, and a plain engine on it."""
    url = sqlite_url(tmp_path / "leases.sqlite3")
    store = LeaseStore.from_url(url)
    store.create_schema()
    store.dispose()
    engine = plain_engine(url)
    yield url, engine
    engine.dispose()


def celery_app(url: str, **conf: Any) -> Celery:
    app = Celery("web_test", set_as_current=False)
    app.conf.update(broker_url="memory://", lease_database_url=url, **conf)
    return app


def client(url: str, **kwargs: Any) -> Any:
    from starlette.testclient import TestClient

    return TestClient(create_app(celery_app(url), **kwargs), base_url=LOCAL)


def csrf_of(response: Any) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', response.text)
    assert match, response.text
    return match.group(1)


# -- keyset pages ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_keyset_pages_walk_every_run_once_newest_first(db_url: str) -> None:
    """Pages bounded by the last row shown cover every run once, newest first (ties by id),
    for each filter, on every database: no row is skipped or repeated across pages."""
    store = LeaseStore.from_url(db_url)
    store.create_schema()
    engine = plain_engine(db_url)
    statuses = ["queued", "running", "succeeded", "failed", "cancelled", "retrying"]
    expected = []
    for n in range(40):
        status, task = statuses[n % 6], f"shop.task{n % 3}"
        created = 10_000 + (n // 4) * 1000  # four runs share each created_at: ties by id
        run_id = f"{task}:order-{n:03d}"
        add_run(engine, run_id, status=status, task=task, created_at=created)
        expected.append((created, run_id, status, task))
    try:
        for status, task in [
            (None, None),
            ("failed", None),
            (None, "shop.task1"),
            ("running", "shop.task2"),
        ]:
            want = sorted(
                (e for e in expected if status in (None, e[2]) and task in (None, e[3])),
                reverse=True,
            )
            seen: list[tuple[int, str]] = []
            after: tuple[int | None, str | None] = (None, None)
            for _ in range(20):
                page = store.reads.page_runs(
                    RunPageQuery(
                        status=status,
                        task_name=task,
                        after_created=after[0],
                        after_id=after[1],
                        limit=7,
                    )
                )
                seen += [(r.created_at, r.id) for r in page]
                if len(page) < 7:
                    break
                after = (page[-1].created_at, page[-1].id)
            assert seen == [(c, i) for c, i, _, _ in want], (status, task)
        # A key prefix pages by id; LIKE's wildcards in it are taken literally.
        add_run(engine, "shop.task1:order_x", task="shop.task1")
        prefixed = store.reads.page_runs(RunPageQuery(id_prefix="shop.task1:order-01", limit=50))
        assert [r.id for r in prefixed] == [f"shop.task1:order-{n:03d}" for n in (10, 13, 16, 19)]
        first = store.reads.page_runs(RunPageQuery(id_prefix="shop.task1:", limit=5))
        rest = store.reads.page_runs(RunPageQuery(id_prefix="shop.task1:", after_id=first[-1].id))
        ids = [r.id for r in first + rest]
        assert ids == sorted(ids) and len(ids) == len(set(ids)) == 14
        assert store.reads.page_runs(RunPageQuery(id_prefix="shop.task1:order%")) == []
        # The age bound: only runs created at or after it.
        recent = store.reads.page_runs(RunPageQuery(created_since=18_000, limit=100))
        assert {r.created_at for r in recent} == {18_000, 19_000}
    finally:
        engine.dispose()
        store.dispose()


# -- pages -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pages_escape_row_values_and_never_show_payload_or_password(
    lease_db: tuple[str, Any],
) -> None:
    """A task name and an error holding ``<script>`` come out as text on every page; the
    stored arguments are shown by size only, and ``password=`` values in errors are masked."""
    url, engine = lease_db
    add_run(
        engine,
        "evil-1",
        task=EVIL_TASK,
        status="failed",
        last_error=EVIL_ERROR,
        failure_code="boom",
        payload=SECRET_ARGS,
        finished_at=LeaseStore.from_url(url).now_ms(),  # in the overview's last hour
    )
    c = client(url, token=TOKEN)
    for path in (
        "/",
        "/runs",
        "/run?id=evil-1",
        "/runs?task=" + EVIL_TASK,
        "/confirm?action=rerun&id=evil-1",
    ):
        response = c.get(path)
        assert response.status_code == 200, path
        html = response.text
        assert "<script>alert" not in html, path
        assert "hunter2" not in html and "SECRET-ARGS" not in html, path
        assert "&lt;script&gt;alert(" in html, path
        assert response.headers["content-security-policy"].startswith("default-src 'none'")
        # Only the package's own script, never inline code or another host's.
        assert re.findall(r"<script[^>]*>", html) == ['<script src="/static/app.js" defer>']
    detail = c.get("/run?id=evil-1").text
    assert f"{len(SECRET_ARGS)} bytes (contents not shown)" in detail
    api = c.get("/api/run?id=evil-1").json()
    assert "SECRET-ARGS" not in str(api) and "hunter2" not in str(api)
    assert c.get("/api/runs").json()["rows"][0]["task"] == EVIL_TASK  # JSON: data, as text


@pytest.mark.timeout(60)
def test_database_password_never_shown(tmp_path: Path) -> None:
    """An unreachable server is a 503 page naming the database with its password masked."""
    url = "postgresql+psycopg://ops:hunter2@127.0.0.1:1/leases"
    c = client(url)
    for path in ("/", "/runs", "/api/runs"):
        response = c.get(path)
        assert response.status_code == 503, path
        assert "hunter2" not in response.text and "***" in response.text, path


@pytest.mark.timeout(60)
def test_runs_page_filters_and_links_the_next_page(lease_db: tuple[str, Any]) -> None:
    """Filters narrow the list; ``older`` links the page after the last row (keyset);
    a bad filter is a 400 with the reason."""
    url, engine = lease_db
    for n in range(60):
        add_run(
            engine,
            f"shop.charge:{n:03d}",
            status="succeeded" if n % 2 else "failed",
            created_at=1_000 + n,
        )
    add_run(engine, "shop.refund:1", task="shop.refund", created_at=5_000)
    c = client(url)
    page = c.get("/api/runs").json()
    assert len(page["rows"]) == 50 and page["rows"][0]["id"] == "shop.refund:1"
    assert page["next"] == "after_id=shop.charge%3A011&after_created=1011"
    older = c.get("/api/runs?" + page["next"]).json()
    assert [r["id"] for r in older["rows"]] == [f"shop.charge:{n:03d}" for n in range(10, -1, -1)]
    assert older["next"] is None
    failed = c.get("/api/runs?status=failed&key=shop.charge:01").json()["rows"]
    assert [r["id"] for r in failed] == [f"shop.charge:{n:03d}" for n in (10, 12, 14, 16, 18)]
    assert [r["id"] for r in c.get("/api/runs?task=shop.refund").json()["rows"]] == [
        "shop.refund:1"
    ]
    html = c.get("/runs?task=shop.charge").text
    assert 'href="/runs?task=shop.charge&amp;after_id=shop.charge%3A010&amp;after_created=' in html
    bad = c.get("/runs?status=exploded")
    assert bad.status_code == 400 and "status must be one of" in bad.text
    assert c.get("/api/runs?age=3y").status_code == 400


@pytest.mark.timeout(60)
def test_overview_counts(db_url: str) -> None:
    """Counts per status and per task (live, and ended in the last hour), the oldest running
    lease, and the runs taken over, re-published by the sweeper and ended after an expired
    lease in the last hour, from the history columns (a run re-claimed and finished since
    still counts; an older takeover does not); on every database."""
    url = db_url
    store = LeaseStore.from_url(url)
    store.create_schema()
    engine = plain_engine(url)
    now = store.now_ms()
    add_run(
        engine,
        "a",
        status="running",
        task="shop.charge",
        created_at=now - 5000,
        started_at=now - 5000,
        lease_owner="w1@host:1:x",
        lease_expires_at=now + 30_000,
        takeovers=1,
        taken_over_at=now - 2000,  # taken over, running again
    )
    add_run(
        engine,
        "b",
        status="running",
        task="shop.charge",
        created_at=now - 1000,
        started_at=now - 1000,
        lease_owner="w2@host:2:y",
        lease_expires_at=now + 30_000,
    )
    add_run(
        engine,
        "c",
        status="retrying",
        task="shop.refund",
        failure_code="lease_expired",
        updated_at=now - 1000,
        created_at=now - 9000,
        republishes=1,
        republished_at=now - 1000,  # swept, waiting for its next claim
        takeovers=3,
        taken_over_at=now - 7_200_000,  # two hours ago: not in the window
    )
    add_run(
        engine,
        "x",
        status="running",
        task="shop.charge",
        started_at=now - 500,
        lease_owner="w3@host:3:z",
        lease_expires_at=now - 100,  # expired: awaiting takeover
    )
    for run_id, ended in (("d", now - 1000), ("e", now - 7_200_000)):  # an end sets both
        add_run(
            engine,
            run_id,
            status="succeeded",
            task="shop.refund",
            finished_at=ended,
            lease_expires_at=ended,
            # Swept, then claimed and finished: no claim resets the history.
            republishes=2,
            republished_at=ended - 500,
        )
    add_run(
        engine,
        "f",
        status="failed",
        task="shop.charge",
        failure_code="lease_expired",
        finished_at=now - 300,
        lease_expires_at=now - 300,
    )
    data = client(url).get("/api/overview").json()
    # Live runs, and the runs that ended in the last hour: "e" ended two hours ago.
    assert {s["status"]: s["count"] for s in data["statuses"]} == {
        "queued": 0,
        "running": 3,
        "retrying": 1,
        "succeeded": 1,
        "failed": 1,
        "cancelled": 0,
    }
    assert data["tasks"] == [
        {
            "task": "shop.charge",
            "live": [0, 3, 0],
            "ended": [0, 1, 0],
            "taken_over": 1,
            "republished": 0,
        },
        {
            "task": "shop.refund",
            "live": [0, 0, 1],
            "ended": [1, 0, 0],
            "taken_over": 0,
            "republished": 2,
        },
    ]
    recovery = {c["name"]: c["count"] for c in data["recovery"]}
    assert recovery == {"taken_over": 1, "republished": 2, "ended_expired": 1}
    assert data["oldest"]["id"] == "a"
    # Its time is since the run's first claim, and says so (not "running for").
    page = client(url).get("/").text
    assert "first claimed " in page and "running for" not in page
    # A task's page counts the same, for that task alone.
    for task, statuses, counted in (
        ("shop.charge", {"running": 3, "failed": 1}, (1, 0, 1)),
        ("shop.refund", {"retrying": 1, "succeeded": 1}, (0, 2, 0)),
    ):
        page = client(url).get(f"/api/task?name={task}").json()
        assert {s["status"]: s["count"] for s in page["statuses"] if s["count"]} == statuses
        assert tuple(c["count"] for c in page["recovery"]) == counted
        assert page["expired_leases"] == (1 if task == "shop.charge" else 0)
    assert (data["live_leases"], data["expired_leases"]) == (2, 1)
    assert data["sweeper"] == "no worker has led it" and data["beats"] == "-"
    assert store.leaders.create("sweeper", "w1@host:1:token.worker", 60_000)
    data = client(url).get("/api/overview").json()
    assert data["sweeper"].startswith("w1@host:1 since ")
    store.dispose()
    engine.dispose()


@pytest.mark.timeout(60)
def test_mounted_under_a_prefix(lease_db: tuple[str, Any]) -> None:
    """Mounted at /lease in another ASGI app (Starlette's Mount, as FastAPI's mount and the
    Django recipe use): links, assets, the form and the CSRF cookie all stay under it."""
    from starlette.routing import Mount, Router
    from starlette.testclient import TestClient

    url, engine = lease_db
    add_run(engine, "r1")
    view = create_app(celery_app(url), token=TOKEN)
    c = TestClient(Router(routes=[Mount("/lease", app=view)]), base_url=LOCAL)
    page = c.get("/lease/runs")
    assert page.status_code == 200
    assert 'href="/lease/run?id=r1"' in page.text and 'src="/lease/static/app.js"' in page.text
    assert "Path=/lease" in page.headers["set-cookie"]
    assert c.get("/lease/static/app.js").status_code == 200
    confirm = c.get("/lease/confirm?action=cancel&id=r1")
    assert 'action="/lease/action"' in confirm.text
    done = c.post(
        "/lease/action",
        data={"csrf": csrf_of(confirm), "action": "cancel", "id": "r1", "token": TOKEN},
    )
    assert done.status_code == 200 and "run r1 is cancelled" in done.text


# -- writes ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_read_only_without_a_token(lease_db: tuple[str, Any]) -> None:
    """Without a write token no action is offered and every write is refused."""
    url, engine = lease_db
    add_run(engine, "r1")
    c = client(url)
    page = c.get("/run?id=r1")
    assert "/confirm?" not in page.text and "read-only" in page.text
    assert c.get("/confirm?action=cancel&id=r1").status_code == 403
    csrf = page.cookies.get("celery_lease_csrf") or c.cookies.get("celery_lease_csrf")
    refused = c.post("/action", data={"csrf": csrf, "action": "cancel", "id": "r1", "token": TOKEN})
    assert refused.status_code == 403 and "read-only" in refused.text
    # A script's bearer token is told the view is read-only (it was told "CSRF check failed").
    scripted = client(url).post(
        "/action",
        data={"action": "cancel", "id": "r1"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert scripted.status_code == 403 and "read-only" in scripted.text, scripted.text
    assert LeaseStore.from_url(url).get("r1").status == "queued"  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_writes_need_the_csrf_value_and_the_token(lease_db: tuple[str, Any]) -> None:
    """A cancel is refused without the CSRF value, with another one, from another origin,
    without the token or with a wrong one; with both it cancels and says so."""
    url, engine = lease_db
    add_run(engine, "r1")
    store = LeaseStore.from_url(url)
    c = client(url, token=TOKEN)
    confirm = c.get("/confirm?action=cancel&id=r1")
    assert confirm.status_code == 200 and "Cancel run" in confirm.text
    csrf = csrf_of(confirm)
    form = {"action": "cancel", "id": "r1", "token": TOKEN}
    for data, headers, reason in [
        (form, {}, "CSRF check failed"),
        ({**form, "csrf": "forged"}, {}, "CSRF check failed"),
        ({**form, "csrf": csrf}, {"origin": "http://evil.example"}, "cross-origin"),
        ({**form, "csrf": csrf, "token": ""}, {}, "wrong or missing write token"),
        ({**form, "csrf": csrf, "token": TOKEN + "x"}, {}, "wrong or missing write token"),
    ]:
        refused = c.post("/action", data=data, headers=headers)
        assert refused.status_code == 403 and reason in refused.text, (data, headers)
        assert store.get("r1").status == "queued"  # type: ignore[union-attr]
    done = c.post("/action", data={**form, "csrf": csrf})
    assert done.status_code == 200 and "run r1 is cancelled" in done.text
    assert store.get("r1").status == "cancelled"  # type: ignore[union-attr]
    add_run(engine, "ended", status="succeeded", finished_at=2_000)
    ended = c.post("/action", data={**form, "id": "ended", "csrf": csrf})
    assert ended.status_code == 409 and "already succeeded: nothing to cancel" in ended.text
    # A script may send the token as a bearer header instead of the form field.
    add_run(engine, "r2")
    bearer = c.post(
        "/action",
        data={"csrf": csrf, "action": "cancel", "id": "r2"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert bearer.status_code == 200
    # A script with only the bearer header (no page fetched, no cookie, no CSRF value)
    # is let through; Basic auth, which a browser replays by itself, still needs the CSRF
    # value, and a wrong bearer token is refused.
    add_run(engine, "r3")
    script = client(url, token=TOKEN)
    basic = base64.b64encode(f"x:{TOKEN}".encode()).decode()
    for headers, reason in [
        ({"authorization": f"Basic {basic}"}, "CSRF check failed"),
        ({"authorization": f"Bearer {TOKEN}x"}, "wrong or missing write token"),
        ({"authorization": f"Bearer {TOKEN}", "origin": "http://evil.example"}, "cross-origin"),
    ]:
        refused = script.post("/action", data={"action": "cancel", "id": "r3"}, headers=headers)
        assert refused.status_code == 403 and reason in refused.text, headers
    assert store.get("r3").status == "queued"  # type: ignore[union-attr]
    scripted = script.post(
        "/action",
        data={"action": "cancel", "id": "r3"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert scripted.status_code == 200 and "run r3 is cancelled" in scripted.text
    store.dispose()


@pytest.mark.timeout(60)
def test_rerun_from_the_web_is_the_cli_rerun(lease_db: tuple[str, Any]) -> None:
    """Rerun puts a failed run back to queued with fresh attempts, as ``lease rerun`` does
    (one shared function), and refuses a live run with the CLI's sentence."""
    url, engine = lease_db
    add_run(engine, "f1", status="failed", attempt=3, failure_code="boom", finished_at=2_000)
    add_run(engine, "live", status="queued")
    c = client(url, token=TOKEN)
    csrf = csrf_of(c.get("/confirm?action=rerun&id=f1"))
    done = c.post("/action", data={"csrf": csrf, "action": "rerun", "id": "f1", "token": TOKEN})
    assert done.status_code == 200, done.text
    assert "run f1 is queued again (attempts 4..8)" in done.text
    refused = c.post(
        "/action", data={"csrf": csrf, "action": "rerun", "id": "live", "token": TOKEN}
    )
    assert refused.status_code == 409 and "it is live, nothing to rerun" in refused.text


@pytest.mark.timeout(60)
def test_pause_and_resume_a_runs_task_from_the_web(lease_db: tuple[str, Any]) -> None:
    """Pause task / Resume task on a run's page pause its task on every worker (the
    same celery_lease.pause/resume as the CLI) and say what they did."""
    from celery_lease.store import LeaseStore

    url, engine = lease_db
    add_run(engine, "r1", status="running")
    c = client(url, token=TOKEN)
    page = c.get("/run?id=r1")
    assert "Pause task" in page.text and "Resume task" in page.text
    csrf = csrf_of(c.get("/confirm?action=pause&id=r1"))
    done = c.post("/action", data={"csrf": csrf, "action": "pause", "id": "r1", "token": TOKEN})
    assert done.status_code == 200, done.text
    store = LeaseStore.from_url(url)
    try:
        paused = store.flow.list_pauses()
        assert [(p.task_name, p.key) for p in paused] == [("shop.charge", "")]
        assert paused[0].reason == "paused from the web view"
        again = c.post(
            "/action", data={"csrf": csrf, "action": "resume", "id": "r1", "token": TOKEN}
        )
        assert again.status_code == 200 and "resumed shop.charge: 0 held deliveries" in again.text
        assert store.flow.list_pauses() == []
        # Resuming what is not paused says so (it used to read "resumed ...: 0 held").
        twice = c.post(
            "/action", data={"csrf": csrf, "action": "resume", "id": "r1", "token": TOKEN}
        )
        assert twice.status_code == 200 and "shop.charge was not paused" in twice.text
    finally:
        store.dispose()


PAYLOAD = b'{"args": [7], "kwargs": {}, "options": {}}'


def flow_app(url: str) -> Celery:
    """An app with a paused-able task and a rate-limited one (per rate key)."""
    from celery_lease import LeasedTask

    app = celery_app(url)

    @app.task(base=LeasedTask, bind=True, name="shop.call_partner")
    def call_partner(self: Any, order: int) -> int:
        return order

    @app.task(
        base=LeasedTask,
        bind=True,
        name="shop.sync",
        lease_rate_limit="2/s",
        lease_rate_key=lambda account: f"acct-{account}",
    )
    def sync(self: Any, account: int) -> int:
        return account

    return app


def flow_client(app: Celery, **kwargs: Any) -> Any:
    from starlette.testclient import TestClient

    return TestClient(create_app(app, **kwargs), base_url=LOCAL)


def hold(store: LeaseStore, reason: str, task: str, n: int, key: str = "", **kw: Any) -> None:
    """Hold ``n`` deliveries of ``task`` as flow control does (test setup)."""
    for i in range(n):
        kept = store.flow.hold(
            reason,
            task_name=task,
            flow_key=key,
            run_id=f"{task}-{key}-{i}",
            task_id=f"{task}-{key}-{i}",
            payload=PAYLOAD,
            payload_content_type="application/json",
            **kw,
        )
        assert kept


@pytest.mark.timeout(60)
def test_front_page_shows_paused_and_rate_limited_work(lease_db: tuple[str, Any]) -> None:
    """The overview lists each pause (task, key, reason, since, deliveries held) and each
    rate-limited task's buckets (limit, deliveries waiting, next slot), in the page and in
    its JSON; nothing paused or limited says so."""
    url, _ = lease_db
    store = LeaseStore.from_url(url)
    app = flow_app(url)
    c = flow_client(app)
    html = c.get("/").text
    assert "nothing is paused" in html
    try:
        store.flow.pause("shop.call_partner", reason="partner 503s INC-44")
        store.flow.pause("shop.sync", key="acct-9")
        hold(store, "paused", "shop.call_partner", 3)
        # Four slots taken at once on acct-1's bucket (2/s): the next is ~2 s off.
        for _ in range(4):
            store.flow.reserve_rate("shop.sync", "acct-1", 500, 1)
        hold(store, "rate", "shop.sync", 2, key="acct-1", available_at=store.now_ms() + 1500)
        data = c.get("/api/overview").json()
        assert data["paused"] == [
            {
                "task": "shop.call_partner",
                "key": "(every key)",
                "reason": "partner 503s INC-44",
                "since": data["paused"][0]["since"],
                "held": "3",
            },
            {
                "task": "shop.sync",
                "key": "acct-9",
                "reason": "-",
                "since": data["paused"][1]["since"],
                "held": "0",
            },
        ]
        assert data["paused"][0]["since"].endswith(" ago")
        # (Tasks other test modules define with @app.task are shared with every app.)
        [rate] = [r for r in data["rate_limited"] if r["task"] == "shop.sync"]
        assert (rate["task"], rate["key"], rate["limit"], rate["waiting"]) == (
            "shop.sync",
            "acct-1",
            "2/s, per rate key",
            "2",
        )
        assert rate["next_slot"].startswith("in ")
        html = c.get("/").text
        for text in ("partner 503s INC-44", "shop.call_partner", "2/s, per rate key"):
            assert text in html
        assert 'href="/task?name=shop.call_partner"' in html
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_task_page_counts_pause_state_and_pause_resume(lease_db: tuple[str, Any]) -> None:
    """A task's page shows its runs per status, its pause and held deliveries; Pause (with a
    reason, cancelling its running runs) and Resume go through the confirmation with the
    token and the CSRF value, and say what they did."""
    url, engine = lease_db
    store = LeaseStore.from_url(url)
    app = flow_app(url)
    now = store.now_ms()
    task = "shop.call_partner"
    for i in range(2):
        store.claim(f"run-{i}", f"w{i}@h:1:x", task_name=task, lease_ms=30_000, max_attempts=3)
    add_run(engine, "done", task=task, status="succeeded", finished_at=now, lease_expires_at=now)
    add_run(engine, "other", task="shop.other", status="running", lease_expires_at=now + 30_000)
    c = flow_client(app, token=TOKEN)
    try:
        data = c.get(f"/api/task?name={task}").json()
        counts = {s["status"]: s["count"] for s in data["statuses"]}
        assert (counts["running"], counts["succeeded"], counts["queued"]) == (2, 1, 0)
        assert data["state"] == "not paused" and data["held"] == 0
        assert [a["name"] for a in data["actions"]] == ["pause-task"]
        page = c.get(f"/task?name={task}").text
        assert f'href="/confirm?action=pause-task&amp;task={task}"' in page
        confirm = c.get(f"/confirm?action=pause-task&task={task}")
        assert confirm.status_code == 200 and "Yes, pause the task" in confirm.text
        assert "pause task it" not in confirm.text.lower()
        form = {
            "csrf": csrf_of(confirm),
            "action": "pause-task",
            "task": task,
            "reason": "partner 503s INC-44",
            "cancel_running": "yes",
        }
        refused = c.post("/action", data=form)
        assert refused.status_code == 403 and "wrong or missing write token" in refused.text
        assert store.flow.list_pauses() == []
        done = c.post("/action", data={**form, "token": TOKEN})
        assert done.status_code == 200, done.text
        assert "cancel requested for 2 running runs" in done.text
        assert 'href="/task?name=shop.call_partner">back to the task' in done.text
        [pause] = store.flow.list_pauses()
        assert (pause.task_name, pause.reason) == (task, "partner 503s INC-44")
        assert store.get("run-0").cancel_requested_at is not None  # type: ignore[union-attr]
        assert store.get("other").cancel_requested_at is None  # type: ignore[union-attr]
        hold(store, "paused", task, 2)
        data = c.get(f"/api/task?name={task}").json()
        assert data["state"].startswith("paused since ") and "INC-44" in data["state"]
        assert data["held"] == 2 and [a["name"] for a in data["actions"]] == ["resume-task"]
        confirm = c.get(f"/confirm?action=resume-task&task={task}")
        assert "Yes, resume the task" in confirm.text and "2 deliveries held" in confirm.text
        resumed = c.post(
            "/action",
            data={"csrf": csrf_of(confirm), "action": "resume-task", "task": task, "token": TOKEN},
        )
        assert resumed.status_code == 200, resumed.text
        assert "resumed shop.call_partner: 2 held deliveries published" in resumed.text
        assert store.flow.list_pauses() == []
        assert c.get("/api/task?name=").status_code == 400
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_bulk_rerun_from_a_filtered_list(lease_db: tuple[str, Any]) -> None:
    """A runs list filtered by task and status failed (or cancelled) offers "Rerun these";
    its confirmation counts the runs (and those without a stored message); confirmed with
    the token, the listed runs go back to queued under new task ids; others stay."""
    url, engine = lease_db
    store = LeaseStore.from_url(url)
    task = "shop.call_partner"
    for i in range(3):
        add_run(
            engine,
            f"f{i}",
            task=task,
            status="failed",
            attempt=2,
            max_attempts=2,
            failure_code="boom",
            finished_at=2_000 + i,
            created_at=2_000 + i,
            payload=PAYLOAD,
            payload_content_type="application/json",
            task_id=f"t{i}",
        )
    add_run(engine, "bare", task=task, status="failed", finished_at=3_000, created_at=3_000)
    add_run(engine, "c1", task=task, status="cancelled", finished_at=3_000, payload=PAYLOAD,
            payload_content_type="application/json")  # fmt: skip
    add_run(engine, "o1", task="shop.other", status="failed", finished_at=3_000,
            payload=PAYLOAD, payload_content_type="application/json")  # fmt: skip
    c = flow_client(flow_app(url), token=TOKEN)
    try:
        assert "Rerun these" not in c.get(f"/runs?task={task}").text
        assert "Rerun these" not in c.get("/runs?status=failed").text
        page = c.get(f"/runs?task={task}&status=failed").text
        assert 'href="/confirm?action=rerun-runs&amp;status=failed&amp;task=' in page
        confirm = c.get(f"/confirm?action=rerun-runs&task={task}&status=failed")
        assert confirm.status_code == 200, confirm.text
        assert "4 failed runs of shop.call_partner match; 3 keep a stored message" in confirm.text
        assert "1 has none and would be left alone" in confirm.text
        assert "Yes, rerun 3 runs" in confirm.text
        assert store.get("f0").status == "failed"  # type: ignore[union-attr]  # dry
        form = {"csrf": csrf_of(confirm), "action": "rerun-runs", "task": task,
                "status": "failed"}  # fmt: skip
        assert c.post("/action", data=form).status_code == 403  # no token
        done = c.post("/action", data={**form, "token": TOKEN})
        assert done.status_code == 200, done.text
        assert "3 failed runs of shop.call_partner queued again" in done.text
        assert "1 left alone" in done.text
        for i in range(3):
            row = store.get(f"f{i}")
            assert row is not None and row.status == "queued" and row.max_attempts == 7
            assert row.task_id not in (None, f"t{i}")
        assert store.get("bare").status == "failed"  # type: ignore[union-attr]
        assert store.get("c1").status == "cancelled"  # type: ignore[union-attr]
        assert store.get("o1").status == "failed"  # type: ignore[union-attr]
        again = c.get(f"/confirm?action=rerun-runs&task={task}&status=failed")
        assert "1 failed run of shop.call_partner matches; 0 keep a stored" in again.text
        assert c.get("/confirm?action=rerun-runs&status=failed").status_code == 400
    finally:
        store.dispose()


@pytest.mark.timeout(60)
def test_a_finished_run_shows_its_outcome_not_mid_way_progress(
    lease_db: tuple[str, Any],
) -> None:
    """A succeeded run whose body last reported 37/50 shows "succeeded" as its progress, a
    failed one where it stopped; a running one its progress (list and detail)."""
    url, engine = lease_db
    now = LeaseStore.from_url(url).now_ms()
    common = {"progress_done": 37.0, "progress_total": 50.0, "finished_at": now}
    add_run(engine, "ok", status="succeeded", **common)
    add_run(engine, "bad", status="failed", **common)
    add_run(engine, "live", status="running", progress_done=37.0, progress_total=50.0,
            lease_expires_at=now + 30_000)  # fmt: skip
    c = client(url)
    rows = {r["id"]: r["progress"] for r in c.get("/api/runs").json()["rows"]}
    assert rows == {"ok": "succeeded", "bad": "failed at 37/50 (74%)", "live": "37/50 (74%)"}
    fields = {f["name"]: f["text"] for f in c.get("/api/run?id=ok").json()["fields"]}
    assert fields["progress"] == "succeeded"


@pytest.mark.timeout(60)
def test_protected_reads_ask_for_the_token(lease_db: tuple[str, Any]) -> None:
    """With ``protect_reads`` (a public bind) every page needs the token as Basic auth."""
    url, _ = lease_db
    c = client(url, token=TOKEN, protect_reads=True)
    denied = c.get("/runs")
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
    assert c.get("/static/app.js").status_code == 401
    basic = base64.b64encode(f"ops:{TOKEN}".encode()).decode()
    assert c.get("/runs", headers={"authorization": f"Basic {basic}"}).status_code == 200
    wrong = base64.b64encode(b"ops:guess-guess-guess").decode()
    assert c.get("/runs", headers={"authorization": f"Basic {wrong}"}).status_code == 401
    with pytest.raises(ImproperlyConfigured, match="needs a write token"):
        client(url, protect_reads=True)


@pytest.mark.timeout(30)
def test_token_setting_is_validated(
    lease_db: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short token is a one-line error; the environment variable is read when unset."""
    url, _ = lease_db
    with pytest.raises(ImproperlyConfigured, match="lease_web_token must be at least 16"):
        create_app(celery_app(url, lease_web_token="short"))
    monkeypatch.setenv("CELERY_LEASE_WEB_TOKEN", TOKEN)
    from starlette.testclient import TestClient

    page = TestClient(create_app(celery_app(url)), base_url=LOCAL).get("/runs").text
    assert "writes need the token" in page


@pytest.mark.timeout(30)
def test_public_bind_without_a_token_is_refused() -> None:
    """Loopback binds serve read-only; any other address needs a token."""
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    with pytest.raises(BindRefused, match=r"refusing to serve on 0\.0\.0\.0 without"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", TOKEN)


@pytest.mark.timeout(60)
def test_cli_refuses_a_public_bind_in_one_line(tmp_path: Path) -> None:
    """``lease web --host 0.0.0.0`` without a token exits 1 with one line, serving nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CL_LEASE_DB": sqlite_url(tmp_path / "l.db")}
    env.pop("CELERY_LEASE_WEB_TOKEN", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.cli_app",
            "lease",
            "web",
            "--host",
            "0.0.0.0",
            "--port",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "Error: refusing to serve on 0.0.0.0 without a credential: set lease_web_token or "
        "CELERY_LEASE_WEB_TOKEN (every page then asks for it), or bind 127.0.0.1"
    ]


@pytest.mark.timeout(60)
def test_cli_says_in_one_line_that_the_port_is_in_use(tmp_path: Path) -> None:
    """``lease web --port P`` with P taken exits 1 with one line and no banner (it printed
    the banner, then uvicorn's error, and exited 3)."""
    url = sqlite_url(tmp_path / "l.db")
    LeaseStore.from_url(url).create_schema()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CL_LEASE_DB": url}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "celery", "-A", "tests.cli_app"),
                *("lease", "web", "--port", str(port)),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=50,
        )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.timeout(30)
def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch, lease_db: tuple[str, Any]) -> None:
    """Without Starlette the factory says which extra to install."""
    for name in [m for m in sys.modules if m.split(".")[0] == "starlette"] + ["starlette"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "celery_lease.web.server", raising=False)
    monkeypatch.delattr(celery_lease.web, "server", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'celery-lease\[web\]'"):
        create_app(celery_app(lease_db[0]))


# -- the real thing, in headless Chromium -----------------------------------------------------


@pytest.fixture
def served(lease_db: tuple[str, Any], tmp_path: Path) -> Iterator[tuple[WebServer, str, Any]]:
    url, engine = lease_db
    server = WebServer(
        "tests.cli_app", {"CL_LEASE_DB": url, "CELERY_LEASE_WEB_TOKEN": TOKEN}, tmp_path
    )
    yield server, url, engine
    server.stop()


def wait_text(driver: Any, css: str, text: str, timeout: float = 10.0) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text)
    )


@pytest.mark.timeout(120)
def test_browser_filter_open_and_cancel_with_the_token(served: tuple[WebServer, str, Any]) -> None:
    """In Chromium: filter the runs page, open a run, cancel it with the token; a cancel
    without the token and one without the CSRF value are refused; `<script>` stays text."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    server, url, engine = served
    add_run(engine, "shop.charge:ord-1", created_at=2_000)
    add_run(engine, "shop.charge:ord-2", created_at=3_000)
    add_run(
        engine,
        "evil",
        task=EVIL_TASK,
        status="failed",
        last_error=EVIL_ERROR,
        created_at=4_000,
        finished_at=4_000,
    )
    add_run(engine, "shop.refund:ord-1", task="shop.refund", created_at=5_000)
    store = LeaseStore.from_url(url)
    driver = browser()
    try:
        driver.get(server.url + "/runs")
        rows = driver.find_elements(By.CSS_SELECTOR, "#rows tr")
        assert [r.get_attribute("data-id") for r in rows] == [
            "shop.refund:ord-1",
            "evil",
            "shop.charge:ord-2",
            "shop.charge:ord-1",
        ]
        assert EVIL_TASK in driver.find_element(By.ID, "rows").text  # shown as text
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018 - no script of the row ran
        # Filter: task shop.charge, key prefix.
        driver.find_element(By.NAME, "task").send_keys("shop.charge")
        driver.find_element(By.NAME, "key").send_keys("shop.charge:ord-2")
        driver.find_element(By.CSS_SELECTOR, "form.filters button").click()
        wait_text(driver, "#rows", "shop.charge:ord-2")
        rows = driver.find_elements(By.CSS_SELECTOR, "#rows tr")
        assert [r.get_attribute("data-id") for r in rows] == ["shop.charge:ord-2"]
        # Open it, then cancel: first without the token, then without the CSRF value.
        driver.find_element(By.LINK_TEXT, "shop.charge:ord-2").click()
        wait_text(driver, "h1", "Run shop.charge:ord-2")
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="status"]').text == "queued"
        driver.find_element(By.LINK_TEXT, "Cancel").click()
        wait_text(driver, "h1", "Cancel run")
        driver.find_element(By.ID, "confirm").click()
        wait_text(driver, "#message", "wrong or missing write token")
        assert store.get("shop.charge:ord-2").status == "queued"  # type: ignore[union-attr]
        driver.back()
        wait_text(driver, "h1", "Cancel run")
        driver.execute_script("document.querySelector('input[name=csrf]').remove()")
        driver.find_element(By.NAME, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "confirm").click()
        wait_text(driver, "#message", "CSRF check failed")
        assert store.get("shop.charge:ord-2").status == "queued"  # type: ignore[union-attr]
        driver.back()
        driver.refresh()
        wait_text(driver, "h1", "Cancel run")
        driver.find_element(By.NAME, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "confirm").click()
        wait_text(driver, "#message", "run shop.charge:ord-2 is cancelled")
        assert store.get("shop.charge:ord-2").status == "cancelled"  # type: ignore[union-attr]
        driver.find_element(By.LINK_TEXT, "back to the run").click()
        wait_text(driver, 'dd[data-field="status"]', "cancelled")
        # The evil run's page: its task and error are text, no script ran.
        driver.get(server.url + "/run?id=evil")
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="task"]').text == EVIL_TASK
        error = driver.find_element(By.CSS_SELECTOR, 'dd[data-field="last_error"]').text
        assert "<script>alert('error')</script>" in error and "hunter2" not in error
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018
    finally:
        driver.quit()
        store.dispose()


@pytest.mark.timeout(120)
def test_browser_live_update_shows_running_then_succeeded(
    served: tuple[WebServer, str, Any],
) -> None:
    """An open runs page and run page follow a run from running to succeeded without a
    reload (the claim and the completion are the store's, as a worker's)."""
    from selenium.webdriver.common.by import By

    server, url, _ = served
    store = LeaseStore.from_url(url)
    driver = browser()
    try:
        driver.get(server.url + "/runs")
        driver.execute_script("window.notReloaded = true")
        claim = store.claim(
            "shop.charge:live",
            "w1@host:4242:abc",
            task_name="shop.charge",
            lease_ms=30_000,
            max_attempts=3,
        )
        wait_text(driver, '#rows tr[data-id="shop.charge:live"] td.status', "running")
        row = driver.find_element(By.CSS_SELECTOR, '#rows tr[data-id="shop.charge:live"]')
        assert "host:4242" in row.text and "left" in row.text
        store.complete("shop.charge:live", claim.owner, claim.attempt)
        wait_text(driver, '#rows tr[data-id="shop.charge:live"] td.status', "succeeded")
        assert driver.execute_script("return window.notReloaded") is True
        assert "live" in driver.find_element(By.ID, "live").text
        # The run's own page too.
        claim2 = store.claim(
            "shop.charge:live2",
            "w2@host:77:def",
            task_name="shop.charge",
            lease_ms=30_000,
            max_attempts=3,
        )
        driver.get(server.url + "/run?id=shop.charge:live2")
        driver.execute_script("window.notReloaded = true")
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="status"]').text == "running"
        store.complete("shop.charge:live2", claim2.owner, claim2.attempt)
        wait_text(driver, 'dd[data-field="status"]', "succeeded")
        wait_text(driver, 'dd[data-field="lease"]', "-")
        assert driver.execute_script("return window.notReloaded") is True
    finally:
        driver.quit()
        store.dispose()


def test_browser_requirement_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """The browser check skips on a laptop without chromium but fails under CI=true."""
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    monkeypatch.setenv("CI", "true")
    assert env_flag("CI")
    with pytest.raises(pytest.fail.Exception, match="chromium"):
        browser()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        browser()


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(180)
def test_browser_follows_a_real_worker_and_cancels_its_run(cluster: Cluster) -> None:
    """With a real ``celery worker``: an open run page shows the run running under that
    worker, the cancel made from the page (with the token) stops it within a heartbeat
    and the page shows ``cancelled``; another run goes running -> succeeded; no reload."""
    from selenium.webdriver.common.by import By

    cluster.start("w1", conf={"lease_seconds": 3})
    env = {**cluster.env, "CELERY_LEASE_WEB_TOKEN": TOKEN}
    server = WebServer("tests.workerapp", env, cluster.tmp_path)
    driver = browser()
    try:
        run_id = cluster.send("work", 60.0)
        wait_for(lambda: cluster.status(run_id) == "running", 30, what="the run to start")
        driver.get(f"{server.url}/run?id={run_id}")
        owner = driver.find_element(By.CSS_SELECTOR, 'dd[data-field="owner"]').text
        assert owner.startswith("w1@"), owner
        driver.find_element(By.LINK_TEXT, "Cancel").click()
        wait_text(driver, "h1", "Cancel run")
        driver.find_element(By.NAME, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "confirm").click()
        wait_text(driver, "#message", "cancel requested")
        driver.find_element(By.LINK_TEXT, "back to the run").click()
        wait_text(driver, "h1", "Run")
        driver.execute_script("window.notReloaded = true")
        wait_text(driver, 'dd[data-field="status"]', "cancelled", timeout=20)
        assert driver.execute_script("return window.notReloaded") is True
        assert cluster.effects(run_id, "commit") == []  # stopped before its fenced write

        second = cluster.send("work", 3.0)
        wait_for(lambda: cluster.status(second) == "running", 30, what="the second run")
        driver.get(f"{server.url}/run?id={second}")
        driver.execute_script("window.notReloaded = true")
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="status"]').text == "running"
        wait_text(driver, 'dd[data-field="status"]', "succeeded", timeout=20)
        assert driver.execute_script("return window.notReloaded") is True
    finally:
        driver.quit()
        server.stop()


def cells(driver: Any, css: str) -> list[list[str]]:
    """The text of each cell of each row matched by ``css``."""
    from selenium.webdriver.common.by import By

    return [
        [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        for row in driver.find_elements(By.CSS_SELECTOR, css)
    ]


def confirm_with_token(driver: Any, heading: str, **fields: str) -> None:
    """On a confirmation page: fill ``fields`` and the token, and confirm."""
    from selenium.webdriver.common.by import By

    wait_text(driver, "h1", heading)
    for name, value in fields.items():
        driver.find_element(By.NAME, name).send_keys(value)
    driver.find_element(By.NAME, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "confirm").click()


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(240)
def test_browser_pause_from_the_task_page_shows_reason_and_held_then_resume(
    cluster: Cluster,
) -> None:
    """With a real worker: Pause on a task's page (reason, token); deliveries sent meanwhile
    are held; the front page shows the task, its reason and 3 held; Resume on the task's
    page publishes them and each runs once."""
    from selenium.webdriver.common.by import By

    cluster.start("w1")
    server = WebServer("tests.workerapp", {**cluster.env, "CELERY_LEASE_WEB_TOKEN": TOKEN},
                       cluster.tmp_path)  # fmt: skip
    driver = browser()
    try:
        driver.get(f"{server.url}/task?name=workerapp.work")
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="state"]').text == "not paused"
        driver.find_element(By.LINK_TEXT, "Pause task").click()
        confirm_with_token(driver, "Pause task", reason="partner 503s INC-44")
        wait_text(driver, "#message", "paused workerapp.work on every worker")
        ids = [cluster.send("work", 0.0) for _ in range(3)]
        wait_for(lambda: sum(cluster.store.flow.flow_counts().paused.values()) == 3, 40,
                 what="3 held deliveries")  # fmt: skip
        assert all(cluster.store.get(i) is None for i in ids)  # no attempt used
        driver.get(server.url + "/")
        [row] = cells(driver, "#paused tr")
        assert row[:3] == ["workerapp.work", "(every key)", "partner 503s INC-44"]
        assert row[3].endswith(" ago") and row[4] == "3"
        driver.find_element(By.CSS_SELECTOR, "#paused a").click()
        wait_text(driver, "h1", "Task workerapp.work")
        state = driver.find_element(By.CSS_SELECTOR, 'dd[data-field="state"]').text
        assert state.startswith("paused since") and "INC-44" in state
        assert driver.find_element(By.CSS_SELECTOR, 'dd[data-field="held"]').text == "3"
        driver.find_element(By.LINK_TEXT, "Resume task").click()
        confirm_with_token(driver, "Resume task")
        wait_text(driver, "#message", "resumed workerapp.work: 3 held deliveries published")
        wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 60, what="3 runs")
        for run_id in ids:
            assert len(cluster.effects(run_id, "commit")) == 1
        driver.find_element(By.LINK_TEXT, "back to the task").click()
        wait_text(driver, 'dd[data-field="state"]', "not paused")
        wait_text(driver, 'td[data-count="succeeded"]', "3")
    finally:
        driver.quit()
        server.stop()


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(240)
def test_browser_bulk_rerun_from_a_filtered_list(cluster: Cluster) -> None:
    """With a real worker: three runs of a task fail (attempts spent) beside a failed run of
    another task; the runs list filtered by task and status offers "Rerun these"; confirmed
    with the token, the three run again and succeed; the other stays failed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    cluster.start("w1", conf={"lease_max_attempts": 1})
    flaky = [cluster.send("flaky", 1) for _ in range(3)]
    boom = cluster.send("boom")
    wait_for(lambda: all(cluster.status(i) == "failed" for i in [*flaky, boom]), 60,
             what="4 failed runs")  # fmt: skip
    server = WebServer("tests.workerapp", {**cluster.env, "CELERY_LEASE_WEB_TOKEN": TOKEN},
                       cluster.tmp_path)  # fmt: skip
    driver = browser()
    try:
        driver.get(server.url + "/runs")
        assert not driver.find_elements(By.ID, "bulk-rerun")
        Select(driver.find_element(By.NAME, "status")).select_by_visible_text("failed")
        driver.find_element(By.NAME, "task").send_keys("workerapp.flaky")
        driver.find_element(By.CSS_SELECTOR, "form.filters button").click()
        wait_text(driver, "#bulk-rerun", "Rerun these failed runs")
        rows = driver.find_elements(By.CSS_SELECTOR, "#rows tr")
        assert sorted(r.get_attribute("data-id") for r in rows) == sorted(flaky)
        driver.find_element(By.ID, "bulk-rerun").click()
        wait_text(driver, "#detail", "3 failed runs of workerapp.flaky match; 3 keep")
        assert cluster.status(flaky[0]) == "failed"  # the confirmation changed nothing
        confirm_with_token(driver, "Rerun the listed runs of")
        wait_text(driver, "#message", "3 failed runs of workerapp.flaky queued again")
        wait_for(lambda: all(cluster.status(i) == "succeeded" for i in flaky), 60,
                 what="the reruns to succeed")  # fmt: skip
        for run_id in flaky:
            assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]
        assert cluster.status(boom) == "failed"
        driver.find_element(By.LINK_TEXT, "back to the runs").click()
        wait_text(driver, "#rows", "no runs match")
    finally:
        driver.quit()
        server.stop()


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(300)
def test_browser_counters_after_a_real_takeover_and_a_real_sweep(cluster: Cluster) -> None:
    """With real workers: one run is taken over (its worker frozen past its lease, the
    message delivered again to another), another re-published by the sweeper (its worker
    killed); once both succeeded (claimed again since), the front page counts one takeover
    and one sweeper re-publish in the last hour, and so do the task rows and the runs'
    pages."""
    from selenium.webdriver.common.by import By

    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
    w1 = cluster.start("w1", **timing)
    taken = cluster.send("sleepy", 4.0)
    wait_for(lambda: cluster.effects(taken, "start"), 30, what="w1 to start the run")
    w1.pause()
    try:
        time.sleep(2.5)  # past the 2 s lease, by the database clock too
        w2 = cluster.start("w2", **timing)
        cluster.send("sleepy", 4.0, task_id=taken)
        wait_for(lambda: len(cluster.effects(taken, "start")) == 2, 30, what="w2's takeover")
    finally:
        w1.resume()
    wait_for(lambda: cluster.status(taken) == "succeeded", 30, what="the takeover to succeed")
    swept = cluster.send("work", 3.0)
    wait_for(lambda: cluster.status(swept) == "running", 30, what="the second run to start")
    unacked = cluster.tmp_path / "broker" / "unacked"
    # Its message acknowledged (not to come back when its worker dies): the sweeper's case.
    wait_for(lambda: not unacked.exists() or not any(unacked.iterdir()), 30, what="the ack")
    owner = cluster.store.get(swept).lease_owner or ""  # type: ignore[union-attr]
    (w1 if owner.startswith("w1@") else w2).kill9()

    def swept_once() -> bool:
        row = cluster.store.get(swept)
        if row is not None and row.republishes:
            return True
        sweep = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp", "lease", "sweep"],
            env={**os.environ, "PYTHONPATH": str(REPO), **cluster.env, **timing},
            cwd=cluster.tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert sweep.returncode == 0, sweep.stderr
        return False

    wait_for(swept_once, 60, interval=0.5, what="the sweeper to re-publish the run")
    # The surviving worker claims it again (attempt 2): the claim resets `requeues`, not
    # the history.
    wait_for(lambda: cluster.status(swept) == "succeeded", 60, what="attempt 2 to succeed")
    row = cluster.store.get(swept)
    assert row is not None and (row.attempt, row.republishes, row.requeues) == (2, 1, 0)
    server = WebServer("tests.workerapp", {**cluster.env, "CELERY_LEASE_WEB_TOKEN": TOKEN},
                       cluster.tmp_path)  # fmt: skip
    driver = browser()
    try:
        driver.get(server.url + "/")
        field = 'dd[data-field="{}"]'.format
        assert driver.find_element(By.CSS_SELECTOR, field("taken_over")).text == "1"
        assert driver.find_element(By.CSS_SELECTOR, field("republished")).text == "1"
        tasks = {row[0]: row for row in cells(driver, "#tasks tr")}
        assert tasks["workerapp.sleepy"][7:9] == ["1", "0"]  # taken over, re-published (1h)
        assert tasks["workerapp.work"][7:9] == ["0", "1"]
        driver.get(f"{server.url}/run?id={taken}")
        assert driver.find_element(By.CSS_SELECTOR, field("takeovers")).text.startswith(
            "1 time, last "
        )
        driver.get(f"{server.url}/run?id={swept}")
        assert driver.find_element(By.CSS_SELECTOR, field("republishes")).text.startswith(
            "1 time, last "
        )
        driver.get(f"{server.url}/task?name=workerapp.work")
        assert driver.find_element(By.CSS_SELECTOR, field("republished")).text == "1"
    finally:
        driver.quit()
        server.stop()


# -- issue 28: the view's edges, over real HTTP (`celery lease web`) -------------------------


def _raw(port: int, request: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is on a new connection; the response's status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _get(port: int, path: str, host: str = "127.0.0.1", extra: str = "") -> Any:
    return _raw(
        port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode()
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def web_db(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """A migrated lease database (SQLite, PostgreSQL) and a plain engine on it."""
    url = str(
        request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url"}[request.param])
    )
    store = LeaseStore.from_url(url)
    store.create_schema()
    store.dispose()
    engine = plain_engine(url)
    yield url, engine
    engine.dispose()


@pytest.mark.timeout(120)
def test_web_edges_over_real_http(web_db: tuple[str, Any], tmp_path: Path) -> None:
    """`celery lease web`, read-only, on SQLite and PostgreSQL: a POST announcing 200 MB is
    refused (413) before its body is read, and a chunked one as soon as it passes 8 KiB;
    a Host that is not the view's (DNS rebinding) gets 400, `lease_web_hosts` allows one;
    a NUL in a filter is 400 (not "503 database unavailable"); a 404 carries the
    security headers; a read-only viewer sees the lease owner as host:pid only."""
    url, engine = web_db
    owner = "worker-host:4242:0d1f-secret-owner-token.w1@worker-host"
    add_run(engine, "shop.charge:ord-1", status="running", lease_owner=owner, created_at=2_000)
    server = WebServer(
        "tests.cli_app", {"CL_LEASE_DB": url, "CL_WEB_HOSTS": "leases.example.test"}, tmp_path
    )
    try:
        port = server.port
        # The body is bounded before it is read: nothing of 200 MB is waited for.
        started = time.monotonic()
        status, headers, _ = _raw(
            port,
            b"POST /action HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 200000000\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\n" + b"a=" + b"x" * 1000,
        )
        assert status == 413 and time.monotonic() - started < 4.0
        assert "default-src 'none'" in headers["content-security-policy"]
        # A chunked body with no length is cut as soon as it passes the bound.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /action HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: application/x-www-form-urlencoded\r\n\r\n"
            )
            sent, answer = 0, b""
            chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
            while sent < 64 * 1024 * 1024:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    answer = sock.recv(4096)
                    break
                try:
                    sock.sendall(chunk)
                except OSError:  # the server closed its side: read its answer
                    answer = sock.recv(4096)
                    break
                sent += 65536
        assert answer.startswith(b"HTTP/1.1 413"), (sent, answer[:80])
        assert sent < 8 * 1024 * 1024, sent  # refused long before the 64 MB were sent
        # DNS rebinding: another site's name pointed at 127.0.0.1 reads nothing.
        status, headers, body = _get(port, "/runs", host=f"rebind.attacker.test:{port}")
        assert status == 400 and b"ord-1" not in body
        assert "default-src 'none'" in headers["content-security-policy"]
        assert _get(port, "/runs", host=f"localhost:{port}")[0] == 200
        assert _get(port, "/runs", host="leases.example.test")[0] == 200  # lease_web_hosts
        # A NUL in a filter is the request's fault, whatever the database.
        for path in ("/runs?task=shop%00x", "/api/runs?key=a%00", "/run?id=x%00", "/task?name=%00"):
            status, _, body = _get(port, path)
            assert status == 400, (path, status, body[:200])
            assert b"navailable" not in body
        # Every error page carries the security headers.
        status, headers, _ = _get(port, "/no-such-page")
        assert status == 404
        for name in ("content-security-policy", "x-content-type-options", "x-frame-options"):
            assert name in headers, (name, headers)
        # A read-only viewer sees host:pid, never the owner's secret part.
        status, _, body = _get(port, "/run?id=shop.charge:ord-1")
        assert status == 200 and b"worker-host:4242" in body
        assert b"secret-owner-token" not in body
        status, _, body = _get(port, "/api/run?id=shop.charge:ord-1")
        assert status == 200 and b"secret-owner-token" not in body
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_the_token_shows_the_full_owner_and_hosts_are_validated(
    lease_db: tuple[str, Any],
) -> None:
    """With the token presented (Basic auth) the run page shows the whole lease owner;
    `lease_web_hosts` is checked like the other settings."""
    url, engine = lease_db
    owner = "worker-host:4242:0d1f-secret-owner-token.w1@worker-host"
    add_run(engine, "shop.charge:ord-9", status="running", lease_owner=owner)
    c = client(url, token=TOKEN, protect_reads=True)
    auth = {"Authorization": "Basic " + base64.b64encode(f"u:{TOKEN}".encode()).decode()}
    assert owner in c.get("/run", params={"id": "shop.charge:ord-9"}, headers=auth).text
    for bad in ([], "a:80", ["http://x"], [1]):
        with pytest.raises(ImproperlyConfigured, match="lease_web_hosts"):
            create_app(celery_app(url, lease_web_hosts=bad))
    assert create_app(celery_app(url, lease_web_hosts=["*"])) is not None
