"""Owner signals beyond the GPU: is the person who owns this machine using it?

HTCondor's desktop policy is the model: start only after the keyboard has been
idle for a while (15 minutes) and the CPU load of other people's processes is low
(below 0.3); leave when the owner comes back. Four signals, each optional (an
`OwnerPolicy` names the ones watched; none by default):

    login     an interactive login of another user (not the job's user) in utmp
              (USER_PROCESS records of /var/run/utmp, glibc's x86_64 `struct utmp`,
              384 bytes), idle for the time since the atime of /dev/<ut_line> (as `w`
              computes it; no tty file: idle since the login)
    keyboard  console input: the newest atime of /dev/input/* and /dev/tty<N> (the
              kernel sets a tty's atime on input; an input device's where it does);
              a host that exposes none has no keyboard signal
    load      the CPU time of processes that are not an eltctl job's, as a rate in
              CPUs between two looks (/proc/<pid>/stat utime+stime)
    memory    the resident memory of those processes, summed (each of at least
              MIN_COUNTED_MIB)

Not an owner: this process, its ancestors (the probe's shell and SSH session) and
descendants (the daemon's workers), kernel threads, and any process whose
environment holds ELTCTL_JOB (every eltctl job's daemon and workers, so two jobs
never take each other for an owner). A process whose environment cannot be read
(another user's, when not root) is an owner's.

The hysteresis (`evaluate`, pure, a fake clock in its tests):

    clear --an input within active_within, load above leave_load for leave_load_for,
            memory above memory_mib--> held   (the signal fires: workers leave)
    held  --every watched signal idle >= idle_to_start and load < start_load
            and memory below memory_mib--> clear   (workers may start again)

While the start condition does not hold (held, or a login idle for less than
idle_to_start), nothing new starts (`Verdict.wait`); only a firing signal makes
running workers leave (`Verdict.leave`).

Where the facts come from (`Sources`): utmp from `$ELTCTL_UTMP` (default
/var/run/utmp), tty and input files under `$ELTCTL_DEV_ROOT` (default /dev); with
`ELTSIM_HOST` set (a simulated host of the test bed, which shares one machine's
processes) only processes whose environment holds the same ELTSIM_HOST count.
`Sources.from_env` reads those variables once, at the program's edge.

This module is stdlib only and self-contained (no package imports): the probe sends
its source to a host that has no runtime installed and runs it as
`python3 -c SOURCE check POLICY_JSON` (see `main`).
"""

from __future__ import annotations

import json
import os
import pwd
import struct
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

SIGNALS = ("login", "keyboard", "load", "memory")
MIN_COUNTED_MIB = 16  # smaller processes are not summed for the memory signal
UTMP_DEFAULT = "/var/run/utmp"
DEV_DEFAULT = "/dev"

# glibc x86_64 struct utmp: type, pid, line[32], id[4], user[32], host[256],
# exit {short, short}, session, tv {int32 sec, int32 usec}, addr_v6[4], unused[20]
UTMP_FORMAT = "<hhi32s4s32s256shhiii4i20s"
UTMP_SIZE = struct.calcsize(UTMP_FORMAT)  # 384
USER_PROCESS = 7


# --------------------------------------------------------------------------- policy

@dataclass(frozen=True)
class OwnerPolicy:
    """Which signals are watched and their thresholds ([policy] owner_* keys; a
    [[hosts]] entry may override each). The documented defaults are these."""

    signals: tuple[str, ...] = ()  # watched signals, of SIGNALS; () watches none
    idle_to_start: float = 900.0  # s of login/keyboard idleness before workers may start
    active_within: float = 60.0  # s: input this recent means the owner is back (leave)
    start_load: float = 0.3  # CPUs of foreign load below which workers may start
    leave_load: float = 1.0  # CPUs of foreign load above which (for leave_load_for) workers leave
    leave_load_for: float = 60.0  # s the foreign load must stay above leave_load
    memory_mib: int = 4096  # MiB of foreign resident memory above which workers leave

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    def to_dict(self) -> dict:
        return {"signals": list(self.signals), "idle_to_start": self.idle_to_start,
                "active_within": self.active_within, "start_load": self.start_load,
                "leave_load": self.leave_load, "leave_load_for": self.leave_load_for,
                "memory_mib": self.memory_mib}

    @classmethod
    def from_dict(cls, d: Any, source: str = "owner") -> "OwnerPolicy":
        """From `to_dict`'s shape; missing keys take the defaults. ValueError names the key."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"{source} must be a JSON object, not {type(d).__name__}")
        base = cls()
        signals = d.get("signals", list(base.signals))
        if not isinstance(signals, list) or any(s not in SIGNALS for s in signals):
            raise ValueError(f"{source}.signals must be a list of {', '.join(SIGNALS)}, not {signals!r}")
        values: dict[str, Any] = {"signals": tuple(dict.fromkeys(signals))}
        for key in ("idle_to_start", "active_within", "start_load", "leave_load", "leave_load_for", "memory_mib"):
            v = d.get(key, getattr(base, key))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{source}.{key} must be a number >= 0, not {v!r}")
            values[key] = int(v) if key == "memory_mib" else float(v)
        return cls(**values)


# --------------------------------------------------------------------------- facts

@dataclass(frozen=True)
class Login:
    """One interactive login (a USER_PROCESS record of utmp)."""

    user: str
    line: str  # the tty, e.g. pts/3
    host: str  # where from ("" on the console)
    pid: int
    idle: float  # seconds since the tty's last input (since the login without a tty file)


@dataclass(frozen=True)
class Looks:
    """What one look at the host saw (None: not measured or not exposed)."""

    logins: tuple[Login, ...] = ()  # other users' logins only
    input_idle: float | None = None  # s since the newest console/keyboard input
    input_what: str = ""  # the device that had it, e.g. tty2
    load: float | None = None  # foreign CPU load in CPUs (None: the first look, no rate yet)
    load_top: tuple[int, str, float] | None = None  # (pid, user, CPUs) of the busiest foreign process
    memory_mib: float | None = None  # foreign resident memory, MiB
    memory_top: tuple[int, str, float] | None = None  # (pid, user, MiB) of the largest


@dataclass(frozen=True)
class OwnerSignal:
    """The signal that holds the host: `name` of SIGNALS, a line for people, and
    `user` for the Yield record ("alice (login on pts/3)")."""

    name: str
    detail: str
    user: str
    pid: int = 0
    since: float = 0.0  # wall clock when it began to hold

    def to_dict(self) -> dict:
        return {"name": self.name, "detail": self.detail, "since": round(self.since, 3)}


@dataclass(frozen=True)
class OwnerState:
    """What `evaluate` remembers between looks."""

    held: OwnerSignal | None = None  # fired, and the start condition has not held since
    load_high_since: float | None = None  # monotonic: since when the load is above leave_load
    waiting: OwnerSignal | None = None  # the last look's unmet start condition (its `since` is kept)


@dataclass(frozen=True)
class Verdict:
    leave: OwnerSignal | None = None  # the owner is back: running workers leave (planned)
    wait: OwnerSignal | None = None  # the start condition does not hold: nothing new starts

    @property
    def holding(self) -> OwnerSignal | None:
        return self.leave or self.wait


# --------------------------------------------------------------------------- the decision

def _login_signal(login: Login, wall: float, why: str) -> OwnerSignal:
    where = f" from {login.host}" if login.host else ""
    return OwnerSignal("login", f"{login.user} logged in on {login.line}{where}, idle {login.idle:.0f} s{why}",
                       f"{login.user} (login on {login.line})", login.pid, wall)


def _load_signal(looks: Looks, wall: float, why: str) -> OwnerSignal:
    pid, user, cpus = looks.load_top or (0, "", 0.0)
    top = f"; busiest: pid {pid} of {user} at {cpus:.2f} CPUs" if pid else ""
    return OwnerSignal("load", f"load of other processes {looks.load:.2f} CPUs{why}{top}",
                       f"{user or 'other processes'} (CPU load {looks.load:.2f})", pid, wall)


def _memory_signal(looks: Looks, wall: float, why: str) -> OwnerSignal:
    pid, user, mib = looks.memory_top or (0, "", 0.0)
    top = f"; largest: pid {pid} of {user} with {mib:.0f} MiB" if pid else ""
    return OwnerSignal("memory", f"other processes hold {looks.memory_mib:.0f} MiB{why}{top}",
                       f"{user or 'other processes'} (memory {looks.memory_mib:.0f} MiB)", pid, wall)


def evaluate(policy: OwnerPolicy, looks: Looks, state: OwnerState, now: float, wall: float
             ) -> tuple[OwnerState, Verdict]:
    """The hysteresis of the module docstring. `now` is monotonic, `wall` time.time()."""
    if not policy.enabled:
        return OwnerState(), Verdict()
    on = set(policy.signals)
    fired: list[OwnerSignal] = []  # leave triggers
    blocks: list[OwnerSignal] = []  # start condition failures

    if "login" in on:
        for lg in sorted(looks.logins, key=lambda x: x.idle):
            if lg.idle < policy.active_within:
                fired.append(_login_signal(lg, wall, ""))
            if lg.idle < policy.idle_to_start:
                blocks.append(_login_signal(lg, wall, f" (starts after {policy.idle_to_start:g} s idle)"))
    if "keyboard" in on and looks.input_idle is not None:
        line = f"console input on {looks.input_what or 'a console'} {looks.input_idle:.0f} s ago"
        sig = OwnerSignal("keyboard", line, f"the console user (input on {looks.input_what or 'a console'})",
                          0, wall)
        if looks.input_idle < policy.active_within:
            fired.append(sig)
        if looks.input_idle < policy.idle_to_start:
            blocks.append(replace(sig, detail=line + f" (starts after {policy.idle_to_start:g} s idle)"))
    high_since = None
    if "load" in on:
        if looks.load is None:
            blocks.append(OwnerSignal("load", "the load of other processes is not measured yet", "load", 0, wall))
        else:
            if looks.load > policy.leave_load:
                high_since = state.load_high_since if state.load_high_since is not None else now
                if now - high_since >= policy.leave_load_for:
                    fired.append(_load_signal(looks, wall, f" (above {policy.leave_load:g} for "
                                                           f"{now - high_since:.0f} s)"))
            if looks.load >= policy.start_load:
                blocks.append(_load_signal(looks, wall, f" (starts below {policy.start_load:g})"))
    if "memory" in on and looks.memory_mib is not None and looks.memory_mib > policy.memory_mib:
        sig = _memory_signal(looks, wall, f" (above {policy.memory_mib} MiB)")
        fired.append(sig)
        blocks.append(sig)

    held = state.held
    if held is None and fired:
        held = fired[0]
    elif held is not None and not blocks:
        held = None  # the start condition holds again
    new = OwnerState(held=held, load_high_since=high_since)
    if held is None:
        wait = blocks[0] if blocks else None
        if wait is not None and state.waiting is not None and state.waiting.name == wait.name:
            wait = replace(wait, since=state.waiting.since)
        return replace(new, waiting=wait), Verdict(wait=wait)
    # Held: keep the first signal's name and start, with the freshest detail of that kind.
    current = next((s for s in fired + blocks if s.name == held.name), None)
    shown = replace(current, since=held.since) if current is not None else held
    return replace(new, held=replace(held, detail=shown.detail)), Verdict(leave=shown if fired else None, wait=shown)


# --------------------------------------------------------------------------- reading the host

@dataclass(frozen=True)
class Sources:
    """Where the facts are read (see the module docstring)."""

    utmp: str = UTMP_DEFAULT
    dev_root: str = DEV_DEFAULT
    sim_host: str | None = None  # ELTSIM_HOST: count only processes of this simulated host

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Sources":
        return cls(utmp=env.get("ELTCTL_UTMP") or UTMP_DEFAULT, dev_root=env.get("ELTCTL_DEV_ROOT") or DEV_DEFAULT,
                   sim_host=env.get("ELTSIM_HOST") or None)


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def parse_utmp(data: bytes) -> list[tuple[int, int, str, str, str, float]]:
    """(type, pid, line, user, host, login time) of each whole record."""
    out = []
    for off in range(0, len(data) - UTMP_SIZE + 1, UTMP_SIZE):
        r = struct.unpack_from(UTMP_FORMAT, data, off)
        out.append((r[0], r[2], _cstr(r[3]), _cstr(r[5]), _cstr(r[6]), r[10] + r[11] / 1e6))
    return out


def pack_utmp(user: str, line: str, *, pid: int, host: str = "", login_time: float | None = None,
              kind: int = USER_PROCESS) -> bytes:
    """One utmp record (the tests write real ones; also documents the layout)."""
    t = time.time() if login_time is None else login_time
    return struct.pack(UTMP_FORMAT, kind, 0, pid, line.encode()[:32], line[-4:].encode()[:4], user.encode()[:32],
                       host.encode()[:256], 0, 0, 0, int(t), int((t % 1) * 1e6), 0, 0, 0, 0, b"")


def read_logins(src: Sources, skip_user: str, wall: float) -> tuple[Login, ...]:
    """Other users' interactive logins, with their idle times."""
    try:
        with open(src.utmp, "rb") as f:
            data = f.read()
    except OSError:
        return ()
    out = []
    for kind, pid, line, user, host, login_time in parse_utmp(data):
        if kind != USER_PROCESS or not user or user == skip_user or not line:
            continue
        try:
            idle = max(0.0, wall - os.stat(os.path.join(src.dev_root, line)).st_atime)
        except OSError:
            idle = max(0.0, wall - login_time)
        out.append(Login(user, line, host, pid, idle))
    return tuple(out)


def read_input_idle(src: Sources, wall: float) -> tuple[float | None, str]:
    """(seconds since the newest input, its device) over /dev/input/* and /dev/tty<N>; (None, "") if none."""
    newest, what = None, ""
    candidates = []
    try:
        candidates += [os.path.join("input", n) for n in os.listdir(os.path.join(src.dev_root, "input"))]
    except OSError:
        pass
    try:
        candidates += [n for n in os.listdir(src.dev_root) if n.startswith("tty") and n[3:].isdigit() and n != "tty0"]
    except OSError:
        pass
    for rel in candidates:
        try:
            at = os.stat(os.path.join(src.dev_root, rel)).st_atime
        except OSError:
            continue
        if newest is None or at > newest:
            newest, what = at, rel
    return (None, "") if newest is None else (max(0.0, wall - newest), what)


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, utime+stime ticks, rss pages, starttime) of a live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            tail = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not tail or tail[0] == b"Z":
        return None
    return int(tail[1]), int(tail[11]) + int(tail[12]), int(tail[21]), int(tail[19])


def _environ(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def _user(pid: int) -> str:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class ProcessMeter:
    """Foreign CPU load (a rate between two looks) and resident memory, from /proc.
    Keeps the previous look's CPU times and each process's classification."""

    def __init__(self, src: Sources, self_pid: int | None = None) -> None:
        self._src = src
        self._self = self_pid if self_pid is not None else os.getpid()
        self._prev: dict[int, int] | None = None
        self._prev_t = 0.0
        self._kind: dict[tuple[int, int], bool] = {}  # (pid, starttime) -> foreign
        self._tick = os.sysconf("SC_CLK_TCK")
        self._page_mib = os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    def _foreign(self, pid: int, start: int, mine: set[int]) -> bool:
        key = (pid, start)
        if key not in self._kind:
            if pid in mine:
                self._kind[key] = False
            else:
                env = _environ(pid)
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        kernel = not f.read(1)
                except OSError:
                    kernel = True
                if kernel:
                    self._kind[key] = False
                elif env is None:
                    self._kind[key] = self._src.sim_host is None  # unreadable: another user's
                else:
                    items = env.split(b"\0")
                    ours = any(i.startswith(b"ELTCTL_JOB=") for i in items)
                    here = (self._src.sim_host is None
                            or f"ELTSIM_HOST={self._src.sim_host}".encode() in items)
                    self._kind[key] = here and not ours
        return self._kind[key]

    def look(self, now: float, memory: bool = True) -> tuple[float | None, tuple | None, float | None, tuple | None]:
        """(load CPUs, (pid, user, CPUs) top, memory MiB, (pid, user, MiB) top); load None on the first look."""
        stats: dict[int, tuple[int, int, int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                s = _stat(int(name))
                if s is not None:
                    stats[int(name)] = s
        # This process, its ancestors (the session that runs it) and its descendants are ours.
        mine = {self._self}
        p = self._self
        while p in stats and stats[p][0] > 1:
            p = stats[p][0]
            mine.add(p)
        children: dict[int, list[int]] = {}
        for pid, s in stats.items():
            children.setdefault(s[0], []).append(pid)
        todo = [self._self]
        while todo:
            for c in children.get(todo.pop(), ()):
                if c not in mine:
                    mine.add(c)
                    todo.append(c)
        load = top_load = mem = top_mem = None
        ticks = {pid: s[1] for pid, s in stats.items()}
        if self._prev is not None and now > self._prev_t:
            dt = now - self._prev_t
            used = {pid: t - self._prev.get(pid, 0) for pid, t in ticks.items()}
            rates = {pid: d / self._tick / dt for pid, d in used.items()
                     if d > 0 and self._foreign(pid, stats[pid][3], mine)}
            load = sum(rates.values())
            if rates:
                pid = max(rates, key=rates.__getitem__)
                top_load = (pid, _user(pid), rates[pid])
        if memory:
            sizes = {pid: s[2] * self._page_mib for pid, s in stats.items()}
            counted = {pid: m for pid, m in sizes.items()
                       if m >= MIN_COUNTED_MIB and self._foreign(pid, stats[pid][3], mine)}
            mem = sum(counted.values())
            if counted:
                pid = max(counted, key=counted.__getitem__)
                top_mem = (pid, _user(pid), counted[pid])
        self._prev, self._prev_t = ticks, now
        live = {(pid, s[3]) for pid, s in stats.items()}
        self._kind = {k: v for k, v in self._kind.items() if k in live}
        return load, top_load, mem, top_mem


class OwnerWatch:
    """Looks at the host for a policy and evaluates it (the daemon keeps one; the
    probe makes one, looks twice `sample_s` apart, and reports)."""

    def __init__(self, policy: OwnerPolicy, src: Sources, user: str | None = None) -> None:
        self.policy = policy
        self.src = src
        self.user = user if user is not None else _user(os.getpid())
        self.state = OwnerState()
        self._meter = ProcessMeter(src)

    def look(self, now: float, wall: float) -> Looks:
        on = set(self.policy.signals)
        logins = read_logins(self.src, self.user, wall) if "login" in on else ()
        idle, what = read_input_idle(self.src, wall) if "keyboard" in on else (None, "")
        load = top = mem = mtop = None
        if on & {"load", "memory"}:
            load, top, mem, mtop = self._meter.look(now, memory="memory" in on)
        return Looks(logins, idle, what, load, top, mem, mtop)

    def step(self, now: float, wall: float) -> Verdict:
        self.state, verdict = evaluate(self.policy, self.look(now, wall), self.state, now, wall)
        return verdict


def check(policy: OwnerPolicy, src: Sources, sample_s: float = 0.5) -> dict:
    """The probe's answer: {"wait": signal or null, "leave": signal or null}. Without
    memory of earlier looks it judges the start condition (and a firing input)."""
    watch = OwnerWatch(policy, src)
    if {"load", "memory"} & set(policy.signals):
        watch.look(time.monotonic(), time.time())  # the first of two looks: a rate needs both
        time.sleep(sample_s)
    verdict = watch.step(time.monotonic(), time.time())
    return {"wait": verdict.wait.to_dict() if verdict.wait else None,
            "leave": verdict.leave.to_dict() if verdict.leave else None}


def main(argv: Iterable[str] | None = None) -> int:
    """`check POLICY_JSON`: print `check`'s answer as one JSON line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "check":
        print("usage: owner check POLICY_JSON", file=sys.stderr)
        return 2
    try:
        policy = OwnerPolicy.from_dict(json.loads(args[1]))
    except ValueError as e:
        print(f"owner: bad policy: {e}", file=sys.stderr)
        return 2
    print(json.dumps(check(policy, Sources.from_env(os.environ))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
