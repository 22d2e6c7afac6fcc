"""The owner string a claim writes to ``lease_owner``: ``host:pid:token[.worker-id]``."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who holds a lease: a host, a process, a random token and, in a worker, the worker's id.

    Formatted as ``host:pid:token`` (``host:pid:token.worker-id`` in a worker).
    The token makes every claim's owner unique and unguessable; the worker id
    lets a worker hand back exactly the leases its own processes took
    (``LeaseStore.release_owned_by``).

    Attributes:
        host: the host name, at most 120 characters.
        pid: the process id, as written (``None`` for a string that is not an owner).
        token: the random part (a uuid4 in hex).
        worker_id: the id of the worker the process belongs to, or None.
    """

    host: str
    pid: str | None = None
    token: str = ""
    worker_id: str | None = None

    @classmethod
    def new(cls, hostname: str | None = None, worker: str | None = None) -> Owner:
        """A fresh owner for this process, with a new random token."""
        host = hostname or socket.gethostname()
        return cls(host[:120], str(os.getpid()), uuid.uuid4().hex, worker or None)

    @classmethod
    def parse(cls, text: str) -> Owner:
        """The owner ``text`` names; a string without ``host:pid:`` is kept whole as ``host``."""
        host, sep, rest = text.partition(":")
        pid, sep2, rest = rest.partition(":")
        if not sep or not sep2:
            return cls(text)
        token, dot, worker = rest.partition(".")
        return cls(host, pid, token, worker if dot else None)

    def format(self) -> str:
        """The string written to ``lease_owner``."""
        if self.pid is None:
            return self.host
        owner = f"{self.host}:{self.pid}:{self.token}"
        return f"{owner}.{self.worker_id}" if self.worker_id is not None else owner

    def short(self) -> str:
        """``host:pid``, for display (the token only matters to the guard)."""
        return f"{self.host}:{self.pid}" if self.pid else self.format()

    def __str__(self) -> str:
        return self.format()


def new_owner(hostname: str | None = None, worker: str | None = None) -> str:
    """A fresh, unguessable owner: ``host:pid:uuid4`` (``host:pid:uuid4.worker-id`` in a worker)."""
    return Owner.new(hostname, worker).format()
