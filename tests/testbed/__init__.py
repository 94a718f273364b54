"""The multi-host test bed: real OpenSSH servers on loopback, one per simulated host.

A `Testbed` owns a temporary directory, a client key, a `known_hosts` file and
a random loopback block 127.A.B.0/24 (so parallel test sessions do not meet).
Each `SimHost` in it is a real sshd on its own address 127.A.B.C and a free
port, with its own home, PATH, host key and simulated GPUs (a JSON state file
read by the stand-in `nvidia-smi` of `eltctl.sim`). Only the GPU is simulated.

Layout of a host directory (`host.dir`):

    bin/nvidia-smi   the stand-in (absent in mode "missing")
    bin/python, bin/python3   run the host interpreter (Python and torch only: hostpython.py)
    home/            HOME of every session on this host (.bashrc cds there)
    gpus.json        the GPU state (ELTSIM_STATE)
    claims/          the GPU claims of every job on it (ELTCTL_CLAIMS_DIR; runtime/claims.py)
    sshd_config, ssh_host_ed25519_key(.pub), sshd.pid, sshd.log, authorized_keys

A session on a host sees HOME=<dir>/home, PATH=<dir>/bin:/usr/local/bin:/usr/bin:/bin,
ELTSIM_HOST=<name>, ELTSIM_STATE=<dir>/gpus.json, ELTCTL_CLAIMS_DIR=<dir>/claims, and
starts in HOME.
Every process started on a host (over SSH) inherits ELTSIM_STATE; `crash()`
and `close()` find and kill processes by it. A process a test starts locally
"as if on the host" should get `host.env()` (plus CUDA_VISIBLE_DEVICES to sit
on a simulated GPU).

Owner signals beyond the GPU (logins, console input, load) get stand-ins per host in
tests/testbed/owner.py: `OwnerStandIn(dir)` holds the host's own utmp and /dev, and
its `env()` passed as `add_host(env=...)` points the host's sessions at them.

Use the `testbed` pytest fixture (tests/conftest.py) or `make_testbed(n)`;
import it as `tests.testbed` (tests/conftest.py puts the repository root on
sys.path; do not import it as plain `testbed`, which would load a second copy):

    def test_busy_gpu(testbed):
        h1, h2 = testbed.add_hosts(2)             # or testbed.add_host("gpu-a", gpus=4)
        pid = h1.start_foreign_process(0, memory_mib=8000)   # a real pid of user eltsim
        h2.set_mode("fail")
        inventory = testbed.write_inventory()     # hosts.toml with key + known_hosts
        ...
        h1.crash(); h1.restore()
        subprocess.run(h1.ssh_argv("nvidia-smi -L"), ...)

Accounts: every host's sessions log in as the account running the tests (root here),
unless `add_host(login=True)`: that host's sessions then log in as a local account of
their own, `eltsim-<name>` (created once, kept; procs.ensure_login_user), which owns the
host's directory, as on a lab whose machines' accounts differ from the control
machine's (different uids, or NFS root_squash). `host.user` is the login name; the
inventory names it as that host's `user`. Without root (no useradd) such a host is
skipped by its test (`TestbedError`).

Each host's home holds the record of a good `import torch` that `eltctl up` leaves
(tests/testbed/torchstamp.py), so `up` does not import torch on it again;
`Testbed(torch_seen=False)` gives hosts that never ran eltctl.

Host keys: `add_host(known=False)` is missing from known_hosts;
`host.change_host_key()` makes the recorded key stale. `testbed.silent_host()`
accepts TCP but never speaks SSH; `testbed.dead_address()` refuses.
Only the test bed appends to known_hosts (never rewrites it), so a test may add
keys to it (e.g. `doctor --accept-new`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from eltctl.sim.gpustate import (
    DEFAULT_GPU_NAME,
    DEFAULT_MEMORY_TOTAL_MIB,
    ForeignProcess,
    GpuMode,
    GpuState,
    find_system_python,
    install_nvidia_smi,
    uninstall_nvidia_smi,
)

from . import procs
from .hostpython import HOST_PYTHON
from .silent import SilentListener
from .torchstamp import seed_torch_stamp
from .sshd import (
    INSTALL_HINT,
    SshdConfig,
    ensure_privsep_dir,
    free_port,
    generate_ed25519,
    sshd_knows,
    sshd_missing_reason,
    start_sshd,
    wait_ready,
)

__all__ = ["SimHost", "Testbed", "TestbedError", "make_testbed", "sshd_missing_reason", "INSTALL_HINT", "GpuMode"]

# The interpreter inventories name as each host's `python`: Python and torch only.
PYTHON = HOST_PYTHON
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"


class TestbedError(RuntimeError):
    """The test bed could not do what a test asked (not a failure of eltctl)."""


CLOCKSHIFT = Path(__file__).resolve().parent / "clockshift"  # a sitecustomize that shifts time.time()


def clock_offset_env(seconds: int) -> dict[str, str]:
    """Environment that sets a host's wall clock `seconds` off for every Python process of
    its sessions (the daemon, the workers): clockshift/sitecustomize.py shifts time.time()."""
    return {"PYTHONPATH": str(CLOCKSHIFT), "ELTSIM_CLOCK_OFFSET": str(int(seconds))}


class SimHost:
    """One simulated host. Created by `Testbed.add_host`; not started by its constructor."""

    __test__ = False  # not a pytest test class

    def __init__(self, bed: "Testbed", name: str, address: str, port: int, directory: Path,
                 known: bool, env: dict[str, str] | None = None, login: str | None = None) -> None:
        self.bed = bed
        self.login = login  # the local account its sessions log in as (None: the test bed's own)
        self.extra_env = dict(env or {})  # more environment for its sessions (e.g. clock_offset_env)
        self.name = name
        self.address = address
        self.port = port
        self.dir = directory
        self.home = directory / "home"
        self.bin = directory / "bin"
        self.state_path = directory / "gpus.json"
        self.claims_dir = directory / "claims"  # ELTCTL_CLAIMS_DIR of its sessions
        self.known = known  # whether its (first) key was written to known_hosts
        self.host_key = directory / "ssh_host_ed25519_key"
        self.public_key = ""  # current host key, "ssh-ed25519 AAAA..."
        self.gpus = GpuState(self.state_path, name)
        self._sshd: subprocess.Popen | None = None
        self._foreign: dict[int, subprocess.Popen] = {}

    def __repr__(self) -> str:
        return f"SimHost({self.name!r}, {self.address}:{self.port})"

    # -- environment -----------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment a session on this host gets (and what marks its processes)."""
        return {
            "HOME": str(self.home),
            "PATH": f"{self.bin}:{BASE_PATH}",
            "ELTSIM_HOST": self.name,
            "ELTSIM_STATE": str(self.state_path),
            # Its own GPU claims (runtime/claims.py): the simulated hosts share one machine,
            # so the machine's /tmp/eltctl-gpus would make h1's GPU 0 and h2's one GPU.
            "ELTCTL_CLAIMS_DIR": str(self.claims_dir),
            **self.extra_env,
        }

    @property
    def python(self) -> str:
        return PYTHON

    @property
    def user(self) -> str:
        """The account a session on this host logs in as."""
        return self.login or self.bed.user

    # -- GPUs ------------------------------------------------------------------

    def set_gpus(self, n: int = 2, *, memory_total_mib: int = DEFAULT_MEMORY_TOTAL_MIB,
                 name: str = DEFAULT_GPU_NAME) -> None:
        """`n` fresh, idle GPUs (0 is allowed: a driver that sees no GPU)."""
        self.gpus.set_gpus(n, memory_total_mib=memory_total_mib, name=name)

    def set_gpu(self, index: int, **fields) -> None:
        """Change one GPU's base values: memory_used_mib, utilization, memory_total_mib,
        name, uuid, pci_bus_id. A string such as "[N/A]" is printed as is."""
        self.gpus.set_gpu(index, **fields)

    def set_mode(self, mode: str) -> None:
        """"ok" | "na" | "fail" | "hang" | "missing" (no nvidia-smi on PATH)."""
        mode = GpuMode(mode)
        self.gpus.set_mode(mode)
        if mode is GpuMode.MISSING:
            uninstall_nvidia_smi(self.bin)
        else:
            install_nvidia_smi(self.bin)

    def start_foreign_process(self, gpu: int, *, memory_mib: int = 2000, utilization: int = 50,
                              user: str | None = procs.FOREIGN_USER) -> int:
        """Start a real long-running process of another user and put it on GPU `gpu`.

        `user=None` (or a system where the user cannot be created) runs it as the
        current user. Returns its pid; stop it with `stop_foreign_process`.
        """
        owner = procs.ensure_foreign_user(user) if user else None
        proc = procs.start_as_user(["sleep", "infinity"], owner)
        self._foreign[proc.pid] = proc
        start = None
        for _ in range(100):  # setpriv execs sleep; wait until the pid runs sleep
            start = procs.process_starttime(proc.pid)
            if _cmdline(proc.pid).startswith(b"sleep"):
                break
            time.sleep(0.01)
        self.gpus.add_process(ForeignProcess(pid=proc.pid, gpu=gpu, used_memory_mib=memory_mib,
                                             utilization=utilization, starttime=start))
        return proc.pid

    def stop_foreign_process(self, pid: int) -> None:
        """Kill it (the GPU frees itself, as on real hardware) and forget it."""
        proc = self._foreign.pop(pid, None)
        if proc is not None:
            procs.stop_popen(proc)
        self.gpus.remove_process(pid)

    # -- life and death ----------------------------------------------------------

    def crash(self) -> None:
        """The machine dies: sshd, its connections and every process started on it are killed."""
        self._kill_sshd_and_foreign()
        procs.kill_host_processes(str(self.state_path))

    def _kill_sshd_and_foreign(self) -> None:
        if self._sshd is not None:
            # The connections' sshd processes first, while they are still the
            # listener's children (killing the listener would orphan them).
            procs.kill_pids(procs.descendants(self._sshd.pid))
        self.stop_sshd()
        for proc in self._foreign.values():
            procs.stop_popen(proc)
        self._foreign.clear()

    def stop_sshd(self) -> None:
        """sshd stops listening (new connections refused). Established connections
        and running processes stay, as with `systemctl stop ssh`."""
        if self._sshd is not None:
            procs.stop_popen(self._sshd)
            self._sshd = None

    def restore(self) -> None:
        """sshd again on the same address, port and keys."""
        if self._sshd is not None and self._sshd.poll() is None:
            return
        self._launch()
        if not self._wait():
            raise TestbedError(f"sshd of {self.name} did not come back on {self.address}:{self.port}; "
                               f"see {self.dir / 'sshd.log'}")

    def change_host_key(self) -> None:
        """A new host key (sshd restarted); known_hosts still holds the old one."""
        was_running = self._sshd is not None
        self.stop_sshd()
        self.public_key = generate_ed25519(self.host_key, f"{self.name}-renewed")
        if was_running:
            self.restore()

    def set_sshd_option(self, keyword: str, value: str) -> None:
        """One sshd_config keyword set to `value` (e.g. AllowTcpForwarding no); sshd restarted."""
        path = self.dir / "sshd_config"
        lines = [line for line in path.read_text().splitlines() if line.split(" ", 1)[0] != keyword]
        path.write_text("\n".join([*lines, f"{keyword} {value}"]) + "\n")
        was_running = self._sshd is not None
        self.stop_sshd()
        if was_running:
            self.restore()

    @property
    def sshd_pid(self) -> int | None:
        return self._sshd.pid if self._sshd is not None and self._sshd.poll() is None else None

    def pids(self) -> list[int]:
        """Live processes of this host: its sshd, the connections' sshd processes,
        and everything started over SSH."""
        found = set(procs.host_pids(str(self.state_path)))
        if self.sshd_pid is not None:
            found.add(self.sshd_pid)
            found.update(p for p in procs.descendants(self.sshd_pid) if procs.is_alive(p))
        found.update(pid for pid in self._foreign if procs.is_alive(pid))
        return sorted(found)

    # -- clients -----------------------------------------------------------------

    def ssh_argv(self, *cmd: str) -> list[str]:
        """An OpenSSH client argv with the test key and known_hosts (strict checking).

        Like ssh itself, the command words are joined with spaces and run by the
        remote shell.
        """
        return [
            "ssh", "-F", "/dev/null",
            "-i", str(self.bed.client_key), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.bed.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=20", "-o", "LogLevel=ERROR",
            "-p", str(self.port), f"{self.user}@{self.address}",
            *(("--", *cmd) if cmd else ()),
        ]

    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{self.port} {self.public_key}"

    # -- internals (called by Testbed) -----------------------------------------

    def _prepare(self, n_gpus: int) -> None:
        for d in (self.dir, self.home, self.bin):
            d.mkdir(parents=True, exist_ok=True)
        self.public_key = generate_ed25519(self.host_key, self.name)
        shutil.copyfile(self.bed.client_key.with_name(self.bed.client_key.name + ".pub"),
                        self.dir / "authorized_keys")
        # Debian's bash sources ~/.bashrc for commands run by sshd: start in HOME.
        (self.home / ".bashrc").write_text('cd "$HOME" 2>/dev/null\n')
        if self.bed.torch_seen:
            seed_torch_stamp(self.home)  # `up` need not import torch here again (torchstamp.py)
        for name in ("python", "python3"):
            launcher = self.bin / name
            # A wrapper, not a symlink: a symlinked venv python does not find its venv.
            launcher.write_text(f'#!/bin/sh\nexec {PYTHON} "$@"\n')
            launcher.chmod(0o755)
        self.gpus.initialize(n_gpus)
        install_nvidia_smi(self.bin)
        config = SshdConfig(
            address=self.address, port=self.port, host_key=self.host_key,
            pid_file=self.dir / "sshd.pid", authorized_keys=self.dir / "authorized_keys",
            home=self.home, env=tuple(self.env().items()),
            no_penalties=sshd_knows("PerSourcePenalties"),
        )
        (self.dir / "sshd_config").write_text(config.render())
        if self.login is not None:
            account = procs.ensure_login_user(self.login)
            if account is None:
                raise TestbedError(f"cannot create the login account {self.login} (needs root and useradd)")
            procs.chown_tree(str(self.dir), account.pw_uid, account.pw_gid)
            gid = procs.ensure_login_group()
            if gid is not None:  # the host interpreter may live below a directory only we enter
                procs.grant_group_traverse(PYTHON, gid)

    def _launch(self) -> None:
        sshd_env = {"PATH": BASE_PATH, "ELTSIM_HOST": self.name, "ELTSIM_STATE": str(self.state_path)}
        self._sshd = start_sshd(self.dir / "sshd_config", self.dir / "sshd.log", sshd_env)

    def _wait(self) -> bool:
        assert self._sshd is not None
        return wait_ready(self._sshd, self.address, self.port)

    def _rewrite_port(self, port: int) -> None:
        self.port = port
        text = (self.dir / "sshd_config").read_text()
        lines = [f"Port {port}" if line.startswith("Port ") else line for line in text.splitlines()]
        (self.dir / "sshd_config").write_text("\n".join(lines) + "\n")



def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Testbed:
    """A set of simulated hosts and the client credentials to reach them.

    Nothing happens until the first `add_host` (or `start()`); `close()` tears
    everything down and is safe to call twice.
    """

    __test__ = False

    def __init__(self, root: Path | None = None, *, torch_seen: bool = True) -> None:
        self._root = root
        # Each host starts with the record of a good `import torch` (tests/testbed/torchstamp.py);
        # False: hosts that never ran eltctl, so `up` imports torch on each.
        self.torch_seen = torch_seen
        self.dir: Path = Path()
        self.client_key: Path = Path()
        self.known_hosts: Path = Path()
        self.hosts: list[SimHost] = []
        self.user = ""  # the login user on every host (we log in as ourselves)
        self._net: tuple[int, int] = (0, 0)
        self._next_octet = 1
        self._started = False
        self._closed = False
        self._silent: list[SilentListener] = []
        self._reaper: subprocess.Popen | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> "Testbed":
        if self._started:
            return self
        reason = sshd_missing_reason()
        if reason:
            raise TestbedError(reason)
        ensure_privsep_dir()
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.dir = Path(tempfile.mkdtemp(prefix="eltsim-", dir=self._root))
        # If this process dies without close() (a pytest timeout, SIGKILL), the
        # reaper sees its stdin close and cleans up: 64 orphaned sshd processes
        # on a machine shared by several test sessions would outlive us.
        self._reaper = subprocess.Popen(
            [find_system_python(), "-IS", str(Path(__file__).with_name("reaper.py")), str(self.dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": BASE_PATH},
        )
        self.client_key = self.dir / "id_ed25519"
        generate_ed25519(self.client_key, "eltsim-client")
        self.known_hosts = self.dir / "known_hosts"
        self.known_hosts.touch()
        # A random /24 of 127/8 per test bed: parallel sessions get different
        # addresses, so a port taken by one never collides with another.
        rng = random.SystemRandom()
        self._net = (rng.randint(64, 254), rng.randint(0, 255))
        self._started = True
        return self

    def __enter__(self) -> "Testbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        errors = []
        for host in self.hosts:
            try:
                host._kill_sshd_and_foreign()
            except Exception as e:  # keep tearing the others down; report at the end
                errors.append(f"{host.name}: {e!r}")
        # One sweep of /proc for all hosts: every state file lies under self.dir.
        procs.kill_host_processes(f"{self.dir}/", prefix=True)
        for listener in self._silent:
            listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._reaper is not None:
            self._reaper.stdin.close()  # nothing left to do for it; it exits
            try:
                self._reaper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait()
        if errors:
            raise TestbedError("test bed teardown: " + "; ".join(errors))

    # -- hosts -------------------------------------------------------------------

    def _address(self) -> str:
        a, b = self._net
        octet = self._next_octet
        self._next_octet += 1
        return f"127.{a}.{(b + (octet - 1) // 250) % 256}.{(octet - 1) % 250 + 1}"

    def add_host(self, name: str | None = None, *, gpus: int = 2, known: bool = True,
                 env: dict[str, str] | None = None, login: bool = False) -> SimHost:
        """Start one host with `gpus` idle GPUs. known=False: its key is not in known_hosts.
        env: more environment for every session on it (e.g. `clock_offset_env(-60)`).
        login=True: its sessions log in as a local account of its own (`host.user`)."""
        return self.add_hosts(1, gpus=gpus, known=known, names=[name] if name else None,
                              envs=[env] if env else None, login=login)[0]

    def add_hosts(self, n: int, *, gpus: int = 2, known: bool = True,
                  names: list[str] | None = None, envs: list[dict[str, str] | None] | None = None,
                  login: bool = False) -> list[SimHost]:
        """Start `n` hosts at once (sshd processes start in parallel); envs: one per host;
        login=True: each logs in as a local account of its own, `eltsim-<name>`."""
        self.start()
        if self._closed:
            raise TestbedError("the test bed is closed")
        taken = {h.name for h in self.hosts}
        if names is None:
            names = []
            i = len(self.hosts) + 1
            while len(names) < n:
                if f"h{i}" not in taken:
                    names.append(f"h{i}")
                i += 1
        if len(names) != n or len(set(names) | taken) != len(taken) + n:
            raise TestbedError(f"host names must be new and unique: {names}")
        new = []
        for i, name in enumerate(names):
            address = self._address()
            host = SimHost(self, name, address, free_port(address), self.dir / name, known,
                           (envs or [None] * n)[i], procs.login_account_name(name) if login else None)
            if login:
                self.dir.chmod(0o711)  # its account must reach its own directory below ours
            self.hosts.append(host)  # before start: close() must find it whatever happens
            host._prepare(gpus)
            new.append(host)
        for host in new:
            host._launch()
        for host in new:
            for attempt in range(5):
                if host._wait():
                    break
                # Most likely the port was taken between choosing and binding it.
                host.stop_sshd()
                host._rewrite_port(free_port(host.address))
                host._launch()
            else:
                raise TestbedError(f"sshd of {host.name} did not start on {host.address}; "
                                   f"see {host.dir / 'sshd.log'}")
        with open(self.known_hosts, "a") as f:
            for host in new:
                if host.known:
                    f.write(host.known_hosts_line() + "\n")
        return new

    def host(self, name: str) -> SimHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def silent_host(self) -> tuple[str, int]:
        """(address, port) that accepts TCP connections and never speaks SSH."""
        self.start()
        listener = SilentListener(self._address())
        self._silent.append(listener)
        return listener.start()

    def dead_address(self) -> tuple[str, int]:
        """(address, port) where nothing listens: connections are refused."""
        self.start()
        address = self._address()
        return address, free_port(address)

    # -- files for eltctl ----------------------------------------------------------

    def write_inventory(self, path: Path | None = None, *, hosts: list[SimHost] | None = None,
                        job: dict | None = None, extra: str = "", connect_timeout: float = 5) -> Path:
        """A hosts.toml for these hosts (default: all), using the test key and known_hosts."""
        self.start()
        path = Path(path) if path is not None else self.dir / "hosts.toml"
        job_table = {"name": "test", "command": ["python", "train.py"], "workdir": "."}
        job_table.update(job or {})
        lines = ["[job]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in job_table.items()]
        lines += [
            "",
            "[ssh]",
            f"identity_file = {_toml_value(str(self.client_key))}",
            f"known_hosts = {_toml_value(str(self.known_hosts))}",
            f"connect_timeout = {_toml_value(connect_timeout)}",
            f"user = {_toml_value(self.user)}",
        ]
        for host in self.hosts if hosts is None else hosts:
            lines += [
                "",
                "[[hosts]]",
                f"name = {_toml_value(host.name)}",
                f"address = {_toml_value(host.address)}",
                f"port = {host.port}",
                f"python = {_toml_value(host.python)}",
                *([f"user = {_toml_value(host.login)}"] if host.login else []),
            ]
        text = "\n".join(lines) + "\n"
        if extra:
            text += "\n" + extra.strip("\n") + "\n"
        path.write_text(text)
        return path


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are valid TOML
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


@contextlib.contextmanager
def make_testbed(n_hosts: int = 0, *, gpus: int = 2, root: Path | None = None) -> Iterator[Testbed]:
    """A started test bed with `n_hosts` hosts (h1..hN), torn down on exit."""
    bed = Testbed(root)
    try:
        bed.start()
        if n_hosts:
            bed.add_hosts(n_hosts, gpus=gpus)
        yield bed
    finally:
        bed.close()
