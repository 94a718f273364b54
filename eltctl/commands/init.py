"""`eltctl init`: write the commented starter inventory (the same text as hosts.example.toml).

The starter documents every key with a comment and parses as it is, so the first
`eltctl doctor` after editing it already talks about hosts, not about syntax.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path
from typing import Optional

import typer

from eltctl.errors import UsageError


def write_starter(path: Path, *, force: bool = False) -> Path:
    """Write STARTER to `path` (parent directories too); refuse to overwrite unless `force`."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory",
                         hint=f"name a file, e.g. `eltctl init {shlex.quote(str(path / 'hosts.toml'))}`")
    if path.exists() and not force:
        raise UsageError(
            f"{path} already exists; not overwriting it",
            hint=f"`eltctl init {shlex.quote(str(path))} --force` replaces it, or name another file",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if not force:
        try:
            with open(path, "x", encoding="utf-8") as f:  # "x": never clobber a file that appeared meanwhile
                f.write(STARTER)
        except FileExistsError:
            raise UsageError(f"{path} already exists; not overwriting it",
                             hint="`eltctl init --force` replaces it") from None
        return path
    # A temporary file renamed into place: an interrupted --force never leaves half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(STARTER)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def register(app: typer.Typer) -> None:
    @app.command()
    def init(
        ctx: typer.Context,
        path: Optional[Path] = typer.Argument(
            None, help="Where to write it.", show_default="the -i inventory, else ./hosts.toml"),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    ) -> None:
        """Write a commented starter inventory to edit."""
        from rich.console import Console
        from rich.markup import escape

        default = ctx.obj.inventory_path
        target = write_starter(path or default, force=force)
        # The next commands find the file by themselves only where eltctl looks without
        # -i: ./hosts.toml, or $ELTCTL_INVENTORY when that is set.
        found = target == default and ctx.obj.inventory_origin != "-i"
        flag = "" if found else f"-i {shlex.quote(str(target))} "
        out = Console(highlight=False, soft_wrap=True)
        out.print(f"Wrote {escape(str(target))}, a commented starter inventory.")
        out.print("Next:")
        out.print(f"  1. Edit it: the \\[job] to run and one \\[\\[hosts]] section per machine.")
        out.print(f"  2. [bold]eltctl {escape(flag)}doctor[/]  checks every host: SSH, host keys, "
                  "Python and torch, nvidia-smi.")
        out.print(f"  3. [bold]eltctl {escape(flag)}probe[/]   shows every host's GPUs and which are free.")


# The starter, identical to hosts.example.toml at the repository root (a test checks).
STARTER = """\
# eltctl inventory: the job to run and the machines it may use.
#
# eltctl reads ./hosts.toml, or the file named by `eltctl -i PATH` or by the
# ELTCTL_INVENTORY environment variable. Relative paths below are relative to this
# file's directory, and `~` means your home directory. Durations are written like
# "90s", "10m", "1h30m", "500ms", or as a number of seconds.
# After editing: `eltctl doctor` checks every host, `eltctl probe` shows their GPUs.

[job]
# Name of the job: letters, digits, '.', '_' and '-' (it names files and directories,
# and marks this job's processes on the GPUs so they are not mistaken for a stranger's).
name = "my-job"
# What each worker runs, as a list of arguments or one string (split like a shell does).
command = ["python", "train.py"]
# The job's code directory on this (the control) machine.
workdir = "."
# Fewest workers the job trains with; it waits until this many GPUs/slots are free.
min_workers = 1
# Most workers it uses at once; leave it out to use every free GPU or slot.
max_workers = 8
# "auto": CUDA on hosts with free GPUs, CPU workers (slots) on hosts without;
# "cuda": GPUs only; "cpu": one CPU worker per free GPU slot (used to simulate GPUs).
device = "auto"
# Extra environment variables for every worker (values are strings).
env = { OMP_NUM_THREADS = "4" }
# true when workdir is the same directory on every host (NFS...): eltctl then does not
# copy the code to the hosts; false: it syncs workdir to each host (only what changed).
shared_filesystem = false

[ssh]
# Default login user for hosts that do not set `user` (unset: ~/.ssh/config, then your
# local user name).
# user = "alice"
# Default SSH port for hosts that do not set `port`.
port = 22
# Private key to log in with, in addition to ssh-agent and the default keys.
# identity_file = "~/.ssh/id_ed25519"
# File of trusted host keys (unset: ~/.ssh/known_hosts). Unknown keys are refused;
# `eltctl doctor --accept-new` records them after showing their fingerprints.
# known_hosts = "~/.ssh/known_hosts"
# How long to wait for a host to accept an SSH connection.
connect_timeout = "10s"
# How long one remote command may take unless a command says otherwise.
command_timeout = "30s"
# How many SSH connections are opened at the same time.
max_parallel = 64

[policy]
# How long a GPU must look free before the job uses it.
idle_for = "10m"
# A GPU whose memory used by others is above this many MiB is busy.
memory_threshold_mib = 500
# A GPU whose utilisation (percent, 0-100) by others is above this is busy.
utilization_threshold = 10
# How long a host the job left (its owner came back, or it failed) rests before reuse.
cooldown = "5m"
# How often the controller probes each host.
probe_interval = "30s"
# How long nvidia-smi may take before the host counts as unhealthy (a wedged driver).
nvidia_smi_timeout = "10s"
# How often each host's daemon looks at its GPUs (an owner's process makes the job
# leave that GPU within about this long).
watch_interval = "1s"
# After this many failures in a row (daemon or workers), a host is benched: left out
# for a while that doubles at each benching.
bench_after = 3
# A worker silent this long (at most 30s) counts as hung and the others go on without it.
hang_timeout = "10s"

[storage]
# Where checkpoints are mirrored: a shared directory, or ssh://[user@]host[:port]/path
# (unset: not mirrored).
# mirror = "/shared/checkpoints"
# How many mirrored checkpoints are kept.
keep = 3

[controller]
# The address of this machine that the hosts use to reach the job's store (the
# controller binds the store to it alone; the store has no authentication, so keep it
# on a trusted network). Unset: the address this machine uses to reach the hosts over
# SSH (127.0.0.1 for "local" hosts); set it when hosts reach this machine differently.
# address = "10.0.0.5"

# One [[hosts]] section per machine. Each takes:
#   name     unique name (letters, digits, '.', '_', '-'); defaults to the address
#   address  hostname or IP to SSH to, or "local" for this machine (no SSH)
#   port     SSH port (default: [ssh] port)
#   user     login user (default: [ssh] user)
#   python   the interpreter with torch on that host (default: "python3")
#   gpus     "all" (the default) or a list of the GPU indices the job may use
#   slots    CPU workers on a host without GPUs (default: 1)
#   env      extra environment variables for commands on that host

# A GPU workstation: every GPU it has, when its owner is not using them.
[[hosts]]
name = "ws-anna"
address = "ws-anna.lab.example.org"
python = "/home/you/venv/bin/python"
gpus = "all"

# A shared GPU server: only GPUs 0 and 1, with another login and SSH port.
[[hosts]]
name = "gpu-server"
address = "10.0.0.12"
port = 2222
user = "train"
python = "/opt/conda/bin/python"
gpus = [0, 1]
env = { NCCL_SOCKET_IFNAME = "eth0" }

# A CPU-only box: no GPUs, four CPU workers.
[[hosts]]
name = "cpu-box"
address = "cpu-box.lab.example.org"
slots = 4

# This machine itself, without SSH.
[[hosts]]
name = "here"
address = "local"
python = "python3"
slots = 1
"""
