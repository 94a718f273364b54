"""The controller's connection to the job's store, and the store keeper's life.

`JobStore` is the controller's client of the TCPStore served by the store keeper
(eltctl/storekeeper.py), scoped to the job's prefix exactly as the runtime scopes it
(`eltctl_runtime.job_store`). The client is signed with the job's secret
(`connect_client`, runtime/auth.py): what the controller writes carries a MAC, what
it reads is checked first, and a value that is not signed with the secret is never
used (`JobStore` reads it as missing, or as the last verified value of its key) but
counted in `forgeries(job)`, which status.json shows. TCPStore calls block, so they
run on one thread of their own (the store client is not shared between threads); the
asyncio loop awaits them. `StoreLike` is the seam a test can fill with a dict.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from eltctl.controller.statedir import StateDir, existing_secret
from eltctl_runtime import auth
from eltctl_runtime.files import read_json
from eltctl_runtime.pids import pid_alive
from eltctl_runtime.protocol import Keys, add_event, job_prefix

STORE_TIMEOUT_S = 10.0
KEEPER_START_TIMEOUT_S = 60.0


class StoreLike(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class KeeperInfo:
    address: str
    port: int
    pid: int

    def to_json(self) -> dict:
        return {"address": self.address, "port": self.port, "pid": self.pid}

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


_FORGERIES: dict[str, auth.Forgeries] = {}


def forgeries(job: str) -> auth.Forgeries:
    """The forged values this process's store clients of `job` have read, per key family
    (one count for the process's life: it survives a reconnect to a new keeper)."""
    return _FORGERIES.setdefault(job, auth.Forgeries())


def connect_client(address: str, port: int, job: str, timeout: float = STORE_TIMEOUT_S,
                   secret: bytes | None = None) -> StoreLike:
    """A TCPStore client under the job's prefix (blocking; raises when nothing answers),
    signed with the job's secret: `secret`, else the one in the job's state directory
    (statedir.job_secret, made at the first `up`). The one place the controller's
    store is built, so a reconnect is signed as the first connection was."""
    import torch.distributed as dist

    if secret is None:
        secret = existing_secret(StateDir.for_job(job))
    tcp = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout))
    return auth.signed(dist.PrefixStore(job_prefix(job), tcp), job_prefix(job), secret, forgeries(job))


class JobStore:
    """Async access to one store client; every call runs on the store's own thread."""

    def __init__(self, client: StoreLike) -> None:
        self._client = client
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eltctl-store")

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def forgeries(self) -> auth.Forgeries | None:
        """The forged values this client read (None: an unsigned client)."""
        return getattr(self._client, "forgeries", None)

    def _read(self, key: str) -> bytes | None:
        """The key's verified value, or None when there is none. A forged value is never
        returned: the key's last verified value stands in for it (rank 0's status, a
        daemon's state), or, when it never had one (a forged event), it reads as missing.
        Either way the forgery is counted (`forgeries`)."""
        if not auth.raw_store(self._client).check([key]):
            return None
        try:
            return self._client.get(key)
        except auth.ForgedValue:
            return None

    async def get_json(self, key: str) -> Any | None:
        raw = await self._call(self._read, key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw

    async def get_raw(self, key: str) -> bytes | None:
        return await self._call(self._read, key)

    async def set_json(self, key: str, value: Any) -> None:
        await self._call(self._client.set, key, json.dumps(value))

    async def set_raw(self, key: str, value: str) -> None:
        await self._call(self._client.set, key, value)

    async def add(self, key: str, amount: int) -> int:
        return await self._call(self._client.add, key, amount)

    async def event(self, document: dict) -> None:
        """Append to the job's event log (events/<n>, the runtime's format)."""
        await self._call(add_event, self._client, document)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the keeper

def live_keeper(state: StateDir, job: str) -> KeeperInfo | None:
    """The store keeper named by controller.json, if its pid lives and its store answers."""
    doc = read_json(state.controller_json) or {}
    store = doc.get("store") or {}
    try:
        info = KeeperInfo(address=str(store["address"]), port=int(store["port"]), pid=int(store["pid"]))
    except (KeyError, TypeError, ValueError):
        return None
    if not pid_alive(info.pid):
        return None
    try:
        client = connect_client(info.address, info.port, job, timeout=3.0)
        client.check([Keys.STATUS])  # a round trip: whether the key exists does not matter
    except Exception:  # noqa: BLE001 - any failure means "not usable": a new keeper is started
        return None
    return info


def start_keeper(state: StateDir, address: str) -> KeeperInfo:
    """Start a store keeper bound to `address` (detached) and wait until it serves."""
    info_path = state.path / "storekeeper.json"
    try:
        info_path.unlink()
    except FileNotFoundError:
        pass
    log = open(state.storekeeper_log, "ab")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eltctl.storekeeper", "--address", address, "--info", str(info_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
    finally:
        log.close()
    deadline = time.monotonic() + KEEPER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        doc = read_json(info_path)
        if doc and doc.get("pid") == proc.pid:
            return KeeperInfo(address=str(doc["address"]), port=int(doc["port"]), pid=proc.pid)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    tail = _tail(state.storekeeper_log)
    raise RuntimeError(f"the store keeper did not start on {address}: {tail}")


def stop_keeper(info: KeeperInfo | None, timeout: float = 10.0) -> None:
    if info is None or not pid_alive(info.pid):
        return
    try:
        os.kill(info.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(info.pid):
        time.sleep(0.05)
    if pid_alive(info.pid):
        try:
            os.kill(info.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(lines[-n:]) or "no output"
