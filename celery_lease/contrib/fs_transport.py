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

And it does not lose the messages a killed worker held. kombu deletes a message file
when a consumer takes it, so a message the worker held unacknowledged (prefetched, or
running under ``acks_late``) was gone with a ``kill -9``: no broker redelivery, and no
lease row for the sweeper when it had not started. Here a taken message moves to the
``unacked`` folder under its consumer's name and is deleted when acknowledged. Each
consuming process holds an exclusive POSIX lock on a file of its own in ``consumers``
for its whole life, and the kernel releases it when the process dies, however it dies:
any consumer that can take that lock (every :data:`RECOVER_INTERVAL` seconds) returns
the dead one's messages to their queue, marked ``redelivered``, as Redis returns them
after its visibility timeout. A worker that shuts down puts its prefetched messages back
itself, as kombu does.

It keeps what kombu's own publish does besides the file name: the file is
written under an exclusive lock (``LOCK_EX``, kombu's lock helpers), and any
``OSError`` becomes kombu's ``ChannelError``, which kombu and Celery handle as a
channel failure. The temporary file is removed when the publish fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import uuid
from collections import deque
from queue import Empty
from time import monotonic, monotonic_ns
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

#: Most messages of one queue a listing of the folder keeps.
LISTING_BATCH = 1000
#: Seconds a listing stands for a queue it found empty: a message published to an idle
#: queue is seen at most this much later (kombu polls an idle channel every second).
LISTING_MAX_AGE = 0.1
#: Seconds between two looks for the unacknowledged messages of consumers that died.
RECOVER_INTERVAL = 1.0
#: The folders, inside the queue folder, of taken messages and of consumers' lock files.
UNACKED = "unacked"
CONSUMERS = "consumers"

#: This process's consumer name, by process id and folder (a forked child takes its own).
_OWN: dict[tuple[int, str], str] = {}
#: The lock files this process holds, open for its whole life.
_HELD: list[Any] = []


def _process_consumer(folder: str) -> str:
    """This process's consumer name: a file ``<name>.lock`` in ``folder`` that it holds a
    POSIX lock on until it exits. The kernel drops that lock when the process dies,
    ``kill -9`` included, and a forked child does not inherit it: a consumer that can take
    the lock knows the messages taken under that name are nobody's."""
    key = (os.getpid(), folder)
    name = _OWN.get(key)
    if name is None:
        name = uuid.uuid4().hex
        os.makedirs(folder, exist_ok=True)
        # Locked under a name no consumer looks at, then renamed into place (the lock stays
        # with the file): no consumer ever finds this file unlocked while we live.
        partial = os.path.join(folder, f"{name}.part")
        held = open(partial, "wb")  # noqa: SIM115 - held for the process's life
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(partial, os.path.join(folder, f"{name}.lock"))
        _HELD.append(held)
        _OWN[key] = name
    return name


class QoS(virtual.QoS):
    """kombu's QoS; an acknowledged (or dropped) message's file is deleted."""

    def ack(self, delivery_tag: Any) -> None:
        super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        self.channel._settled(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]
        self.channel._settled(delivery_tag)


class Channel(filesystem.Channel):
    """A filesystem channel whose ``_put`` writes a temporary file, then renames it, whose
    ``_get`` takes messages from a listing kept between polls, and which keeps taken
    messages until they are acknowledged."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # Per queue that had messages at the last listing: their file names not taken
        # yet, in order (a queue with none is not a key).
        self._listed: dict[str, deque[str]] = {}
        self._listed_at = -math.inf
        # Taken and not yet acknowledged: delivery tag -> its file in the unacked folder.
        self._taken: dict[str, str] = {}
        # Queues consumed without acknowledgements (the worker's control queue): taken
        # for good, as kombu takes every message.
        self._noack_queues: set[str] = set()
        self._recovered_at = -math.inf

    def _get(self, queue: str) -> Any:  # type: ignore[override]
        """The next message of ``queue``: kombu's ``_get`` (move the file out, read it,
        remove it), from the kept listing; ``Empty`` when it has none for ``queue``."""
        if self._recover():
            self._listed = {}  # a dead consumer's messages came back: take them first
        listed = self._listed.get(queue)
        # Its messages all taken: list again at once, as kombu would. None at the last
        # listing: list again only once that listing is LISTING_MAX_AGE old.
        if not listed and (queue in self._listed or self._stale()):
            self._list()
            listed = self._listed.get(queue)
        while listed:
            filename = listed.popleft()
            path = os.path.join(self._unacked_folder(), f"{self._consumer_name()}.{filename}")
            try:
                os.rename(os.path.join(self.data_folder_in, filename), path)
            except OSError:
                continue  # taken by another consumer since the listing
            try:
                with open(path, "rb") as f:
                    message = loads(bytes_to_str(f.read()))  # type: ignore[no-untyped-call]
            except OSError as exc:
                raise ChannelError(f"Cannot read file {path!r} from queue.") from exc
            tag = (message.get("properties") or {}).get("delivery_tag")
            if tag is None or queue in self._noack_queues:  # nothing will acknowledge it
                self._done(path)
            else:
                self._taken[tag] = path
            return message
        raise Empty()

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        """kombu's; a queue consumed without acknowledgements is remembered."""
        if no_ack:
            self._noack_queues.add(queue)
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[no-untyped-call]

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """kombu's; a message got without acknowledgement is taken for good."""
        if not no_ack:
            return super().basic_get(queue, no_ack, **kwargs)  # type: ignore[no-untyped-call]
        self._noack_queues.add(queue)
        try:
            return super().basic_get(queue, no_ack, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._noack_queues.discard(queue)

    # -- taken messages: kept until acknowledged, returned when their consumer dies -----

    def _settled(self, delivery_tag: Any) -> None:
        """The message is acknowledged, dropped or put back: its taken file goes."""
        path = self._taken.pop(delivery_tag, None)
        if path is not None:
            self._done(path)

    def _done(self, path: str) -> None:
        if self.store_processed:
            with contextlib.suppress(OSError):
                shutil.move(path, self.processed_folder)
                return
        with contextlib.suppress(OSError):
            os.remove(path)

    def _restore(self, message: Any) -> None:
        """Put a taken message back (a requeue, a shutdown): kombu's restore, marked
        ``redelivered`` where Celery reads it, and its taken file deleted."""
        headers = message.headers
        if isinstance(headers, dict):
            headers["redelivered"] = True
        super()._restore(message)  # type: ignore[no-untyped-call]
        self._settled(message.delivery_tag)

    def _unacked_folder(self) -> str:
        folder = os.path.join(self.data_folder_in, UNACKED)
        os.makedirs(folder, exist_ok=True)
        return folder

    def _consumer_name(self) -> str:
        """This process's name in the unacked folder (see :func:`_process_consumer`)."""
        return _process_consumer(os.path.join(self.data_folder_in, CONSUMERS))

    def _recover(self) -> bool:
        """Return the taken messages of consumers that died to their queues, and forget
        those consumers (each consumer looks at most every :data:`RECOVER_INTERVAL` s);
        True when it found a dead one."""
        if monotonic() - self._recovered_at < RECOVER_INTERVAL:
            return False
        self._recovered_at = monotonic()
        consumers = os.path.join(self.data_folder_in, CONSUMERS)
        try:
            locks = [name for name in os.listdir(consumers) if name.endswith(".lock")]
        except FileNotFoundError:
            return False
        mine = _OWN.get((os.getpid(), consumers))
        dead = []
        for lock in locks:
            owner = lock[: -len(".lock")]
            if owner == mine:
                continue  # never probe our own: closing a file drops this process's lock
            path = os.path.join(consumers, lock)
            try:
                with open(path, "r+b") as probe:
                    fcntl.lockf(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its consumer lives (or the file just went)
            dead.append((owner, path))
        if not dead:
            return False
        folder = os.path.join(self.data_folder_in, UNACKED)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        for owner, lock_path in dead:
            for name in sorted(n for n in names if n.startswith(f"{owner}.")):
                self._return_taken(os.path.join(folder, name), name[len(owner) + 1 :])
            with contextlib.suppress(OSError):
                os.remove(lock_path)
        return True

    def _return_taken(self, path: str, original: str) -> None:
        """A dead consumer's taken message back into its queue, ``redelivered``, under its
        own name (so it is taken in its turn again)."""
        try:
            with open(path, "rb") as f:
                message = json.loads(f.read())
            message.setdefault("headers", {})["redelivered"] = True
            message["redelivered"] = True
            partial = os.path.join(self.data_folder_in, f"{uuid.uuid4()}.part")
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(message)))  # type: ignore[no-untyped-call]
            os.replace(partial, os.path.join(self.data_folder_in, original))
            os.remove(path)
        except (OSError, ValueError):
            return  # another consumer returned it first, or the file is not a message
        self._listed_at = -math.inf

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
