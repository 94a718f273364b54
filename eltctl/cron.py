"""Unattended operation: the crontab entry that keeps a job alive, and the run it makes.

`eltctl cron` prints the entry, `--install` / `--remove` edit the user's crontab
through the `crontab` program (`crontab -l`, `crontab -`); $ELTCTL_CRONTAB names
another program with the same two calls (the tests' stand-in keeps its table in
a file). The entry is one line, marked by a trailing comment naming the inventory
(`MARK_PREFIX`), so installing twice leaves one line and removing leaves every other
line alone::

    */5 * * * * cd /lab/job && XDG_STATE_HOME=/x /venv/bin/python -m eltctl -i /lab/job/hosts.toml up --unattended  # eltctl cron: /lab/job/hosts.toml

It works in cron's environment (PATH=/usr/bin:/bin, HOME set, no ssh-agent, no
terminal): the interpreter and the inventory are absolute paths, it changes to the
inventory's directory, the variables that place the job's state (`KEEP_ENV`) are
written into the line, and SSH uses the inventory's [ssh] identity_file (or the
default keys under ~/.ssh): without SSH_AUTH_SOCK, asyncssh simply has no agent.

`up --unattended` (`run_unattended`) is what the entry runs: a lock in the job's state
directory (`cron.lock`, flock'ed) makes an overlapping run return at once, doing
nothing; a run that finds the controller alive changes nothing and writes nothing; a
run that starts the controller appends what it did to `cron.log` there (capped at
`LOG_CAP_BYTES`: the full log then moves to cron.log.1). It exits non-zero only on a real
failure (the inventory is broken, no host can run the job, the controller dies, the
workers fail at start everywhere): the error goes to the log and to stderr, which
cron mails. Waiting longer than `--timeout` for the first step is not a failure.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from eltctl.errors import EltctlError
from eltctl.inventory import Inventory
from eltctl_runtime.files import try_flock

CRONTAB_ENV = "ELTCTL_CRONTAB"
DEFAULT_SCHEDULE = "*/5 * * * *"
MARK_PREFIX = "# eltctl cron: "
# What places the job's state (and its identity on the hosts): carried into the line when set.
KEEP_ENV = ("XDG_STATE_HOME", "ELTCTL_CONTROL_ID")
LOCK_NAME = "cron.lock"
LOG_NAME = "cron.log"
LOG_CAP_BYTES = 1 << 20
UNATTENDED_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- the entry


def marker(inventory_path: Path) -> str:
    return f"{MARK_PREFIX}{Path(inventory_path).resolve()}"


def command(inventory: Inventory, *, python: str | None = None,
            environ: Mapping[str, str] | None = None) -> str:
    """The shell command the entry runs (before cron's `%` escaping)."""
    env = os.environ if environ is None else environ
    path = Path(inventory.path).resolve()
    interpreter = os.path.abspath(python or sys.executable)  # not resolved: a venv's python is a link
    keep = " ".join(f"{k}={shlex.quote(env[k])}" for k in KEEP_ENV if env.get(k, "").strip())
    run = f"{shlex.quote(interpreter)} -m eltctl -i {shlex.quote(str(path))} up --unattended"
    return f"cd {shlex.quote(str(path.parent))} && {keep + ' ' if keep else ''}{run}"


def entry(inventory: Inventory, schedule: str = DEFAULT_SCHEDULE, *, python: str | None = None,
          environ: Mapping[str, str] | None = None) -> str:
    """The crontab line: schedule, command (`%` escaped: cron reads it as a newline), marker."""
    check_schedule(schedule)
    cmd = command(inventory, python=python, environ=environ).replace("%", "\\%")
    return f"{schedule} {cmd}  {marker(inventory.path)}"


def check_schedule(schedule: str) -> None:
    fields = schedule.split()
    if not (len(fields) == 5 or (len(fields) == 1 and fields[0].startswith("@"))):
        raise EltctlError(f"{schedule!r} is not a cron schedule: it takes five fields (minute hour day month "
                          "weekday) or one @word", hint='e.g. --schedule "*/5 * * * *" or --schedule @hourly')


def command_of(line: str) -> str:
    """What cron hands to /bin/sh for an entry written by `entry` (the tests run it so)."""
    body = line.split(None, 5)[5] if not line.startswith("@") else line.split(None, 1)[1]
    out, i = [], 0
    while i < len(body):  # cron: `\%` is a literal %, a bare % ends the command
        if body.startswith("\\%", i):
            out.append("%")
            i += 2
        elif body[i] == "%":
            break
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def with_entry(table: str, line: str, mark: str) -> str:
    """`table` with `line` as the one entry carrying `mark` (in place of an older one)."""
    lines = [item for item in table.splitlines() if not item.endswith(mark)]
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join([*lines, line]) + "\n"


def without_entry(table: str, mark: str) -> str:
    """`table` without the entry carrying `mark`; every other line as it was."""
    lines = [item for item in table.splitlines() if not item.endswith(mark)]
    return "\n".join(lines) + "\n" if lines else ""


def entries(table: str, mark: str) -> list[str]:
    return [item for item in table.splitlines() if item.endswith(mark)]


def agent_note(inventory: Inventory, environ: Mapping[str, str] | None = None) -> str | None:
    """A warning when SSH may work here only through ssh-agent, which cron runs do not have."""
    env = os.environ if environ is None else environ
    if inventory.ssh.identity_file is not None or not env.get("SSH_AUTH_SOCK"):
        return None
    doctor = command(inventory, environ=env).split(" && ", 1)[1].replace(" up --unattended", " doctor")
    return ("cron runs have no ssh-agent: the hosts must accept one of your default keys (~/.ssh/id_*) without "
            "a passphrase, or set [ssh] identity_file in the inventory; check with `env -i HOME=$HOME "
            f"PATH=/usr/bin:/bin {doctor}`")


# --------------------------------------------------------------------------- the crontab


def crontab_program(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    named = env.get(CRONTAB_ENV, "").strip()
    if named:
        return named
    found = shutil.which("crontab")
    if found is None:
        raise EltctlError("no `crontab` program on this machine, so eltctl cannot edit the crontab",
                          hint="install cron (Debian/Ubuntu: `apt-get install cron`; Fedora: cronie), or add "
                               "the line `eltctl cron` prints to your scheduler yourself")
    return found


def read_table(program: str) -> str:
    """The user's crontab (empty when there is none yet)."""
    try:
        out = subprocess.run([program, "-l"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise EltctlError(f"cannot run {program}: {exc.strerror or exc}") from None
    if out.returncode != 0:
        if "no crontab" in out.stderr.lower():
            return ""
        raise EltctlError(f"`{program} -l` failed (exit {out.returncode}): {out.stderr.strip()}")
    return out.stdout


def write_table(program: str, table: str) -> None:
    try:
        out = subprocess.run([program, "-"], input=table, capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise EltctlError(f"cannot run {program}: {exc.strerror or exc}") from None
    if out.returncode != 0:
        raise EltctlError(f"`{program} -` refused the new table (exit {out.returncode}): {out.stderr.strip()}")


@dataclass(frozen=True)
class CronChange:
    line: str  # the entry (installed, or removed: the one that was there)
    changed: bool  # the crontab was rewritten


def install(inventory: Inventory, schedule: str = DEFAULT_SCHEDULE, *,
            environ: Mapping[str, str] | None = None) -> CronChange:
    """Put the job's entry in the user's crontab, once (an older entry of this inventory is replaced)."""
    program = crontab_program(environ)
    line = entry(inventory, schedule, environ=environ)
    mark = marker(inventory.path)
    table = read_table(program)
    if entries(table, mark) == [line]:
        return CronChange(line, False)
    write_table(program, with_entry(table, line, mark))
    return CronChange(line, True)


def remove(inventory: Inventory, *, environ: Mapping[str, str] | None = None) -> CronChange:
    """Take the job's entry out of the user's crontab (nothing else changes)."""
    program = crontab_program(environ)
    mark = marker(inventory.path)
    table = read_table(program)
    found = entries(table, mark)
    if not found:
        return CronChange("", False)
    write_table(program, without_entry(table, mark))
    return CronChange(found[0], True)


def installed(inventory: Inventory, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's entry in the user's crontab, or None (also when there is no crontab program)."""
    try:
        table = read_table(crontab_program(environ))
    except EltctlError:
        return None
    found = entries(table, marker(inventory.path))
    return found[0] if found else None


# --------------------------------------------------------------------------- the run


class RunLock:
    """`cron.lock` in the job's state directory, flock'ed for one unattended run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self._fd = try_flock(self.path)
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_log(path: Path, lines: list[str], cap: int = LOG_CAP_BYTES) -> None:
    """Append timestamped `lines` to the log; past `cap` bytes the log moves to `<log>.1` first."""
    if not lines:
        return
    try:
        if path.stat().st_size > cap:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(path, "a", encoding="utf-8") as f:
        for line in lines:
            for part in line.splitlines() or [""]:
                f.write(f"{stamp} [{os.getpid()}] {part}\n")


@dataclass(frozen=True)
class RunOutcome:
    ran: bool  # False: another run held the lock; nothing was done
    changed: bool  # a controller was started
    lines: tuple[str, ...]  # what was logged (empty when nothing changed)


def run_unattended(inventory: Inventory, *, timeout: float = UNATTENDED_TIMEOUT_S) -> RunOutcome:
    """One run of the cron entry (see the module docstring). Raises the failure's
    EltctlError after logging it."""
    from eltctl.controller import client

    state = client.state_of(inventory)
    state.create()
    lock = RunLock(state.path / LOCK_NAME)
    if not lock.try_acquire():
        return RunOutcome(False, False, ())
    log_path = state.path / LOG_NAME
    said: list[str] = []
    try:
        try:
            # A live controller is only asked to reconcile (nothing to wait for, nothing to say).
            alive = client.same_inventory(inventory, client.ping(state)) is not None
            result = client.up(inventory, detach=alive, timeout=timeout, progress=said.append)
        except client.NotTrainingYet as exc:
            lines = [*said, f"up: {exc.message}"]
            append_log(log_path, lines)
            return RunOutcome(True, True, tuple(lines))
        except EltctlError as exc:
            append_log(log_path, [*said, f"error: {exc}"])
            raise
        if not result.started:
            return RunOutcome(True, False, ())
        lines = [*said, f"up: controller {result.controller_pid} started; {result.state}: {result.message}"]
        append_log(log_path, lines)
        return RunOutcome(True, True, tuple(lines))
    finally:
        lock.release()

