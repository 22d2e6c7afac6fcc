"""A loopback TCP proxy that can be partitioned: it stops forwarding, it does not refuse.

During :meth:`Proxy.partition` every byte is read and dropped, in both
directions, and new connections are accepted but never connected upstream, as
a network that silently drops packets looks to a client: its writes succeed,
no reply ever comes. Connections that saw the partition stay dead after
:meth:`Proxy.heal` (like a lost NAT mapping); new ones forward normally.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from sqlalchemy.engine import make_url


class _Pair:
    """One client connection and, unless accepted while partitioned, its upstream."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream
        self.dead = upstream is None

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class Proxy:
    """Forward 127.0.0.1:<port> to ``target`` (host, port) until partitioned."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._partitioned = threading.Event()
        self._closed = False
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def for_url(cls, url: str) -> tuple[Proxy, str]:
        """A proxy in front of ``url``'s server, and the same URL through the proxy."""
        parsed = make_url(url)
        proxy = cls((parsed.host or "127.0.0.1", parsed.port or 5432))
        via = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        return proxy, via

    def partition(self) -> None:
        """Stop forwarding: drop every byte, connect nothing new upstream."""
        self._partitioned.set()

    def heal(self) -> None:
        """Forward again, for connections made from now on."""
        self._partitioned.clear()

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = None
            if not self._partitioned.is_set():
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                    upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
            threading.Thread(target=self._pump, args=(pair, client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(
                    target=self._pump, args=(pair, upstream, client), daemon=True
                ).start()

    def _pump(self, pair: _Pair, src: socket.socket, dst: Any) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self._partitioned.is_set():
                    pair.dead = True
                if pair.dead or dst is None:
                    continue  # dropped, as by the network
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # A dead pair stays silent towards its client until the client hangs up.
            if src is pair.client or not pair.dead:
                pair.close()
