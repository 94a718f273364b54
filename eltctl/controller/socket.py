"""The controller's command socket: `control.sock`, one JSON object per line each way.

Requests and answers are in docs/control-plane.md ("The controller's command
socket"). `serve` runs in the controller's event loop; `request` is the client the
CLI commands use (standard library only: the commands must not import torch).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger("eltctl.controller")

Handler = Callable[[dict], Awaitable[dict]]
MAX_LINE = 1 << 20
MAX_SOCKET_PATH = 108  # sun_path, with its terminating NUL


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    """Listen on `path` (mode 0600; a stale socket file is replaced: we hold the lock)."""
    if len(os.fsencode(str(path))) >= MAX_SOCKET_PATH:
        from eltctl.errors import EltctlError

        raise EltctlError(f"the state directory's path is too long for a unix socket ({path})",
                          hint="set XDG_STATE_HOME to a shorter directory")
    try:
        path.unlink()
    except FileNotFoundError:
        pass

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("a request is a JSON object")
                    answer = await handler(request)
                except ValueError as exc:
                    answer = {"ok": False, "error": f"bad request: {exc}"}
                except Exception as exc:  # noqa: BLE001 - answer, log, and keep serving
                    log.exception("The request %r failed.", line[:200])
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    old = os.umask(0o177)  # the socket file is created 0600: only this user may command the job
    try:
        server = await asyncio.start_unix_server(client, path=str(path), limit=MAX_LINE)
    finally:
        os.umask(old)
    return server


class SocketError(OSError):
    """Nothing answers on the socket (no controller, or it died)."""


def request(path: Path, message: dict, *, timeout: float = 10.0) -> dict[str, Any]:
    """Send one request and return the answer (a JSON object); SocketError when no
    controller answers, ValueError when the answer is not a JSON object."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            _connect(s, path)
        except OSError as exc:
            raise SocketError(f"no controller answers on {path}: {exc.strerror or exc}") from exc
        s.sendall(json.dumps(message).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            try:
                chunk = s.recv(65536)
            except socket.timeout as exc:
                raise SocketError(f"the controller did not answer {message.get('op')!r} within {timeout:g} s") from exc
            if not chunk:
                raise SocketError("the controller closed the connection without an answer")
            buf += chunk
        answer = json.loads(buf)
        if not isinstance(answer, dict):
            raise ValueError(f"{path}: the answer is not a JSON object")
        return answer
    finally:
        s.close()


def _connect(sock: socket.socket, path: Path) -> None:
    # sun_path holds 107 bytes; a deep XDG_STATE_HOME (pytest's tmp dirs) exceeds it.
    # Going through the directory's descriptor keeps the name short.
    if len(os.fsencode(str(path))) < MAX_SOCKET_PATH - 8:
        sock.connect(str(path))
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
