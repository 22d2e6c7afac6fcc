"""Redaction of credentials in stored errors and logged URLs."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_lease.sanitize import MAX_ERROR_LENGTH, describe_exception, safe_url, sanitize
from tests.cluster import Cluster
from tests.helpers import Worker, wait_for

SECRETS = [
    ("postgresql+psycopg://billing:Pa55-word@db.internal:5432/pay failed", "Pa55-word"),
    ("could not connect: host=db user=app password=hunter2 dbname=pay", "hunter2"),
    ("headers: {'Authorization': 'Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig'}", "eyJhbGciOiJIUzI1NiJ9"),
    ("Authorization: Basic YWxhZGRpbjpvcGVuc2VzYW1l", "YWxhZGRpbjpvcGVuc2VzYW1l"),
    ("GET /v1/charge?token=tok_live_123&amount=5", "tok_live_123"),
    ('{"client_secret": "cs_live_abc"}', "cs_live_abc"),
    ("api_key=sk_live_xyz rejected", "sk_live_xyz"),
    ("redis://:r3dis-pw@cache:6379/0 timed out", "r3dis-pw"),
]


@pytest.mark.parametrize(("text", "secret"), SECRETS)
def test_secret_is_redacted(text: str, secret: str) -> None:
    """Each credential form is removed; the surrounding text stays readable."""
    cleaned = sanitize(text)
    assert secret not in cleaned
    assert "***" in cleaned


def test_useful_context_survives() -> None:
    """Host names, users and exception types are kept: they help debugging."""
    cleaned = describe_exception(ConnectionError("postgresql://app:pw@db.internal/pay down"))
    assert cleaned.startswith("ConnectionError: ")
    assert "db.internal" in cleaned and "app" in cleaned and ":pw@" not in cleaned


def test_length_is_capped() -> None:
    """Huge messages are truncated to the cap, with a marker."""
    cleaned = sanitize("x" * (MAX_ERROR_LENGTH * 3))
    assert len(cleaned) <= MAX_ERROR_LENGTH and cleaned.endswith("[truncated]")


def test_safe_url_hides_password() -> None:
    """Database URLs are logged with the password masked."""
    shown = safe_url("postgresql+psycopg://app:s3cret@127.0.0.1:5432/leases")
    assert "s3cret" not in shown and "127.0.0.1" in shown


def test_password_with_at_colon_and_slash_is_redacted_whole() -> None:
    """A raw @, : or / inside a password does not let any part of it through."""
    for url in (
        "postgresql://u:p@ss:w/rd@db.internal/pay",
        "mysql+pymysql://app:a@b@c:3306/x",
        "postgresql://user@tenant:pa/ss@db/x",
    ):
        shown = safe_url(url)
        text = sanitize(f"could not connect to {url}: timeout")
        for part in ("p@ss", "ss:w", "w/rd", "a@b@c", "pa/ss"):
            assert part not in shown and part not in text
        assert "***@" in shown


CARDS = [
    ("card 4242424242424242 declined", "card ***4242 declined"),
    ("pan=5555555555554444", "pan=***4444"),
    ("charge failed for 4242 4242 4242 4242", "charge failed for ***4242"),
    ("charge failed for 4242-4242-4242-4242", "charge failed for ***4242"),
    ("amex 3782 822463 10005 refused", "amex ***0005 refused"),
    ("card 4242 4242 4242 4242 12 26 expired", "card ***4242 12 26 expired"),
    ("cards 4111111111111111,5555555555554444.", "cards ***1111,***4444."),
    ("key card-4242424242424242 busy", "key card-***4242 busy"),
]


@pytest.mark.parametrize(("text", "expected"), CARDS)
def test_card_number_keeps_only_last_four(text: str, expected: str) -> None:
    """A Luhn-valid 13-19 digit number, plain or grouped, shows as *** and its last four."""
    assert sanitize(text) == expected


NOT_CARDS = [
    "order 4242424242424241 not found",  # 16 digits failing Luhn
    "order 1234567812345678 not found",
    "deadline 1733560000000 passed",  # epoch milliseconds
    "ticket 1234567890123456789012345 closed",  # 25 digits
    "ticket 4242424242424242424242424 closed",  # 25 digits, a Luhn-valid 16 inside
    "run 123e4567-e89b-12d3-a456-426614174000 lost",
    "run 12345678-4242-4242-4242-424242424242 lost",  # an all-digit UUID
    "token id a4242424242424242 and 4242424242424242f",  # hex, glued to letters
    "call +1 (555) 123-4567 or +44 20 7946 0958",
    "sum 0.30000000000000004 off",  # a float's fraction
]


@pytest.mark.parametrize("text", NOT_CARDS)
def test_other_numbers_are_kept(text: str) -> None:
    """Ids, timestamps, UUIDs and phone numbers that are not card numbers stay as they are."""
    assert sanitize(text) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("card declined: cvc 123", "card declined: cvc ***"),
        ("CVV=1234 rejected", "CVV=*** rejected"),
        ("cvc: 123", "cvc: ***"),
        ('{"card_cvc": "123", "cvc_check": "fail"}', '{"card_cvc": "***", "cvc_check": "fail"}'),
    ],
)
def test_labelled_cvc_is_redacted(text: str, expected: str) -> None:
    """A CVC/CVV value after its label is redacted like other labelled secrets."""
    assert sanitize(text) == expected


def test_labelled_card_number_is_hidden_whole() -> None:
    """A card number under a secret label is redacted whole, last four included."""
    assert sanitize("token=4242424242424242") == "token=***"


_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s"
_TRIGGERS = {
    "sqlite": [
        "CREATE TRIGGER refuse_claim BEFORE INSERT ON celery_lease_runs "
        "WHEN NEW.task_name = 'workerapp.refused' "
        "BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END"
    ],
    "mysql": [
        "CREATE TRIGGER refuse_claim BEFORE INSERT ON celery_lease_runs FOR EACH ROW BEGIN "
        "IF NEW.task_name = 'workerapp.refused' THEN SIGNAL SQLSTATE '45000' "
        "SET MESSAGE_TEXT = 'refused by the test trigger'; END IF; END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_claim() RETURNS trigger AS $$ BEGIN "
        "IF NEW.task_name = 'workerapp.refused' THEN "
        "RAISE EXCEPTION 'refused by the test trigger'; END IF; RETURN NEW; END $$ "
        "LANGUAGE plpgsql",
        "CREATE TRIGGER refuse_claim BEFORE INSERT ON celery_lease_runs "
        "FOR EACH ROW EXECUTE FUNCTION refuse_claim()",
    ],
}


def _records_by_logger(log: str) -> list[tuple[str, str]]:
    """``(logger name, full text)`` of each record in a worker log (tracebacks included)."""
    records: list[tuple[str, str]] = []
    head = re.compile(r"^\[[^\]]*\] (?P<name>[\w.]+): ")
    for line in log.splitlines():
        match = head.match(line)
        if match:
            records.append((match["name"], line))
        elif records:
            records[-1] = (records[-1][0], records[-1][1] + "\n" + line)
    return records


@pytest.fixture(params=["sqlite-fs", "pg-redis", "mysql-redis"])
def scan_cluster(
    request: pytest.FixtureRequest, tmp_path: Path, workers: list[Worker]
) -> Iterator[Cluster]:
    """A cluster on SQLite + filesystem broker, PostgreSQL + Redis, or MySQL + Redis."""
    if request.param == "sqlite-fs":
        folder = tmp_path / "broker"
        (folder / "control").mkdir(parents=True)
        db_url = request.getfixturevalue("sqlite_url")
        broker = {"CL_BROKER_URL": "filesystem://", "CL_FS_DIR": str(folder)}
    else:
        db_url = request.getfixturevalue("pg_url" if request.param == "pg-redis" else "mysql_url")
        broker = {"CL_BROKER_URL": request.getfixturevalue("redis_url")}
    c = Cluster(db_url, broker, tmp_path, workers)
    yield c
    c.close()


@pytest.mark.timeout(120)
def test_no_planted_secret_in_any_celery_lease_log_line(scan_cluster: Cluster) -> None:
    """A full failure scenario in a real worker: a body failing with credentials in its
    error, and a claim refused by the database while the statement's parameters carry
    task arguments with a card number. No celery_lease record shows either secret."""
    cluster = scan_cluster
    with cluster.engine.begin() as conn:
        for ddl in _TRIGGERS[cluster.engine.dialect.name]:
            conn.exec_driver_sql(ddl)
    conf = {
        "lease_retry_backoff": 0.2,
        "lease_retry_backoff_max": 0.5,
        "lease_max_attempts": 2,
        "worker_log_format": _LOG_FORMAT,
        "worker_task_log_format": _LOG_FORMAT,
    }
    w1 = cluster.start("w1", conf=conf)
    card = "4111-1111-1111-1111-planted"
    refused = cluster.send("workerapp.refused", card)
    failing = cluster.send("workerapp.flaky", 99)
    wait_for(lambda: cluster.status(failing) == "failed", 40, what="the failing run to end")
    # A refusal by the database is a permanent error: the claim fails for good at once.
    wait_for(
        lambda: f"run {refused}: claim failed for good" in w1.log(),
        40,
        what="the refused claim to be logged",
    )
    records = _records_by_logger(w1.log())
    ours = [text for name, text in records if name.startswith("celery_lease")]
    assert any("refused by the test trigger" in text for text in ours)  # the cause survives
    assert any("celery-lease: lease database" in text for text in ours)
    for secret in (card, "s3cr3t-pw", "eyJhbGciOiJIUzI1NiJ9.payload.sig"):
        leaking = [text for text in ours if secret in text]
        assert not leaking, leaking
    assert cluster.effects(refused) == []


def test_a_megabyte_of_text_is_sanitized_in_a_moment_and_cut_safely() -> None:
    """Only the start of a long text is read (a 1 MB message took minutes); a secret at
    the start is redacted, and nothing past ``limit`` shows."""
    started = time.monotonic()
    text = sanitize("password=hunter2 " + "A" * 1_000_000 + " token=tail-secret")
    assert time.monotonic() - started < 2.0
    assert text.startswith("password=***") and "hunter2" not in text
    assert "tail-secret" not in text and len(text) <= 2000
    # A secret that starts just before the cut and ends after it is never shown in part.
    near = "A " * 2500 + "https://user:pw-longsecret@db.example/x" + " A" * 5000
    assert "pw-long" not in sanitize(near, 5050)
