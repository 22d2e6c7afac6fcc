"""Celery's ``filesystem://`` transport with an atomic publish.

kombu's transport creates the message file and then writes into it, so a
consumer polling at that moment can take the still-empty file: the message is
lost and the consumer raises ``JSONDecodeError``, which stops the worker. Here
the message is written under a name no consumer matches and renamed into place
(``rename`` is atomic within one folder), so a consumer sees whole files only,
and named so that one publisher's messages are taken in the order it sent them.
Select it with ``app.conf.broker_transport =
"celery_lease.contrib.fs_transport:Transport"`` (the URL stays ``filesystem://``); the
example project and the test suite do. It changes nothing but the publish.

It keeps what kombu's own publish does besides the file name: the file is
written under an exclusive lock (``LOCK_EX``, kombu's lock helpers), and any
``OSError`` becomes kombu's ``ChannelError``, which kombu and Celery handle as a
channel failure. The temporary file is removed when the publish fails.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from time import monotonic_ns
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    """A filesystem channel whose ``_put`` writes a temporary file, then renames it."""

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
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    """The filesystem transport, with :class:`Channel`."""

    Channel = Channel
