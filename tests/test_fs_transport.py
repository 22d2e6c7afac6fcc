"""celery_lease.contrib.fs_transport: a consumer polling mid-publish never takes a partial file."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection
from kombu.exceptions import ChannelError

from celery_lease.contrib import fs_transport
from celery_lease.contrib.fs_transport import Transport


@pytest.mark.timeout(30)
def test_consumer_polling_mid_publish_never_takes_the_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll between writing a message and renaming it into place finds no message (kombu
    before 5.5 matches any file name containing `.<queue>.msg`), and the message arrives whole."""
    (tmp_path / "control").mkdir()
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path / "control"),
    }
    seen_mid_write: list[Any] = []
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        channel: Any = conn.default_channel
        real_replace = os.replace

        def replace_after_a_poll(src: str, dst: str) -> None:
            try:
                seen_mid_write.append(channel._get("orders"))
            except Empty:
                pass
            except ChannelError as exc:
                seen_mid_write.append(exc)
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace_after_a_poll)
        channel._put("orders", {"body": "m1"})
        monkeypatch.setattr(os, "replace", real_replace)
        assert seen_mid_write == []
        assert channel._get("orders") == {"body": "m1"}


@pytest.mark.timeout(30)
def test_publish_failure_is_a_channel_error_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As kombu's own publish: an OSError (here a missing folder) is raised as ChannelError,
    and a failed rename leaves no temporary file behind."""
    (tmp_path / "control").mkdir()
    options = {
        "data_folder_in": str(tmp_path / "missing"),
        "data_folder_out": str(tmp_path / "missing"),
        "control_folder": str(tmp_path / "control"),
    }
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        channel: Any = conn.default_channel
        with pytest.raises(ChannelError, match="Cannot add file"):
            channel._put("orders", {"body": "m1"})
    (tmp_path / "out").mkdir()
    options = {**options, "data_folder_out": str(tmp_path / "out")}
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        channel = conn.default_channel

        def refuse(src: str, dst: str) -> None:
            raise PermissionError(13, "refused", dst)

        monkeypatch.setattr(os, "replace", refuse)
        with pytest.raises(ChannelError):
            channel._put("orders", {"body": "m2"})
    assert list((tmp_path / "out").iterdir()) == []


def _options(folder: Path) -> dict[str, str]:
    (folder / "control").mkdir(exist_ok=True)
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder / "control"),
    }


def _drain(channel: Any, queue: str) -> list[Any]:
    got = []
    while True:
        try:
            got.append(channel._get(queue))
        except Empty:
            return got


@pytest.mark.timeout(60)
def test_a_backlog_is_listed_once_per_batch_not_once_per_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu lists and sorts the whole folder for every message it takes (O(backlog) per
    message in the worker's main process); here one listing serves a batch, in order."""
    monkeypatch.setattr(fs_transport, "LISTING_BATCH", 100)
    options = _options(tmp_path)
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        producer: Any = conn.channel()
        for i in range(450):
            producer._put("orders", {"body": i})
    listings = 0
    real_listdir = os.listdir

    def counting(path: Any) -> list[str]:
        nonlocal listings
        if os.fspath(path) == str(tmp_path):  # the queue folder (not the consumers' one)
            listings += 1
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", counting)
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        got = _drain(conn.channel(), "orders")
    assert [m["body"] for m in got] == list(range(450))
    assert listings <= 6, listings  # 5 batches, and the one that finds the folder empty


@pytest.mark.timeout(60)
def test_two_consumers_take_each_message_once_and_see_new_ones_at_once(tmp_path: Path) -> None:
    """Two consumers sharing the folder (two workers) each skip what the other took since
    their listing: every message is taken once. A consumer that took all it had listed
    finds a message published since at once (a chain's next step); a queue it found empty
    is listed again within LISTING_MAX_AGE."""
    options = _options(tmp_path)
    with (
        Connection("filesystem://", transport=Transport, transport_options=options) as pub,
        Connection("filesystem://", transport=Transport, transport_options=options) as one,
        Connection("filesystem://", transport=Transport, transport_options=options) as two,
    ):
        producer: Any = pub.channel()
        a: Any = one.channel()
        b: Any = two.channel()
        for i in range(40):
            producer._put("orders", {"body": i})
        taken: list[int] = []
        for turn in range(100):
            with contextlib.suppress(Empty):
                taken.append((a if turn % 2 else b)._get("orders")["body"])
        assert sorted(taken) == list(range(40))
        for i in range(3):
            producer._put("steps", {"body": i})
        time.sleep(fs_transport.LISTING_MAX_AGE)  # a's listing found no step
        assert [a._get("steps")["body"] for _ in range(3)] == [0, 1, 2]
        producer._put("steps", {"body": "next"})
        assert a._get("steps") == {"body": "next"}  # its listed messages were all taken
        with pytest.raises(Empty):
            a._get("idle")
        producer._put("idle", {"body": "late"})
        started = time.monotonic()
        got = None
        while got is None and time.monotonic() - started < 5:
            try:
                got = a._get("idle")
            except Empty:
                time.sleep(0.01)
        assert got == {"body": "late"}
        assert time.monotonic() - started < fs_transport.LISTING_MAX_AGE + 0.5


@pytest.mark.timeout(60)
def test_a_taken_message_is_kept_until_acknowledged_and_a_dead_consumers_come_back(
    tmp_path: Path,
) -> None:
    """A message taken with acknowledgement waits in the unacked folder until acked; one
    taken without (a worker's control queue) is gone at once. The messages of a consumer
    whose lock nobody holds any more (it died) go back to their queue, ``redelivered``, and
    are taken before the later ones a live consumer had listed already."""
    options = _options(tmp_path)
    unacked = tmp_path / fs_transport.UNACKED
    with Connection("filesystem://", transport=Transport, transport_options=options) as conn:
        channel: Any = conn.channel()
        channel.queue_declare("orders")
        for body in ("a", "b", "c", "d", "e"):
            channel.basic_publish(channel.prepare_message(body), "", "orders")
        taken = channel.basic_get("orders", no_ack=False)
        assert taken.body == b"a" and len(os.listdir(unacked)) == 1
        taken.ack()
        assert os.listdir(unacked) == []
        assert channel.basic_get("orders", no_ack=True).body == b"b"
        assert os.listdir(unacked) == []
        kept = channel.basic_get("orders", no_ack=False)
        assert kept.body == b"c" and len(os.listdir(unacked)) == 1
        # As if its consumer had died: the file moves to a name whose lock nobody holds.
        (held,) = os.listdir(unacked)
        original = held.partition(".")[2]
        (tmp_path / fs_transport.CONSUMERS / "gone.lock").touch()
        os.rename(unacked / held, unacked / f"gone.{original}")
        channel._taken.clear()
        channel._recovered_at = float("-inf")  # a second has passed
        again = channel.basic_get("orders", no_ack=False)
        assert again is not None and again.body == b"c"
        assert again.headers.get("redelivered") is True
        assert not (tmp_path / fs_transport.CONSUMERS / "gone.lock").exists()
        assert [channel.basic_get("orders", no_ack=True).body for _ in "de"] == [b"d", b"e"]
