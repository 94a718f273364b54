"""Operations on one host of a job, over its `Transport`: the control plane's hands.

Each is one or two round trips on the host and needs only `/bin/sh` and the host's
Python there (docs/control-plane.md, "Files"):

- `ensure_runtime`: the runtime (`eltctl_runtime`, every runtime/**/*.py) lives in
  `~/.eltctl/runtime/<hash>/` where the hash covers its files' paths and contents; it
  is sent (a base64 tar on stdin) only when that directory is missing.
- `sync_code`: the job's code directory goes to `~/.eltctl/jobs/<job>/<host>/code/`;
  the host's Python lists what is there with SHA-256 sums and only changed files are
  sent, removed ones deleted. What goes is chosen by `code_rules` (`eltctl.hosts.ignore`:
  the built-in rules, the ignore files, `[job] exclude` and `include`); a file left out
  is deleted on the host too. Skipped when the inventory says the hosts share a
  filesystem (the workers then run in `workdir` itself).
- `start_daemon`: writes the job's `secret` (mode 0600, carried on the command's
  stdin: never on a command line or in an environment that `ps` shows) and
  `daemon.json` (the job's `env` inside it, also from stdin), and starts `python -m
  eltctl_runtime.daemon` detached (`setsid nohup`, stdin from /dev/null, output to
  `daemon.log`).
- `daemon_pid`, `job_processes`, `kill_pids`: what runs there, found on the host
  itself (pid files and `/proc/<pid>/environ` holding `ELTCTL_JOB=<job>`), whatever
  the controller remembers.

Where things are on the host is `eltctl.hosts.layout`; the Python programs run there
are the files of `eltctl.hosts.programs`.

Errors a host raises are `HostError`s (the transport's); a command that ran and
failed is a `HostError` of kind `command` with its stderr, so a Fleet outcome says why.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import shlex
import tarfile
from dataclasses import dataclass
from pathlib import Path

from eltctl.errors import HostError
from eltctl.hosts import ignore, layout, programs
from eltctl.hosts.layout import HostPaths
from eltctl.hosts.transport import ErrorKind, RunResult, Transport
from eltctl.inventory import DeviceKind, Host, Inventory, courtesy
from eltctl_runtime.store.auth import encode_secret

RUNTIME_PACKAGE = "eltctl_runtime"
DAEMON_MODULE = "eltctl_runtime.daemon"
# Never listed on the host (so never deleted there): version control, caches, environments,
# our own state. What is sent is chosen by `code_rules`.
SYNC_EXCLUDE_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", layout.STATE_DIR,
                               ".mypy_cache", ".pytest_cache", ".ipynb_checkpoints", "node_modules"})
SYNC_EXCLUDE_SUFFIXES = (".pyc", ".pyo")
TRANSFER_TIMEOUT = 120.0


def _check(host: Host, what: str, result: RunResult) -> RunResult:
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_status}")
        raise HostError(host.name, f"{what} failed: {detail.splitlines()[-1][:300]}", kind=ErrorKind.COMMAND)
    return result


async def remote_home(t: Transport) -> str:
    result = _check(t.host, "reading $HOME", await t.run('printf "%s" "$HOME"'))
    home = result.stdout.strip()
    if not home.startswith("/"):
        raise HostError(t.host.name, f"$HOME is {home!r}, not an absolute path", kind=ErrorKind.COMMAND)
    return home


async def host_paths(t: Transport, job: str) -> HostPaths:
    return HostPaths(home=await remote_home(t), job=job, host=t.host.name)


# --------------------------------------------------------------------------- the runtime

def runtime_source_dir() -> Path:
    """The directory of the runtime package, found without importing it (it imports torch)."""
    spec = importlib.util.find_spec(RUNTIME_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {RUNTIME_PACKAGE} package is not installed next to eltctl")
    return Path(list(spec.submodule_search_locations)[0])


def runtime_files(source: Path | None = None) -> dict[str, bytes]:
    """{relative POSIX path: contents} of every `*.py` under the runtime directory
    (subpackages included, `__pycache__` left out)."""
    source = source or runtime_source_dir()
    return {p.relative_to(source).as_posix(): p.read_bytes() for p in sorted(source.rglob("*.py"))
            if "__pycache__" not in p.relative_to(source).parts}


def runtime_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()[:16]


def _tar_b64(members: dict[str, bytes]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


async def ensure_runtime(t: Transport, paths: HostPaths, files: dict[str, bytes] | None = None) -> tuple[str, bool]:
    """(the runtime directory to put on PYTHONPATH, whether it was sent now)."""
    files = files if files is not None else runtime_files()
    digest = runtime_digest(files)
    target = paths.runtime_dir(digest)
    probe = await t.run(f"test -f {shlex.quote(target + '/eltctl_runtime/__init__.py')}")
    if probe.ok:
        return target, False
    _check(t.host, "shipping the runtime",
           await t.run(programs.command(t.host.python, "unpack_runtime", target), input=_tar_b64(files),
                       timeout=TRANSFER_TIMEOUT))
    return target, True


# --------------------------------------------------------------------------- the code

def code_rules(inventory: Inventory) -> ignore.Rules:
    """What of the job's workdir goes to the hosts (`eltctl.hosts.ignore`): the built-in
    rules, the job's own files inside the workdir, `[job] exclude` and `include`."""
    from eltctl.controller.statedir import state_root

    job = inventory.job
    own = ((inventory.path, "the inventory"), (state_root(), "the controller's state"),
           (inventory.controller.metrics_file, "the metrics file"))
    return ignore.Rules(first=ignore.builtin_rules() + ignore.job_rules(job.workdir, own),
                        exclude=ignore.compile_patterns(job.exclude, "[job] exclude"),
                        include=ignore.compile_patterns(job.include, "[job] include"))


def code_selection(inventory: Inventory) -> ignore.Selection:
    """The files of the workdir that go to the hosts, and those left out (with why)."""
    return ignore.choose(inventory.job.workdir, code_rules(inventory))


def local_manifest(workdir: Path, rules: ignore.Rules | None = None) -> dict[str, str]:
    """{relative path: sha256} of the code directory's files that go to the hosts (`rules`;
    None: the built-in rules only)."""
    rules = rules if rules is not None else ignore.Rules(first=ignore.builtin_rules())
    return {rel: hashlib.sha256((workdir / rel).read_bytes()).hexdigest()
            for rel in sorted(ignore.choose(workdir, rules).files)}


@dataclass(frozen=True)
class SyncResult:
    sent: tuple[str, ...]
    deleted: tuple[str, ...]


def plan_sync(local: dict[str, str], remote: dict[str, str]) -> SyncResult:
    """Pure: what to send (new or changed) and what to delete (gone locally)."""
    sent = tuple(sorted(p for p, h in local.items() if remote.get(p) != h))
    deleted = tuple(sorted(p for p in remote if p not in local))
    return SyncResult(sent=sent, deleted=deleted)


async def sync_code(t: Transport, workdir: Path, code_dir: str, rules: ignore.Rules | None = None) -> SyncResult:
    """Make `code_dir` on the host hold exactly `workdir`'s files that `rules` choose
    (`code_rules`; None: the built-in rules); send only the changes."""
    host = t.host
    listing = programs.command(host.python, "manifest", code_dir, json.dumps(sorted(SYNC_EXCLUDE_DIRS)),
                               json.dumps(list(SYNC_EXCLUDE_SUFFIXES)))
    got = _check(host, "listing the code on the host", await t.run(listing, timeout=TRANSFER_TIMEOUT))
    try:
        remote = json.loads(got.stdout.strip().splitlines()[-1]) if got.stdout.strip() else {}
    except ValueError as exc:
        raise HostError(host.name, f"unreadable code listing from the host: {exc}", kind=ErrorKind.COMMAND) from exc
    local = local_manifest(workdir, rules)
    plan = plan_sync(local, remote)
    if not plan.sent and not plan.deleted:
        return plan
    tar = ""
    if plan.sent:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as archive:
            for rel in plan.sent:
                src = workdir / rel
                info = tarfile.TarInfo(rel)
                data = src.read_bytes()
                info.size = len(data)
                info.mode = src.stat().st_mode & 0o777
                archive.addfile(info, io.BytesIO(data))
        tar = base64.b64encode(buf.getvalue()).decode()
    _check(host, "sending the code",
           await t.run(programs.command(host.python, "apply", code_dir),
                       input=json.dumps({"delete": list(plan.deleted), "tar": tar}), timeout=TRANSFER_TIMEOUT))
    return plan


# --------------------------------------------------------------------------- the daemon

def daemon_config(inventory: Inventory, host: Host, paths: HostPaths, store: str,
                  gpus: tuple[int, ...] | None, *, secret: bool = False) -> dict:
    """daemon.json (runtime/daemon/config.py documents each key).

    `gpus`: the GPU indices the job may use on this host (the inventory's list, else
    what the probe found); None on a host without GPUs (then `slots` CPU workers).
    `secret`: the job's secret is written beside it (`start_daemon`): `secret_file`
    names it, and the daemon and its workers sign and check every store value with it.
    """
    job, policy = inventory.job, inventory.policy
    code_dir = str(job.workdir) if job.shared_filesystem else paths.code_dir
    device = _daemon_device(inventory, gpus)
    return {
        "job": job.name,
        "host": host.name,
        "store": store,
        "job_dir": paths.job_dir,
        "code_dir": code_dir,
        "python": host.python,
        "command": list(job.command),
        "env": dict(job.env),
        "device": device,
        "gpus": list(gpus) if gpus else None,
        # the probe's GPUs, not the inventory's: the daemon follows what its nvidia-smi lists
        "follow_gpus": _follows(host, gpus),
        "slots": host.slots,
        "max_micro_batch": host.max_micro_batch,
        "data_interface": host.data_interface,
        "checkpoint_dir": paths.checkpoint_dir,
        "hang_timeout": policy.hang_timeout,
        "min_workers": job.min_workers,
        "max_workers": job.max_workers,
        "watch_interval": policy.watch_interval,
        "nvidia_smi_timeout": policy.nvidia_smi_timeout,
        "mode": job.mode.value,
        "stop_grace": job.stop_grace,
        "progress": job.progress,
        "max_restarts": job.max_restarts,
        "restart_window": job.restart_window,
        "courtesy": courtesy.for_host(inventory.courtesy, host.courtesy).to_json(),
        "owner": inventory.owner_policy(host).to_dict(),
        **({"secret_file": paths.secret_file} if secret else {}),
    }


def _follows(host: Host, gpus: tuple[int, ...] | None) -> bool:
    """The daemon's GPUs follow its nvidia-smi: they came from a probe (the inventory's
    `gpus` pin them; a CPU host has none to follow)."""
    return host.gpus is None and bool(gpus)


def _daemon_device(inventory: Inventory, gpus: tuple[int, ...] | None) -> str:
    if inventory.job.device is DeviceKind.AUTO:
        return "cuda" if gpus else "cpu"
    return inventory.job.device.value


def daemon_slot_kind(inventory: Inventory, host: Host,
                     gpus: tuple[int, ...] | None) -> tuple[str, frozenset[int] | None]:
    """What the slots of a daemon started with `gpus` (`daemon_config`) are: ("gpu" or
    "cpu", the slots it has; None: any GPU), as its state document reports them
    (`slot_kind`, `valid_slots`, at its start: one that follows its GPUs, `follow_gpus`,
    takes nvidia-smi's list later; runtime/daemon/config.py `gpu_host`, `valid_slots`)."""
    listed = tuple(gpus) if gpus else None
    if listed is not None:
        return "gpu", frozenset(listed)
    if _daemon_device(inventory, gpus) == "cuda":
        return "gpu", None
    return "cpu", frozenset(range(host.slots))


@dataclass(frozen=True)
class Owner:
    """Which control machine runs a job on a host: the job directory's `owner` file."""

    control: str  # statedir.control_id() of that machine
    machine: str  # its host name, for messages
    inventory: str

    def line(self) -> str:
        return json.dumps({"control": self.control, "machine": self.machine, "inventory": self.inventory})


OWNER_FILE = "owner"
SECRET_TMP = f".{layout.SECRET_FILE}.tmp"


def start_daemon_command(host: Host, paths: HostPaths, runtime_dir: str, job: str,
                         owner: Owner | None = None, secret: bool = False, bind_from_ssh: bool = False) -> str:
    """Write daemon.json from stdin, then start the daemon detached from the session.

    With `secret`, stdin's first line is the job's secret (hex): the shell's `read`
    and `printf` builtins write it to `secret` under umask 077, so it is 0600 from
    the start and appears in no process's arguments or environment.

    `--detach` makes the daemon start itself again in a new session (stdin from
    /dev/null, output to daemon.log) and answer once it holds its pid file: "ok PID"
    (exit 0), or "running PID" (exit 3) when one runs already. ELTCTL_JOB and
    ELTCTL_HOST in its environment (and so its workers') mark the job's processes.

    `bind_from_ssh` (the "ssh" store mode, where the store is a Unix socket on the host):
    ELTCTL_BIND_ADDRESS is the host's own address of this SSH connection (the third
    field of SSH_CONNECTION), where its workers' gloo/NCCL listen (runtime/collectives.py
    `bind_address`); empty when SSH_CONNECTION is missing (the runtime's own rule then).
    """
    q = shlex.quote
    bind = "ELTCTL_BIND_ADDRESS=$(set -- ${SSH_CONNECTION:-}; echo ${3:-}) " if bind_from_ssh else ""
    env = (f"{bind}ELTCTL_JOB={q(job)} ELTCTL_HOST={q(host.name)} "
           + (f"ELTCTL_CONTROL={q(owner.control)} " if owner else "")
           + f"PYTHONPATH={q(runtime_dir)}${{PYTHONPATH:+:$PYTHONPATH}}")
    claim = f"printf '%s\\n' {q(owner.line())} > {OWNER_FILE} && " if owner else ""
    keep = (f"IFS= read -r s && (umask 077 && printf '%s\\n' \"$s\" > {SECRET_TMP}) && chmod 600 {SECRET_TMP} && "
            f"mv {SECRET_TMP} {layout.SECRET_FILE} && s= && " if secret else "")
    jobs = f"{paths.home}/{layout.JOBS_DIR}"
    private = [f"{paths.home}/{layout.STATE_DIR}", jobs, f"{jobs}/{job}", paths.job_dir]
    return (
        # umask 077 (the transport's) makes new ones private; older ones are tightened
        f"mkdir -p {q(paths.workers_dir)} && chmod 700 {' '.join(map(q, private))} && cd {q(paths.job_dir)} && "
        f"{keep}cat > {layout.DAEMON_JSON}.tmp && mv {layout.DAEMON_JSON}.tmp {layout.DAEMON_JSON} && {claim}"
        f"{env} {q(host.python)} -m {DAEMON_MODULE} --config {q(paths.daemon_json)} --detach </dev/null"
    )


DAEMON_START_TIMEOUT = 90.0


async def start_daemon(t: Transport, paths: HostPaths, runtime_dir: str, config: dict,
                       owner: Owner | None = None, secret: bytes | None = None,
                       bind_from_ssh: bool = False) -> int | None:
    """Start the daemon; its pid (None if it did not say). One running already is fine.
    With `secret` (the job's), it is written first, to `config["secret_file"]`."""
    cmd = start_daemon_command(t.host, paths, runtime_dir, config["job"], owner, secret is not None,
                               bind_from_ssh)
    head = encode_secret(secret) if secret is not None else ""
    result = await t.run(cmd, input=head + json.dumps(config, indent=1) + "\n", timeout=DAEMON_START_TIMEOUT)
    if result.exit_status not in (0, 3):
        log = await tail_log(t, paths.daemon_log, 5)
        detail = (result.stdout.strip() + " " + result.stderr.strip()).strip() or f"exit {result.exit_status}"
        raise HostError(t.host.name, f"the daemon did not start: {detail[-300:]}"
                        + (f"; daemon.log: {' | '.join(log.strip().splitlines()[-3:])}" if log.strip() else ""),
                        kind=ErrorKind.COMMAND)
    words = result.stdout.split()
    return int(words[1]) if len(words) >= 2 and words[1].isdigit() else None


async def daemon_pid(t: Transport, paths: HostPaths) -> int | None:
    """The pid in daemon.pid when that process is alive and is our daemon, else None."""
    q = shlex.quote
    result = await t.run(
        f"p=$(cat {q(paths.daemon_pid)} 2>/dev/null) && [ -n \"$p\" ] && kill -0 \"$p\" 2>/dev/null && "
        f"tr '\\000' ' ' </proc/$p/cmdline 2>/dev/null | grep -q {q(DAEMON_MODULE)} && echo \"$p\"")
    text = result.stdout.strip()
    return int(text) if result.ok and text.isdigit() else None


async def daemon_owner(t: Transport, paths: HostPaths) -> Owner | None:
    """Who started the job's daemon on this host (None: no owner file, an older eltctl)."""
    result = await t.run(f"cat {shlex.quote(paths.job_dir + '/' + OWNER_FILE)} 2>/dev/null")
    try:
        d = json.loads(result.stdout.strip().splitlines()[-1])
        return Owner(str(d["control"]), str(d.get("machine", "?")), str(d.get("inventory", "?")))
    except (ValueError, IndexError, KeyError, TypeError):
        return None


def foreign_owner_error(host: str, job: str, owner: Owner) -> HostError:
    return HostError(
        host, f"job {job!r} runs here from another control machine ({owner.machine}, inventory "
              f"{owner.inventory}): two control machines cannot run one job name on the same hosts",
        kind=ErrorKind.COMMAND,
        hint=f"give one of the two jobs another [job] name; `eltctl down` on {owner.machine} stops it there")


async def tail_log(t: Transport, path: str, lines: int = 20) -> str:
    result = await t.run(f"tail -n {int(lines)} {shlex.quote(path)} 2>/dev/null")
    return result.stdout


# --------------------------------------------------------------------------- processes

@dataclass(frozen=True)
class JobProcess:
    pid: int
    command: str


async def job_processes(t: Transport, job: str, control: str = "") -> list[JobProcess]:
    """This job's processes on the host: `ELTCTL_JOB=<job>` in their environment (and,
    when set, `ELTCTL_HOST` naming this host: several inventory hosts may share a machine;
    `ELTCTL_CONTROL` naming `control`: another control machine's job of the same name
    is not ours)."""
    result = _check(t.host, "listing the job's processes",
                    await t.run(programs.command(t.host.python, "list_processes", job, t.host.name, control)))
    try:
        rows = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise HostError(t.host.name, f"unreadable process list: {exc}", kind=ErrorKind.COMMAND) from exc
    return [JobProcess(pid=int(p), command=str(c)) for p, c in rows]


async def kill_pids(t: Transport, pids: list[int], signal_name: str = "TERM") -> None:
    if pids:
        await t.run(f"kill -{signal_name} {' '.join(str(int(p)) for p in pids)} 2>/dev/null; true")


def local_address(t: Transport) -> str | None:
    """The address this machine uses on its connection to the host (None: local host)."""
    return t.local_address()
