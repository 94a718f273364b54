"""Another program on a port: it takes the port a store listened on and hangs up on
every connection without a word of the store protocol.

What a reconnecting client meets when a dead store's port was taken by someone else:
it must not take the squatter for its store (tests of store loss and of a keeper
restarted on a new port).
"""

from __future__ import annotations

import socket
import threading


class PortSquatter:
    """`bind()` (or `try_bind()` while the old owner's connections still hold the port),
    then `start()`; `close()` frees the port, pass or fail."""

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self._sock = socket.socket()
        # the dead listener's connections may sit in TIME_WAIT: the port is free to bind
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        self._sock.bind((self.address, self.port))

    def try_bind(self) -> bool:
        """False while the port is still held (e.g. FIN-WAIT of the old owner's connections)."""
        try:
            self.bind()
        except OSError:
            return False
        return True

    def start(self, backlog: int = 64) -> "PortSquatter":
        self._sock.listen(backlog)
        self._sock.settimeout(0.1)  # how soon the accepting thread sees close()
        self._thread = threading.Thread(target=self._hang_up, daemon=True)
        self._thread.start()
        return self

    def _hang_up(self) -> None:
        while not self._stop.is_set():
            try:
                self._sock.accept()[0].close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
