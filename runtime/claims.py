"""GPU claims: which eltctl job holds which GPU (or CPU slot) of a host.

Several eltctl jobs (of one user or of several) may share hosts. Before a host
daemon starts a worker on GPU N it takes an exclusive claim on a file of its own
account, `<claims dir>/gpuN@<account>` (`cpuN.HOST@<account>` for CPU slot N of the
inventory host HOST: `slot_file` gives the slot's base name, `own_file` the file):
`flock(LOCK_EX | LOCK_NB)` on an open file description that it passes to the worker
(`pass_fds`) and then closes. The lock lives exactly as long as the worker (and
anything the worker started that inherited it): a dead daemon keeps it, a dead
worker frees it, and no claim is ever stale, so nothing has to clean claims up. A
slot whose claim another job holds is "taken by job X": the daemon starts nothing there.

The claims directory is one per host, shared by every job and user there:
`claims_dir` in daemon.json, else `$ELTCTL_CLAIMS_DIR` in the daemon's
environment, else `/tmp/eltctl-gpus` (`DEFAULT_DIR`). Whoever creates it makes it
world-writable and sticky (mode 1777); each file in it is mode 0644 and written
only by its owner. The file holds the claim (`Claim`, one line of JSON)::

    {"job": "mnist", "user": "alice", "host": "ws1", "slot": 0, "pid": 4242, "since": 1700000000.0}

Who wrote what (issue 49). Any account can create any file there, so nothing in it
is believed without proof of its writer, by ONE rule both sides apply (`judge`: the
host daemon here, the probe's parser on the control side, which gets each file's
owner from the probe): a file counts only when its name is in the strict set
(`parse_name`), the account its name names is its owner's, and its content names
that account too (and, for a demand, the job its name names); a time more than
`CLOCK_SKEW_S` in the future is refused (it would stay fresh for ever); a held claim
counts only while its `pid` is a live process of the file's owner (a lock held by
another account's process, or by a process that is gone, keeps no GPU from anyone).
What is refused is reported (`Refusal`: file, owner, reason) in the daemon's state
document and the probe's output, so `eltctl status` and `eltctl lab` name it.

Two accounts racing for one GPU each lock and write their own file, then look at
the others' (`take`): whoever sees another valid claim of the slot backs off (drops
its lock), sleeps a random few milliseconds and looks again. Because both write
before they look, at least one of them sees the other: never two holders; when both
see each other both back off and the random sleeps break the tie.

A squatted name (a file with my name that another account created first: the sticky
bit keeps me from replacing it) is reported with the account that holds it and
worked around: the writer uses the alternates `NAME~1` .. `NAME~3`, which readers
accept under the same rule. Every open is O_NONBLOCK | O_NOFOLLOW and checked with
fstat to be a regular file (a FIFO or a device never blocks the daemon's loop).

The directory itself is judged too (`dir_problem`): not sticky while others may write
it, it is not trusted at all (any account could remove or rename every entry); owned
by another account than root or this one, it is used (each file is still judged by
its owner) but reported (that account can remove entries): create it as root.

The same directory holds the jobs' demand entries for fair share (`demand.<account>.<job>`,
written by each controller's probe: eltctl/demand.py has their fields). A host daemon
reads them every watch interval (`DemandReader`: a file is read again only when it was
replaced) and passes the believed, fresh ones on in its state document.

Standard library only: the control side imports this module to read claims.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pwd
import random
import re
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

ENV = "ELTCTL_CLAIMS_DIR"
DEFAULT_DIR = "/tmp/eltctl-gpus"
DIR_MODE = 0o1777  # world-writable and sticky: every user claims, nobody removes another's file
FILE_MODE = 0o644  # each account writes only its own files; everyone reads them
TRIES = 6  # a collision with another account's claim is looked at again after a random pause
BACKOFF_S = (0.005, 0.05)  # the random pause's range
RETRY_S = 0.01
ALTERNATES = 3  # NAME~1 .. NAME~3 when another account squats NAME
CLOCK_SKEW_S = 120.0  # a time further in the future than this is refused
# Demand entries (fair share, eltctl/demand.py): the file name's prefix, the most of a
# file that is read, and when an entry is stale (`demand_stale_after`).
DEMAND_PREFIX = "demand."
DEMAND_MAX_BYTES = 4000
CLAIM_MAX_BYTES = 2000
DEMAND_STALE_MIN_S = 60.0
MAX_REFUSALS = 20  # the most refusals a state document or a probe lists (their count is whole)

# The strict name set: an account (no dot, so a demand name splits once), a job or host
# name (as the inventory allows: eltctl/inventory/parse.py NAME_PATTERN).
ACCOUNT = r"[A-Za-z_][A-Za-z0-9_-]{0,31}"
NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
SAFE_CHARS = "A-Za-z0-9._@~-"  # every name eltctl writes there is made of these (the probe's filter)
_CLAIM_RE = re.compile(rf"(?P<kind>gpu|cpu)(?P<slot>[0-9]{{1,5}})(?:\.(?P<host>{NAME}))?@(?P<user>{ACCOUNT})"
                       rf"(?:~(?P<alt>[1-{ALTERNATES}]))?")
_DEMAND_RE = re.compile(rf"demand\.(?P<user>{ACCOUNT})\.(?P<job>{NAME}?)(?:~(?P<alt>[1-{ALTERNATES}]))?")
_SAFE_RE = re.compile(f"[{SAFE_CHARS}]+")


class ClaimError(RuntimeError):
    """The claims directory cannot be used (not creatable, not a directory, no permission, not trusted)."""


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
        return cls.from_dict(json_object(text))

    @classmethod
    def from_dict(cls, d: Any) -> "Claim":
        if not isinstance(d, dict):
            return cls(job="")
        return cls(job=str(d.get("job") or ""), user=str(d.get("user") or ""), host=str(d.get("host") or ""),
                   slot=_number(d, "slot", int), pid=_number(d, "pid", int), since=_number(d, "since", float))

    def describe(self) -> str:
        """`job mnist (user alice, pid 4242)`, for reasons a person reads."""
        facts = [f"user {self.user}" if self.user else "", f"pid {self.pid}" if self.pid else ""]
        facts = [f for f in facts if f]
        name = f"job {self.job}" if self.job else "another eltctl job"
        return f"{name} ({', '.join(facts)})" if facts else name


def _number(d: Mapping, key: str, kind: type):
    v = d.get(key)
    return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def json_object(text: str | bytes | None) -> dict | None:
    """The JSON object `text` holds; None for anything else."""
    if text is None:
        return None
    try:
        d = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


# --------------------------------------------------------------------------- names and the rule (pure)

@dataclass(frozen=True)
class Name:
    """A file name of the claims directory, parsed: `kind` gpu, cpu or demand; the account
    it names; the slot's base name (`gpu0`, `cpu1.ws1`) or the demand's job; the alternate
    (0: the name itself, 1..ALTERNATES: `~N`)."""

    kind: str
    user: str
    base: str = ""
    job: str = ""
    alt: int = 0


def parse_name(name: str) -> Name | None:
    """The parsed name of a claim (`gpu0@alice`, `cpu1.ws1@alice~1`) or a demand entry
    (`demand.alice.mnist`), None for any other name (outside the strict set too)."""
    m = _CLAIM_RE.fullmatch(name)
    if m is not None:
        base = f"{m['kind']}{int(m['slot'])}" + (f".{m['host']}" if m["host"] else "")
        if m["kind"] == "gpu" and m["host"]:
            return None
        return Name(kind=m["kind"], user=m["user"], base=base, alt=int(m["alt"] or 0))
    m = _DEMAND_RE.fullmatch(name)
    if m is not None and m["job"]:
        return Name(kind="demand", user=m["user"], job=m["job"], alt=int(m["alt"] or 0))
    return None


def looks_like_ours(name: str) -> bool:
    """A name that could be meant as eltctl's (a claim or a demand entry): one that does
    not parse is then reported, not silently skipped."""
    return name.startswith(("gpu", "cpu", DEMAND_PREFIX))


def shown_name(name: str) -> str:
    """A file name as reports show it: as it is when in the strict set, else escaped
    (Python's ascii(), cut to 80 characters): a newline never reaches a log or a table."""
    if _SAFE_RE.fullmatch(name) and len(name) <= 200:
        return name
    s = ascii(name)
    return s if len(s) <= 80 else s[:77] + "..."


def _shown_again(text: str) -> str:
    """A name already shown (`shown_name`) passes as it is; anything else is escaped."""
    return text if text.isascii() and text.isprintable() and len(text) <= 300 else shown_name(text)


def judge(name: str, owner: str | None, content: Mapping | None, now: float | None, *,
          alive: bool | None = None) -> str | None:
    """THE rule for an entry of the shared claims directory (the daemon and the probe's
    parser both call it): None when it is believed, else why not (one line).

    `owner`: the file owner's account (None: unknown); `content`: its JSON object (None:
    unreadable or not JSON); `now`: the host's clock; `alive`: for a held claim, whether
    its `pid` is a live process of the owner (None: not asked). An unheld claim file is
    no claim: only its name and owner are judged (`judge_owner`: a squat).

    A legacy claim (`gpu0`, one file per slot shared by all, from an eltctl before issue
    49 whose daemons may still run) names its account only in its content: it is judged
    as if named for that account."""
    if is_legacy(name):
        user = str((content or {}).get("user") or "")
        if not re.fullmatch(ACCOUNT, user):
            return "an older eltctl's claim that names no account"
        if owner != user:
            return f"an older eltctl's claim naming {user} but owned by {owner}"
        name = own_file(name, user)
    why = judge_owner(name, owner)
    if why is not None:
        return why
    n = parse_name(name)
    assert n is not None  # judge_owner refused any other name
    if content is None:
        return "its content is not a JSON object"
    user = content.get("user")
    if user != n.user:
        return f"its content names user {shown_name(str(user))!r}, not {n.user}"
    if n.kind == "demand" and content.get("job") != n.job:
        return f"its content names job {shown_name(str(content.get('job')))!r}, not {n.job}"
    stamp = _number(content, "time" if n.kind == "demand" else "since", float)
    if now is not None and stamp is not None and stamp > now + CLOCK_SKEW_S:
        return f"dated {stamp - now:.0f} s in the future"
    if alive is False:
        return f"locked, but its pid {_number(content, 'pid', int)} is no live process of {n.user}"
    return None


def is_legacy(name: str) -> bool:
    """A claim file's name from before issue 49: the slot's base name alone (`gpu0`, `cpu1.ws1`)."""
    return "@" not in name and parse_name(f"{name}@x") is not None and not name.startswith(DEMAND_PREFIX)


def judge_owner(name: str, owner: str | None) -> str | None:
    """The part of `judge` a name and its owner decide: None when `owner` is the account
    the name names (a well-formed name), else why not."""
    n = parse_name(name)
    if n is None:
        return "a name outside eltctl's strict set"
    if owner is None:
        return "its owner is unknown"
    if owner != n.user:
        return f"named for {n.user} but owned by {owner}"
    return None


@dataclass(frozen=True)
class Refusal:
    """An entry of the claims directory that was not believed: its (shown) name, its
    owner's account, and why."""

    file: str
    owner: str
    reason: str

    def to_dict(self) -> dict:
        return {"file": self.file, "owner": self.owner, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Any) -> "Refusal | None":
        if not isinstance(d, dict) or not isinstance(d.get("file"), str):
            return None
        return cls(file=_shown_again(d["file"]), owner=_shown_again(str(d.get("owner") or "?")),
                   reason=_shown_again(str(d.get("reason") or ""))[:300])

    def describe(self) -> str:
        return f"{self.file} (owner {self.owner}): {self.reason}"


def dir_problem(owner_uid: int, mode: int, my_uid: int, owner: str) -> tuple[str, bool] | None:
    """What is wrong with the claims directory (its owner's uid and account, its st_mode),
    and whether it is still used: None when it is root's or ours and sticky (or not
    writable by others)."""
    if not stat.S_ISDIR(mode):
        return "not a directory", False
    others_write = bool(mode & (stat.S_IWOTH | stat.S_IWGRP))
    if others_write and not mode & stat.S_ISVTX:
        return f"writable by other accounts without the sticky bit (mode {stat.S_IMODE(mode):o})", False
    if owner_uid not in (0, my_uid):
        return f"owned by {owner}, not root: {owner} can remove any entry (create it as root, mode 1777)", True
    return None


def refusal_doc(refused: Iterable[Refusal]) -> dict:
    """What a state document or a probe report carries: the count and the first few."""
    refused = list(refused)
    return {"count": len(refused), "entries": [r.to_dict() for r in refused[:MAX_REFUSALS]]}


# --------------------------------------------------------------------------- the directory

def slot_file(slot: int, gpu: bool = True, host: str = "") -> str:
    """The slot's base name: `gpu0`; for a CPU slot of the inventory host `host`,
    `cpu0.HOST` (`cpu0` without a host). Each account's claim file is the base name
    with `@account` (`own_file`).

    A GPU is one device, whatever name an inventory gives its machine. A CPU slot is a
    share of the machine that an inventory host entry declares (`slots`): two entries
    for one machine (`address = "local"` twice) each have their own slot 0, so the
    claim is per host name. Jobs that call a CPU box by the same name share its slots
    first come, first served, as they share GPUs."""
    if gpu:
        return f"gpu{int(slot)}"
    return f"cpu{int(slot)}.{host}" if host else f"cpu{int(slot)}"


def own_file(base: str, account: str, alt: int = 0) -> str:
    """`gpu0@alice` (`~N` for the Nth alternate of a squatted name)."""
    return f"{base}@{account}" + (f"~{alt}" if alt else "")


def parse_slot_file(name: str) -> tuple[str, int, str] | None:
    """(`gpu` or `cpu`, slot, host) of a claim file's name (`own_file`, or a base name);
    None for another file."""
    n = parse_name(name) if "@" in name else parse_name(f"{name}@x")
    if n is None or n.kind == "demand":
        return None
    number, _, host = n.base[3:].partition(".")
    return n.kind, int(number), host


def account(uid: int) -> str:
    """The account name of a uid (its number when it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def my_account() -> str:
    return account(os.geteuid())


def claims_dir(configured: str | os.PathLike | None, env: Mapping[str, str]) -> Path:
    """Where this host's claims live: daemon.json's `claims_dir`, else $ELTCTL_CLAIMS_DIR
    of the environment given (the daemon's), else DEFAULT_DIR."""
    if configured:
        return Path(configured).expanduser()
    return Path(env.get(ENV) or DEFAULT_DIR).expanduser()


def check_dir(directory: Path) -> Refusal | None:
    """The directory's own problem as a refusal (None: none); raises ClaimError when it
    cannot be trusted at all."""
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise ClaimError(f"cannot use the GPU claims directory {directory}: {e.strerror}") from None
    found = dir_problem(st.st_uid, st.st_mode, os.geteuid(), account(st.st_uid))
    if found is None:
        return None
    why, usable = found
    if not usable:
        raise ClaimError(f"the GPU claims directory {directory} is {why}: nothing in it is trusted; remove it "
                         f"(root: `rm -rf {directory}`) so it is made again with mode 1777, or point {ENV} elsewhere")
    return Refusal(file=str(directory), owner=account(st.st_uid), reason=f"the directory is {why}")


def ensure_dir(directory: Path) -> Refusal | None:
    """Create the claims directory (mode 1777) if it is missing; the directory's problem
    (`check_dir`) if it has one it can be used with."""
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
    if not directory.is_dir() or directory.is_symlink():
        raise ClaimError(f"the GPU claims path {directory} is not a directory; remove it or point {ENV} "
                         "on the host elsewhere")
    return check_dir(directory)


def open_entry(path: Path | str) -> tuple[int, os.stat_result] | None:
    """An entry opened for reading without ever blocking or following a link: (fd, its
    fstat) for a regular file, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def pid_of(uid: int, pid: int | None) -> bool:
    """A live process `pid` (not a zombie) that runs as `uid`."""
    if not pid or pid <= 0:
        return False
    try:
        st = os.stat(f"/proc/{int(pid)}")
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return st.st_uid == uid and state not in (b"Z", b"X")


class Squatted(ClaimError):
    """Every name this account may write a file under is another account's."""


def open_own(directory: Path, name: str) -> tuple[int, str, list[Refusal]]:
    """A file of this account for `name` (a claim or a demand entry) in `directory`:
    (fd opened read-write, the name used, the squatted names met). The name itself,
    else its alternates `~1..~ALTERNATES` when another account holds it (reported)."""
    me = os.geteuid()
    squats: list[Refusal] = []
    for alt in range(ALTERNATES + 1):
        used = name + (f"~{alt}" if alt else "")
        path = directory / used
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            owner = _owner_of(path)
            squats.append(Refusal(file=used, owner=owner, reason=f"squatted: {owner} holds this account's name"))
            continue
        st = os.fstat(fd)
        if st.st_uid != me or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            owner = account(st.st_uid)
            squats.append(Refusal(file=used, owner=owner, reason=f"squatted: {owner} holds this account's name"))
            continue
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)  # past the umask; never writable by others
        return fd, used, squats
    raise Squatted("; ".join(r.describe() for r in squats))


def _owner_of(path: Path) -> str:
    try:
        return account(os.lstat(path).st_uid)
    except OSError:
        return "?"


class Taken(Exception):
    """The slot's claim is held: by `holder` (None when it could not be read)."""

    def __init__(self, slot_name: str, holder: Claim | None) -> None:
        super().__init__(f"{slot_name} is held by {holder.describe() if holder else 'another process'}")
        self.holder = holder


class Held:
    """A claim this process holds: an open file description with LOCK_EX on it.

    `record(pid)` rewrites the file with the worker's pid; `close()` drops this
    process's descriptor (the lock stays while the worker holds its copy)."""

    def __init__(self, fd: int, path: Path, claim: Claim, refused: tuple[Refusal, ...] = ()) -> None:
        self.fd = fd
        self.path = path
        self.claim = claim
        self.refused = refused  # the squatted names and other entries refused on the way

    def record(self, claim: Claim) -> None:
        """Name the worker holding it now (its pid is what readers check is alive)."""
        self.claim = claim
        try:
            _write(self.fd, claim)
        except OSError:
            pass  # a full disk: the file keeps the daemon's pid, believed while the daemon lives

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
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read(fd: int, limit: int = CLAIM_MAX_BYTES) -> bytes:
    try:
        return os.pread(fd, limit, 0)
    except OSError:
        return b""


def take(directory: Path, base: str, claim: Claim, tries: int = TRIES) -> Held:
    """Claim the slot `base` (`slot_file`) for `claim` (its job, host, slot, pid, since;
    its user is this account, whatever it says).

    Returns the `Held` claim (pass its fd to the worker, then close it here).
    Raises `Taken` when another holder has it, `ClaimError` when the directory
    cannot be used (`Squatted` when every name of this account is another's)."""
    dir_refusal = ensure_dir(directory)
    claim = replace(claim, user=my_account())
    try:
        fd, used, squats = open_own(directory, own_file(base, claim.user))
    except OSError as e:
        raise ClaimError(f"cannot open the GPU claim {directory / own_file(base, claim.user)}: {e.strerror or e}; "
                         f"make the claims directory world-writable and sticky (mode 1777) or point {ENV} "
                         "on the host elsewhere") from None
    refused = tuple(squats) + ((dir_refusal,) if dir_refusal else ())
    other: Claim | None = None
    for attempt in range(max(1, tries)):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # this account's own file: another job of it (or a lingering worker of this one)
            # holds it, or a reader's instant shared lock, which must not look like a claim
            other = Claim.from_json(_read(fd))
            if other.job and other.job != claim.job and attempt >= 1:
                break  # a real holder names itself: no need to wait out the retries
            time.sleep(RETRY_S)
            continue
        except OSError as e:
            os.close(fd)
            raise ClaimError(f"cannot lock the GPU claim {directory / used}: {e.strerror or e}") from None
        try:
            _write(fd, claim)
        except OSError as e:
            os.close(fd)
            raise ClaimError(f"cannot write the GPU claim {directory / used}: {e.strerror or e}") from None
        # Write, then look: of two accounts racing, at least one sees the other.
        other = holder(directory, base, exclude=used)
        if other is None:
            return Held(fd, directory / used, claim, refused)
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        time.sleep(random.uniform(*BACKOFF_S))
    os.close(fd)
    raise Taken(base, other)


def entries(directory: Path) -> list[str]:
    """The names in the directory ([] when it cannot be listed)."""
    try:
        return [e.name for e in os.scandir(directory)]
    except OSError:
        return []


def look(directory: Path, name: str, now: float | None = None) -> tuple[Claim | None, Refusal | None]:
    """One claim file: (its claim when held and believed, None otherwise; the refusal
    when it is refused). An unheld file is no claim; refused only when squatted (its
    name names another account than its owner)."""
    opened = open_entry(directory / name)
    if opened is None:
        return None, (Refusal(shown_name(name), _owner_of(directory / name), "not a regular file")
                      if looks_like_ours(name) and os.path.lexists(directory / name) else None)
    fd, st = opened
    try:
        owner = account(st.st_uid)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = _read(fd)
        except OSError:
            return None, None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            why = None if is_legacy(name) else judge_owner(name, owner)
            return None, (Refusal(shown_name(name), owner, why) if why else None)
    finally:
        os.close(fd)
    doc = json_object(raw)
    alive = pid_of(st.st_uid, _number(doc, "pid", int)) if doc is not None else None
    why = judge(name, owner, doc, time.time() if now is None else now, alive=alive)
    if why is not None:
        return None, Refusal(shown_name(name), owner, why)
    return Claim.from_dict(doc), None


def holder(directory: Path, base: str, *, exclude: str = "", refused: list | None = None) -> Claim | None:
    """Who holds the slot `base` now (a believed claim of any account); None when nobody
    does. `refused`: where the refused files of the slot are appended."""
    found = None
    for name in sorted(entries(directory)):
        if name == exclude or not name.startswith(base):
            continue
        n = parse_name(name) if name != base else Name(kind=base[:3], user="", base=base)  # legacy
        if n is None:
            if refused is not None and (name.startswith(base + "@") or "\n" in name):
                refused.append(Refusal(shown_name(name), _owner_of(directory / name),
                                       "a name outside eltctl's strict set"))
            continue
        if n.kind == "demand" or n.base != base:
            continue
        claim, why = look(directory, name)
        if why is not None and refused is not None:
            refused.append(why)
        if claim is not None and found is None:
            found = claim
    return found


def holders(directory: Path, bases: Iterable[str]) -> dict[str, Claim]:
    """base name -> the holder, for the held ones among `bases`."""
    out = {}
    for base in bases:
        h = holder(directory, base)
        if h is not None:
            out[base] = h
    return out


# --------------------------------------------------------------------------- demand entries

def demand_stale_after(every: float) -> float:
    """Seconds after which a demand entry written every `every` seconds is stale (its
    controller is gone): an entry's `time` and the reader's clock are the host's."""
    return max(DEMAND_STALE_MIN_S, 3 * every)


def demand_fresh(entry: Mapping, host_now: float) -> bool:
    """A demand entry (a file's JSON object) written recently enough to count (and not
    in the future beyond the clock skew allowed: such a time would stay fresh for ever)."""
    def num(key: str, default: float) -> float:
        v = entry.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    t = num("time", 0.0)
    return host_now - t <= demand_stale_after(num("every", 30.0)) and t <= host_now + CLOCK_SKEW_S


class DemandReader:
    """The believed, fresh demand entries of one claims directory, read cheaply enough for
    every watch interval: the directory is listed, and a file is opened again only when it
    was replaced (the writers rename a new file over it: another inode or mtime). Nothing
    is read before `read`. `refused`: the entries refused at the last `read` (`judge`)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._cache: dict[str, tuple[tuple[int, int, int, int], dict | None, str]] = {}
        self.refused: list[Refusal] = []

    def read(self, host_now: float) -> list[dict]:
        """The believed fresh entries (each file's JSON object, with `job`), sorted by file name."""
        seen: dict[str, tuple[tuple[int, int, int, int], dict | None, str]] = {}
        refused: list[Refusal] = []
        try:
            listing = list(os.scandir(self._dir))
        except OSError:
            listing = []
        for e in listing:
            if not e.name.startswith(DEMAND_PREFIX):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            owner = account(st.st_uid)
            if parse_name(e.name) is None:
                refused.append(Refusal(shown_name(e.name), owner, "a name outside eltctl's strict set"))
                continue
            if not stat.S_ISREG(st.st_mode):
                refused.append(Refusal(e.name, owner, "not a regular file"))
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_uid)
            cached = self._cache.get(e.name)
            if cached is None or cached[0] != sig:
                doc, uid = _read_demand(e.path)
                cached = (sig, doc, account(uid) if uid is not None else owner)
            seen[e.name] = cached
        self._cache = seen
        out = []
        for name, (_, doc, owner) in sorted(seen.items()):
            why = judge(name, owner, doc, host_now)
            if why is not None:
                refused.append(Refusal(name, owner, why))
            elif demand_fresh(doc, host_now):
                out.append(doc)
        self.refused = refused
        return out


def _read_demand(path: str) -> tuple[dict | None, int | None]:
    """A demand file's JSON object and its owner's uid (fstat of what was read)."""
    opened = open_entry(path)
    if opened is None:
        return None, None
    fd, st = opened
    try:
        raw = os.read(fd, DEMAND_MAX_BYTES)
    except OSError:
        return None, st.st_uid
    finally:
        os.close(fd)
    return json_object(raw), st.st_uid


__all__ = ["ALTERNATES", "CLOCK_SKEW_S", "Claim", "ClaimError", "DEFAULT_DIR", "DEMAND_PREFIX", "DemandReader", "ENV",
           "Held", "Name", "Refusal", "SAFE_CHARS", "Squatted", "Taken", "account", "check_dir", "claims_dir",
           "demand_fresh", "demand_stale_after", "dir_problem", "ensure_dir", "holder", "holders", "judge",
           "json_object", "is_legacy", "judge_owner", "look", "my_account", "open_entry", "open_own", "own_file", "parse_name",
           "parse_slot_file", "pid_of", "refusal_doc", "shown_name", "slot_file", "take"]
