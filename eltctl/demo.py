"""The demo scenario: the real system on this machine, without an SSH server.

`eltctl demo` writes a temporary inventory of a few hosts with `address = "local"`
(the local transport), each with simulated GPUs (`eltctl.sim`: a state file read
by a stand-in `nvidia-smi` put first on that host's PATH), and runs the real
`eltctl up` on the example training with CPU workers. After some steps a simulated
owner (a real process registered on one host's GPU) takes that GPU: the host's
daemon sees it and the job's worker there leaves; later the owner's process ends,
the GPU looks idle for `idle_for`, and the controller lets the job grow back. Then
`eltctl down`, and a summary: steps, each resize with its pause, final loss.

The parts are separate so tests and the owner-yield benchmark reuse them:
`prepare` writes the files (no processes), `Owner` is the simulated owner,
`EltctlRunner` runs eltctl's own commands against the demo's inventory and private
state directory, the predicates on status documents are pure, `sweep` ends every
process the demo started (found by a marker in their environment) and `run_demo`
is the scenario with its live view.

Everything lives under one temporary directory (its own HOME for the hosts, its
own XDG_STATE_HOME for the controller); it is removed at the end, Ctrl-C included.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from eltctl.errors import EltctlError

MARKER_ENV = "ELTCTL_DEMO_ROOT"  # in the environment of every process the demo starts
OWNER_USER_LABEL = "owner"
RESIZE_KINDS = ("start", "join", "leave", "yield", "crash", "hang", "restore")


class DemoError(EltctlError):
    """The demo could not run or did not reach a step of its scenario."""


@dataclass(frozen=True)
class DemoHost:
    name: str
    gpus: int


@dataclass(frozen=True)
class DemoPlan:
    """What the demo does, and how long it may wait for each step of it."""

    hosts: tuple[DemoHost, ...] = (DemoHost("ws1", 2), DemoHost("ws2", 1), DemoHost("ws3", 1))
    owner_host: str = "ws1"  # whose owner comes back, and to which of its GPUs
    owner_gpu: int = 1
    steps_before_owner: int = 15  # training steps at full size before the owner comes
    owner_stays_s: float = 6.0  # how long the owner keeps the GPU
    steps_after_rejoin: int = 10  # steps at full size again before `down`
    idle_for: str = "3s"  # [policy] of the demo inventory
    cooldown: str = "3s"
    probe_interval: str = "2s"
    watch_interval: str | None = None  # None: the inventory's default (written only if it knows the key)
    step_sleep_s: float = 0.05  # extra work per step: a pace a person can follow
    wait_s: float = 90.0  # the longest any one step of the scenario may take

    @property
    def gpu_count(self) -> int:
        return sum(h.gpus for h in self.hosts)


@dataclass(frozen=True)
class DemoSetup:
    """The files `prepare` wrote: where everything is."""

    root: Path
    inventory: Path
    job: str
    home: Path  # HOME of the demo's hosts (they share this machine and this home)
    state_home: Path  # XDG_STATE_HOME of the demo's controller
    bin_dir: Path  # holds the stand-in nvidia-smi
    gpu_states: Mapping[str, Path]  # host name -> its simulated GPU state file

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for eltctl's own commands: the private state and the marker."""
        env = dict(os.environ if base is None else base)
        env["XDG_STATE_HOME"] = str(self.state_home)
        env[MARKER_ENV] = str(self.root)
        return env

    def host_dir(self, host: str) -> Path:
        """The job's directory on a demo host (`~/.eltctl/jobs/<job>/<host>/`)."""
        return self.home / ".eltctl" / "jobs" / self.job / host


def example_dir() -> Path:
    """The repository's examples/ (train.py, toy.py) next to the eltctl package."""
    return Path(__file__).resolve().parent.parent / "examples"


def training_command(python: str, plan: DemoPlan) -> list[str]:
    """The example training, small enough for 2 cores and long enough to outlast the demo."""
    return [python, "train.py", "--steps", "1000000", "--hidden", "64", "--layers", "2",
            "--samples", "4096", "--batch", "32", "--checkpoint-every", "20",
            "--step-sleep", f"{plan.step_sleep_s:g}"]


def _toml(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _policy_keys() -> tuple[str, ...]:
    from eltctl.inventory import POLICY_KEYS

    return tuple(POLICY_KEYS)


def prepare(root: Path, plan: DemoPlan, *, python: str | None = None,
            source: Path | None = None, job: str | None = None) -> DemoSetup:
    """Write the demo's files under `root` (which must exist): code, GPUs, inventory.

    Starts no process. `python` is the interpreter with torch (default: this one).
    """
    from eltctl.sim.gpustate import GpuState, install_nvidia_smi

    python = python or sys.executable
    source = source or example_dir()
    job = job or f"demo-{os.getpid()}-{int(time.time()) % 100000}"
    root = Path(root)
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "toy.py"):
        if not (source / name).is_file():
            raise DemoError(f"the example training is missing: no {source / name}",
                            hint="run the demo from a checkout of eltctl (bash scripts/demo.sh)")
        shutil.copyfile(source / name, code / name)
    home = root / "home"
    home.mkdir(exist_ok=True)
    state_home = root / "state"
    state_home.mkdir(exist_ok=True)
    bin_dir = root / "bin"
    install_nvidia_smi(bin_dir)
    gpu_states: dict[str, Path] = {}
    for host in plan.hosts:
        path = root / "gpus" / f"{host.name}.json"
        path.parent.mkdir(exist_ok=True)
        GpuState(path, host.name).initialize(host.gpus)
        gpu_states[host.name] = path

    base_path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    policy = {"idle_for": plan.idle_for, "cooldown": plan.cooldown,
              "probe_interval": plan.probe_interval}
    if plan.watch_interval is not None and "watch_interval" in _policy_keys():
        policy["watch_interval"] = plan.watch_interval
    lines = [
        "# Written by `eltctl demo`: three hosts on this machine (no SSH), simulated GPUs.",
        "[job]",
        f"name = {_toml(job)}",
        f"command = {_toml(training_command(python, plan))}",
        f"workdir = {_toml(str(code))}",
        "min_workers = 1",
        f"max_workers = {plan.gpu_count}",
        'device = "cpu"',
        # Two cores for every worker, daemon and controller of the demo.
        'env = { OMP_NUM_THREADS = "1" }',
        "",
        "[policy]",
        *(f"{k} = {_toml(v)}" for k, v in policy.items()),
    ]
    for host in plan.hosts:
        env = {"HOME": str(home), "PATH": f"{bin_dir}:{base_path}",
               "ELTSIM_HOST": host.name, "ELTSIM_STATE": str(gpu_states[host.name])}
        lines += ["", "[[hosts]]", f"name = {_toml(host.name)}", 'address = "local"',
                  f"python = {_toml(python)}", f"env = {_toml(env)}"]
    inventory = root / "hosts.toml"
    inventory.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return DemoSetup(root=root, inventory=inventory, job=job, home=home, state_home=state_home,
                     bin_dir=bin_dir, gpu_states=gpu_states)


# --------------------------------------------------------------------------- the owner


@dataclass
class Owner:
    """A simulated owner: a real process of this user, registered on one host's GPU.

    The stand-in nvidia-smi lists it on that GPU while it lives (as the driver would),
    so the host's daemon sees a process that is not the job's.
    """

    setup: DemoSetup
    host: str
    gpu: int
    memory_mib: int = 6000
    utilization: int = 90
    pid: int | None = None
    registered_at: float | None = None  # time.time() when nvidia-smi started to list it
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def arrive(self) -> int:
        from eltctl.sim.gpustate import ForeignProcess, GpuState, process_starttime

        env = {"PATH": "/usr/bin:/bin", MARKER_ENV: str(self.setup.root)}
        self._proc = subprocess.Popen(["sleep", "86400"], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        self.pid = self._proc.pid
        GpuState(self.setup.gpu_states[self.host], self.host).add_process(ForeignProcess(
            pid=self.pid, gpu=self.gpu, used_memory_mib=self.memory_mib,
            utilization=self.utilization, starttime=process_starttime(self.pid)))
        self.registered_at = time.time()
        return self.pid

    def leave(self) -> None:
        from eltctl.sim.gpustate import GpuState

        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self.pid is not None:
            GpuState(self.setup.gpu_states[self.host], self.host).remove_process(self.pid)


# --------------------------------------------------------------------------- the job's workers


def read_pid_file(path: Path) -> int | None:
    """The pid in a daemon or worker pid file (a number, or JSON with "pid"), else None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text.startswith("{"):
        import json

        try:
            value = json.loads(text).get("pid")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None
    head = text.split()[0] if text else ""
    return int(head) if head.isdigit() else None


def pid_alive(pid: int | None) -> bool:
    """Alive and not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def worker_pid(setup: DemoSetup, host: str, slot: int) -> int | None:
    """The live worker of `slot` on `host`, from the daemon's pid file."""
    pid = read_pid_file(setup.host_dir(host) / "workers" / f"{slot}.pid")
    return pid if pid_alive(pid) else None


class PidWatch:
    """Notes when a process exits, watching it from a thread (10 ms polls), so a live
    view can go on refreshing meanwhile. `start()` begins; `exited_at` is the
    time.time() it was first seen gone, None until then."""

    def __init__(self, pid: int, timeout: float) -> None:
        self.pid = pid
        self.timeout = timeout
        self.exited_at: float | None = None
        self._thread = None

    def start(self) -> "PidWatch":
        import threading

        def watch() -> None:
            self.exited_at = wait_pid_exit(self.pid, self.timeout)

        self._thread = threading.Thread(target=watch, name=f"pid-watch-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()


def wait_pid_exit(pid: int, timeout: float, *, poll: float = 0.01) -> float | None:
    """time.time() when `pid` was first seen gone (or a zombie), or None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return time.time()
        time.sleep(poll)
    return None


# --------------------------------------------------------------------------- eltctl's own commands


@dataclass
class EltctlRunner:
    """Runs `eltctl -i <demo inventory> ...` with the demo's private state directory."""

    setup: DemoSetup
    python: str = sys.executable
    log_dir: Path | None = None

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "eltctl", "-i", str(self.setup.inventory), *args]

    def start(self, *args: str, log_name: str) -> subprocess.Popen:
        """Start a command in the background; its output goes to `<log_dir>/<log_name>`."""
        log_dir = self.log_dir or self.setup.root
        out = open(log_dir / log_name, "ab")
        try:
            # Its own session: the user's Ctrl-C reaches the demo, which then cleans up
            # in order, instead of reaching every child at once.
            return subprocess.Popen(self.argv(*args), env=self.setup.environ(),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            out.close()

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.setup.environ(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, start_new_session=True)


def sweep(root: Path, *, grace_s: float = 3.0) -> list[int]:
    """End every process of this user whose environment carries the demo's marker.

    The marker reaches the controller, the store keeper, the daemons and the
    workers through the environment they inherit, and the owner directly; also
    matched: the hosts' ELTSIM_STATE (under `root`) and the private XDG_STATE_HOME.
    SIGTERM, then SIGKILL after `grace_s`. Returns the pids it signalled.
    """
    marker = f"{MARKER_ENV}={root}".encode()
    prefixes = (f"ELTSIM_STATE={root}/".encode(), f"XDG_STATE_HOME={root}/".encode())
    me, uid = os.getpid(), os.getuid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if any(item == marker or item.startswith(prefixes) for item in environ):
            found.append(int(entry))
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = [p for p in found if pid_alive(p)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if pid_alive(p)]
    return found


# --------------------------------------------------------------------------- reading the status


def events_since(doc: Mapping[str, Any], since: float) -> list[dict]:
    return [e for e in doc.get("events") or [] if isinstance(e, dict)
            and isinstance(e.get("time"), (int, float)) and e["time"] >= since]


def is_training(doc: Mapping[str, Any], world_size: int, *, min_step: int = 0) -> bool:
    """The job trains at `world_size` workers and has reached `min_step`."""
    return (doc.get("state") == "training" and doc.get("world_size") == world_size
            and (doc.get("step") or 0) >= min_step)


def has_yielded(doc: Mapping[str, Any], host: str, since: float) -> bool:
    """A `yield` event on `host` since `since` (a second of clock skew allowed)."""
    return any(e.get("kind") == "yield" and e.get("host") == host for e in events_since(doc, since - 1))


def resizes(doc: Mapping[str, Any], since: float = 0.0) -> list[dict]:
    """The membership changes among the events since `since`, oldest first."""
    return [e for e in events_since(doc, since) if e.get("kind") in RESIZE_KINDS]


# --------------------------------------------------------------------------- the summary


@dataclass(frozen=True)
class Resize:
    at_s: float  # seconds since the demo started
    kind: str
    host: str
    pause_s: float | None
    detail: str


@dataclass(frozen=True)
class DemoSummary:
    job: str
    steps: int | None
    final_loss: float | None
    first_loss: float | None
    resizes: tuple[Resize, ...]
    yield_latency_s: float | None  # owner registered -> our worker on that GPU gone
    rejoin_after_s: float | None  # owner gone -> the job back at full size
    duration_s: float
    down_message: str = ""


def summarize(job: str, final_doc: Mapping[str, Any], *, started: float, first_loss: float | None,
              yield_latency_s: float | None, rejoin_after_s: float | None, duration_s: float,
              down_message: str = "") -> DemoSummary:
    """The summary from the last status document seen (pure)."""
    from eltctl.statusview import describe_event

    changes = tuple(
        Resize(at_s=max(0.0, float(e["time"]) - started), kind=str(e.get("kind")),
               host=describe_event(e)[0],
               pause_s=float(e["pause_s"]) if isinstance(e.get("pause_s"), (int, float)) else None,
               detail=describe_event(e)[1])
        for e in resizes(final_doc, started - 1))
    loss = final_doc.get("loss")
    return DemoSummary(job=job, steps=final_doc.get("step"),
                       final_loss=float(loss) if isinstance(loss, (int, float)) else None,
                       first_loss=first_loss, resizes=changes, yield_latency_s=yield_latency_s,
                       rejoin_after_s=rejoin_after_s, duration_s=duration_s, down_message=down_message)


def render_summary(summary: DemoSummary):
    """The closing table: what happened, each resize and its pause, the figures."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from eltctl.statusview import format_pause

    table = Table(title="resizes", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  header_style="bold")
    table.add_column("at", justify="right", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("host", no_wrap=True)
    table.add_column("pause", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in summary.resizes:
        table.add_row(f"{r.at_s:.1f} s", r.kind, escape(r.host), format_pause(r.pause_s), escape(r.detail))
    if not summary.resizes:
        table.add_row("", "[dim]none[/]", "", "", "")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column()
    facts.add_row("job", escape(summary.job))
    facts.add_row("steps", "?" if summary.steps is None else str(summary.steps))
    loss = "?" if summary.final_loss is None else f"{summary.final_loss:.4g}"
    if summary.first_loss is not None and summary.final_loss is not None:
        loss += f" (first seen {summary.first_loss:.4g})"
    facts.add_row("final loss", loss)
    pauses = [r.pause_s for r in summary.resizes if r.pause_s is not None]
    if pauses:
        facts.add_row("pauses", f"{len(pauses)} resize(s), longest {format_pause(max(pauses))}, "
                                f"median {format_pause(statistics.median(pauses))}")
    if summary.yield_latency_s is not None:
        facts.add_row("owner yield", f"{summary.yield_latency_s:.2f} s from the owner's process on the "
                                     "GPU to our worker's exit there (target <= 5 s)")
    if summary.rejoin_after_s is not None:
        facts.add_row("rejoin", f"{summary.rejoin_after_s:.1f} s after the owner left "
                                "(idle_for + cooldown + join)")
    facts.add_row("took", f"{summary.duration_s:.0f} s")
    if summary.down_message:
        facts.add_row("down", escape(summary.down_message))
    return Group("[bold]demo summary[/]", facts, table)


# --------------------------------------------------------------------------- the scenario


def torch_missing_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return ("eltctl demo runs the real controller and workers, which need PyTorch on this "
                "machine, and torch is not installed for " + sys.executable)
    return None


@dataclass
class Narrator:
    """The demo's running commentary: lines with the time since the start."""

    started: float
    emit_plain: Callable[[str], None] | None = None  # prints each line at once (no live view)
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        line = f"[{time.time() - self.started:5.1f} s] {text}"
        self.lines.append(line)
        if self.emit_plain is not None:
            self.emit_plain(line)


class Scenario:
    """One run of the demo: the steps in order, each waiting on the live status."""

    def __init__(self, setup: DemoSetup, plan: DemoPlan, console, *, live: bool,
                 python: str = sys.executable) -> None:
        self.setup = setup
        self.plan = plan
        self.console = console
        self.live_view = live
        self.runner = EltctlRunner(setup, python=python)
        self.started = time.time()
        self.narrator = Narrator(self.started, None if live else self._plain)
        self.last_doc: dict[str, Any] = {}
        self.first_loss: float | None = None
        self._live = None
        self._up: subprocess.Popen | None = None

    def _plain(self, line: str) -> None:
        from rich.markup import escape

        self.console.print(escape(line), highlight=False)

    # -- observing ------------------------------------------------------------

    def snapshot(self):
        from eltctl.statusview import NoJobError, job_state_dir, read_snapshot

        state_dir = job_state_dir(self.setup.job, self.setup.environ())
        try:
            snap = read_snapshot(self.setup.job, state_dir, timeout=2.0)
        except NoJobError:
            return None
        self.last_doc = dict(snap.document)
        if self.first_loss is None and isinstance(self.last_doc.get("loss"), (int, float)):
            self.first_loss = float(self.last_doc["loss"])
        return snap

    def _render(self, snap):
        from rich.markup import escape

        from eltctl.statusview import ViewOptions, render_status

        title = "[bold]eltctl demo[/]: 3 hosts on this machine, simulated GPUs, the example training"
        story = tuple(escape(line) for line in self.narrator.lines[-6:])
        if snap is None:
            return "\n".join([title, *story, "[dim]waiting for the controller's first status...[/]"])
        return render_status(snap, ViewOptions(now=time.time(), title=title, extra=story + ("",)))

    def wait_for(self, what: str, done: Callable[[Mapping[str, Any]], bool], *,
                 timeout: float | None = None, also: Callable[[], None] | None = None) -> Mapping[str, Any]:
        """Refresh the view about every 0.5 s until `done(status document)`."""
        deadline = time.monotonic() + (timeout or self.plan.wait_s)
        while True:
            snap = self.snapshot()
            if self._live is not None:
                self._live.update(self._render(snap), refresh=True)
            if snap is not None and done(snap.document):
                return snap.document
            if also is not None:
                also()
            if time.monotonic() > deadline:
                state = self.last_doc.get("state", "no status")
                raise DemoError(f"the demo waited {timeout or self.plan.wait_s:.0f} s for {what}; "
                                f"the job is {state} at world size {self.last_doc.get('world_size')}",
                                hint=f"logs: {self.setup.state_home / 'eltctl' / self.setup.job} and "
                                     f"{self.setup.home / '.eltctl' / 'jobs' / self.setup.job}")
            time.sleep(0.5)

    def _check_up(self) -> None:
        if self._up is not None and self._up.poll() not in (None, 0):
            log = (self.setup.root / "up.log").read_text(errors="replace")[-2000:]
            raise DemoError(f"`eltctl up` failed (exit {self._up.returncode}):\n{log}")

    # -- the story --------------------------------------------------------------

    def run(self) -> DemoSummary:
        from rich.live import Live

        if self.live_view:
            with Live(self._render(None), console=self.console, auto_refresh=False,
                      transient=False, redirect_stdout=False) as live:
                self._live = live
                try:
                    return self._story()
                finally:
                    self._live = None
        return self._story()

    def _story(self) -> DemoSummary:
        plan, setup = self.plan, self.setup
        full = plan.gpu_count
        say = self.narrator.say
        say(f"eltctl up: {len(plan.hosts)} hosts, {full} simulated GPUs, CPU workers")
        self._up = self.runner.start("up", log_name="up.log")
        doc = self.wait_for(f"the job to train on {full} workers",
                            lambda d: is_training(d, full), also=self._check_up)
        say(f"training on {full} workers (generation {doc.get('generation')})")
        target = (doc.get("step") or 0) + plan.steps_before_owner
        self.wait_for(f"step {target}", lambda d: is_training(d, full, min_step=target))

        victim = worker_pid(setup, plan.owner_host, plan.owner_gpu)
        watch = PidWatch(victim, plan.wait_s).start() if victim is not None else None
        owner = Owner(setup, plan.owner_host, plan.owner_gpu)
        pid = owner.arrive()
        arrived = owner.registered_at or time.time()
        say(f"the owner of {plan.owner_host} starts a process on GPU {plan.owner_gpu} (pid {pid})")
        doc = self.wait_for("the job to yield the owner's GPU and go on",
                            lambda d: has_yielded(d, plan.owner_host, arrived)
                            and is_training(d, full - 1) and (watch is None or watch.done()))
        yield_latency = None
        if watch is not None and watch.exited_at is not None:
            yield_latency = watch.exited_at - arrived
            say(f"our worker on {plan.owner_host} GPU {plan.owner_gpu} (pid {victim}) left "
                f"{yield_latency:.2f} s after the owner's process appeared")
        step_at_yield = doc.get("step") or 0
        self.wait_for("training to go on without that GPU",
                      lambda d: is_training(d, full - 1, min_step=step_at_yield + 3))
        say(f"the job goes on at {full - 1} workers; the owner keeps the GPU {plan.owner_stays_s:g} s")
        until = time.monotonic() + plan.owner_stays_s
        self.wait_for("the owner", lambda d: time.monotonic() >= until)

        owner.leave()
        left = time.time()
        say(f"the owner's process ends; after idle_for {plan.idle_for} and cooldown "
            f"{plan.cooldown} the GPU is used again")
        doc = self.wait_for(f"GPU {plan.owner_gpu} of {plan.owner_host} to be used again",
                            lambda d: is_training(d, full))
        rejoin_after = time.time() - left
        say(f"GPU {plan.owner_gpu} of {plan.owner_host} is used again: {full} workers, "
            f"{rejoin_after:.1f} s after the owner left")
        target = (doc.get("step") or 0) + plan.steps_after_rejoin
        self.wait_for(f"step {target}", lambda d: is_training(d, full, min_step=target))
        final = dict(self.last_doc)

        say("eltctl down: final checkpoint, every process stops")
        if self._live is not None:
            self._live.update(self._render(self.snapshot()), refresh=True)
        down = self.runner.run("down", timeout=plan.wait_s)
        message = (down.stdout.strip().splitlines() or [""])[-1]
        if down.returncode != 0:
            raise DemoError(f"`eltctl down` failed (exit {down.returncode}): "
                            f"{(down.stderr or down.stdout).strip()[-1500:]}")
        return summarize(setup.job, final, started=self.started, first_loss=self.first_loss,
                         yield_latency_s=yield_latency, rejoin_after_s=rejoin_after,
                         duration_s=time.time() - self.started, down_message=message)

    def close(self, *, force_down: bool) -> None:
        """Reap `eltctl up`; after a failure or Ctrl-C, `down --force` if a controller may run."""
        if self._up is not None:
            if self._up.poll() is None:
                self._up.kill()
            self._up.wait()
        if force_down and (self.setup.state_home / "eltctl" / self.setup.job).exists():
            try:
                self.runner.run("down", "--force", timeout=60)
            except subprocess.TimeoutExpired:
                pass


def run_demo(plan: DemoPlan, console, *, keep: bool = False, live: bool | None = None,
             root: Path | None = None) -> DemoSummary:
    """The whole demo; everything it started is ended and its directory removed, whatever happens."""
    reason = torch_missing_reason()
    if reason:
        raise DemoError(reason, hint="bash scripts/demo.sh sets up .venv with torch and runs the demo")
    made = root is None
    root = Path(tempfile.mkdtemp(prefix="eltctl-demo-")) if root is None else Path(root)
    live = console.is_terminal if live is None else live
    scenario: Scenario | None = None
    outcome = "failed"
    try:
        setup = prepare(root, plan)
        scenario = Scenario(setup, plan, console, live=live)
        summary = scenario.run()
        outcome = "ok"
        return summary
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        # A second Ctrl-C must not leave processes behind: cleaning up is not interruptible.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _in_main_thread() else None
        try:
            if scenario is not None:
                scenario.close(force_down=outcome != "ok")
            sweep(root)
            # A failed demo keeps its files: the controller's and hosts' logs say why.
            if keep or (outcome == "failed" and made):
                console.print(f"demo files kept in {root}", highlight=False)
            elif made:
                shutil.rmtree(root, ignore_errors=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def yield_figures(latencies: Sequence[float]) -> dict[str, float | int | None]:
    """min / median / max of owner-yield latencies (seconds); shared with the benchmark."""
    if not latencies:
        return {"n": 0, "min_s": None, "median_s": None, "max_s": None}
    return {"n": len(latencies), "min_s": min(latencies), "median_s": statistics.median(latencies),
            "max_s": max(latencies)}
