"""celery_lease.contrib.fs_transport: a consumer polling mid-publish never takes a partial file."""

from __future__ import annotations

import os
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection
from kombu.exceptions import ChannelError

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
