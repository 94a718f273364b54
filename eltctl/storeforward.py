"""The store's SSH remote forwards, held by the store keeper (docs/control-plane.md).

In the default `[controller] store = "ssh"` mode the keeper binds 127.0.0.1 alone, and
each remote host reaches it through a remote port forward on the controller's own,
verified SSH connection to that host (eltctl/hosts/ssh.py `connect`: the inventory's
known_hosts and identity, agent forwarding off, ProxyJump hops checked the same way):
the host's sshd listens on ITS 127.0.0.1:P_h and carries each connection back to the
keeper's 127.0.0.1:K. The daemon and workers of that host use `127.0.0.1:P_h`.

The keeper holds the forwards (not the controller), so a controller crash costs
nothing; a keeper restart re-opens them. `Forwarder` runs an asyncio loop on a thread
of its own in the keeper process:

- which hosts: the inventory's remote hosts (address other than "local"); the file is
  re-read when its mtime changes (checked every `RELOAD_EVERY_S`) or on `reload()`
  (the keeper calls it on SIGHUP), so `scale --add` of a host newly written into the
  inventory gets its forward. A host removed from the inventory loses its forward.
- which port: the one remembered for the host in forwards.json, else K, else any
  (0). Within one keeper's life, and in a keeper that replaces a lost one
  (`insist=True`), a remembered port is asked for again and again, never changed: the
  host's daemon knows only that one. A fresh keeper (a new `up`) takes another port
  when the remembered one is taken.
- a lost connection is opened again with back-off (`BACKOFF_S`, doubling to
  `BACKOFF_MAX_S`).

forwards.json (`FORWARDS_FILE` in the state directory, written atomically on every
change): {"keeper": pid, "keeper_port": K, "hosts": {host: {"port": P_h or null,
"up": bool, "error": str, "since": time}}}. The controller reads it for the port to
write into a host's daemon.json (only while "keeper" is its keeper's pid and the
host's forward is up) and `status` shows it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

from eltctl_runtime.files import read_json, write_atomic

log = logging.getLogger("eltctl.storeforward")

FORWARDS_FILE = "forwards.json"
RELOAD_EVERY_S = 2.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0


def read_forwards(path: Path) -> dict:
    """forwards.json as a dict ({} when missing or unreadable)."""
    doc = read_json(path)
    return doc if isinstance(doc, dict) else {}


def forward_port(doc: dict, host: str, keeper_pid: int) -> int | None:
    """The port `host` reaches the store at, when keeper `keeper_pid` holds its forward up."""
    if doc.get("keeper") != keeper_pid:
        return None
    entry = (doc.get("hosts") or {}).get(host) or {}
    port = entry.get("port")
    return int(port) if entry.get("up") and isinstance(port, int) and port > 0 else None


class Forwarder:
    def __init__(self, inventory_path: Path, state_file: Path, keeper_port: int, *, insist: bool = False) -> None:
        self.inventory_path = Path(inventory_path)
        self.state_file = Path(state_file)
        self.keeper_port = keeper_port
        self.insist = insist
        previous = (read_forwards(self.state_file).get("hosts") or {})
        self.remembered: dict[str, int] = {h: int(e["port"]) for h, e in previous.items()
                                           if isinstance(e, dict) and isinstance(e.get("port"), int) and e["port"] > 0}
        self.hosts: dict[str, dict] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._addresses: dict[str, tuple] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mtime: float | None = None
        self._wake: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._pinned: set[str] = set()  # hosts whose daemon may know their port: never changed

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._wake = asyncio.Event()
            ready.set()
            self._loop.run_until_complete(self._main())

        self._thread = threading.Thread(target=run, name="eltctl-forwards", daemon=True)
        self._thread.start()
        ready.wait()
        self._write()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every forward and end the thread (the keeper exits without it: its
        connections die with the process)."""
        if self._loop is None:
            return
        self._stopping = True
        self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout)

    def reload(self) -> None:
        """Re-read the inventory now (thread-safe; the keeper's SIGHUP)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ the loop
    async def _main(self) -> None:
        while not self._stopping:
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - a bad edit of the inventory: keep what runs
                log.warning("store forwards: cannot read the inventory %s: %s", self.inventory_path, exc)
            try:
                await asyncio.wait_for(self._wake.wait(), RELOAD_EVERY_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _sync(self) -> None:
        from eltctl.inventory import load_inventory

        try:
            mtime = self.inventory_path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime and not self._wake.is_set():
            return
        self._mtime = mtime
        inventory = load_inventory(self.inventory_path)
        wanted = {h.name: h for h in inventory.hosts if not h.is_local}
        for name in list(self._tasks):
            h = wanted.get(name)
            key = (h.address, h.port, h.user, inventory.ssh) if h is not None else None
            if key != self._addresses.get(name):
                self._tasks.pop(name).cancel()
                self._addresses.pop(name, None)
                self.hosts.pop(name, None)
        for name, host in wanted.items():
            if name not in self._tasks:
                self._addresses[name] = (host.address, host.port, host.user, inventory.ssh)
                self._tasks[name] = asyncio.ensure_future(self._hold(host, inventory.ssh))
        self._write()

    async def _hold(self, host, settings) -> None:
        """Keep one host's forward up, for ever (until cancelled)."""
        import asyncssh

        from eltctl.errors import HostError
        from eltctl.hosts.ssh import connect

        delay = BACKOFF_S
        while True:
            transport = None
            try:
                transport = await connect(host, settings)
                conn = transport._conn
                port = await self._listen(conn, host.name)
                self._set(host.name, port=port, up=True, error="")
                log.info("store forwards: %s: 127.0.0.1:%d there reaches the store", host.name, port)
                delay = BACKOFF_S
                await conn.wait_closed()
                self._set(host.name, up=False, error="the SSH connection was lost; opening it again")
            except asyncio.CancelledError:
                if transport is not None:
                    await transport.close()
                raise
            except (HostError, asyncssh.Error, OSError) as exc:
                self._set(host.name, up=False, error=str(exc))
                log.warning("store forwards: %s: %s; trying again in %.0f s", host.name, exc, delay)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the host's forward for good
                self._set(host.name, up=False, error=f"{type(exc).__name__}: {exc}")
                log.exception("store forwards: %s: unexpected error; trying again in %.0f s", host.name, delay)
            finally:
                if transport is not None:
                    try:
                        await transport.close()
                    except Exception:  # noqa: BLE001 - it is gone either way
                        pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _listen(self, conn, name: str) -> int:
        """The remote forward 127.0.0.1:P_h -> 127.0.0.1:K on the host; P_h as the module says."""
        import asyncssh

        remembered = self.remembered.get(name)
        insist = self.insist or name in self._pinned
        tries = [remembered] if remembered else []
        if not (remembered and insist):
            tries += [p for p in (self.keeper_port, 0) if p not in tries]
        error: Exception | None = None
        for port in tries:
            try:
                listener = await conn.forward_remote_port("127.0.0.1", port, "127.0.0.1", self.keeper_port)
            except (asyncssh.Error, asyncssh.ChannelListenError) as exc:
                error = exc
                continue
            got = listener.get_port()
            self.remembered[name] = got
            self._pinned.add(name)
            return got
        raise OSError(f"the host's sshd refused to listen on 127.0.0.1:{tries[-1]} for the store "
                      f"({error}): it needs AllowTcpForwarding yes (or remote)"
                      + (f", and port {remembered} (the one this host's daemon knows) must be free there"
                         if remembered and insist else ""))

    # ------------------------------------------------------------------ the file
    def _set(self, name: str, **fields) -> None:
        entry = self.hosts.setdefault(name, {"port": self.remembered.get(name), "up": False, "error": ""})
        if "up" in fields and fields["up"] != entry.get("up"):
            entry["since"] = time.time()
        entry.update(fields)
        self._write()

    def _write(self) -> None:
        with self._lock:
            hosts = {}
            for name in self._tasks or self.hosts:
                hosts[name] = dict(self.hosts.get(name) or {"port": self.remembered.get(name), "up": False,
                                                             "error": "connecting"})
            doc = {"keeper": os.getpid(), "keeper_port": self.keeper_port, "hosts": hosts, "time": time.time()}
            write_atomic(self.state_file, json.dumps(doc, indent=1))
