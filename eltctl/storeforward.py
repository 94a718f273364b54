"""The store's SSH forwards and the run id's delivery, held by the store keeper
(docs/control-plane.md).

In the default `[controller] store = "ssh"` mode the keeper serves the store on a Unix
socket in the controller's 0700 state directory, and each remote host reaches it
through a remote **Unix-socket** forward (OpenSSH's streamlocal forwarding) on the
controller's own, verified SSH connection to that host (eltctl/hosts/ssh.py `connect`:
the inventory's known_hosts and identity, agent forwarding off, ProxyJump hops checked
the same way): the host's sshd listens on `store.sock` in the host's 0700 job directory
(eltctl/hosts/layout.py) and carries each connection back to the keeper's socket. Only
the job's account on the host can connect to it (the directory's mode; sshd creates
the socket 0600 with its default StreamLocalBindMask), no TCP port is open anywhere.
The host's sshd must allow it: `AllowStreamLocalForwarding yes` (the default);
`eltctl doctor` and `up` name a host whose sshd refuses.

Before it opens a host's forward the keeper writes its run id (a fresh random value at
every keeper start) to the host's job directory, file `run` (0600, atomically, over the
same connection), and removes a stale `store.sock` there (sshd's StreamLocalBindUnlink
is off by default). So a store reachable on a host is always the keeper whose run id
the host holds. With `forward=False` (the "direct" store mode) only the run id is
delivered, and with it (`store`: written first, the same way) the store's TCP address
to the file `store.address` (layout.STORE_ADDRESS): a keeper restarted while another
process holds its port serves on a new one, and the daemons and workers already
running read it there when they reconnect (eltctl_runtime.store.loss.StoreAddress).

The keeper holds the forwards (not the controller), so a controller crash costs
nothing; a keeper restart re-opens them at the same paths. `Forwarder` runs an asyncio
loop on a thread of its own in the keeper process:

- which hosts: the inventory's remote hosts (address other than "local") get a
  forward; its "local" hosts get the run id in their job directory on this machine
  (`deliver_local`) and an entry that is up once it is there. The file is re-read when
  its mtime changes (checked every `RELOAD_EVERY_S`) or on `reload()` (the keeper calls
  it on SIGHUP, which the controller sends when it re-reads the inventory: `up`,
  `scale --add`), so a host newly written into the inventory, local or remote, gets its
  run id (and forward) within seconds. The controller starts a host's daemon only once
  its entry is up (`run_delivered`, `forward_socket`): a daemon started before would
  sign with another run id, and it and the job would take each other's values for
  forgeries. A host removed from the inventory loses its forward.
- a lost connection is opened again with back-off (`BACKOFF_S`, doubling to
  `BACKOFF_MAX_S`).

forwards.json (`FORWARDS_FILE` in the state directory, written atomically on every
change): {"keeper": pid, "keeper_socket": path, "forward": bool, "local_runs": true,
"hosts": {host: {"socket": the host's store.sock path or null, "up": bool, "error":
str, "since": time, "local": true for a local host}}}. The controller reads it for the
address to write into a host's daemon.json (only while "keeper" is its keeper's pid
and the host's forward, or a local host's run id, is up) and `status` shows it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import threading
import time
from pathlib import Path

from eltctl_runtime.files import read_json, write_atomic
from eltctl_runtime.store.server import UNIX_PATH_MAX

log = logging.getLogger("eltctl.storeforward")

FORWARDS_FILE = "forwards.json"
RELOAD_EVERY_S = 2.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
STREAMLOCAL_FIX = ("set `AllowStreamLocalForwarding yes` in the host's sshd_config and reload sshd, or set "
                   "[controller] store = \"direct\" in the inventory (the store then listens on the network)")


def read_forwards(path: Path) -> dict:
    """forwards.json as a dict ({} when missing or unreadable)."""
    doc = read_json(path)
    return doc if isinstance(doc, dict) else {}


def forward_socket(doc: dict, host: str, keeper_pid: int) -> str | None:
    """The Unix socket `host` reaches the store at, when keeper `keeper_pid` holds its forward up."""
    if doc.get("keeper") != keeper_pid:
        return None
    entry = (doc.get("hosts") or {}).get(host) or {}
    path = entry.get("socket")
    return path if entry.get("up") and isinstance(path, str) and path.startswith("/") else None


def nudge_keeper(forwards_file: Path, keeper_pid: int) -> bool:
    """Ask keeper `keeper_pid` to re-read the inventory now (SIGHUP), when it holds a
    Forwarder (its pid in the forwards file: a keeper without one would stop on SIGHUP).
    The controller calls it when it re-reads the inventory, so a host added to the file
    gets its run id within a pass, not at the next mtime check."""
    import signal

    if keeper_pid <= 0 or read_forwards(forwards_file).get("keeper") != keeper_pid:
        return False
    try:
        os.kill(keeper_pid, signal.SIGHUP)
    except OSError:
        return False
    return True


def _shell_write(var: str, name: str) -> str:
    """Shell: the line read into `var` into the file `name` (0600, renamed into place)."""
    return (f"IFS= read -r {var} && printf '%s\\n' \"${var}\" > .{name}.tmp && chmod 600 .{name}.tmp "
            f"&& mv -f .{name}.tmp {name}")


def prepare_command(job: str, host: str, store: bool = False) -> str:
    """The host's side of a forward, before it opens: the job directory (0700), the run
    id from stdin into `run` (0600, renamed into place), no stale `store.sock`; prints
    the job directory's absolute path. `store` (the direct mode): stdin's first line is
    the store's address, written to `store.address` the same way, before the run id."""
    from eltctl.hosts import layout

    q = shlex.quote
    home = "$HOME"
    private = [f"{home}/{layout.STATE_DIR}", f"{home}/{layout.JOBS_DIR}", f"{home}/{layout.JOBS_DIR}/{q(job)}",
               layout.shell_job_dir(job, host)]
    address = f"{_shell_write('a', layout.STORE_ADDRESS)} && " if store else ""
    return (f"umask 077 && mkdir -p {private[-1]} && chmod 700 {' '.join(private)} && cd {private[-1]} && "
            f"{address}{_shell_write('r', layout.RUN_FILE)} && rm -f {layout.STORE_SOCKET} && pwd")


def write_local_run(job_dir: Path, run_id: str, store: str | None = None) -> None:
    """The run id into a job directory on this machine (a "local" host's), before the
    store serves; `store` (the direct mode): the store's address too, first."""
    from eltctl.hosts import layout

    job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(job_dir, 0o700)
    if store is not None:
        write_atomic(job_dir / layout.STORE_ADDRESS, store + "\n")  # 0600
    write_atomic(job_dir / layout.RUN_FILE, run_id + "\n")  # 0600


def local_job_dir(host, job: str) -> Path:
    """A "local" host's job directory on this machine (its HOME: the entry's env, else ours)."""
    from eltctl.hosts.layout import job_dir_in

    home = dict(host.env).get("HOME") or os.environ.get("HOME") or str(Path.home())
    return job_dir_in(Path(home), job, host.name)


def run_delivered(doc: dict, host: str, keeper_pid: int) -> bool:
    """Whether keeper `keeper_pid` wrote its run id to `host`'s job directory (a daemon
    started before that signs with another run id, and every value it and the others
    exchange reads as forged). A keeper from before local hosts were listed
    (no "local_runs" in its file) wrote them all at its start."""
    if doc.get("keeper") != keeper_pid:
        return False
    if not doc.get("local_runs"):
        return True
    entry = (doc.get("hosts") or {}).get(host) or {}
    return bool(entry.get("up"))


class Forwarder:
    def __init__(self, inventory_path: Path, state_file: Path, keeper_socket: str | None, run_id: str, *,
                 forward: bool = True, store: str | None = None) -> None:
        self.inventory_path = Path(inventory_path)
        self.state_file = Path(state_file)
        self.keeper_socket = keeper_socket
        self.run_id = run_id
        self.store = store  # the direct mode: the store's TCP address, written beside the run id
        self.forward = forward and keeper_socket is not None
        self.hosts: dict[str, dict] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._addresses: dict[str, tuple] = {}
        self._local: dict[str, Path] = {}  # the "local" hosts' job directories the run id is written to
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mtime: float | None = None
        self._wake: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._dest: str | None = None  # the keeper's socket as asyncssh connects to it
        self._dir_fd: int | None = None

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        if self.forward and self.keeper_socket is not None:
            self._dest = self.keeper_socket
            if len(os.fsencode(self.keeper_socket)) > UNIX_PATH_MAX:  # held for the keeper's life
                parent, name = os.path.split(self.keeper_socket)
                self._dir_fd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
                self._dest = f"/proc/{os.getpid()}/fd/{self._dir_fd}/{name}"
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

    def deliver_local(self, inventory=None) -> None:
        """The run id into the job directory of each "local" host of the inventory that
        does not hold it yet (the keeper calls it once before its store serves, the loop
        at every re-read: a local host added to the file gets it within seconds, before
        the controller starts its daemon; `run_delivered`)."""
        from eltctl.inventory import load_inventory

        inventory = inventory if inventory is not None else load_inventory(self.inventory_path)
        wanted = {h.name: local_job_dir(h, inventory.job.name) for h in inventory.hosts if h.is_local}
        for name in [n for n in self._local if n not in wanted]:
            del self._local[name]
            self.hosts.pop(name, None)
        for name, job_dir in wanted.items():
            if self._local.get(name) == job_dir and (self.hosts.get(name) or {}).get("up"):
                continue
            try:
                write_local_run(job_dir, self.run_id, self.store)
            except OSError as exc:
                self._local[name] = job_dir
                self.hosts[name] = {"socket": None, "up": False, "local": True, "since": time.time(),
                                    "error": f"cannot write the run id to {job_dir}: {exc}"}
                log.warning("store forwards: %s: cannot write the run id to %s: %s", name, job_dir, exc)
                continue
            self._local[name] = job_dir
            self.hosts[name] = {"socket": None, "up": True, "error": "", "local": True, "since": time.time()}
            log.info("store forwards: %s: the run id is in its job directory %s", name, job_dir)
        self._write()

    def reload(self) -> None:
        """Re-read the inventory now (thread-safe; the keeper's SIGHUP)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ the loop
    async def _main(self) -> None:
        forced = False
        while not self._stopping:
            try:
                self._sync(forced)
            except Exception as exc:  # noqa: BLE001 - a bad edit of the inventory: keep what runs
                log.warning("store forwards: cannot read the inventory %s: %s", self.inventory_path, exc)
            try:
                await asyncio.wait_for(self._wake.wait(), RELOAD_EVERY_S)
            except asyncio.TimeoutError:
                pass
            forced = self._wake.is_set()  # reload(): read it even if its mtime looks the same
            self._wake.clear()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _sync(self, forced: bool = False) -> None:
        from eltctl.inventory import load_inventory

        try:
            mtime = self.inventory_path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime and not forced:
            return
        self._mtime = mtime
        inventory = load_inventory(self.inventory_path)
        self.deliver_local(inventory)
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
                self._tasks[name] = asyncio.ensure_future(self._hold(host, inventory.ssh, inventory.job.name))
        self._write()

    async def _hold(self, host, settings, job: str) -> None:
        """Keep one host's forward up, for ever (until cancelled)."""
        import asyncssh

        from eltctl.errors import HostError
        from eltctl.hosts.ssh import connect

        delay = BACKOFF_S
        while True:
            transport = None
            try:
                transport = await connect(host, settings)
                path = await self._prepare(transport, job)
                if not self.forward:
                    self._set(host.name, socket=None, up=True, error="")
                    log.info("store forwards: %s: the run id is in its job directory", host.name)
                    return  # the direct mode: nothing to hold
                await self._listen(transport._conn, path)
                self._set(host.name, socket=path, up=True, error="")
                log.info("store forwards: %s: %s there reaches the store", host.name, path)
                delay = BACKOFF_S
                await transport._conn.wait_closed()
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

    async def _prepare(self, transport, job: str) -> str:
        """The run id written on the host, its stale socket removed: the socket's path there."""
        from eltctl.hosts import layout

        lines = ([self.store] if self.store is not None else []) + [self.run_id]
        res = await transport.run(prepare_command(job, transport.host.name, store=self.store is not None),
                                  input="".join(f"{line}\n" for line in lines), timeout=60)
        lines = res.stdout.strip().splitlines()
        if not res.ok or not lines or not lines[-1].startswith("/"):
            raise OSError(f"cannot write the run id to the host's job directory: "
                          f"{(res.stderr or res.stdout).strip()[-300:] or f'exit status {res.exit_status}'}")
        path = f"{lines[-1]}/{layout.STORE_SOCKET}"
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise OSError(f"the host's store socket {path} is longer than a Unix socket path may be "
                          f"({UNIX_PATH_MAX} bytes): use a shorter HOME there, or [controller] store = \"direct\"")
        return path

    async def _listen(self, conn, path: str) -> None:
        """The remote forward of `path` on the host to the keeper's socket."""
        import asyncssh

        try:
            await conn.forward_remote_path(path, self._dest)
        except (asyncssh.Error, asyncssh.ChannelListenError) as exc:
            raise OSError(f"the host's sshd refused to forward the store's Unix socket {path} ({exc}): "
                          + STREAMLOCAL_FIX) from exc

    # ------------------------------------------------------------------ the file
    def _set(self, name: str, **fields) -> None:
        entry = self.hosts.setdefault(name, {"socket": None, "up": False, "error": ""})
        if "up" in fields and fields["up"] != entry.get("up"):
            entry["since"] = time.time()
        entry.update(fields)
        self._write()

    def _write(self) -> None:
        with self._lock:
            hosts = {}
            for name in dict.fromkeys([*self._tasks, *self._local]) or list(self.hosts):
                hosts[name] = dict(self.hosts.get(name) or {"socket": None, "up": False, "error": "connecting"})
            # local_runs: the local hosts are listed too, up once the run id is in their job directory
            doc = {"keeper": os.getpid(), "keeper_socket": self.keeper_socket, "forward": self.forward,
                   "local_runs": True, "hosts": hosts, "time": time.time()}
            write_atomic(self.state_file, json.dumps(doc, indent=1))
