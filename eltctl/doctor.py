"""The doctor: per host, what would stop eltctl from using it, and how to fix it.

For each host a list of `Check`s (name, ok/warn/fail/skip, detail, fix: eltctl/checks.py), in the order a
person would fix them: reachable, host key, auth, then (once connected) the remote
Python against the local major.minor, torch importable and its version against the
local one, nvidia-smi, and a writable work directory `~/.eltctl`.

The judgements are pure functions of what the host printed (`parse_remote_facts`,
`check_python`, `check_torch`, ...), tested with tables; `diagnose` runs them over a
`Fleet`. With `accept_new`, a host whose key is unknown gets its key recorded (trust
on first use, with the fingerprint shown); a changed key is never replaced.
`eltctl up` runs the same checks (eltctl/preflight.py), adding the job's own through
the `extra` hook of `diagnose_fleet`. With `link_test`, the hosts that pass are then
measured in pairs over the data plane (eltctl/linkspeed.py): a `link` check each.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from eltctl.checks import Check, Report, Status
from eltctl.errors import HostError
from eltctl.inventory import Host, Inventory, Policy, SSHSettings
from eltctl.probe import MARK, sections as _sections
from eltctl.probe import (HANG_STATUSES, NOT_FOUND_STATUS, HostProbe, parse_probe_output, probe_command,
                          probe_timeout)
from eltctl.hosts.fleet import Fleet
from eltctl.hosts.transport import ErrorKind, Transport

WORKDIR = "~/.eltctl"
# Older torch: torch.load(weights_only=True) is bypassable (CVE-2025-32434), and a host
# restores checkpoints (perhaps from a shared mirror) with it.
MIN_TORCH = (2, 6)
TORCH_IMPORT_TIMEOUT = 120.0  # seconds; a cold `import torch` on a loaded host is slow
RUNTIME_PACKAGE = "eltctl_runtime"  # shipped to each host and put on its workers' PYTHONPATH (hosts/ops.py)


# doctor's name for a host's report (preflight's too; the mirror's is one more, `mirror`)
HostDiagnosis = Report


@dataclass(frozen=True)
class Versions:
    """Python (major.minor.micro) and torch versions; torch None: not installed."""

    python: str
    torch: str | None


def local_versions() -> Versions:
    """This machine's versions, without importing torch (that would cost a second)."""
    from importlib import metadata

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return Versions(python="%d.%d.%d" % sys.version_info[:3], torch=torch)


# --------------------------------------------------------------------------- connection

def connection_checks(error: HostError | None, *, accepted: str | None = None) -> list[Check]:
    """reachable / host key / auth from how connecting went (None: it worked)."""
    accepted_detail = accepted or "verified against known_hosts"
    if error is None:
        return [Check("reachable", Status.OK, "sshd answered"),
                Check("host key", Status.OK, accepted_detail),
                Check("auth", Status.OK, "logged in")]
    kind = str(error.kind)
    detail = _bare(error)
    if kind in (ErrorKind.UNREACHABLE, ErrorKind.TIMEOUT):
        return [Check("reachable", Status.FAIL, detail, error.hint)]
    if kind in (ErrorKind.HOST_KEY_UNKNOWN, ErrorKind.HOST_KEY_CHANGED):
        return [Check("reachable", Status.OK, "sshd answered"),
                Check("host key", Status.FAIL, detail, error.hint)]
    if kind == ErrorKind.AUTH:
        return [Check("reachable", Status.OK, "sshd answered"),
                Check("host key", Status.OK, accepted_detail),
                Check("auth", Status.FAIL, detail, error.hint)]
    return [Check("connect", Status.FAIL, detail, error.hint)]


def _bare(error: HostError) -> str:
    """The message without the "host: " prefix (the output already groups by host)."""
    prefix = f"{error.host}: "
    return error.message[len(prefix):] if error.message.startswith(prefix) else error.message


# --------------------------------------------------------------------------- remote facts

@dataclass(frozen=True)
class RemoteFacts:
    python_path: str | None  # None: the interpreter was not found
    python_version: str | None
    python_error: str
    torch_version: str | None  # None: `import torch` failed
    torch_error: str
    workdir_ok: bool
    workdir_error: str


# Where a host remembers its last successful `import torch` (doctor_script): the
# interpreter, torch's __init__.py and its mtime on the first line, `torch=VERSION` on the second.
TORCH_STAMP = ".eltctl/torch-import-ok"


def doctor_script(python: str, torch_cached: bool = False) -> str:
    """POSIX sh printing delimited sections about the interpreter, torch and ~/.eltctl.

    `import torch` costs seconds of CPU on each host, far more on a loaded one. A
    successful import is remembered in ~/TORCH_STAMP with what identifies the install
    (the interpreter, torch's __init__.py and its mtime: a new install changes them);
    with `torch_cached` (`eltctl up`'s checks) a host whose install matches its stamp is
    not imported again; `eltctl doctor` always imports."""
    py = " ".join(shlex.quote(w) for w in shlex.split(python)) or "python3"
    first = shlex.quote(shlex.split(python)[0]) if python.strip() else "python3"
    t = f"{TORCH_IMPORT_TIMEOUT:g}"
    return f"""\
m='{MARK}'
if command -v timeout >/dev/null 2>&1; then to="timeout -k 2 {t}"; else to=""; fi
echo "${{m}}python-path"
command -v {first} 2>/dev/null
echo "${{m}}python"
{py} -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' </dev/null 2>&1
echo "${{m}}python-rc $?"
echo "${{m}}torch"
st="$HOME/{TORCH_STAMP}"
sig=$({py} -c 'import importlib.util as u, os, sys; s = u.find_spec("torch"); o = s and s.origin; print(sys.executable, o, os.stat(o).st_mtime_ns if o else "")' </dev/null 2>/dev/null)
if [ {1 if torch_cached else 0} = 1 ] && [ -n "$sig" ] && [ -f "$st" ] && [ "$(head -n 1 "$st" 2>/dev/null)" = "$sig" ] \
   && sed -n 2p "$st" 2>/dev/null | grep -q '^torch='; then
  sed -n 2p "$st"
else
  out=$($to {py} -c 'import torch; print("torch=" + torch.__version__)' </dev/null 2>&1 | tail -n 5)
  printf '%s\n' "$out"
  v=$(printf '%s\n' "$out" | grep '^torch=' | tail -n 1)
  if [ -n "$v" ] && [ -n "$sig" ] && mkdir -p "$HOME/.eltctl" 2>/dev/null; then
    (printf '%s\n%s\n' "$sig" "$v" >"$st.$$" && mv -f "$st.$$" "$st") 2>/dev/null || rm -f "$st.$$"
  fi
fi
echo "${{m}}workdir"
d="$HOME/.eltctl"
if mkdir -p "$d" 2>&1 && t=$(mktemp "$d/.doctor.XXXXXX" 2>&1) && rm -f "$t"; then echo "ok"; else echo "failed: $t"; fi
echo "${{m}}end"
"""


def _last_line(lines: list[str]) -> str:
    lines = [ln.strip() for ln in lines if ln.strip()]
    return lines[-1][:300] if lines else ""


def parse_remote_facts(text: str) -> RemoteFacts:
    s = _sections(text)
    path_lines = [ln.strip() for ln in s.get("python-path", ("", []))[1] if ln.strip()]
    py_lines = s.get("python", ("", []))[1]
    py_rc = s.get("python-rc", ("", []))[0]
    version = None
    for ln in py_lines:
        parts = ln.strip().split(".")
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            version = ln.strip()
    torch_lines = s.get("torch", ("", []))[1]
    torch = None
    for ln in torch_lines:
        if ln.startswith("torch="):
            torch = ln[len("torch="):].strip()
    wd = [ln.strip() for ln in s.get("workdir", ("", []))[1] if ln.strip()]
    workdir_ok = bool(wd) and wd[0] == "ok"
    return RemoteFacts(
        python_path=path_lines[0] if path_lines else None,
        python_version=version if py_rc == "0" else None,
        python_error=_last_line(py_lines) if py_rc != "0" or version is None else "",
        torch_version=torch,
        torch_error="" if torch else (_last_line(torch_lines) or "no output"),
        workdir_ok=workdir_ok,
        workdir_error="" if workdir_ok else (" ".join(wd) or "no answer"),
    )


def _release(version: str) -> tuple[int, ...]:
    """'2.13.0+cu121' -> (2, 13, 0): the local build tag does not matter for compatibility."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def check_python(facts: RemoteFacts, local: Versions, python: str) -> Check:
    if facts.python_version is None:
        where = f"`{python}` was not found on PATH" if facts.python_path is None else \
            f"`{python}` ({facts.python_path}) does not run: {facts.python_error or 'no output'}"
        return Check("python", Status.FAIL, where,
                     f"install Python {local.python.rsplit('.', 1)[0]} there, or set this host's "
                     "`python = \"/path/to/python\"` in the inventory")
    remote, mine = _release(facts.python_version)[:2], _release(local.python)[:2]
    if remote != mine:
        return Check("python", Status.WARN,
                     f"{facts.python_version} at {facts.python_path} (local {local.python}): "
                     "major.minor differ",
                     f"use Python {'.'.join(map(str, mine))} on the host if workers misbehave")
    return Check("python", Status.OK, f"{facts.python_version} at {facts.python_path}")


def check_torch(facts: RemoteFacts, local: Versions, python: str) -> Check:
    want = f"torch=={local.torch.split('+')[0]}" if local.torch else "torch"
    if facts.python_version is None:
        return Check("torch", Status.SKIP, "no working Python")
    if facts.torch_version is None:
        return Check("torch", Status.FAIL, f"`import torch` failed: {facts.torch_error}",
                     f"install it for that interpreter ({python} -m pip install {want}) or point "
                     "this host's `python` at an interpreter that has it")
    if _release(facts.torch_version)[:2] < MIN_TORCH:
        return Check("torch", Status.FAIL,
                     f"{facts.torch_version} is older than {'.'.join(map(str, MIN_TORCH))}: its "
                     "torch.load(weights_only=True), which restores checkpoints, can be made to run code "
                     "(CVE-2025-32434)", f"{python} -m pip install {want}")
    if local.torch is None:
        return Check("torch", Status.OK, f"{facts.torch_version} (no local torch to compare with)")
    remote, mine = _release(facts.torch_version), _release(local.torch)
    if remote[:2] != mine[:2]:
        return Check("torch", Status.FAIL,
                     f"{facts.torch_version}, but local is {local.torch}: workers of different torch "
                     "releases cannot be relied on to talk to each other",
                     f"{python} -m pip install {want}")
    if remote != mine:
        return Check("torch", Status.WARN, f"{facts.torch_version} (local {local.torch})",
                     f"{python} -m pip install {want}")
    return Check("torch", Status.OK, facts.torch_version)


def check_nvidia_smi(probe: HostProbe, policy: Policy, host: Host) -> Check:
    t = f"{policy.nvidia_smi_timeout:g}"
    if not probe.complete:
        return Check("nvidia-smi", Status.FAIL, "the probe's output was cut short",
                     "run the probe by hand: eltctl probe")
    if probe.nvidia_smi is None or probe.gpu_status == NOT_FOUND_STATUS:
        return Check("nvidia-smi", Status.OK,
                     f"not installed: a CPU-only host ({host.slots} slot(s))")
    if probe.gpu_status in HANG_STATUSES:
        return Check("nvidia-smi", Status.FAIL, f"did not answer in {t} s (driver wedged?)",
                     "check the NVIDIA driver on the host (nvidia-smi; dmesg); a reboot may be needed")
    if probe.gpu_status != 0:
        msg = next((ln.strip() for ln in probe.gpu_output.splitlines() if ln.strip()), "no output")
        return Check("nvidia-smi", Status.FAIL, f"failed (exit {probe.gpu_status}): {msg[:200]}",
                     "check the NVIDIA driver on the host (nvidia-smi; dmesg; is the module loaded?)")
    if not probe.gpus:
        return Check("nvidia-smi", Status.WARN, "answered but listed no GPUs",
                     "check the GPUs with nvidia-smi -L on the host")
    names = sorted({g.name for g in probe.gpus})
    return Check("nvidia-smi", Status.OK, f"{len(probe.gpus)} GPU(s): {', '.join(names)}")


def check_workdir(facts: RemoteFacts) -> Check:
    if facts.workdir_ok:
        return Check("work directory", Status.OK, f"{WORKDIR} is writable")
    return Check("work directory", Status.FAIL, f"{WORKDIR} is not writable: {facts.workdir_error}",
                 f"on the host: mkdir -p {WORKDIR} && chmod u+rwx {WORKDIR} (and check the disk is not full)")


async def check_store_forward(host: Host, transport: Transport) -> Check | None:
    """The default `[controller] store = "ssh"` mode reaches the job's store through a remote
    forward on each host's SSH connection: FAIL when the host's sshd refuses one (None for a
    local host, which reaches the store directly)."""
    probe = getattr(transport, "remote_forward_refusal", None)
    if host.is_local or probe is None:
        return None
    refused = await probe()
    if refused is None:
        return Check("store forward", Status.OK, "sshd forwards a Unix socket (streamlocal) for the job's store")
    from eltctl.storeforward import STREAMLOCAL_FIX

    return Check("store forward", Status.FAIL, f"the host's sshd refused to forward a Unix socket ({refused})",
                 f"the job's store reaches the host through one: {STREAMLOCAL_FIX}")


# --------------------------------------------------------------------------- running it

# More checks run once connected, beside doctor's own (`eltctl up` adds what only the
# job knows: its workdir and script on the host); `[]` when all is well.
ExtraChecks = Callable[[Host, Transport], Awaitable[list[Check]]]


async def _remote_checks(host: Host, transport: Transport, policy: Policy, local: Versions,
                         torch_cached: bool = False) -> list[Check]:
    facts_cmd = "sh -c " + shlex.quote(doctor_script(host.python, torch_cached))
    facts_res, probe_res = await asyncio.gather(
        transport.run(facts_cmd, timeout=TORCH_IMPORT_TIMEOUT + 30),
        transport.run(probe_command("", policy.nvidia_smi_timeout), timeout=probe_timeout(policy)),
        return_exceptions=True)
    checks: list[Check] = []
    if isinstance(facts_res, HostError):
        checks.append(Check("python", Status.FAIL, f"the check did not complete: {_bare(facts_res)}",
                            facts_res.hint))
    elif isinstance(facts_res, BaseException):
        raise facts_res
    else:
        facts = parse_remote_facts(facts_res.stdout)
        checks += [check_python(facts, local, host.python), check_torch(facts, local, host.python)]
    if isinstance(probe_res, HostError):
        checks.append(Check("nvidia-smi", Status.FAIL, f"the probe did not complete: {_bare(probe_res)}",
                            "check the NVIDIA driver on the host"))
    elif isinstance(probe_res, BaseException):
        raise probe_res
    else:
        checks.append(check_nvidia_smi(parse_probe_output(probe_res.stdout), policy, host))
    if not isinstance(facts_res, BaseException):
        checks.append(check_workdir(facts))
    return checks


async def diagnose_host(fleet: Fleet, host: Host, *, policy: Policy, local: Versions,
                        accept_new: bool = False, extra: ExtraChecks | None = None,
                        torch_cached: bool = False) -> Report:
    accepted: str | None = None
    try:
        transport = await fleet.transport(host)
        error = None
    except HostError as exc:
        transport, error = None, exc
    if error is not None and accept_new and str(error.kind) == ErrorKind.HOST_KEY_UNKNOWN and not host.is_local:
        from eltctl.hosts.ssh import accept_new_host_key

        try:
            key = await accept_new_host_key(host, fleet.ssh)
        except HostError as exc:
            error = exc
        else:
            accepted = f"recorded new key {key.fingerprint} in {key.known_hosts} (first use, --accept-new)"
            await fleet.forget(host.name)
            try:
                transport = await fleet.transport(host)
                error = None
            except HostError as exc:
                error = exc
    elif error is not None and accept_new and str(error.kind) == ErrorKind.HOST_KEY_CHANGED:
        error = HostError(host.name, _bare(error) + "; --accept-new never replaces a changed key",
                          kind=error.kind, hint=error.hint)

    if host.is_local:
        checks = [Check("reachable", Status.OK, "this machine (address = \"local\")")]
    else:
        checks = connection_checks(error, accepted=accepted)
    if transport is not None:
        if extra is None:
            checks += await _remote_checks(host, transport, policy, local, torch_cached)
        else:
            mine, theirs = await asyncio.gather(_remote_checks(host, transport, policy, local, torch_cached),
                                                extra(host, transport))
            checks += mine + theirs
    return Report(host=host.name, address=host.address, checks=tuple(checks))


async def diagnose_fleet(fleet: Fleet, *, policy: Policy, accept_new: bool = False,
                         local: Versions | None = None, hosts: Iterable[Host] | None = None,
                         extra: ExtraChecks | None = None, torch_cached: bool = False) -> list[Report]:
    """`torch_cached`: a host's `import torch` is not repeated while its install matches
    the last successful one (doctor_script; `eltctl up`)."""
    local = local or local_versions()
    targets = fleet.hosts if hosts is None else tuple(hosts)
    results = await asyncio.gather(*(
        _guarded(diagnose_host(fleet, h, policy=policy, local=local, accept_new=accept_new, extra=extra,
                               torch_cached=torch_cached), h)
        for h in targets))
    return list(results)


async def _guarded(coro, host: Host) -> Report:
    """One host's unexpected error is that host's failed check, never the batch's end."""
    try:
        return await coro
    except HostError as exc:
        return Report(host.name, host.address, (Check("connect", Status.FAIL, _bare(exc), exc.hint),))
    except Exception as exc:  # noqa: BLE001 - reported per host, see docstring
        return Report(host.name, host.address, (
            Check("internal", Status.FAIL, f"{type(exc).__name__}: {exc}",
                  "this is a bug in eltctl; please report it"),))


def diagnose(inventory: Inventory, *, accept_new: bool = False,
             ssh: SSHSettings | None = None, extra: ExtraChecks | None = None,
             link_test: bool = False) -> list[Report]:
    """`eltctl doctor`: diagnose every host of the inventory. `extra`: more checks per
    connected host (`eltctl doctor` passes the job's, preflight.host_job_checks, which
    include the store forward's); default: the store forward's alone. `link_test`: the
    hosts that pass are then measured in pairs over the data plane (eltctl/linkspeed.py),
    each one's `link` check added last."""

    async def forward(host: Host, transport: Transport) -> list[Check]:
        check = await check_store_forward(host, transport) if inventory.controller.store == "ssh" else None
        return [check] if check is not None else []

    async def main() -> list[Report]:
        async with Fleet(inventory, ssh=ssh) as fleet:
            results = await diagnose_fleet(fleet, policy=inventory.policy, accept_new=accept_new,
                                           extra=extra or forward)
            if link_test:
                from eltctl import linkspeed

                figures = await linkspeed.measure(fleet, [inventory.host(r.host) for r in results if r.ok])
                results = linkspeed.with_link_checks(results, figures)
            return results + await mirror_diagnosis(inventory, fleet, results)

    return asyncio.run(main())


async def mirror_diagnosis(inventory: Inventory, fleet: Fleet, results: list[Report]) -> list[Report]:
    """`[storage] mirror` checked as every account will use it (eltctl/mirror/check.py), shown
    as one more entry, `mirror`, with a check per account; [] without a mirror."""
    from eltctl.mirror.check import check_mirror

    ready = [inventory.host(r.host) for r in results if r.ok]
    found = await check_mirror(inventory, fleet.transport, ready)
    if found is None:
        return []
    return [found]


# --------------------------------------------------------------------------- the job's script, on a host

def script_neighbours(directory) -> list[str]:
    """The modules beside the script on this machine (`x.py`, a package or namespace
    directory `x/`, an extension `x.cpython-...so`): its imports of them are found on
    the host once the code is there, which it need not be yet when `doctor` runs."""
    import os

    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    names = set()
    for e in entries:
        stem, dot, suffix = e.partition(".")
        if not dot and os.path.isdir(os.path.join(directory, e)) and e.isidentifier():
            names.add(e)
        elif dot and suffix.rsplit(".", 1)[-1] in ("py", "so", "pyc") and stem.isidentifier():
            names.add(stem)
    return sorted(names)


def script_imports_check(output: str, script: str, python: str) -> Check:
    """The answer of the host program `script_imports` as doctor's check of the script."""
    import json

    try:
        found = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Check("script imports", Status.WARN, f"the check of {script} gave no answer: {output.strip()[:200]!r}",
                     f"run `{python} -c 'import ast'` on the host to see what fails")
    version = found.get("python", "?")
    syntax = found.get("syntax")
    if isinstance(syntax, dict):
        return Check("script imports", Status.FAIL,
                     f"{script} line {syntax.get('line')} does not compile with the host's Python {version}: "
                     f"{syntax.get('message')}", f"fix the script, or use a Python on the host that reads it")
    missing = found.get("missing") or []
    if missing:
        names = ", ".join(f"{m} (line {line})" for m, line in missing)
        first = missing[0][0]
        return Check("script imports", Status.FAIL,
                     f"{script} imports what {python} (Python {version}) on the host cannot find: {names}",
                     f"install the package that provides {first} for that interpreter ({python} -m pip install ...), "
                     f"or put {first}.py beside the script in the workdir")
    return Check("script imports", Status.OK,
                 f"{script} compiles and its {found.get('checked', 0)} top-level import(s) are found (not run)")


@dataclass(frozen=True)
class LocalScript:
    """The job's Python script as this machine has it, for `check_script_imports`."""

    name: str  # as the command names it, relative to the workdir
    source: str
    neighbours: tuple[str, ...]  # the modules a worker has besides the host's own (local_script)
    paths: tuple[str, ...]  # the job's env PYTHONPATH (absolute entries)
    interpreter: str | None  # the command's own interpreter; None: the host's `python` (command[0] "python")

    def python(self, host_python: str) -> str:
        return self.interpreter or host_python


def local_script(command: tuple[str, ...], script: str | None, workdir, env) -> LocalScript | None:
    """The script `command` runs with Python (`script`: its name, as preflight.command_target
    tells it) when it is a relative `.py` file this machine has; else None (nothing to check)."""
    import os
    from pathlib import Path

    if not command or script is None or os.path.isabs(script) or not script.endswith(".py"):
        return None
    path = Path(workdir) / script
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # job_problems reports a missing script
    first = os.path.basename(command[0])
    if not first.startswith("python"):
        return None  # bash run.sh, ./train.py: not a Python command line to check this way
    entries = [p for p in dict(env).get("PYTHONPATH", "").split(":") if p]
    # what a worker imports besides the host's own modules: the script's neighbours, the
    # job's relative PYTHONPATH (in the synced code), and the runtime eltctl ships there
    provided = {*script_neighbours(path.parent), RUNTIME_PACKAGE}
    for entry in entries:
        if not os.path.isabs(entry):
            provided.update(script_neighbours(Path(workdir) / entry))
    return LocalScript(script, source, tuple(sorted(provided)), tuple(p for p in entries if os.path.isabs(p)),
                       None if command[0] in ("python", "python3") else command[0])


async def check_script_imports(transport: Transport, host_python: str, script: LocalScript,
                               timeout: float) -> Check:
    """Compile the job's script (its source, sent on stdin) with the host's interpreter and
    find its top-level imports there, without running it (hosts/programs/script_imports.py)."""
    import json

    from eltctl.hosts import programs

    python = script.python(host_python)
    command = programs.command(python, "script_imports", json.dumps(sorted(script.neighbours)),
                               json.dumps(list(script.paths)))
    try:
        res = await transport.run(command, timeout=timeout, input=script.source)
    except HostError as exc:
        return Check("script imports", Status.WARN, f"the check of {script.name} did not complete: {_bare(exc)}",
                     exc.hint)
    if not res.ok:
        return Check("script imports", Status.WARN,
                     f"the check of {script.name} failed (exit {res.exit_status}): {res.stderr.strip()[-200:]}",
                     f"run `{python} -c 'import ast'` on the host to see what fails")
    return script_imports_check(res.stdout, script.name, python)
