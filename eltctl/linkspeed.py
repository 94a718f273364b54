"""The link test: host-to-host throughput over the data plane, and what it means for a job.

A job's gradients cross the links between its hosts at every synchronous step, on the
data plane (where gloo listens: the host's address of its SSH connection, or its
`data_interface`; runtime/netif.py). On office Ethernet that link, not the GPUs, often
sets the job's speed (docs/network.md). `eltctl probe`, `doctor` and `up` measure it
with a short transfer between pairs of hosts, over the SSH connections they hold:

- **The pairs** (`ring`): each host sends to the next one of the list, the last to the
  first, all pairs at once. N hosts cost N transfers (not N^2) and about one transfer's
  time; each host sends once and receives once, so on switched full-duplex Ethernet
  no two transfers share a direction of a link, and every host's link is measured in
  both directions. Two hosts are the pair both ways.
- **A transfer** (hosts/programs/link_test.py, the same file the tests run directly):
  a receiver on B listens on B's data-plane address only, on an ephemeral port, for
  one sender that proves itself with a random token (sent on stdin, never on a command
  line); B times five one-byte round trips (the link's latency, `rtt_ms`: the smallest),
  then A sends zeros for `seconds` (at most `max_bytes`); B counts what arrived in
  that time and prints it. Each end exits on its own within a few seconds.
- **The verdict** (`advice`, pure): the slowest pair's rate against a synchronous
  fp32 all-reduce of the model's gradients (the job's reported bytes per step when
  known, else the rule of thumb: 200 MB, a 50 M-parameter model), beside a
  workstation GPU's step of about `STEP_COMPUTE_S`; it names `grad_dtype="bf16"` and
  the local-steps mode (`sync="local"`, `sync_every=H`) and says which pays; where
  bf16 is not enough, also the low-rank compressor (`compress="powersgd"`), which keeps
  the steps synchronous for a compute of its own.

Pure parts first (plan, figures, verdict, doctor's check), then the I/O.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shlex
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from eltctl.checks import Check, Report, Status
from eltctl.errors import HostError
from eltctl.inventory import Host

# What a transfer sends: at most MAX_BYTES, for at most the seconds asked.
MAX_BYTES = 64 * 1024 * 1024  # at 10 Gbit/s about 50 ms: long enough to leave slow start behind
PROBE_SECONDS = 1.0  # `eltctl probe` and `doctor`
UP_SECONDS = 0.5  # `eltctl up`: its checks must stay quick
ACCEPT_S = 5.0  # how long a receiver waits for its sender

# The rule of thumb when the model's size is not known: a 50 M-parameter model's fp32
# gradients (docs/network.md: 1.77 s for 2 ranks at 1 Gbit/s, measured) ...
REFERENCE_GRAD_BYTES = 200_000_000
# ... and one workstation GPU's step (issue 51: GPT-2 small, 0.2-0.3 s).
STEP_COMPUTE_S = 0.25
# Local steps aim at a sync costing at most this share of the compute between two syncs
# (issue 51's target: 0.90 utilization); H is rounded up to one of these.
LOCAL_SHARE = 0.1
SYNC_EVERY_CHOICES = (4, 8, 16, 32, 64, 128, 256, 500)


# --------------------------------------------------------------------------- the plan (pure)

@dataclass(frozen=True)
class Pair:
    sender: str
    receiver: str


def ring(names: Sequence[str]) -> list[Pair]:
    """Each host sends to the next, the last to the first (see the module docstring); []
    for fewer than two hosts."""
    if len(names) < 2:
        return []
    return [Pair(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]


# --------------------------------------------------------------------------- the figures (pure)

@dataclass(frozen=True)
class Figure:
    """One pair's transfer: what arrived at `receiver` (`address`, its data plane) in
    `seconds`, or why nothing was measured (`error`)."""

    sender: str
    receiver: str
    address: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    rejected: int = 0  # connections the receiver closed: not the sender (no token)
    rtt_ms: float | None = None  # the smallest one-byte round trip before the transfer (the link's latency)

    @property
    def mbit_s(self) -> float | None:
        """Megabits per second (10^6); None when nothing could be timed."""
        if self.error is not None or self.bytes <= 0 or self.seconds <= 0:
            return None
        return self.bytes * 8 / self.seconds / 1e6

    def to_json(self) -> dict:
        rate = self.mbit_s
        return {"from": self.sender, "to": self.receiver, "address": self.address,
                "mbit_s": None if rate is None else round(rate, 1), "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "rtt_ms": self.rtt_ms, "error": self.error}

    @classmethod
    def from_json(cls, doc: Mapping) -> Figure:
        return cls(str(doc["from"]), str(doc["to"]), doc.get("address"), int(doc.get("bytes") or 0),
                   float(doc.get("seconds") or 0.0), doc.get("error"), rtt_ms=_ms(doc.get("rtt_ms")))

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.sender} -> {self.receiver}: not measured: {self.error}"
        rate = self.mbit_s
        got = f"{self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s" + (
            f", round trip {self.rtt_ms:.2f} ms" if self.rtt_ms is not None else "")
        return (f"{self.sender} -> {self.receiver} ({self.address}): "
                + (f"{rate:,.0f} Mbit/s ({got})" if rate is not None else f"too fast to time ({got})"))


def _ms(value) -> float | None:
    """A round trip from JSON: a non-negative number of milliseconds, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def parse_receiver(text: str, pair: Pair, address: str) -> Figure:
    """The receiver's last JSON line as the pair's figure."""
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    try:
        doc = json.loads(lines[-1])
    except (IndexError, ValueError):
        return Figure(pair.sender, pair.receiver, address, error=f"the receiver gave no answer ({text.strip()[-200:]!r})")
    if not isinstance(doc, dict):
        return Figure(pair.sender, pair.receiver, address, error="the receiver's answer is not an object")
    rejected = int(doc.get("rejected") or 0)
    if doc.get("error"):
        return Figure(pair.sender, pair.receiver, address, error=str(doc["error"]), rejected=rejected)
    try:
        return Figure(pair.sender, pair.receiver, address, bytes=int(doc["bytes"]), seconds=float(doc["seconds"]),
                      rejected=rejected, rtt_ms=_ms(doc.get("rtt_ms")))
    except (KeyError, TypeError, ValueError):
        return Figure(pair.sender, pair.receiver, address, error=f"the receiver's answer is malformed: {doc!r}")


def sender_error(exit_status: int, stdout: str, stderr: str) -> str | None:
    """Why the sender measured nothing (its JSON `error`, else a failed run's stderr), or None."""
    for line in reversed(stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("error"):
            return str(doc["error"])
        break
    if exit_status != 0:
        return f"exit {exit_status}: {(stderr.strip() or 'no output')[-200:]}"
    return None


def slowest(figures: Iterable[Figure]) -> Figure | None:
    """The measured pair with the lowest rate (the one a ring all-reduce goes at)."""
    timed = [f for f in figures if f.mbit_s is not None]
    return min(timed, key=lambda f: f.mbit_s or 0.0) if timed else None


# --------------------------------------------------------------------------- the verdict (pure)

def allreduce_seconds(grad_bytes: float, mbit_s: float, world: int) -> float:
    """The wire time of a ring all-reduce of `grad_bytes` over `world` ranks: each rank
    sends 2 (N-1)/N of it. 200 MB, 2 ranks, 1 Gbit/s: 1.6 s (measured: 1.77 s)."""
    n = max(world, 2)
    return 2 * (n - 1) / n * grad_bytes * 8 / (mbit_s * 1e6)


@dataclass(frozen=True)
class Advice:
    network_bound: bool  # the link, not the GPUs, sets a synchronous fp32 job's speed
    sync_s: float  # one synchronous fp32 all-reduce on this link
    mode: str | None  # "bf16" or "local": which mode pays (None: none is needed; "local" also names low rank)
    sync_every: int | None  # H for the local-steps mode
    text: str


# Where bf16 is not enough: the synchronous alternative to local steps (docs/network.md
# "Low-rank gradients"; its bytes depend on the model's matrices, so no time is given).
LOW_RANK = ("low-rank gradients (ElasticJob(compress=\"powersgd\", compress_rank=4)) keep the steps synchronous "
            "and send the big weight matrices as thin factors (100x fewer bytes in docs/network.md's run, the loss "
            "within 1 %), for a compression compute of their own")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def advice(mbit_s: float, world: int, grad_bytes: float | None = None) -> Advice:
    """What the link means for the job (see the module docstring). `grad_bytes`: what
    each rank all-reduces per step (the job's `network.bytes_per_step` from a run), None
    when not known (then the rule of thumb, said in the text)."""
    known = grad_bytes is not None and grad_bytes > 0
    size = float(grad_bytes) if known else float(REFERENCE_GRAD_BYTES)
    what = (f"the job's {_mb(size)} of gradients per step" if known else
            f"{_mb(size)} of fp32 gradients (a 50 M-parameter model; the rule of thumb, the job's model size "
            "is not known here: scale with it)")
    t = allreduce_seconds(size, mbit_s, world)
    head = (f"at {mbit_s:,.0f} Mbit/s a synchronous all-reduce of {what} takes about {t:.2f} s per step "
            f"at world {max(world, 2)}, against about {STEP_COMPUTE_S:g} s of a workstation GPU's step")
    if t <= STEP_COMPUTE_S:
        return Advice(False, t, None, None, head + ": the GPUs, not the network, set the job's speed")
    h = next((c for c in SYNC_EVERY_CHOICES if t / c <= LOCAL_SHARE * STEP_COMPUTE_S), SYNC_EVERY_CHOICES[-1])
    local = (f"local steps (ElasticJob(sync=\"local\", sync_every={h})) send it once per {h} steps, "
             f"about {t / h:.2f} s per step")
    bf16 = f"a bf16 all-reduce (ElasticJob(grad_dtype=\"bf16\")) halves it to about {t / 2:.2f} s"
    if t / 2 <= STEP_COMPUTE_S:
        mode, tail = "bf16", (f"{bf16}, within the compute: that pays here and keeps the steps synchronous; "
                              f"{local}")
    else:
        mode, tail = "local", f"{local}: that pays here; {LOW_RANK}; {bf16}, still more than the compute"
    return Advice(True, t, mode, h, f"{head}: the network, not the GPUs, will set the job's speed. "
                                    f"{tail[0].upper()}{tail[1:]}")


def link_check(host: str, figures: Iterable[Figure], world: int) -> Check | None:
    """doctor's `link` check of one host: the pairs it takes part in (sending and
    receiving); WARN when the slower is slow for a job (`advice`, rule of thumb) or
    could not be measured (what blocks the test may block gloo: any port between the
    hosts); None when the host was in no pair."""
    mine = [f for f in figures if host in (f.sender, f.receiver)]
    if not mine:
        return None
    detail = "; ".join(f.describe() for f in mine)
    failed = [f for f in mine if f.error is not None]
    if failed:
        return Check("link", Status.WARN, detail,
                     "the job's collectives (gloo) connect between the hosts' data-plane addresses on any port: "
                     "check a firewall between them, or set the host's data_interface in the inventory")
    worst = slowest(mine)
    if worst is None or worst.mbit_s is None:
        return Check("link", Status.OK, detail)
    verdict = advice(worst.mbit_s, world)
    if verdict.network_bound:
        return Check("link", Status.WARN, detail, verdict.text)
    return Check("link", Status.OK, detail)


def with_link_checks(reports: Sequence[Report], figures: Sequence[Figure]) -> list[Report]:
    """doctor's reports, each host's with its `link` check added last."""
    world = len({f.sender for f in figures} | {f.receiver for f in figures})
    out = []
    for r in reports:
        check = link_check(r.host, figures, world)
        out.append(r if check is None else replace(r, checks=(*r.checks, check)))
    return out


def up_lines(figures: Sequence[Figure], grad_bytes: float | None = None) -> list[str]:
    """What `up` says about the links (its progress lines): nothing when none was
    measured; the slowest pair, and when it sets the job's speed, the advice."""
    failed = [f for f in figures if f.error is not None]
    lines = [f"warning: link test {f.describe()}" for f in failed]
    worst = slowest(figures)
    if worst is None:
        return lines
    world = len({f.sender for f in figures} | {f.receiver for f in figures})
    verdict = advice(worst.mbit_s or 0.0, world, grad_bytes)
    lines.append(f"link test: slowest {worst.describe()}")
    if verdict.network_bound:
        lines.append(f"hint: {verdict.text} (docs/network.md)")
    return lines


def grad_bytes_of(status: Mapping | None) -> float | None:
    """The bytes each rank all-reduces per step, as a running job reports them (its
    status document's `network.bytes_per_step`); None when it does not."""
    net = (status or {}).get("network")
    value = net.get("bytes_per_step") if isinstance(net, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def host_links(figures: Sequence[Figure]) -> dict[str, dict]:
    """`eltctl probe --json`'s `link` of each host: the pair it sent on."""
    return {f.sender: f.to_json() for f in figures}


# --------------------------------------------------------------------------- running it

def net_command(marker: str) -> str:
    from eltctl.probe import net_section

    return "sh -c " + shlex.quote(f"m={shlex.quote(marker)}\n{net_section()}echo \"${{m}}end\"\n")


async def data_address(host: Host, transport) -> str | None:
    """The host's data-plane address as its daemon would choose it (eltctl/probe.py
    `data_plane`: the same facts and rule); None when it has none to name (a `local`
    host without data_interface decides from its route) or it could not be learnt."""
    from eltctl.probe import data_plane, new_marker, parse_probe_output

    marker = new_marker()
    try:
        res = await transport.run(net_command(marker), timeout=15)
    except HostError:
        return None
    plane = data_plane(host, parse_probe_output(res.stdout, marker))
    return plane.get("address") if plane and not plane.get("error") else None


async def _read_line(stream, limit: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        part = await asyncio.wait_for(stream.read(1), timeout=limit)
        if not part:
            break
        buf += part
    return buf


async def measure_pair(pair: Pair, sender: Host, receiver: Host, transports: Mapping[str, object], address: str,
                       *, seconds: float, max_bytes: int = MAX_BYTES) -> Figure:
    """One transfer, `sender` -> `receiver` at `address`; every failure is the figure's `error`."""
    from eltctl.hosts import programs

    token = secrets.token_hex(16)
    tx, rx = transports[pair.sender], transports[pair.receiver]
    recv_cmd = programs.command(receiver.python, "link_test", "recv", address, f"{ACCEPT_S:g}", f"{seconds:g}")
    try:
        stream = await rx.open_stream(recv_cmd)
    except HostError as exc:
        return Figure(pair.sender, pair.receiver, address, error=f"the receiver did not start: {exc.message}")
    try:
        await stream.write((token + "\n").encode())
        await stream.close_stdin()
        first = (await _read_line(stream, ACCEPT_S + 10)).decode("utf-8", "replace").split()
        if len(first) != 2 or first[0] != "port" or not first[1].isdigit():
            _, err = await asyncio.wait_for(stream.wait(), timeout=5)
            return Figure(pair.sender, pair.receiver, address,
                          error=f"the receiver could not listen on {address}: {(err.strip() or ' '.join(first))[-200:]}")
        send_cmd = programs.command(sender.python, "link_test", "send", address, first[1], f"{seconds:g}",
                                    str(max_bytes))
        sent = await tx.run(send_cmd, input=token + "\n",
                            timeout=seconds + ACCEPT_S + 10)
        rest = b""
        while True:
            part = await asyncio.wait_for(stream.read(65536), timeout=seconds + ACCEPT_S + 10)
            if not part:
                break
            rest += part
        figure = parse_receiver(rest.decode("utf-8", "replace"), pair, address)
        why = sender_error(sent.exit_status, sent.stdout, sent.stderr)
        return figure if figure.error is None or why is None else replace(figure, error=f"the sender: {why}")
    except (HostError, asyncio.TimeoutError, OSError, ValueError) as exc:
        why = exc.message if isinstance(exc, HostError) else (type(exc).__name__ + (f": {exc}" if str(exc) else ""))
        return Figure(pair.sender, pair.receiver, address, error=f"the transfer did not complete: {why}")
    finally:
        stream.kill()


async def measure(fleet, hosts: Sequence[Host], *, seconds: float = PROBE_SECONDS,
                  max_bytes: int = MAX_BYTES) -> list[Figure]:
    """The ring of `hosts` (those connected and with a data-plane address, in order),
    all pairs at once, over the fleet's connections."""
    transports: dict[str, object] = {}
    for h in hosts:
        try:
            transports[h.name] = await fleet.transport(h)
        except HostError:
            continue
    usable = [h for h in hosts if h.name in transports]
    found = await asyncio.gather(*(data_address(h, transports[h.name]) for h in usable))
    addresses = dict(zip((h.name for h in usable), found))
    by_name = {h.name: h for h in usable}

    def receiver_address(pair: Pair) -> str | None:
        if addresses.get(pair.receiver):
            return addresses[pair.receiver]
        if by_name[pair.receiver].is_local:  # this machine: its address towards the sender
            return getattr(transports[pair.sender], "local_address", lambda: None)()
        return None

    pairs = ring([h.name for h in usable])

    async def one(pair: Pair) -> Figure:
        address = receiver_address(pair)
        if address is None:
            return Figure(pair.sender, pair.receiver, error=f"{pair.receiver}'s data-plane address is not known")
        return await measure_pair(pair, by_name[pair.sender], by_name[pair.receiver], transports, address,
                                  seconds=seconds, max_bytes=max_bytes)

    return list(await asyncio.gather(*(one(p) for p in pairs)))


def probe_inventory_with_links(inventory, *, hosts: Iterable[Host] | None = None) -> list:
    """`eltctl probe` with the link test: the probe's reports (eltctl/probe.py), then the
    ring of the usable ones (`ok`, `cpu-only`) over the same connections, each report's
    `link` the pair its host sent on."""
    from eltctl.hosts.fleet import Fleet
    from eltctl.probe import HostState, probe_fleet

    async def main() -> list:
        async with Fleet(inventory) as fleet:
            reports = await probe_fleet(fleet, job=inventory.job.name, policy=inventory.policy, hosts=hosts,
                                        owner=inventory.owner_policy)
            usable = [inventory.host(r.name) for r in reports if r.state in (HostState.OK, HostState.CPU_ONLY)]
            links = host_links(await measure(fleet, usable))
            return [replace(r, link=links.get(r.name)) for r in reports]

    return asyncio.run(main())
