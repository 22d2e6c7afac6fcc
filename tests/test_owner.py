"""The owner string's value type: one format, built and parsed in one place."""

from __future__ import annotations

import os

import pytest

from celery_lease.owner import Owner, new_owner

pytestmark = pytest.mark.timeout(10)


def test_new_owner_formats_host_pid_token_and_worker() -> None:
    """A worker's owner is ``host:pid:token.worker-id``; outside a worker it has no suffix."""
    owner = Owner.new("host-a", "w1")
    text = owner.format()
    assert text.startswith(f"host-a:{os.getpid()}:") and text.endswith(".w1")
    assert Owner.parse(text) == owner and owner.worker_id == "w1"
    plain = new_owner("host-a")
    assert Owner.parse(plain).worker_id is None and plain.count(".") == 0
    assert new_owner("h") != new_owner("h")  # a fresh token each time
    assert len(Owner.new("x" * 300).host) == 120


@pytest.mark.parametrize(
    ("text", "short"),
    [
        ("host:42:abc", "host:42"),
        ("host:42:abc.worker.id", "host:42"),
        ("thief", "thief"),
        ("abc:", "abc:"),
        ("abc:12", "abc:12"),
        ("a::x", "a::x"),
    ],
)
def test_parse_round_trips_and_short_shows_host_and_pid(text: str, short: str) -> None:
    """Any stored owner parses and formats back to itself; ``short()`` is ``host:pid``."""
    owner = Owner.parse(text)
    assert owner.format() == text == str(owner)
    assert owner.short() == short
