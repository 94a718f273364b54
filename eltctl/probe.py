"""The probe: what each host can offer now, and why.

One round trip per host runs `probe_script` (POSIX sh): it prints delimited sections
with the CPU count, load average, logged-in users, whether `nvidia-smi` exists, the
GPU query and the compute-apps query (each under `timeout`), for each GPU process
its owner and the eltctl job it belongs to (`ELTCTL_JOB=...` in its environment,
when readable), and the GPU claims held on the host (runtime/claims.py: which eltctl
job holds which GPU, also for processes of other users).
Where the host watches owner signals beyond the GPU (the inventory's owner_* keys), it
also runs eltctl_runtime.owner's source with the host's Python (`owner check`, two
looks 0.5 s apart for a load rate): when its start condition does not hold, every
slot of the host is busy with the signal as the reason (`HostReport.owner`), so
nothing starts there; a check that cannot run counts as an owner too (owner first).

The rest is pure and tested with tables: `parse_probe_output` turns that text into a
`HostProbe` (facts), `classify_gpu` decides free / busy / ours for one GPU, and
`assess_host` turns facts into a `HostReport` (a GPU another eltctl job holds is
`taken`, never `busy`: that job is not an owner) whose state is one of

    ok         reachable, nvidia-smi answered; its GPUs are classified
    cpu-only   reachable, no nvidia-smi: `slots` CPU workers
    unhealthy  reachable, but nvidia-smi (or the probe) failed or hung
    unreachable  not reachable (the HostError's kind and message say why)

`probe_inventory` runs it all over a `Fleet`; `reports_to_json` is the documented
`eltctl probe --json` format (see `JSON_FORMAT`).
"""

from __future__ import annotations

import asyncio
import enum
import json
import secrets
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from eltctl_runtime import owner as owner_signals  # stdlib only; its source is run on the host
from eltctl_runtime.owner import OwnerPolicy

from eltctl_runtime import netif  # the data plane's choice, shared with the host daemon; stdlib only
from eltctl_runtime import nvsmi  # the one nvidia-smi parser, shared with the host daemon; stdlib only
from eltctl_runtime.claims import Claim, Refusal, parse_slot_file
from eltctl_runtime.nvsmi import parse_number
from eltctl.demand import Demand
from eltctl.sharedir import claims_section, demand_section, parse_claims, parse_demands, refused_summary
from eltctl.errors import HostError
from eltctl.inventory import Host, Inventory, Policy
from eltctl.hosts.fleet import Fleet, Outcome
from eltctl.hosts.transport import ErrorKind, Transport
from eltctl.text import printable

MARK = ":::eltctl:"  # the fixed marker (doctor's script); a probe's own is random (`new_marker`)
PROBE_VERSION = "1"
GPU_FIELDS = ",".join(nvsmi.GPU_FIELDS)
APP_FIELDS = ",".join(nvsmi.APP_FIELDS)
HANG_STATUSES = (124, 137)  # `timeout` gave up (TERM, then KILL)
NOT_FOUND_STATUS = 127  # the shell's "command not found"


class HostState(str, enum.Enum):
    OK = "ok"
    CPU_ONLY = "cpu-only"
    UNHEALTHY = "unhealthy"
    UNREACHABLE = "unreachable"

    def __str__(self) -> str:
        return self.value


class GpuUse(str, enum.Enum):
    FREE = "free"  # nothing runs on it and it looks idle
    BUSY = "busy"  # a process that is not this job's, or memory/utilisation above the thresholds
    OURS = "ours"  # only this job's processes run on it
    TAKEN = "taken"  # another eltctl job holds it (its claim or its processes): not an owner, never used

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_used_mib: int | None  # None: the driver said [N/A] / [Not Supported]
    memory_total_mib: int | None
    utilization: int | None  # percent


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_memory_mib: int | None
    name: str
    user: str | None = None  # None: the owner could not be read (e.g. another pid namespace)
    ours: bool = False  # its environment holds ELTCTL_JOB=<this job>
    job: str | None = None  # the ELTCTL_JOB in its environment (None: none, or unreadable)


@dataclass(frozen=True)
class HostProbe:
    """The facts one probe run printed, before any judgement."""

    complete: bool = False  # the end marker arrived
    cpu_count: int | None = None
    load_avg: tuple[float, float, float] | None = None
    users: tuple[str, ...] = ()
    nvidia_smi: str | None = None  # its path; None: not installed (a CPU-only host)
    gpu_status: int | None = None  # exit status of the GPU query
    gpu_output: str = ""  # the query's text when it failed
    gpus: tuple[Gpu, ...] = ()
    apps_status: int | None = None
    apps_output: str = ""
    processes: tuple[GpuProcess, ...] = ()
    owner_ran: bool = False  # the owner check ran (the host watches owner signals)
    owner: dict | None = None  # its answer {"wait": signal or null, "leave": ...}; None: no answer
    owner_output: str = ""  # what it printed when it gave no answer
    claims: tuple[tuple[str, Claim], ...] = ()  # (claim file name, holder) of the held GPU claims
    net: bool = False  # the net section arrived
    ssh_address: str | None = None  # the host's address of the probe's SSH connection; None: none (local)
    interfaces: dict[str, tuple[str, ...]] | None = None  # `ip -o addr show`: name -> addresses; None: no `ip`
    host_time: float | None = None  # the host's clock when the probe ran (demand times are on it)
    demands: tuple[Demand, ...] = ()  # the fresh demand entries of the jobs sharing the host (eltctl/demand.py)
    demand_error: str = ""  # why this job's demand could not be written there
    refused: tuple[Refusal, ...] = ()  # entries of the claims directory not believed (eltctl/sharedir.py)


@dataclass(frozen=True)
class GpuReport:
    gpu: Gpu
    state: GpuUse
    reason: str
    processes: tuple[GpuProcess, ...] = ()
    job: str | None = None  # the eltctl job holding it: this one (ours), another (taken), else None


@dataclass(frozen=True)
class HostReport:
    name: str
    address: str
    state: HostState
    reason: str
    error: HostError | None = None
    gpus: tuple[GpuReport, ...] = ()
    cpu_count: int | None = None
    slots: int = 0
    load_avg: tuple[float, float, float] | None = None
    users: tuple[str, ...] = ()
    # The owner signal that keeps workers off this host ({"name", "detail", "since"}), or None.
    owner: dict | None = None
    # Where its collectives listen ({"interface", "address", "source", "error"}; data_plane()), or None.
    data_plane: dict | None = None
    # Fair share (eltctl/demand.py): every held claim (this job's too), the host's clock and
    # the fresh demand entries of the jobs sharing it.
    claims: tuple[tuple[str, Claim], ...] = ()
    host_time: float | None = None
    demands: tuple[Demand, ...] = ()
    refused: tuple[Refusal, ...] = ()  # entries of its claims directory not believed: file, owner, reason
    # The link test's pair this host sent on (eltctl/linkspeed.py, Figure.to_json), or None.
    link: dict | None = None

    @property
    def reachable(self) -> bool:
        return self.state is not HostState.UNREACHABLE

    def gpus_in(self, state: GpuUse) -> list[GpuReport]:
        return [g for g in self.gpus if g.state is state]


# --------------------------------------------------------------------------- the script

def probe_script(job: str, nvidia_smi_timeout: float) -> str:
    """The POSIX sh program a probe runs; the job name is its first argument, then
    (optional) the host's Python, the owner policy as JSON and owner.py's source, this
    job's demand and the sections' marker (`new_marker`)."""
    t = f"{nvidia_smi_timeout:g}"
    return f"""\
job="$1"
m="${{6:-{MARK}}}"
echo "${{m}}probe {PROBE_VERSION}"
tmp=$(mktemp 2>/dev/null) || tmp=$(umask 077; mkdir -p "$HOME/.eltctl" && echo "$HOME/.eltctl/probe.$$")
trap 'rm -f "$tmp"' EXIT
if command -v timeout >/dev/null 2>&1; then to="timeout -k 2 {t}"; else to=""; fi
echo "${{m}}cpus"
getconf _NPROCESSORS_ONLN 2>/dev/null || nproc 2>/dev/null
echo "${{m}}loadavg"
cat /proc/loadavg 2>/dev/null
echo "${{m}}who"
who 2>/dev/null
echo "${{m}}smi"
smi=$(command -v nvidia-smi 2>/dev/null)
echo "$smi"
if [ -n "$smi" ]; then
  $to nvidia-smi --query-gpu={GPU_FIELDS} --format=csv,noheader,nounits </dev/null >"$tmp" 2>&1
  rc=$?
  echo "${{m}}gpus $rc"
  cat "$tmp"
  if [ "$rc" -eq 0 ]; then
    $to nvidia-smi --query-compute-apps={APP_FIELDS} --format=csv,noheader,nounits </dev/null >"$tmp" 2>&1
    rc=$?
    echo "${{m}}apps $rc"
    cat "$tmp"
    echo "${{m}}owners"
    if [ "$rc" -eq 0 ]; then
      while IFS=, read -r _uuid pid _rest || [ -n "$pid" ]; do
        pid=${{pid#"${{pid%%[! ]*}}"}}; pid=${{pid%"${{pid##*[! ]}}"}}
        case "$pid" in ''|*[!0-9]*) continue ;; esac
        user=$(ps -o user= -p "$pid" 2>/dev/null); user=${{user#"${{user%%[! ]*}}"}}; user=${{user%"${{user##*[! ]}}"}}
        pjob=""
        [ -r "/proc/$pid/environ" ] && pjob=$(tr '\\000' '\\n' <"/proc/$pid/environ" 2>/dev/null | sed -n '/^ELTCTL_JOB=/{{s///p;q;}}')
        ours=0
        if [ -n "$job" ] && [ "$pjob" = "$job" ]; then ours=1; fi
        echo "$pid $ours ${{user:-?}} ${{pjob:--}}"
      done <"$tmp"
    fi
  fi
fi
if [ -n "$3" ]; then
  echo "${{m}}owner"
  $to "$2" -c "$4" check "$3" </dev/null 2>&1
fi
{claims_section()}{net_section()}{demand_section()}echo "${{m}}end"
"""


def net_section() -> str:
    """The sh lines printing the `net` section (the host's address of its SSH connection,
    then `ip -o addr show`), under the marker in `$m`: where the data plane's facts come
    from, for the probe and for the link test (eltctl/linkspeed.py)."""
    return ('echo "${m}net $(set -- ${SSH_CONNECTION:-}; echo ${3:-})"\n'
            'if command -v ip >/dev/null 2>&1; then ip -o addr show 2>/dev/null; else echo "!no-ip"; fi\n')


def owner_source() -> str:
    """eltctl_runtime.owner's source: what the probe runs on a host without the runtime."""
    return Path(owner_signals.__file__).read_text(encoding="utf-8")


def probe_command(job: str, nvidia_smi_timeout: float, owner: OwnerPolicy | None = None,
                  python: str = "python3", demand: Demand | None = None, marker: str = MARK) -> str:
    """The one shell command a probe sends: `sh -c SCRIPT eltctl-probe JOB [PYTHON POLICY SOURCE
    [DEMAND [MARKER]]]` (the three when `owner` watches signals; DEMAND: this job's demand to
    publish there, as JSON; MARKER: the sections' marker, `new_marker`; empty ones are
    passed as '' when a later one follows)."""
    cmd = "sh -c " + shlex.quote(probe_script(job, nvidia_smi_timeout)) + " eltctl-probe " + shlex.quote(job)
    args = [python, json.dumps(owner.to_dict()), owner_source()] if owner is not None and owner.enabled else \
        ["", "", ""]
    args += [json.dumps(demand.published()) if demand is not None else "", "" if marker == MARK else marker]
    while args and not args[-1]:
        args.pop()
    return cmd + "".join(" " + shlex.quote(a) for a in args)


def new_marker() -> str:
    """A probe's own section marker: random, so nothing the host echoes (a file name, a
    process name) can start a section the parser believes (issue 49). It is on the
    command line, which other accounts may read while the probe runs: what keeps an
    echoed name out is the strict name set (eltctl/sharedir.py); this is the second lock."""
    return f":::eltctl-{secrets.token_hex(8)}:"


def probe_timeout(policy: Policy) -> float:
    """How long a whole probe may take: two nvidia-smi calls plus the rest."""
    return 2 * (policy.nvidia_smi_timeout + 2) + 10


# --------------------------------------------------------------------------- parsing

def parse_gpu_line(line: str) -> Gpu | None:
    """One `--query-gpu` line, through the parser the host daemon uses too."""
    g = nvsmi.parse_gpu_line(line)
    if g is None:
        return None
    return Gpu(index=g.index, uuid=g.uuid, name=g.name, memory_used_mib=g.memory_used_mib,
               memory_total_mib=g.memory_total_mib, utilization=g.utilization)


def parse_app_line(line: str) -> GpuProcess | None:
    """One `--query-compute-apps` line, likewise."""
    a = nvsmi.parse_app_line(line)
    if a is None:
        return None
    return GpuProcess(pid=a.pid, gpu_uuid=a.gpu_uuid, used_memory_mib=a.used_memory_mib, name=a.name)


def sections(text: str, marker: str = MARK) -> dict[str, tuple[str, list[str]]]:
    """{name: (argument after the name, lines)} for each `<marker>name arg` line. Each
    section is parsed once: a second section of a name (forged) is ignored, lines and all."""
    out: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(marker):
            name, _, arg = line[len(marker):].partition(" ")
            if name in out:
                current = None
                continue
            current = []
            out[name] = (arg.strip(), current)
        elif current is not None:
            current.append(line)
    return out


def _status(arg: str) -> int | None:
    try:
        return int(arg)
    except ValueError:
        return None


def parse_probe_output(text: str, marker: str = MARK) -> HostProbe:
    """The facts in a probe's output (`marker`: its sections' marker, `new_marker`).
    Tolerates missing sections (a truncated run). Control characters (a process or user
    name of anyone on the host) are made visible."""
    s = sections(printable(text), marker)
    cpu_count = None
    for line in s.get("cpus", ("", []))[1]:
        n = parse_number(line)
        if n:
            cpu_count = n
            break
    load_avg = None
    la = " ".join(s.get("loadavg", ("", []))[1]).split()
    if len(la) >= 3:
        try:
            load_avg = (float(la[0]), float(la[1]), float(la[2]))
        except ValueError:
            load_avg = None
    users = sorted({line.split()[0] for line in s.get("who", ("", []))[1] if line.strip()})
    smi_lines = [ln.strip() for ln in s.get("smi", ("", []))[1] if ln.strip()]
    nvidia_smi = smi_lines[0] if smi_lines else None

    gpu_status = gpu_output = None
    gpus: list[Gpu] = []
    if "gpus" in s:
        arg, lines = s["gpus"]
        gpu_status = _status(arg)
        gpu_output = "\n".join(lines).strip()
        if gpu_status == 0:
            gpus = [g for g in map(parse_gpu_line, lines) if g is not None]

    apps_status = apps_output = None
    procs: list[GpuProcess] = []
    if "apps" in s:
        arg, lines = s["apps"]
        apps_status = _status(arg)
        apps_output = "\n".join(lines).strip()
        if apps_status == 0:
            procs = [p for p in map(parse_app_line, lines) if p is not None]
    owners: dict[int, tuple[bool, str | None, str | None]] = {}
    for line in s.get("owners", ("", []))[1]:
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit():
            user = parts[2] if len(parts) >= 3 and parts[2] != "?" else None
            pjob = parts[3] if len(parts) >= 4 and parts[3] != "-" else None
            owners[int(parts[0])] = (parts[1] == "1", user, pjob)
    procs = [GpuProcess(pid=p.pid, gpu_uuid=p.gpu_uuid, used_memory_mib=p.used_memory_mib, name=p.name,
                        user=owners.get(p.pid, (False, None, None))[1], ours=owners.get(p.pid, (False, None, None))[0],
                        job=owners.get(p.pid, (False, None, None))[2])
             for p in procs]
    owner_ran = "owner" in s
    owner, owner_output = None, ""
    if owner_ran:
        lines = [ln.strip() for ln in s["owner"][1] if ln.strip()]
        try:
            doc = json.loads(lines[-1])
            if isinstance(doc, dict) and "wait" in doc:
                owner = doc
        except (IndexError, ValueError):
            pass
        if owner is None:
            owner_output = "\n".join(lines)
    ssh_address, interfaces = None, None
    if "net" in s:
        arg, lines = s["net"]
        ssh_address = arg or None
        if "!no-ip" not in lines:
            interfaces = netif.parse_ip_addr("\n".join(lines))
    demand = parse_demands(s.get("demand", ("", []))[1])
    claims, refused, trusted = parse_claims(s.get("claims", ("", []))[1], demand["host_time"])
    if not trusted:
        demand = {**demand, "demands": ()}
    return HostProbe(
        net="net" in s, ssh_address=ssh_address, interfaces=interfaces,
        complete="end" in s, cpu_count=cpu_count, load_avg=load_avg, users=tuple(users),
        nvidia_smi=nvidia_smi, gpu_status=gpu_status, gpu_output=gpu_output or "", gpus=tuple(gpus),
        apps_status=apps_status, apps_output=apps_output or "", processes=tuple(procs),
        owner_ran=owner_ran, owner=owner, owner_output=owner_output,
        claims=claims, **{**demand, "refused": refused + demand["refused"]})


# --------------------------------------------------------------------------- decisions

def _describe_process(p: GpuProcess) -> str:
    who = p.user or "unknown user"
    name = f" {p.name}" if p.name else ""
    return f"pid {p.pid}{name} ({who})"


def classify_gpu(gpu: Gpu, processes: Iterable[GpuProcess], policy: Policy, *,
                 claim: Claim | None = None) -> tuple[GpuUse, str]:
    """free / busy / ours / taken for one GPU, with the reason a person would want to read.

    A process that is not this job's makes the GPU busy, even next to ours. With no
    process listed, memory or utilisation above the policy's thresholds still means
    busy (containers hide their processes from the host's driver view).
    Another eltctl job is not an owner: its processes (their ELTCTL_JOB names it, or,
    unreadable, their user holds the GPU's `claim` for it) or its claim alone make
    the GPU taken (`taken_by`).
    """
    procs = [p for p in processes if p.gpu_uuid == gpu.uuid]
    others = [p for p in procs if not p.ours]
    taken = taken_by(others, claim)
    foreign = [p for p in others if p not in taken]
    ours = [p for p in procs if p.ours]
    if not foreign and not ours and (taken or claim is not None):
        return GpuUse.TAKEN, taken_reason(taken, claim)
    if foreign:
        reason = "used by " + ", ".join(_describe_process(p) for p in foreign)
        if ours:
            reason += "; shares it with this job's " + ", ".join(f"pid {p.pid}" for p in ours)
        return GpuUse.BUSY, reason
    if ours:
        return GpuUse.OURS, "runs this job's " + ", ".join(_describe_process(p) for p in ours)

    mem, util = gpu.memory_used_mib, gpu.utilization
    if mem is not None and mem > policy.memory_threshold_mib:
        total = f" of {gpu.memory_total_mib}" if gpu.memory_total_mib is not None else ""
        return GpuUse.BUSY, (f"{mem}{total} MiB used (threshold {policy.memory_threshold_mib} MiB) "
                               "with no process listed (another container?)")
    if util is not None and util > policy.utilization_threshold:
        return GpuUse.BUSY, (f"{util}% utilisation (threshold {policy.utilization_threshold}%) "
                               "with no process listed (another container?)")
    facts = ["no processes"]
    facts.append(f"{mem} MiB used" if mem is not None else "memory use not reported")
    facts.append(f"{util}% utilisation" if util is not None else "utilisation not reported")
    if mem is None and util is None:
        facts.append("judged by the process list only")
    elif mem is None:
        facts.append("judged by utilisation and processes")
    elif util is None:
        facts.append("judged by memory and processes")
    return GpuUse.FREE, ", ".join(facts)


def taken_by(others: Iterable[GpuProcess], claim: Claim | None) -> list[GpuProcess]:
    """The processes among `others` (not this job's) that belong to another eltctl job:
    their environment names one, or it is unreadable and their user holds the GPU's claim
    (`claim`: another job's, or None)."""
    return [p for p in others
            if p.job or (claim is not None and claim.user and p.user == claim.user and p.job is None)]


def taken_reason(taken: Iterable[GpuProcess], claim: Claim | None) -> str:
    """`taken by job B (user bob, pid 42)`: the claim's words, else the processes'."""
    if claim is not None:
        return f"taken by {claim.describe()}"
    taken = list(taken)
    jobs = sorted({p.job for p in taken if p.job})
    return (f"taken by job {', '.join(jobs)} ("
            + ", ".join(_describe_process(p) for p in taken) + ")")


def gpu_claims(probe: HostProbe, job: str) -> dict[int, Claim]:
    """GPU index -> the claim another eltctl job (not `job`) holds on it."""
    out: dict[int, Claim] = {}
    for name, c in probe.claims:
        slot = parse_slot_file(name)
        if slot is not None and slot[0] == "gpu" and (not job or c.job != job):
            out.setdefault(slot[1], c)
    return out


def _first_line(text: str, default: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return default


def owner_hold(probe: HostProbe) -> dict | None:
    """The owner signal that keeps workers off the host ({"name", "detail", "since"}), or None.
    An owner check that ran and gave no answer holds the host too (owner first)."""
    if not probe.owner_ran:
        return None
    if probe.owner is None:
        why = _first_line(probe.owner_output, "no output")
        return {"name": "unknown", "detail": f"the owner check failed: {why}", "since": None}
    wait = probe.owner.get("wait")
    return wait if isinstance(wait, dict) and wait.get("name") else None


def with_owner(report: HostReport, hold: dict | None) -> HostReport:
    """Every slot of a host the owner holds is busy, with the signal as the reason."""
    if hold is None or report.state not in (HostState.OK, HostState.CPU_ONLY):
        return report
    why = f"owner: {hold.get('detail', '')}"
    gpus = tuple(replace(g, state=GpuUse.BUSY, reason=why) for g in report.gpus)
    return replace(report, gpus=gpus, slots=0, owner=hold,
                   reason=f"owner signal {hold.get('name')}: {hold.get('detail', '')}")


def assess_host(host: Host, probe: HostProbe, policy: Policy, *, job: str = "") -> HostReport:
    """The host's state and its GPUs' states from the probe's facts. `job`: this job's
    name (a GPU claim of another job makes that GPU taken; "" counts every claim as another's)."""
    report = with_owner(_assess_host(host, probe, policy, job=job), owner_hold(probe))
    plane = data_plane(host, probe)
    if plane is not None and plane["error"] and plane["source"] == "inventory":  # its daemon would not start
        report = replace(report, reason=f"{report.reason}; {plane['error']}")
    return replace(report, data_plane=plane, claims=probe.claims, host_time=probe.host_time, demands=probe.demands,
                   refused=probe.refused)


def data_plane(host: Host, probe: HostProbe) -> dict | None:
    """Where the host's collectives would listen, as its daemon decides (runtime/netif.py):
    the inventory's data_interface, else the interface of the probe's SSH address. None
    when the probe printed no net section (cut short). Without an SSH address (a `local` host) and
    without data_interface the daemon decides from its route to the store: `source`
    says so and `interface` is null."""
    if not probe.net:
        return None
    table = probe.interfaces
    ssh = None if host.is_local else probe.ssh_address  # a local host's daemon is started without SSH
    if table is None:
        return {"interface": None, "address": ssh, "source": "address",
                "error": "no `ip` command on the host: its interfaces are unknown here"}
    if ssh is None and not host.data_interface:
        return {"interface": None, "address": None, "source": "store route", "error": None}
    try:
        plane = netif.choose(table, address=ssh or "", interface=host.data_interface)
    except netif.DataInterfaceError as e:
        return {"interface": host.data_interface, "address": None, "source": "inventory", "error": str(e)}
    return {**plane.to_json(), "error": None}


def _assess_host(host: Host, probe: HostProbe, policy: Policy, *, job: str = "") -> HostReport:
    common = dict(name=host.name, address=host.address, cpu_count=probe.cpu_count,
                  load_avg=probe.load_avg, users=probe.users)
    t = f"{policy.nvidia_smi_timeout:g}"
    if not probe.complete:
        return HostReport(state=HostState.UNHEALTHY, reason="the probe's output was cut short", **common)
    if probe.nvidia_smi is None:
        return HostReport(state=HostState.CPU_ONLY, slots=host.slots,
                          reason=f"no nvidia-smi on PATH: CPU-only host, {host.slots} slot(s)", **common)
    if probe.gpu_status == NOT_FOUND_STATUS:
        # On PATH but not runnable ("command not found"): as good as absent.
        return HostReport(state=HostState.CPU_ONLY, slots=host.slots,
                          reason=(f"nvidia-smi at {probe.nvidia_smi} cannot run (exit 127): "
                                  f"CPU-only host, {host.slots} slot(s)"), **common)
    if probe.gpu_status in HANG_STATUSES:
        return HostReport(state=HostState.UNHEALTHY,
                          reason=f"nvidia-smi did not answer in {t} s (driver wedged?)", **common)
    if probe.gpu_status != 0:
        msg = _first_line(probe.gpu_output, "no output")
        return HostReport(state=HostState.UNHEALTHY,
                          reason=f"nvidia-smi failed (exit {probe.gpu_status}): {msg}", **common)
    if probe.apps_status in HANG_STATUSES:
        return HostReport(state=HostState.UNHEALTHY,
                          reason=f"nvidia-smi's process query did not answer in {t} s (driver wedged?)",
                          **common)
    if probe.apps_status != 0:
        msg = _first_line(probe.apps_output, "no output")
        return HostReport(state=HostState.UNHEALTHY,
                          reason=f"nvidia-smi's process query failed (exit {probe.apps_status}): {msg}",
                          **common)
    if not probe.gpus:
        return HostReport(state=HostState.UNHEALTHY, reason="nvidia-smi listed no GPUs", **common)

    wanted = set(host.gpus) if host.gpus is not None else None
    gpus = [g for g in probe.gpus if wanted is None or g.index in wanted]
    reports = []
    claimed = gpu_claims(probe, job)
    for g in sorted(gpus, key=lambda g: g.index):
        state, why = classify_gpu(g, probe.processes, policy, claim=claimed.get(g.index))
        on = tuple(p for p in probe.processes if p.gpu_uuid == g.uuid)
        reports.append(GpuReport(gpu=g, state=state, reason=why, processes=on,
                                 job=holding_job(state, on, claimed.get(g.index), job)))
    counts = {s: sum(1 for r in reports if r.state is s) for s in GpuUse}
    reason = ", ".join(f"{counts[s]} {s.value}" for s in GpuUse if counts[s]) or "no GPUs considered"
    if wanted is not None:
        absent = sorted(wanted - {g.index for g in probe.gpus})
        if absent:
            reason += f"; GPU(s) {', '.join(map(str, absent))} from the inventory are not on this host"
    return HostReport(state=HostState.OK, reason=reason, gpus=tuple(reports),
                      slots=counts[GpuUse.FREE], **common)


def holding_job(state: GpuUse, processes: Iterable[GpuProcess], claim: Claim | None, job: str) -> str | None:
    """Which eltctl job holds a GPU in `state`: this one, another (its claim or its
    processes' ELTCTL_JOB), or None."""
    if state is GpuUse.OURS:
        return job or None
    if state is GpuUse.TAKEN:
        if claim is not None:
            return claim.job or None
        return next((p.job for p in processes if p.job and not p.ours), None)
    return None


def bare_message(error: HostError) -> str:
    """The message without its "host: " prefix, for output already grouped by host."""
    prefix = f"{error.host}: "
    return error.message[len(prefix):] if error.message.startswith(prefix) else error.message


def unreachable_report(host: Host, error: HostError) -> HostReport:
    return HostReport(name=host.name, address=host.address, state=HostState.UNREACHABLE,
                      reason=bare_message(error), error=error)


# --------------------------------------------------------------------------- running it

async def probe_host(host: Host, transport: Transport, *, job: str, policy: Policy,
                     owner: OwnerPolicy | None = None, demand: Demand | None = None) -> HostReport:
    """One round trip; a probe that times out or fails to run makes the host unhealthy.
    `owner`: the owner signals the host watches (None or none watched: no owner check).
    `demand`: this job's demand to publish on the host (a controller's probe; None: none)."""
    limit = probe_timeout(policy)
    marker = new_marker()
    try:
        result = await transport.run(probe_command(job, policy.nvidia_smi_timeout, owner, host.python, demand,
                                                   marker), timeout=limit)
    except HostError as exc:
        if exc.kind in (ErrorKind.TIMEOUT, ErrorKind.COMMAND):  # str enum: equal to the plain strings too
            return HostReport(name=host.name, address=host.address, state=HostState.UNHEALTHY,
                              reason=f"the probe did not complete: {bare_message(exc)}", error=exc)
        raise
    probe = parse_probe_output(result.stdout, marker)
    if not probe.complete and result.exit_status != 0:
        msg = _first_line(result.stderr, f"exit {result.exit_status}")
        return HostReport(name=host.name, address=host.address, state=HostState.UNHEALTHY,
                          reason=f"the probe script failed: {msg}")
    return assess_host(host, probe, policy, job=job)


async def probe_fleet(fleet: Fleet, *, job: str, policy: Policy,
                      hosts: Iterable[Host] | None = None,
                      owner: Callable[[Host], OwnerPolicy] | None = None,
                      demand: Callable[[Host], Demand | None] | None = None) -> list[HostReport]:
    """Probe every host of the fleet at once; reports in the fleet's host order.
    `owner(host)`: the owner signals each host watches (Inventory.owner_policy);
    `demand(host)`: this job's demand to publish there (fair share; None: publish nothing)."""
    targets = fleet.hosts if hosts is None else tuple(hosts)

    async def one(host: Host, transport: Transport) -> HostReport:
        return await probe_host(host, transport, job=job, policy=policy, owner=owner(host) if owner else None,
                                demand=demand(host) if demand else None)

    outcomes: dict[str, Outcome[HostReport]] = await fleet.each(targets, one)
    reports = []
    for host in targets:
        o = outcomes[host.name]
        reports.append(o.value if o.error is None else unreachable_report(host, o.error))
    return reports


def probe_inventory(inventory: Inventory, *, hosts: Iterable[Host] | None = None) -> list[HostReport]:
    """`eltctl probe`: probe the inventory's hosts (all by default) and close everything
    (with the link test: eltctl/linkspeed.py `probe_inventory_with_links`)."""

    async def main() -> list[HostReport]:
        async with Fleet(inventory) as fleet:
            return await probe_fleet(fleet, job=inventory.job.name, policy=inventory.policy, hosts=hosts,
                                     owner=inventory.owner_policy)

    return asyncio.run(main())


# --------------------------------------------------------------------------- JSON

JSON_FORMAT = """\
`eltctl probe --json` prints one JSON array, one object per inventory host, in inventory order:

| key | type | meaning |
|---|---|---|
| `name` | string | the host's name in the inventory |
| `address` | string | its address (`local` for this machine) |
| `state` | string | `ok`, `cpu-only`, `unhealthy` or `unreachable` |
| `reachable` | bool | false only when `state` is `unreachable` |
| `reason` | string | one line saying why the host is in that state |
| `error` | object or null | when the host could not be used: `kind` (`unreachable`, `timeout`, `auth`, `host-key-unknown`, `host-key-changed`, `command`, `internal`), `message`, `hint` (how to fix it) |
| `cpu_count` | int or null | online CPUs |
| `slots` | int | workers the host can take now: free GPUs on an `ok` host, the inventory's `slots` on a `cpu-only` host, 0 otherwise |
| `load_avg` | [float, float, float] or null | 1, 5 and 15 minute load average |
| `users` | [string] | users logged in (from `who`), sorted, once each |
| `owner` | object or null | the owner signal that keeps workers off the host (the inventory's owner_* keys; then every GPU is `busy` and `slots` is 0): `name` (`login`, `keyboard`, `load`, `memory`, or `unknown` when the check could not run), `detail` (e.g. "alice logged in on pts/3, idle 40 s (starts after 900 s idle)"), `since` (wall clock or null) |
| `data_plane` | object or null | where the job's collectives (gloo, NCCL) listen on the host, as its daemon chooses (docs/control-plane.md, "The data plane"): `interface` (string or null: none holds the address, or a `local` host decides from its route to the store), `address` (string or null), `source` (`inventory`: the host's `data_interface`; `address`: the interface of the host's address of its SSH connection; `store route`), `error` (string or null: e.g. a `data_interface` the host lacks, then also in `reason`); null when the host was not probed to the end |
| `link` | object or null | the link test (docs/network.md, "The link test"): what this host sent to the next usable host (`ok` or `cpu-only`) of a ring over that host's data plane in about a second: `from`, `to` (host names), `address` (the receiver's data-plane address), `mbit_s` (number or null: not measured or too fast to time), `bytes`, `seconds` (what arrived, and in how long), `rtt_ms` (number or null: the smallest of five one-byte round trips before the transfer, the link's latency), `error` (string or null: why nothing was measured); null with `--no-link-test`, with fewer than two usable hosts, or for a host not usable |
| `gpus` | [object] | the GPUs considered (the host's `gpus` list, or all), by index; empty unless `state` is `ok` |
| `host_time` | number or null | the host's clock when the probe ran |
| `refused` | object or null | entries of the host's GPU claims directory that were not believed (docs/control-plane.md, "Several jobs on one lab"): `count`, `entries` (the first 20: `file`, `owner` (the file owner's account), `reason`); null when none |
| `demands` | [object] | fair share (docs/fairshare.md): the fresh demand entries the eltctl jobs sharing the host published beside its GPU claims: `job`, `user` (the host account), `time` (host clock), `priority`, `held` and `wanted` (GPUs, job-wide), `held_here`, `wants_here` (this host), `usage_gpu_h` (recent usage, decayed GPU-hours), `min_workers`, `every` (seconds between its writes) |

Each GPU:

| key | type | meaning |
|---|---|---|
| `index` | int | nvidia-smi's index |
| `uuid` | string | |
| `name` | string | the board's name |
| `state` | string | `free`, `busy` (a process not of this job, or memory/utilisation over the policy's thresholds), `ours` (only this job's processes) or `taken` (another eltctl job holds it: its GPU claim, or its processes; never an owner, never used) |
| `reason` | string | why (`taken by job B (user bob, pid 4242)`) |
| `job` | string or null | the eltctl job holding it: this job's name when `ours`, the other job's when `taken`, else null |
| `memory_used_mib`, `memory_total_mib` | int or null | null when the driver says `[N/A]`/`[Not Supported]` |
| `utilization` | int or null | percent; null when not reported |
| `processes` | [object] | compute processes: `pid` (int), `user` (string or null when unreadable), `ours` (bool: its environment holds `ELTCTL_JOB=<job name>`), `job` (string or null: the `ELTCTL_JOB` in its environment, null when it has none or it cannot be read), `used_memory_mib` (int or null), `name` (string) |
"""


def _error_json(err: HostError | None) -> dict | None:
    if err is None:
        return None
    return {"kind": str(err.kind), "message": err.message, "hint": err.hint}


def report_to_json(r: HostReport) -> dict:
    return {
        "name": r.name,
        "address": r.address,
        "state": r.state.value,
        "reachable": r.reachable,
        "reason": r.reason,
        "error": _error_json(r.error),
        "cpu_count": r.cpu_count,
        "slots": r.slots,
        "load_avg": list(r.load_avg) if r.load_avg is not None else None,
        "users": list(r.users),
        "owner": r.owner,
        "data_plane": r.data_plane,
        "host_time": r.host_time,
        "demands": [json.loads(d.to_json()) for d in r.demands],
        "refused": refused_summary(r.refused),
        "link": r.link,
        "gpus": [
            {
                "index": g.gpu.index,
                "uuid": g.gpu.uuid,
                "name": g.gpu.name,
                "state": g.state.value,
                "reason": g.reason,
                "memory_used_mib": g.gpu.memory_used_mib,
                "memory_total_mib": g.gpu.memory_total_mib,
                "utilization": g.gpu.utilization,
                "job": g.job,
                "processes": [
                    {"pid": p.pid, "user": p.user, "ours": p.ours, "job": p.job,
                     "used_memory_mib": p.used_memory_mib, "name": p.name}
                    for p in g.processes
                ],
            }
            for g in r.gpus
        ],
    }


def reports_to_json(reports: Iterable[HostReport]) -> list[dict]:
    return [report_to_json(r) for r in reports]
