"""Celery's ``filesystem://`` transport with an atomic publish.

kombu's transport creates the message file and then writes into it, so a
consumer polling at that moment can take the still-empty file: the message is
lost and the consumer raises ``JSONDecodeError``, which stops the worker. Here
the message is written under a name no consumer matches and renamed into place
(``rename`` is atomic within one folder), so a consumer sees whole files only,
and named so that one publisher's messages are taken in the order it sent them.
Select it with ``app.conf.broker_transport =
"celery_lease.contrib.fs_transport:Transport"`` (the URL stays ``filesystem://``); the
example project and the test suite do.

It also consumes from a listing kept between polls. kombu lists and sorts the
whole folder for every message it takes, so a worker facing a backlog of N
messages spent O(N) of its main process's CPU per message (about 0.8 ms per
task at a backlog of 1,000). Here one listing serves every queue: each takes
its messages from it in name order (up to :data:`LISTING_BATCH`); a queue
whose listed messages are all taken lists the folder again at once, and a
queue the listing found empty (the worker's control queue, an idle queue) at
most every :data:`LISTING_MAX_AGE` seconds. A file another consumer took
meanwhile is skipped, as kombu skips one. Messages renamed into place after a
listing are taken after that listing's (their names sort later anyway: they
lead with the time of the publish).

It keeps what kombu's own publish does besides the file name: the file is
written under an exclusive lock (``LOCK_EX``, kombu's lock helpers), and any
``OSError`` becomes kombu's ``ChannelError``, which kombu and Celery handle as a
channel failure. The temporary file is removed when the publish fails.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import uuid
from collections import deque
from queue import Empty
from time import monotonic, monotonic_ns
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

#: Most messages of one queue a listing of the folder keeps.
LISTING_BATCH = 1000
#: Seconds a listing stands for a queue it found empty: a message published to an idle
#: queue is seen at most this much later (kombu polls an idle channel every second).
LISTING_MAX_AGE = 0.1


class Channel(filesystem.Channel):
    """A filesystem channel whose ``_put`` writes a temporary file, then renames it, and
    whose ``_get`` takes messages from a listing kept between polls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # Per queue that had messages at the last listing: their file names not taken
        # yet, in order (a queue with none is not a key).
        self._listed: dict[str, deque[str]] = {}
        self._listed_at = -math.inf

    def _get(self, queue: str) -> Any:  # type: ignore[override]
        """The next message of ``queue``: kombu's ``_get`` (move the file out, read it,
        remove it), from the kept listing; ``Empty`` when it has none for ``queue``."""
        listed = self._listed.get(queue)
        # Its messages all taken: list again at once, as kombu would. None at the last
        # listing: list again only once that listing is LISTING_MAX_AGE old.
        if not listed and (queue in self._listed or self._stale()):
            self._list()
            listed = self._listed.get(queue)
        processed = self.processed_folder if self.store_processed else tempfile.gettempdir()
        while listed:
            filename = listed.popleft()
            try:
                shutil.move(os.path.join(self.data_folder_in, filename), processed)
            except OSError:
                continue  # taken by another consumer since the listing, or locked
            path = os.path.join(processed, filename)
            try:
                with open(path, "rb") as f:
                    payload = f.read()
                if not self.store_processed:
                    os.remove(path)
            except OSError as exc:
                raise ChannelError(f"Cannot read file {path!r} from queue.") from exc
            return loads(bytes_to_str(payload))  # type: ignore[no-untyped-call]
        raise Empty()

    def _list(self) -> None:
        """List the folder once: each queue's first :data:`LISTING_BATCH` message files,
        by name."""
        by_queue: dict[str, list[str]] = {}
        for name in os.listdir(self.data_folder_in):
            queue, dot, ext = name.partition(".")[2].rpartition(".")
            if dot and ext == "msg":
                by_queue.setdefault(queue, []).append(name)
        self._listed = {q: deque(sorted(names)[:LISTING_BATCH]) for q, names in by_queue.items()}
        self._listed_at = monotonic()

    def _stale(self) -> bool:
        return monotonic() - self._listed_at >= LISTING_MAX_AGE

    def _purge(self, queue: str) -> int:
        """kombu's purge, and the kept listing of ``queue`` dropped."""
        self._listed.pop(queue, None)
        return int(super()._purge(queue))  # type: ignore[no-untyped-call]

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # kombu's name leads with the monotonic milliseconds and consumers take files in
        # name order; the sub-millisecond part keeps one publisher's messages in the
        # order it sent them (a resume publishing held deliveries), not a uuid's.
        now = monotonic_ns()
        name = f"{now // 1_000_000}_{now % 1_000_000:06d}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # No ".<queue>.msg" anywhere in the name: kombu before 5.5 takes every file whose
        # name merely contains it (later versions compare the whole suffix).
        partial = os.path.join(self.data_folder_out, f"{uuid.uuid4()}.part")
        try:
            with open(partial, "wb", buffering=0) as f:
                filesystem.lock(f, filesystem.LOCK_EX)  # type: ignore[no-untyped-call]
                try:
                    f.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
                finally:
                    filesystem.unlock(f)  # type: ignore[no-untyped-call]
            os.replace(partial, final)
            self._listed_at = -math.inf  # this channel's next get sees it at once
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    """The filesystem transport, with :class:`Channel`."""

    Channel = Channel

    @property
    def default_connection_params(self) -> dict[str, Any]:
        """No default host: a folder has none, and kombu warns "No hostname was supplied"
        for each connection (twice at every worker start) when a default is offered."""
        return {"port": self.default_port}
