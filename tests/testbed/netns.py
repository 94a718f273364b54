"""A shaped network test bed: simulated hosts in their own network namespaces.

Every figure measured on loopback hides the network a lab really has (1 GbE
between workstations, sometimes less). This bed gives each simulated host its
own network stack (a namespace with one interface, `eth0`, on a private /24)
and joins them by a bridge, like workstations on an office switch:

    host ns h1: eth0 10.77.X.1 --veth-- port h1 \\
    host ns h2: eth0 10.77.X.2 --veth-- port h2  >- br0 in the bed's switch ns
    ...                                          /

The bridge lives in a namespace of its own, so the bed adds nothing to the
machine's own network (no interface, no route, no firewall interplay) and two
beds can never collide: each has its own stacks, its own namespace names (the
creating pid and a random token in each), and a random X in its subnet.

Each host's link is shaped with `tc` (`Link`): the rate limits both directions
(`tbf` on `eth0` and on the switch port); delay, jitter and loss apply to what
the host sends (`netem` on `eth0`), so a path's round trip is the sum of its two
hosts' delays. `tc_commands` decides the qdiscs (a pure function); the bed only
runs them. A kernel without `sch_netem` delays through the user-space delay line
(delayline.py: eth0's egress is redirected to a TAP, a process holds what the host
sends and writes it to a TAP port of the bridge; the rate stays tbf's):
`delay_line=True`, or by itself where a starting link needs a delay. Where neither works, `shaping_missing_reason`
says why and the bed raises `ShapingUnsupported` with the fix.

Commands run inside a host by `ip netns exec` (`run_in` returns the process in
its own session; the bed kills each such process group at exit, then every
process left in its namespaces, then deletes them). A bed whose owner was
SIGKILLed leaves namespaces named with a dead pid; the next bed's start removes
them (`remove_stale`). Root is needed; `netns_missing_reason` says why not.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from . import procs

PREFIX = "eltnet-"     # every namespace a bed makes is named PREFIX<pid>-<token>-<host>
IFNAME = "eth0"        # a host's interface (gloo's GLOO_SOCKET_IFNAME, sshd's ListenAddress)
BRIDGE = "br0"
LINE_TAP = "delay0"    # with a delay line: the TAP in each host that eth0's egress is redirected to
SWITCH = "sw"          # the host name of the bridge's namespace (not a valid host name)
NETEM_HINT = ("this kernel has no sch_netem qdisc, which delay, jitter and loss need: "
              "`modprobe sch_netem`, or a kernel built with CONFIG_NET_SCH_NETEM")


class ShapingUnsupported(RuntimeError):
    """The kernel lacks a qdisc that a Link needs (the message says which, and the fix)."""


@dataclass(frozen=True)
class Link:
    """One host's link to the switch. None/0 means unshaped in that respect.

    rate_mbit limits each direction; delay_ms, jitter_ms and loss_pct apply to
    what the host sends (so an A-B round trip is delay(A) + delay(B)).
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"Link rate_mbit must be positive (or None for unshaped), not {self.rate_mbit}")
        if min(self.delay_ms, self.jitter_ms, self.loss_pct) < 0 or self.loss_pct > 100:
            raise ValueError(f"Link delay/jitter must be >= 0 and loss_pct in [0, 100]: {self}")
        if self.jitter_ms and not self.delay_ms:
            raise ValueError(f"Link jitter_ms needs a delay_ms to vary around: {self}")

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_ms or self.loss_pct)

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"]
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g} ms" + (f" ±{self.jitter_ms:g}" if self.jitter_ms else ""))
        if self.loss_pct:
            parts.append(f"{self.loss_pct:g} % loss")
        return ", ".join(parts)


UNSHAPED = Link()


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters for a rate: a burst of at least 4 ms of traffic (tbf cannot
    send faster than burst per timer tick, and a 64 KiB GSO packet must fit) and
    a queue of 50 ms (the figures in /work/shared/elastic-notes.md used these)."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(256 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


def tc_commands(dev: str, link: Link, *, sending: bool) -> list[list[str]]:
    """The `tc` argv lists (without the leading `tc -n NS`) that shape `dev`.

    sending: `dev` is the host's own interface (its egress is what the host
    sends: rate, delay, jitter, loss); otherwise it is the switch port towards
    the host (rate only). With both delay and rate, netem is the root and tbf
    its child, the usual way to get both from netem and tbf.
    """
    netem: list[str] = []
    if sending and link.needs_netem:
        netem = ["netem", "limit", "100000"]
        if link.delay_ms:
            netem += ["delay", f"{link.delay_ms:g}ms"]
            if link.jitter_ms:  # netem's queue is ordered by send time: jitter reorders packets
                netem += [f"{link.jitter_ms:g}ms"]
        if link.loss_pct:
            netem += ["loss", f"{link.loss_pct:g}%"]
    if netem and link.rate_mbit:
        return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *netem],
                ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf_args(link.rate_mbit)]]
    if netem:
        return [["qdisc", "add", "dev", dev, "root", *netem]]
    if link.rate_mbit:
        return [["qdisc", "add", "dev", dev, "root", *tbf_args(link.rate_mbit)]]
    return []


def namespace_name(pid: int, token: str, host: str) -> str:
    return f"{PREFIX}{pid}-{token}-{host}"


def owner_pid(ns: str) -> int | None:
    """The pid of the process that made a bed namespace (None: not one of ours)."""
    if not ns.startswith(PREFIX):
        return None
    head = ns[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def stale_namespaces(names: Sequence[str], alive) -> list[str]:
    """The bed namespaces among `names` whose maker is dead (`alive(pid)` says)."""
    return [n for n in names if (pid := owner_pid(n)) is not None and not alive(pid)]


# --- I/O: ip, tc and processes ----------------------------------------------------

def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in `ns` (sshd daemons, workers a test forgot)."""
    for _ in range(3):
        done = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    """Kill its processes, then delete it (its veths and bridge go with it)."""
    _kill_namespace_processes(ns)
    _run(["ip", "netns", "delete", ns], check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces that beds of dead processes left behind; returns their names."""
    stale = stale_namespaces(list_namespaces(), procs.is_alive)
    for ns in stale:
        delete_namespace(ns)
    return stale


_probed: dict[str, str | None] = {}


def netns_missing_reason() -> str | None:
    """Why this bed cannot run here, or None if it can."""
    if "netns" in _probed:
        return _probed["netns"]
    reason = None
    if os.geteuid() != 0:
        reason = "the network-namespace bed needs root (ip netns, tc)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "`ip` or `tc` not found: apt-get install iproute2"
    else:
        probe = namespace_name(os.getpid(), "probe" + secrets.token_hex(2), "p")
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            reason = f"`ip netns add` failed here: {made.stderr.strip()}"
        else:
            _run(["ip", "netns", "delete", probe], check=False)
    _probed["netns"] = reason
    return reason


def _qdisc_missing(kind: str) -> bool:
    """Whether the kernel refuses a qdisc kind (probed once on a throwaway veth)."""
    key = "qdisc:" + kind
    if key not in _probed:
        ns = namespace_name(os.getpid(), "probe" + secrets.token_hex(2), "q")
        _run(["ip", "netns", "add", ns])
        try:
            _run(["ip", "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
            args = {"netem": ["netem", "delay", "1ms"], "tbf": tbf_args(100)}[kind]
            done = _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root", *args], check=False)
            _probed[key] = done.stderr.strip() if done.returncode != 0 else None
        finally:
            delete_namespace(ns)
    return _probed[key] is not None


def delay_line_missing_reason() -> str | None:
    """Why the user-space delay line (delayline.py) cannot run here, or None."""
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun for the user-space delay line (CONFIG_TUN)"
    return None


def uses_delay_line(links) -> bool:
    """Whether a bed for `links` delays through user space: one of them needs a delay,
    jitter or loss and the kernel has no netem (delayline.py)."""
    return any(link.needs_netem for link in links) and _qdisc_missing("netem")


def shaping_missing_reason(link: Link) -> str | None:
    """Why this machine cannot shape `link`, or None if it can (needs root). Without
    netem, delay, jitter and loss go through the user-space delay line (a bed made
    with `delay_line=True`, which `NetBed` picks itself for the links it starts with)."""
    if link.needs_netem and _qdisc_missing("netem") and delay_line_missing_reason():
        return f"{NETEM_HINT}; and {delay_line_missing_reason()}"
    if link.rate_mbit and _qdisc_missing("tbf"):
        return "this kernel has no sch_tbf qdisc, which a rate needs: `modprobe sch_tbf`"
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, interface and bridge address."""

    name: str
    netns: str
    address: str
    ifname: str = IFNAME


@dataclass
class NetBed:
    """Hosts in namespaces on a shaped bridge; a context manager (start/close).

    `links` maps host names to their Links (an int n: hosts h1..hn, unshaped).
    The constructor does no I/O; `start()` (or `with`) builds the bed.

    `delay_line`: send what every host sends through the user-space delay line
    (delayline.py, `_start_line`) so its link can be delayed without netem. None (the
    default): where the kernel has no netem and a starting link needs a delay;
    a bed to be `reshape`d to a delay later says True (`uses_delay_line(cases)`).
    """

    links: Mapping[str, Link] | int
    subnet_octet: int = field(default_factory=lambda: random.randrange(1, 255))
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    _token: str = field(default_factory=lambda: secrets.token_hex(3), init=False)
    _switch_ns: str = field(default="", init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    delay_line: bool | None = None
    _made: list[str] = field(default_factory=list, init=False)
    _lines: dict[str, subprocess.Popen] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.links, int):
            self.links = {f"h{i + 1}": UNSHAPED for i in range(self.links)}
        if not 1 <= len(self.links) <= 250:
            raise ValueError(f"a NetBed holds 1 to 250 hosts, not {len(self.links)}")
        for name in self.links:
            if not name.replace("_", "").isalnum() or name == SWITCH or len(name) > 15:
                raise ValueError(f"host name {name!r}: use up to 15 letters/digits, not {SWITCH!r}")

    # --- lifecycle ---

    def __enter__(self) -> NetBed:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self._made:
            raise RuntimeError("this NetBed is already started: close() it first")
        reason = netns_missing_reason()
        if reason:
            raise RuntimeError(reason)
        for link in self.links.values():
            reason = shaping_missing_reason(link)
            if reason:
                raise ShapingUnsupported(f"cannot shape a link of {link.describe()}: {reason}")
        if self.delay_line is None:
            self.delay_line = uses_delay_line(self.links.values())
        if self.delay_line and delay_line_missing_reason():
            raise ShapingUnsupported(f"cannot build a delay line: {delay_line_missing_reason()}")
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _ns(self, host: str) -> str:
        return namespace_name(os.getpid(), self._token, host)

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])

    def _build(self) -> None:
        sw = self._switch_ns = self._ns(SWITCH)
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0"])
        _run(["ip", "-n", sw, "link", "set", "dev", BRIDGE, "up"])
        for i, (name, link) in enumerate(self.links.items()):
            ns = self._ns(name)
            self._add_ns(ns)
            # Both ends are made inside their namespaces, so names never meet the machine's own.
            mac = f"02:77:{self.subnet_octet:02x}:00:{(i + 1) >> 8:02x}:{(i + 1) & 0xFF:02x}"
            _run(["ip", "link", "add", IFNAME, "netns", ns, "address", mac, "type", "veth", "peer", "name", name,
                  "netns", sw])
            _run(["ip", "-n", sw, "link", "set", "dev", name, "master", BRIDGE, "up"])
            address = f"10.77.{self.subnet_octet}.{i + 1}"
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", "dev", IFNAME, "up"])
            if self.delay_line:
                self._start_line(name, ns, i + 1, mac, link)
            self.hosts[name] = Host(name, ns, address)
            self._apply(name, link)

    def _start_line(self, name: str, ns: str, index: int, mac: str, link: Link) -> None:
        """Route what host `name` sends through a delay line (delayline.py): eth0's egress
        is redirected (tc mirred) to a TAP in the host (`LINE_TAP`), the delay line holds
        it and writes it to a TAP port of the bridge (`dl<index>`, which learns nothing);
        the bridge knows the host's MAC on its veth port (a static entry), so what the
        host receives comes straight through the veth, as on a plain link."""
        port = f"dl{index}"
        line = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("delayline.py")), ns, self._switch_ns, LINE_TAP, port,
             f"{link.delay_ms:g}", f"{link.jitter_ms:g}", f"{link.loss_pct:g}", str(random.randrange(1 << 30))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._procs.append(line)
        self._lines[name] = line
        if line.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay line of {name} did not start (exit {line.wait()})")
        sw = self._switch_ns
        _run(["ip", "-n", sw, "link", "set", "dev", port, "master", BRIDGE, "up"])
        _run(["bridge", "-n", sw, "link", "set", "dev", port, "learning", "off"])
        _run(["bridge", "-n", sw, "fdb", "replace", mac, "dev", name, "master", "static"])
        _run(["ip", "-n", ns, "link", "set", "dev", LINE_TAP, "up"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "clsact"])
        _run(["tc", "-n", ns, "filter", "add", "dev", IFNAME, "egress", "protocol", "all", "u32", "match", "u32",
              "0", "0", "action", "mirred", "egress", "redirect", "dev", LINE_TAP])

    def close(self) -> None:
        """Kill what the bed started, then delete its namespaces (idempotent)."""
        for proc in self._procs:
            _kill_group(proc)
        self._procs.clear()
        self._lines.clear()
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()
        self.hosts.clear()

    # --- shaping ---

    def _sending_dev(self, name: str) -> str:
        """Where what host `name` sends is shaped: its delay line's TAP, else eth0."""
        return LINE_TAP if name in self._lines else IFNAME

    def _apply(self, name: str, link: Link) -> None:
        ns = self.hosts[name].netns
        line = self._lines.get(name)
        if line is not None:  # the delay line delays; the kernel keeps the rate, on the TAP eth0 sends into
            line.stdin.write(f"{link.delay_ms:g} {link.jitter_ms:g} {link.loss_pct:g}\n")
            line.stdin.flush()
            link = Link(rate_mbit=link.rate_mbit)
        for argv in tc_commands(self._sending_dev(name), link, sending=True):
            _run(["tc", "-n", ns, *argv])
        for argv in tc_commands(name, link, sending=False):
            _run(["tc", "-n", self._switch_ns, *argv])

    def reshape(self, name: str, link: Link) -> None:
        """Give a running host's link a new shape (the processes on it keep running)."""
        reason = shaping_missing_reason(link)
        if not reason and link.needs_netem and not self.delay_line and _qdisc_missing("netem"):
            reason = f"{NETEM_HINT}; or a bed made with NetBed(..., delay_line=True)"
        if reason:
            raise ShapingUnsupported(f"cannot shape a link of {link.describe()}: {reason}")
        _run(["tc", "-n", self.hosts[name].netns, "qdisc", "del", "dev", self._sending_dev(name), "root"],
             check=False)
        _run(["tc", "-n", self._switch_ns, "qdisc", "del", "dev", name, "root"], check=False)
        self.links = {**self.links, name: link}
        self._apply(name, link)

    def reshape_all(self, link: Link) -> None:
        for name in list(self.hosts):
            self.reshape(name, link)

    # --- running commands in a host ---

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace (for callers that start it themselves)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def run_in(self, host: str, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
        """Start `argv` in `host`'s namespace, in a session of its own; the bed kills
        the process group at close. popen_kw go to subprocess.Popen (env, stdout...)."""
        popen_kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.exec_argv(host, argv), start_new_session=True, **popen_kw)
        self._procs.append(proc)
        return proc

    def check_in(self, host: str, argv: Sequence[str], *, timeout: float = 60,
                 env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run `argv` in `host` to completion; raises on a non-zero exit, with its stderr."""
        proc = self.run_in(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(env) if env is not None else None)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{list(argv)} in {host} exited {proc.returncode}: {err.strip()}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def namespaces(self) -> list[str]:
        """Every namespace this bed made and still holds."""
        return list(self._made)


def _kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()
