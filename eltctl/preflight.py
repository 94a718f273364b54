"""`eltctl up`'s checks before it starts anything: doctor's, plus what only the job knows.

On the control machine, for the job (`job_problems`): the workdir exists, the
command's script (or `-m` module) is found in it, the environment can be passed to a
process. A problem here is the inventory's: `up` stops with a ConfigError (exit 2)
naming `job.workdir`, `job.command` or `job.env`, and starts nothing.

On each host it is about to use, in parallel (`check_hosts`): doctor's checks
(eltctl/doctor.py: SSH, host key, auth, interpreter, torch, nvidia-smi, the work
directory; one implementation, run through `diagnose_fleet`; a host's `import torch`
is not repeated while its torch install is the one it last imported: doctor_script's
stamp), plus `host_job_checks`:
with `shared_filesystem = true` the workdir and the script on the host; a `-m` module
not in the workdir must be importable by the host's python.

`verdict` (pure) judges the hosts: a host passes when none of its checks FAILs.
No host passing (and none already running the job's workers): a HostError (exit 3)
naming each host, its failed check and the fix, in doctor's words. Some hosts
failing: each is a warning, and each is left out (`Verdict.left_out`, host -> reason)
for the controller, which shows it in `eltctl status` as removed with that reason
until the next `up` (policy.leave_out). A host that only could not be reached is
warned about but not left out, and so is one whose nvidia-smi failed: the controller
already shows it unreachable or unhealthy and uses it once it is well (WATCHED_CHECKS).

With `link_test` (a person's `up`; never cron's), the hosts checked that pass are then
measured in pairs over the data plane (eltctl/linkspeed.py, half a second), and
`progress` says when the network, not the GPUs, will set the job's speed.

Which hosts are checked (`for_up`): every host of the inventory except those a live
controller reports running the job's workers (they have proven themselves) and
those removed by `scale --remove`. So `up` of a running healthy job makes no SSH
connection at all and stays quick; hosts left out by a previous `up` are checked
again (a fixed host comes back).
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from eltctl.doctor import Check, HostDiagnosis, Status, check_script_imports, check_store_forward, local_script
from eltctl.errors import ConfigError, EltctlError, HostError
from eltctl.inventory import Host, Inventory, JobSpec

Progress = Callable[[str], None]

# The reason the controller shows for a host `up` left out starts with this
# (policy.host_state); `for_up` checks such hosts again.
LEFT_OUT = "left out by `eltctl up`"
# doctor's checks whose failure is a passing condition the controller watches (it shows
# the host unreachable or unhealthy and uses it once it is well again), not a mistake
# to fix: such a host is warned about, not left out.
WATCHED_CHECKS = ("reachable", "nvidia-smi")

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_SHELLS = ("sh", "bash", "dash", "zsh")
# python's short options that take a value (the value may be attached: -Wignore).
_PY_VALUE_OPTS = "WX"
_PY_LONG_WITH_VALUE = ("--check-hash-based-pycs",)


# --------------------------------------------------------------------------- the command

@dataclass(frozen=True)
class Target:
    """What the command runs from the workdir: a script path or a `-m` module."""

    kind: str  # "script" or "module"
    name: str


def command_target(command: Iterable[str]) -> Target | None:
    """The script or module a worker's command runs; None when it cannot be told
    (`python -c ...`, a program on PATH such as `torchrun`, a script read from stdin).

    `python [options] script.py args`, `python -u -m pkg.mod`, `python3.11 -um mod`,
    `bash run.sh`, `./train.py`, `train.sh`.
    """
    argv = list(command)
    if not argv:
        return None
    first = os.path.basename(argv[0])
    if _PYTHON.fullmatch(first):
        return _python_target(argv[1:])
    if first in _SHELLS:
        rest = argv[1:]
        return Target("script", rest[0]) if rest and not rest[0].startswith("-") else None
    if "/" in argv[0] or argv[0].endswith((".py", ".sh")):
        return Target("script", argv[0])
    return None


def _python_target(args: list[str]) -> Target | None:
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return Target("script", args[i + 1]) if i + 1 < len(args) else None
        if a == "-":
            return None  # the program comes from stdin
        if a.startswith("--"):
            i += 2 if a in _PY_LONG_WITH_VALUE else 1
            continue
        if a.startswith("-") and len(a) > 1:
            for k, ch in enumerate(a[1:], start=1):
                if ch in "cm" + _PY_VALUE_OPTS:
                    value = a[k + 1:] or (args[i + 1] if i + 1 < len(args) else "")
                    if ch == "c":
                        return None
                    if ch == "m":
                        return Target("module", value) if value else None
                    i += 0 if a[k + 1:] else 1  # skip a separate value
                    break
            i += 1
            continue
        return Target("script", a)
    return None


def module_files(module: str) -> tuple[str, ...]:
    """Where `-m module` is found relative to a directory on sys.path."""
    base = module.replace(".", "/")
    return (f"{base}.py", f"{base}/__main__.py", f"{base}/__init__.py")


# --------------------------------------------------------------------------- the job (control machine)

@dataclass(frozen=True)
class JobFacts:
    """What the control machine says about the job, for the host checks."""

    target: Target | None
    module_in_workdir: bool  # a `-m` module was found in the workdir


def job_problems(inventory: Inventory) -> list[ConfigError]:
    """The job's mistakes found on this machine: workdir, script or module, env."""
    job, path = inventory.job, str(inventory.path)
    problems: list[ConfigError] = []
    workdir = Path(job.workdir)
    if not workdir.is_dir():
        what = "is not a directory" if workdir.exists() else "does not exist"
        problems.append(ConfigError(
            f"the job's code directory {workdir} {what} on this machine", path=path, key="job.workdir",
            hint="set [job] workdir to the directory that holds your training script "
                 "(a relative path is relative to the inventory's directory)"))
    else:
        problem = _script_problem(job, workdir, path)
        if problem is not None:
            problems.append(problem)
    problems += _env_problems(job, path)
    return problems


def _script_problem(job: JobSpec, workdir: Path, path: str) -> ConfigError | None:
    target = command_target(job.command)
    if target is None or target.kind != "script" or os.path.isabs(target.name):
        return None  # an absolute script lives on the hosts: checked there only with a shared filesystem
    if (workdir / target.name).is_file():
        return None
    near = _near(workdir, target.name)
    return ConfigError(
        f"the command runs {target.name}, which is not in the workdir {workdir}"
        + (f" (did you mean {near}?)" if near else ""), path=path, key="job.command",
        hint=f"fix the script's name in [job] command{f' (e.g. {near!r})' if near else ''}, or put "
             f"{target.name} into {workdir}; the path is relative to the workdir")


def _near(workdir: Path, name: str) -> str | None:
    parent = (workdir / name).parent
    try:
        names = [p.name for p in parent.iterdir() if p.is_file()]
    except OSError:
        return None
    hit = difflib.get_close_matches(os.path.basename(name), names, n=1, cutoff=0.6)
    return os.path.join(os.path.dirname(name), hit[0]) if hit else None


def _env_problems(job: JobSpec, path: str) -> list[ConfigError]:
    """The parser checked names and types; a NUL cannot pass to a process."""
    return [ConfigError("contains a NUL character, which no process environment can hold",
                        path=path, key=f"job.env.{name}", hint="remove the \\u0000 from the name or value")
            for name, value in job.env if "\0" in name or "\0" in value]


def job_facts(inventory: Inventory) -> JobFacts:
    target = command_target(inventory.job.command)
    found = target is not None and target.kind == "module" and any(
        (Path(inventory.job.workdir) / f).is_file() for f in module_files(target.name))
    return JobFacts(target=target, module_in_workdir=found)


# --------------------------------------------------------------------------- the job (on a host)

def host_job_script(job: JobSpec, facts: JobFacts, python: str) -> str | None:
    """POSIX sh printing one word per problem (nodir, noscript, nomodule); None: nothing to check."""
    q = shlex.quote
    lines: list[str] = []
    t = facts.target
    if job.shared_filesystem:
        lines.append(f"if cd {q(str(job.workdir))} 2>/dev/null; then")
        if t is not None and t.kind == "script":
            lines.append(f"  test -f {q(t.name)} || echo noscript")
        lines.append("else echo nodir; fi")
    if t is not None and t.kind == "module" and not facts.module_in_workdir:
        py = " ".join(q(w) for w in shlex.split(python)) or "python3"
        top = t.name.split(".")[0]
        lines.append(f"{py} -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) "
                     f"else 3)' {q(top)} </dev/null >/dev/null 2>&1 || echo nomodule")
    return "\n".join(lines) + "\n" if lines else None


def parse_host_job(text: str, job: JobSpec, facts: JobFacts, python: str) -> list[Check]:
    """The words `host_job_script` printed, as doctor's failed checks (with their fixes)."""
    words = set(text.split())
    checks = []
    if "nodir" in words:
        checks.append(Check("workdir", Status.FAIL,
                            f"{job.workdir} does not exist on the host (shared_filesystem = true)",
                            "mount the shared filesystem there at the same path, or set "
                            "[job] shared_filesystem = false (eltctl then copies the code)"))
    if "noscript" in words and facts.target is not None:
        checks.append(Check("script", Status.FAIL,
                            f"{facts.target.name} is not in {job.workdir} on the host (shared_filesystem = true)",
                            "check that the shared filesystem is mounted and up to date there"))
    if "nomodule" in words and facts.target is not None:
        checks.append(Check("module", Status.FAIL,
                            f"`-m {facts.target.name}`: neither in the workdir {job.workdir} nor importable "
                            f"by {python} on the host",
                            f"put {module_files(facts.target.name)[0]} into the workdir, or install the "
                            f"package for that interpreter ({python} -m pip install ...)"))
    return checks


def host_job_checks(inventory: Inventory):
    """doctor's `extra` hook: the job's checks on one connected host."""
    facts = job_facts(inventory)
    job = inventory.job
    # the script compiled and its top-level imports found by the host's Python (doctor.py)
    python_script = local_script(job.command, facts.target.name if facts.target and facts.target.kind == "script"
                                 else None, job.workdir, job.env)

    async def extra(host: Host, transport) -> list[Check]:
        checks = await owner_checks(inventory, host, transport)
        if inventory.controller.store == "ssh":
            forward = await check_store_forward(host, transport)
            checks += [forward] if forward is not None else []
        if python_script is not None:
            checks.append(await check_script_imports(transport, host.python, python_script,
                                                     timeout=inventory.ssh.command_timeout + 30))
        script = host_job_script(job, facts, host.python)
        if script is None:
            return checks
        try:
            res = await transport.run("sh -c " + shlex.quote(script), timeout=inventory.ssh.command_timeout + 30)
        except HostError as exc:
            return checks + [Check("job", Status.FAIL, f"the job's checks did not complete: {exc.message}",
                                   exc.hint)]
        return checks + parse_host_job(res.stdout, job, facts, host.python)

    return extra


async def owner_checks(inventory: Inventory, host: Host, transport) -> list[Check]:
    """FAIL when the job's daemon on this host was started by another control machine (the
    same job name run from two places would share the host's job directory)."""
    from eltctl.controller.statedir import control_id
    from eltctl.hosts import ops as hostops

    try:
        paths = await hostops.host_paths(transport, inventory.job.name)
        if await hostops.daemon_pid(transport, paths) is None:
            return []
        owner = await hostops.daemon_owner(transport, paths)
    except HostError:
        return []  # doctor's own checks say what is wrong with the host
    if owner is None or owner.control == control_id():
        return []
    err = hostops.foreign_owner_error(host.name, inventory.job.name, owner)
    return [Check("owner", Status.FAIL, err.message.removeprefix(host.name + ": "), err.hint)]


# --------------------------------------------------------------------------- the verdict (pure)

@dataclass(frozen=True)
class Verdict:
    passed: tuple[str, ...]
    failed: Mapping[str, tuple[Check, ...]]  # host -> its failed checks, in doctor's order
    left_out: Mapping[str, str] = field(default_factory=dict)  # host -> reason, for the controller

    @property
    def watched(self) -> tuple[str, ...]:
        """Failed hosts not left out: unreachable or nvidia-smi failing (WATCHED_CHECKS)."""
        return tuple(h for h in self.failed if h not in self.left_out)


def describe(checks: Iterable[Check]) -> str:
    """One line: each failed check, its detail and its fix."""
    return "; ".join(f"{c.name}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else "") for c in checks)


def verdict(diagnoses: Iterable[HostDiagnosis]) -> Verdict:
    passed, failed, left_out = [], {}, {}
    for d in diagnoses:
        bad = tuple(c for c in d.checks if c.status is Status.FAIL)
        if not bad:
            passed.append(d.host)
            continue
        failed[d.host] = bad
        if any(c.name not in WATCHED_CHECKS for c in bad):
            left_out[d.host] = f"{LEFT_OUT}: {describe(bad)}"
    return Verdict(passed=tuple(passed), failed=failed, left_out=left_out)


def error_of(v: Verdict, *, running: Iterable[str] = ()) -> HostError | None:
    """Exit 3 when no host can run the job: none passed and none runs its workers already."""
    if v.passed or list(running) or not v.failed:
        return None
    lines = ["no host can run the job; `eltctl up` started nothing:"]
    for host, checks in v.failed.items():
        for c in checks:
            lines.append(f"  {host}: {c.name}: {c.detail}")
            if c.fix:
                lines.append(f"    fix: {c.fix}")
    err = HostError(", ".join(v.failed), "")
    EltctlError.__init__(err, "\n".join(lines),
                         hint="fix it, then run `eltctl up` again (`eltctl doctor` checks the hosts alone)")
    err.kind = "preflight"
    return err


def warnings(v: Verdict) -> list[str]:
    out = [f"warning: {host} is left out: {v.left_out[host][len(LEFT_OUT) + 2:]}" for host in v.left_out]
    out += [f"warning: {host} is not usable now ({describe(v.failed[host])}); the controller uses it "
            "once it is" for host in v.watched]
    return out


# --------------------------------------------------------------------------- running it

async def check_hosts(inventory: Inventory, hosts: Iterable[Host], *, link_test: bool = False) -> tuple[
        list[HostDiagnosis], list]:
    """doctor's checks and the job's, on `hosts` at once; with `link_test`, then the link
    test's figures between those that pass (eltctl/linkspeed.py, `UP_SECONDS` a transfer)."""
    from eltctl.doctor import diagnose_fleet
    from eltctl.hosts.fleet import Fleet

    async with Fleet(inventory) as fleet:
        found = await diagnose_fleet(fleet, policy=inventory.policy, hosts=hosts,
                                     extra=host_job_checks(inventory), torch_cached=True)
        if not link_test:
            return found, []
        from eltctl import linkspeed

        passed = [inventory.host(d.host) for d in found if d.ok]
        return found, await linkspeed.measure(fleet, passed, seconds=linkspeed.UP_SECONDS)


def hosts_to_check(inventory: Inventory, status: Mapping | None) -> tuple[list[Host], list[str]]:
    """(hosts to check, hosts running the job's workers) from a live controller's status."""
    states = {h.get("name"): (h.get("state"), str(h.get("reason") or ""))
              for h in (status or {}).get("hosts") or [] if isinstance(h, Mapping)}
    check, running = [], []
    for host in inventory.hosts:
        state, reason = states.get(host.name, (None, ""))
        if not host.schedule.enabled or state == "cordoned":
            continue  # `enabled = false` or `eltctl cordon`: not about to be used
        if state == "running":
            running.append(host.name)
        elif state == "removed" and not reason.startswith(LEFT_OUT):
            continue  # `scale --remove`: not about to be used
        else:
            check.append(host)
    return check, running


def _live_status(inventory: Inventory) -> dict | None:
    from eltctl.controller import socket as csock
    from eltctl.controller.statedir import StateDir

    sock = StateDir.for_job(inventory.job.name).socket
    if not sock.exists():
        return None
    try:
        doc = csock.request(sock, {"op": "status"}, timeout=10)
    except (csock.SocketError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def for_doctor(inventory: Inventory, *, accept_new: bool = False,
               link_test: bool = False) -> tuple[list[ConfigError], list[HostDiagnosis]]:
    """`eltctl doctor`: the job's problems on this machine (`job_problems`) and every
    host's diagnosis with the job's checks there (`host_job_checks`): what `up` checks,
    so a job `doctor` passes does not fail at `up`; `link_test`: and the links between
    the hosts that pass (eltctl/linkspeed.py)."""
    from eltctl.doctor import diagnose

    return job_problems(inventory), diagnose(inventory, accept_new=accept_new, extra=host_job_checks(inventory),
                                             link_test=link_test)


def for_up(inventory: Inventory, progress: Progress = lambda _m: None, *,
           ignore_mirror_check: bool = False, link_test: bool = False) -> dict[str, str]:
    """Run the checks; raise ConfigError (job), HostError (no host usable) or
    MirrorCheckError (the mirror unusable by an account that touches it, unless
    `ignore_mirror_check`); else the hosts to leave out, with their reasons (warnings go
    to `progress`). `link_test` (a person's `up`, not cron's): the hosts checked that pass
    are measured in pairs, and `progress` says when the link, not the GPUs, will set the
    job's speed (eltctl/linkspeed.py; the job's bytes per step when it reports them)."""
    problems = job_problems(inventory)
    if problems:
        raise ConfigError.several(problems)
    status = _live_status(inventory)
    hosts, running = hosts_to_check(inventory, status)
    if not hosts:
        return {}
    progress(f"checking {len(hosts)} host(s): {', '.join(h.name for h in hosts)}")
    diagnoses, figures = asyncio.run(check_hosts(inventory, hosts, link_test=link_test))
    v = verdict(diagnoses)
    err = error_of(v, running=running)
    if err is not None:
        raise err
    for line in warnings(v):
        progress(line)
    if figures:
        from eltctl import linkspeed

        for line in linkspeed.up_lines(figures, linkspeed.grad_bytes_of(status)):
            progress(line)
    from eltctl.mirror import check as mirror_check  # the mirror as every account will use it

    mirror_check.for_up(inventory, [h for h in hosts if h.name in v.passed], progress, ignore=ignore_mirror_check)
    return dict(v.left_out)


__all__ = ["LEFT_OUT", "JobFacts", "Target", "Verdict", "check_hosts", "command_target", "describe",
           "error_of", "for_doctor", "for_up", "host_job_checks", "host_job_script", "hosts_to_check", "job_facts",
           "job_problems", "module_files", "parse_host_job", "verdict", "warnings"]
