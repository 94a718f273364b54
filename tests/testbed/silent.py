"""A host that accepts TCP connections and never speaks SSH (a hung machine).

Connections are accepted and held open without a byte sent, so a client waits
for the server's banner until its own timeout, as with a host whose sshd is
wedged or a machine that is swapping to death.
"""

from __future__ import annotations

import selectors
import socket
import threading


class SilentListener:
    """Listens on (address, port) from `start()` until `close()`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.port = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._held: list[socket.socket] = []

    def start(self) -> tuple[str, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.address, 0))
        sock.listen(256)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name=f"silent-{self.address}", daemon=True)
        self._thread.start()
        return self.address, self.port

    def _serve(self) -> None:
        assert self._sock is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for _ in sel.select(timeout=0.2):
                    try:
                        conn, _addr = self._sock.accept()
                    except OSError:
                        continue
                    self._held.append(conn)  # kept open, never written to

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in self._held:
            conn.close()
        self._held.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
