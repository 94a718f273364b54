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
(`eltctl_runtime.job_store`). TCPStore calls block, so they run on one thread of
their own (the store client is not shared between threads); the asyncio loop awaits
them. `StoreLike` is the seam a test can fill with a dict.

The keeper's life: `live_keeper` (adopt the one controller.json names),
`start_keeper`, `stop_keeper`, and `KeeperSupervisor`, which the controller asks
every pass or two whether its keeper still lives and answers; a lost keeper is
replaced by a new one on the SAME address and port (the hosts know that one), or,
in the direct mode when another process took that port, on a new port (`--any-port`:
anyone on the LAN can take a port, and would otherwise keep the job from its store
for as long as they hold it); controller.json names the new pid and port, the
controller swaps its client (`JobStore.swap`), re-publishes what it owns and gives
the new address to every daemon it starts (controller/loop.py
`Controller.watch_keeper`). The Unix socket of the "ssh" mode is in the controller's
0700 directory: no other account can take it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eltctl.controller.statedir import StateDir, existing_secret
from eltctl.storekeeper import PORT_TAKEN
from eltctl_runtime.store import auth
from eltctl_runtime.files import read_json, write_json_atomic
from eltctl_runtime.pids import pid_alive
from eltctl_runtime.protocol import Keys, add_event, job_prefix, watch_deleted

log = logging.getLogger("eltctl.controller")

STORE_TIMEOUT_S = 10.0
KEEPER_START_TIMEOUT_S = 60.0


class StoreLike(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class KeeperInfo:
    """Where the keeper serves: its Unix `socket` (the "ssh" mode), else TCP at
    `address`:`port` (the direct mode)."""

    address: str
    port: int
    pid: int
    socket: str | None = None

    def to_json(self) -> dict:
        return {"address": self.address, "port": self.port, "socket": self.socket, "pid": self.pid}

    @classmethod
    def from_json(cls, doc: dict) -> "KeeperInfo":
        """Raises KeyError, TypeError or ValueError when `doc` is not one."""
        sock = doc.get("socket")
        return cls(address=str(doc.get("address") or ""), port=int(doc.get("port") or 0), pid=int(doc["pid"]),
                   socket=str(sock) if sock else None)

    @property
    def endpoint(self) -> str:
        """The store's address for `storeclient.connect` (eltctl_runtime.store.server's grammar)."""
        if self.socket:
            return f"unix:{self.socket}"
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp:{host}:{self.port}"


_FORGERIES: dict[str, auth.Forgeries] = {}


def forgeries(job: str) -> auth.Forgeries:
    """The forged values this process's store clients of `job` have read, per key family
    (one count for the process's life: it survives a reconnect to a new keeper)."""
    return _FORGERIES.setdefault(job, auth.Forgeries())


def connect_client(endpoint: str, job: str, timeout: float = STORE_TIMEOUT_S,
                   secret: bytes | None = None) -> StoreLike:
    """A client of the store at `endpoint` (`KeeperInfo.endpoint`) under the job's
    prefix (blocking; raises when nothing answers), signed with the job's secret:
    `secret`, else the one in the job's state directory (statedir.job_secret, made at
    the first `up`). The one place the controller's store is built, so a reconnect is
    signed as the first connection was."""
    from eltctl_runtime.store.client import connect, prefix_store

    state = StateDir.for_job(job)
    if secret is None:
        secret = existing_secret(state)
    run = auth.read_run_id(run_file(state)) if secret is not None else ""  # re-read at every (re)connect
    raw = connect(endpoint, timeout, plain=True)  # no torch in the controller
    return auth.signed(prefix_store(job_prefix(job), raw), job_prefix(job), secret, forgeries(job), run)


def run_file(state: StateDir) -> Path:
    """The store's run id file in the state directory (auth.RUN_FILE_NAME), written at
    every store keeper start; absent: run id ""."""
    return state.path / auth.RUN_FILE_NAME


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

    async def watch_deleted(self, key: str, timeout_s: float) -> tuple[bytes | None, bool]:
        """A key read as missing after it was there (deleted by someone who reaches the
        store): protocol.watch_deleted, on the store's thread."""
        return await self._call(watch_deleted, self._client, key, timeout_s)

    async def set_json(self, key: str, value: Any) -> None:
        await self._call(self._client.set, key, json.dumps(value))

    async def set_raw(self, key: str, value: str) -> None:
        await self._call(self._client.set, key, value)

    async def add(self, key: str, amount: int) -> int:
        return await self._call(self._client.add, key, amount)

    async def event(self, document: dict) -> None:
        """Append to the job's event log (events/<n>, the runtime's format)."""
        await self._call(add_event, self._client, document)

    def swap(self, client: StoreLike) -> None:
        """Use a new client from now on (the keeper was restarted: the old one is dead)."""
        self._client = client

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the keeper

def previous_keeper(state: StateDir) -> KeeperInfo | None:
    """The keeper controller.json names, alive or not, when the job may still run
    (status.json does not say it was taken down or finished): a new keeper must take its port,
    the only one the hosts know."""
    if (read_json(state.status_json) or {}).get("phase") in ("stopped", "finished"):
        return None
    store = (read_json(state.controller_json) or {}).get("store") or {}
    try:
        return KeeperInfo.from_json(store)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def live_keeper(state: StateDir, job: str) -> KeeperInfo | None:
    """The store keeper named by controller.json, if its pid lives and its store answers."""
    doc = read_json(state.controller_json) or {}
    store = doc.get("store") or {}
    try:
        info = KeeperInfo.from_json(store)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not pid_alive(info.pid):
        return None
    try:
        client = connect_client(info.endpoint, job, timeout=3.0)
        client.check([Keys.STATUS])  # a round trip: whether the key exists does not matter
    except Exception:  # noqa: BLE001 - any failure means "not usable": a new keeper is started
        return None
    return info


class KeeperPortTaken(RuntimeError):
    """The keeper's port is held by another process (the new keeper exited PORT_TAKEN)."""


def forwards_path(state: StateDir) -> Path:
    """The keeper's forwards file (eltctl/storeforward.py)."""
    from eltctl.storeforward import FORWARDS_FILE

    return state.path / FORWARDS_FILE


def start_keeper(state: StateDir, address: str | None, port: int = 0, restarted_job: str | None = None,
                 forward_inventory: Path | None = None, *, inventory: Path | None = None,
                 any_port: bool = False) -> KeeperInfo:
    """Start a store keeper detached, and wait until it serves: on TCP at `address`
    (and `port`; 0: any), or, with `address` None, on the state directory's Unix
    socket (`state.store_socket`). `restarted_job`: it replaces a lost keeper of that
    job (the store gets the job's `store/restarted` mark). `forward_inventory`: the
    keeper holds SSH forwards of its socket to this inventory's remote hosts (the
    "ssh" store mode; their state in `forwards_path(state)`); `inventory` (the direct
    mode): the keeper only writes its run id to that inventory's hosts. `any_port`
    (with a `port`): when another process holds it, the keeper serves on a new one
    (the returned info says which). Raises KeeperPortTaken when the address is held
    by another process, RuntimeError when it fails otherwise."""
    info_path = state.path / "storekeeper.json"
    try:
        info_path.unlink()
    except FileNotFoundError:
        pass
    log = open(state.storekeeper_log, "ab")
    cmd = [sys.executable, "-m", "eltctl.storekeeper", "--info", str(info_path), "--run-file", str(state.run_file),
           "--stats", str(state.store_stats)]
    cmd += ["--socket", str(state.store_socket)] if address is None else ["--address", address]
    if port and address is not None:
        cmd += ["--port", str(port)] + (["--any-port"] if any_port else [])
    if restarted_job:
        cmd += ["--restarted-job", restarted_job]
        if existing_secret(state) is not None:
            cmd += ["--secret-file", str(state.secret)]
    if forward_inventory is not None:
        cmd += ["--inventory", str(forward_inventory), "--forwards", str(forwards_path(state))]
    elif inventory is not None:
        cmd += ["--inventory", str(inventory), "--forwards", str(forwards_path(state)), "--no-forward"]
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
    finally:
        log.close()
    deadline = time.monotonic() + KEEPER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        doc = read_json(info_path)
        if doc and doc.get("pid") == proc.pid:
            return KeeperInfo.from_json(doc)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    tail = _tail(state.storekeeper_log, 1)
    if proc.returncode == PORT_TAKEN:
        raise KeeperPortTaken(tail)
    raise RuntimeError(f"the store keeper did not start on {address or state.store_socket}: "
                       f"{_tail(state.storekeeper_log)}")


class KeeperSupervisor:
    """Whether the job's store keeper lives and answers, and its restart on the same
    address and port (in the direct mode, a new port when another process took it).
    Blocking calls (run them off the event loop); the constructor
    does no I/O.

    `check` is a pid check every call and a store round trip every `round_trip_every`
    calls (its own short-lived client: the controller's client sits on its own
    thread). A keeper whose pid is gone is lost at once; one whose pid lives but
    does not answer for `unresponsive_s` (stopped, wedged) is killed and lost.

    A keeper whose store refuses requests (over its limits: someone else is talking to
    it, in the direct mode) is not restarted for it: a new one would be flooded the
    same way. `attack()` reports it (status.json, an event), and while it refuses, a
    missed round trip is not held against it."""

    def __init__(self, state: StateDir, job: str, info: KeeperInfo, *, round_trip_every: int = 2,
                 unresponsive_s: float = 10.0, clock=time.monotonic, forward_inventory: Path | None = None,
                 inventory: Path | None = None) -> None:
        self.state = state
        self.forward_inventory = forward_inventory  # the "ssh" store mode: a new keeper holds the forwards too
        self.inventory = inventory  # the direct mode: a new keeper writes its run id to these hosts
        self.job = job
        self.info = info
        self.restarts = 0
        self.problem = ""  # why the keeper cannot be restarted now ("": none)
        self._round_trip_every = round_trip_every
        self._unresponsive_s = unresponsive_s
        self._clock = clock
        self._calls = 0
        self._silent_since: float | None = None

    def check(self) -> bool:
        """True while the keeper serves (as far as this call looked)."""
        if not pid_alive(self.info.pid):
            return False
        self._calls += 1
        if self._calls % self._round_trip_every:
            return True
        try:
            client = connect_client(self.info.endpoint, self.job, timeout=3.0)
            client.check([Keys.STATUS])
        except Exception as exc:  # noqa: BLE001 - no answer: counted against its time
            if type(exc).__name__ == "StoreRefused" or self.attack() is not None:
                log.warning("The store keeper %d refuses requests (%s); it is not restarted for it.",
                            self.info.pid, self.attack() or exc)
                return True  # alive and flooded: a new keeper would be flooded the same way
            now = self._clock()
            self._silent_since = self._silent_since or now
            if now - self._silent_since < self._unresponsive_s:
                return True
            log.warning("The store keeper %d has not answered for %.0f s: it is killed and replaced.",
                        self.info.pid, now - self._silent_since)
            try:
                os.kill(self.info.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 2.0
            while pid_alive(self.info.pid) and time.monotonic() < deadline:  # its port is freed at its exit
                time.sleep(0.05)
            return False
        self._silent_since = None
        return True

    def stats(self) -> dict:
        """The live keeper's store counters (storestats.json; {} before its first)."""
        doc = read_json(self.state.store_stats) or {}
        return doc if isinstance(doc, dict) and doc.get("keeper") == self.info.pid else {}

    def attack(self) -> str | None:
        """What the keeper's store refused, when it refused anything: the job's own
        clients stay within its limits, so refusals mean someone else connects."""
        stats = self.stats()
        refused = int(stats.get("refused") or 0)
        if not refused:
            return None
        reasons = ", ".join(f"{n} {r}" for r, n in sorted((stats.get("refused_by_reason") or {}).items()))
        return (f"the store refused {refused} requests ({reasons}; last: {stats.get('last_refusal') or '?'}): "
                "possible attack on the store's address")

    def restart(self) -> KeeperInfo:
        """A new keeper at the same address (the direct mode: on a new port when another
        process took the old one); controller.json names it. Raises KeeperPortTaken or
        RuntimeError (the caller tries again later)."""
        old = self.info  # gone (`check` killed one that did not answer): never signalled here, its pid may be reused
        try:
            info = start_keeper(self.state, None if old.socket else old.address, old.port, restarted_job=self.job,
                                forward_inventory=self.forward_inventory, inventory=self.inventory,
                                any_port=not old.socket)
        except KeeperPortTaken as exc:
            self.problem = (f"the store's address {old.endpoint} is taken by another process ({exc}); the hosts "
                            "know only this address: free it, the controller retries every few seconds")
            raise
        except RuntimeError as exc:
            self.problem = str(exc)
            raise
        self.info, self.problem = info, ""
        self.restarts += 1
        self._calls, self._silent_since = 0, None
        doc = read_json(self.state.controller_json) or {}
        doc["store"] = info.to_json()
        doc["keeper_restarts"] = self.restarts
        write_json_atomic(self.state.controller_json, doc)
        return info


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
