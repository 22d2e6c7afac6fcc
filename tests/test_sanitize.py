"""Redaction of credentials in stored errors and logged URLs."""

from __future__ import annotations

import pytest

from celery_lease.sanitize import MAX_ERROR_LENGTH, describe_exception, safe_url, sanitize

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
