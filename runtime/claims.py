"""GPU claims: which eltctl job holds which GPU (or CPU slot) of a host.

Several eltctl jobs (of one user or of several) may share hosts. Before a host
daemon starts a worker on GPU N it takes an exclusive claim on the file
`<claims dir>/gpuN` (`cpuN.HOST` for CPU slot N of the inventory host HOST:
`slot_file`): `flock(LOCK_EX | LOCK_NB)` on an open file description that it
passes to the worker (`pass_fds`) and then closes. The lock lives exactly as long as the worker (and anything the worker
started that inherited it): a dead daemon keeps it, a dead worker frees it,
and no claim is ever stale, so nothing has to clean claims up. A slot whose
claim another job holds is "taken by job X": the daemon starts nothing there.

The claims directory is one per host, shared by every job and user there:
`claims_dir` in daemon.json, else `$ELTCTL_CLAIMS_DIR` in the daemon's
environment, else `/tmp/eltctl-gpus` (`DEFAULT_DIR`). Whoever creates it makes
it world-writable and sticky (mode 1777), and each claim file is mode 0666, so
the daemons of two users can lock the same files. The file holds the claim
(`Claim`, one line of JSON) written by its holder after locking::

    {"job": "mnist", "user": "alice", "host": "ws1", "slot": 0, "pid": 4242, "since": 1700000000.0}

A reader (another job's daemon, `eltctl probe`) learns whether a claim is
held by trying a shared lock for an instant (`holder`); the content then says
by whom. A claimer that meets such a reader retries for a few milliseconds
before it calls the slot taken (`take`).

The same directory holds the jobs' demand entries for fair share (`demand.<account>.<job>`,
written by each controller's probe: eltctl/demand.py has their fields). A host daemon
reads them every watch interval (`DemandReader`: a file is read again only when it was
replaced) and passes the fresh ones on in its state document, so a controller learns of
another job's new demand from its own daemons within a second or two, not only at its
next probe.

Standard library only: the control side imports this module to read claims.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

ENV = "ELTCTL_CLAIMS_DIR"
DEFAULT_DIR = "/tmp/eltctl-gpus"
DIR_MODE = 0o1777  # world-writable and sticky: every user claims, nobody removes another's file
FILE_MODE = 0o666
TRIES = 6  # a failed LOCK_EX is retried: a reader's instant shared lock must not look like a claim
RETRY_S = 0.01
# Demand entries (fair share, eltctl/demand.py): the file name's prefix, the most of a
# file that is read, and when an entry is stale (`demand_stale_after`).
DEMAND_PREFIX = "demand."
DEMAND_MAX_BYTES = 4000
DEMAND_STALE_MIN_S = 60.0


class ClaimError(RuntimeError):
    """The claims directory cannot be used (not creatable, not a directory, no permission)."""


@dataclass(frozen=True)
class Claim:
    """Who holds a slot's claim. Read from the file: a field it lacked is empty."""

    job: str
    user: str = ""
    host: str = ""
    slot: int | None = None
    pid: int | None = None  # the worker holding it (the daemon's, for the instant before the worker starts)
    since: float | None = None  # wall clock

    def to_json(self) -> str:
        return json.dumps({"job": self.job, "user": self.user, "host": self.host, "slot": self.slot,
                           "pid": self.pid, "since": self.since})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Claim":
        """A claim file's content; unreadable content gives a claim of an unknown job ("")."""
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            return cls(job="")
        if not isinstance(d, dict):
            return cls(job="")

        def number(key: str, kind: type):
            v = d.get(key)
            return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        return cls(job=str(d.get("job") or ""), user=str(d.get("user") or ""), host=str(d.get("host") or ""),
                   slot=number("slot", int), pid=number("pid", int), since=number("since", float))

    def describe(self) -> str:
        """`job mnist (user alice, pid 4242)`, for reasons a person reads."""
        facts = [f"user {self.user}" if self.user else "", f"pid {self.pid}" if self.pid else ""]
        facts = [f for f in facts if f]
        name = f"job {self.job}" if self.job else "another eltctl job"
        return f"{name} ({', '.join(facts)})" if facts else name


def slot_file(slot: int, gpu: bool = True, host: str = "") -> str:
    """The claim file's name for a slot: `gpu0`; for a CPU slot of the inventory host
    `host`, `cpu0.HOST` (`cpu0` without a host).

    A GPU is one device, whatever name an inventory gives its machine. A CPU slot is a
    share of the machine that an inventory host entry declares (`slots`): two entries
    for one machine (`address = "local"` twice) each have their own slot 0, so the
    claim is per host name. Jobs that call a CPU box by the same name share its slots
    first come, first served, as they share GPUs."""
    if gpu:
        return f"gpu{int(slot)}"
    return f"cpu{int(slot)}.{host}" if host else f"cpu{int(slot)}"


def parse_slot_file(name: str) -> tuple[str, int, str] | None:
    """(`gpu` or `cpu`, slot, host) of a claim file's name (`slot_file`); None for another file."""
    kind, rest = name[:3], name[3:]
    if kind not in ("gpu", "cpu"):
        return None
    number, dot, host = rest.partition(".")
    if not number.isdigit() or (dot and (kind == "gpu" or not host)):
        return None
    return kind, int(number), host


def claims_dir(configured: str | os.PathLike | None, env: Mapping[str, str]) -> Path:
    """Where this host's claims live: daemon.json's `claims_dir`, else $ELTCTL_CLAIMS_DIR
    of the environment given (the daemon's), else DEFAULT_DIR."""
    if configured:
        return Path(configured).expanduser()
    return Path(env.get(ENV) or DEFAULT_DIR).expanduser()


def ensure_dir(directory: Path) -> None:
    """Create the claims directory (mode 1777) if it is missing."""
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as e:
        raise ClaimError(f"cannot create the GPU claims directory {directory}: {e.strerror}; create it "
                         f"(mode 1777) or point {ENV} on the host at a writable directory") from None
    else:
        try:
            os.chmod(directory, DIR_MODE)  # mkdir's mode went through the umask
        except OSError:
            pass
    if not directory.is_dir():
        raise ClaimError(f"the GPU claims path {directory} is not a directory; remove it or point {ENV} "
                         "on the host elsewhere")


def _open_for_claim(path: Path) -> int:
    """The claim file, opened read-write (read-only if another user's file is not writable).

    Without O_CREAT first: Linux's fs.protected_regular refuses O_CREAT on another
    user's file in a sticky world-writable directory even when it exists."""
    for _ in range(5):
        for flags in (os.O_RDWR, os.O_RDONLY):
            try:
                return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                break
            except PermissionError:
                continue
        else:
            raise PermissionError(errno.EACCES, f"cannot open {path}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except FileExistsError:
            continue  # created by someone else just now: open theirs
        try:
            os.fchmod(fd, FILE_MODE)  # past the umask: other users' daemons lock it too
        except OSError:
            pass
        return fd
    raise OSError(errno.EAGAIN, f"cannot open {path}")


class Taken(Exception):
    """The slot's claim is held: by `holder` (None when it could not be read)."""

    def __init__(self, slot_name: str, holder: Claim | None) -> None:
        super().__init__(f"{slot_name} is held by {holder.describe() if holder else 'another process'}")
        self.holder = holder


class Held:
    """A claim this process holds: an open file description with LOCK_EX on it.

    `record(pid)` rewrites the file with the worker's pid; `close()` drops this
    process's descriptor (the lock stays while the worker holds its copy)."""

    def __init__(self, fd: int, path: Path, claim: Claim) -> None:
        self.fd = fd
        self.path = path
        self.claim = claim

    def record(self, claim: Claim) -> None:
        self.claim = claim
        _write(self.fd, claim)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Held":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write(fd: int, claim: Claim) -> None:
    data = (claim.to_json() + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass  # opened read-only (another user's file we may lock but not write): the lock is what counts


def _read(fd: int) -> Claim:
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        raw = b""
    return Claim.from_json(raw)


def take(directory: Path, name: str, claim: Claim, tries: int = TRIES) -> Held:
    """Claim `directory/name` for `claim` (its job, user, host, slot, pid, since).

    Returns the `Held` claim (pass its fd to the worker, then close it here).
    Raises `Taken` when another holder has it, `ClaimError` when the directory
    cannot be used."""
    ensure_dir(directory)
    path = directory / name
    try:
        fd = _open_for_claim(path)
    except OSError as e:
        raise ClaimError(f"cannot open the GPU claim {path}: {e.strerror or e}; make the claims directory "
                         f"world-writable (mode 1777) or point {ENV} on the host elsewhere") from None
    for attempt in range(max(1, tries)):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            if holder.job and holder.job != claim.job and attempt >= 1:
                break  # a real holder names itself: no need to wait out the retries
            time.sleep(RETRY_S)
            continue
        except OSError as e:
            os.close(fd)
            raise ClaimError(f"cannot lock the GPU claim {path}: {e.strerror or e}") from None
        _write(fd, claim)
        return Held(fd, path, claim)
    holder = _read(fd)
    os.close(fd)
    raise Taken(name, holder)


def holder(directory: Path, name: str) -> Claim | None:
    """Who holds the claim `directory/name` now; None when nobody does (or no such file)."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holders(directory: Path, names: Iterable[str]) -> dict[str, Claim]:
    """name -> the holder, for the held ones among `names`."""
    out = {}
    for name in names:
        h = holder(directory, name)
        if h is not None:
            out[name] = h
    return out


def demand_stale_after(every: float) -> float:
    """Seconds after which a demand entry written every `every` seconds is stale (its
    controller is gone): an entry's `time` and the reader's clock are the host's."""
    return max(DEMAND_STALE_MIN_S, 3 * every)


def demand_fresh(entry: Mapping, host_now: float) -> bool:
    """A demand entry (a file's JSON object) written recently enough to count."""
    def num(key: str, default: float) -> float:
        v = entry.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    return host_now - num("time", 0.0) <= demand_stale_after(num("every", 30.0))


class DemandReader:
    """The fresh demand entries of one claims directory, read cheaply enough for every
    watch interval: the directory is listed, and a file is opened again only when it was
    replaced (the writers rename a new file over it: another inode or mtime). Nothing is
    read before `read`."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._cache: dict[str, tuple[tuple[int, int, int], dict | None]] = {}

    def read(self, host_now: float) -> list[dict]:
        """The fresh entries (each file's JSON object, with `job`), sorted by file name."""
        seen: dict[str, tuple[tuple[int, int, int], dict | None]] = {}
        try:
            entries = list(os.scandir(self._dir))
        except OSError:
            entries = []
        for e in entries:
            if not e.name.startswith(DEMAND_PREFIX):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._cache.get(e.name)
            seen[e.name] = cached if cached is not None and cached[0] == sig else (sig, _read_demand(e.path))
        self._cache = seen
        return [doc for _, (_, doc) in sorted(seen.items()) if doc is not None and demand_fresh(doc, host_now)]


def _read_demand(path: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.read(fd, DEMAND_MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("job"), str) and doc["job"] else None


__all__ = ["Claim", "ClaimError", "DEFAULT_DIR", "DEMAND_PREFIX", "DemandReader", "ENV", "Held", "Taken", "claims_dir",
           "demand_fresh", "demand_stale_after", "ensure_dir", "holder", "holders", "parse_slot_file", "slot_file",
           "take"]
