"""One real OpenSSH server per simulated host: its configuration, keys and process.

Each host's sshd listens on its own loopback address and port, authenticates
only the test bed's client key, and gives every session the host's own
environment (HOME, PATH, ELTSIM_HOST, ELTSIM_STATE) through sshd_config's
`SetEnv`, which overrides the defaults sshd derives from the passwd entry.
Debian's bash sources `$HOME/.bashrc` for commands run by sshd; the host's
.bashrc changes to $HOME there, so a command starts in the host's home as it
would on a real machine (sshd itself chdirs to the passwd home first).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
INSTALL_HINT = "apt-get install openssh-server openssh-client"


def sshd_missing_reason() -> str | None:
    """Why real sshd hosts cannot run here, or None if they can."""
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found: {INSTALL_HINT}"
    if shutil.which("ssh") is None:
        return f"the ssh client is not installed: {INSTALL_HINT}"
    if not sshd_knows("SetEnv"):
        return f"{SSHD} is older than OpenSSH 7.8 (no SetEnv): {INSTALL_HINT}"
    return None


_keywords: dict[str, bool] = {}


def sshd_knows(keyword: str) -> bool:
    """Whether this sshd binary has a configuration keyword (its keyword table
    is plain lower-case text in the binary), so newer options can be set
    without breaking older servers."""
    if keyword not in _keywords:
        try:
            _keywords[keyword] = keyword.lower().encode() in Path(SSHD).read_bytes()
        except OSError:
            _keywords[keyword] = False
    return _keywords[keyword]


@dataclass(frozen=True)
class SshdConfig:
    """What one host's sshd needs; `render` turns it into sshd_config text."""

    address: str
    port: int
    host_key: Path
    pid_file: Path
    authorized_keys: Path
    home: Path
    env: tuple[tuple[str, str], ...]  # the session environment (SetEnv)
    # OpenSSH >= 9.8 refuses a source address for a while after connections that
    # never authenticate: every test connects from 127.0.0.1, readiness checks
    # and host-key tests do exactly that, so the penalties are turned off.
    no_penalties: bool = False

    def render(self) -> str:
        setenv = " ".join(f'"{k}={v}"' for k, v in self.env)
        return "\n".join([
            *(["PerSourcePenalties no"] if self.no_penalties else []),
            f"ListenAddress {self.address}",
            f"Port {self.port}",
            f"HostKey {self.host_key}",
            f"PidFile {self.pid_file}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            # Key-only root login, as on a lab machine set up for automation.
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # PAM would add pam_env/motd/loginuid work to every session; 64 hosts
            # share two cores, so sessions are kept as cheap as sshd allows.
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # The store reaches the hosts through remote forwards of the controller's
            # connections (eltctl/storeforward.py), listening on the host's loopback
            # only: GatewayPorts stays no.
            "AllowTcpForwarding yes",
            "GatewayPorts no",
            # The temp directories are not root-only all the way up.
            "StrictModes no",
            # Every probe of a many-host test opens connections at once.
            "MaxStartups 100:30:200",
            "LogLevel VERBOSE",
            f"Subsystem sftp internal-sftp -d {self.home}",
            f"SetEnv {setenv}",
            "",
        ])


def free_port(address: str) -> int:
    """A port nothing listens on at `address` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def ensure_privsep_dir() -> None:
    # sshd refuses to start as root without its privilege separation directory
    # (normally created by systemd's RuntimeDirectory, absent in containers).
    if os.geteuid() == 0 and not PRIVSEP_DIR.is_dir():
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)


def start_sshd(config_file: Path, log_file: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start sshd in the foreground (-D), in its own process group.

    `env` is sshd's own environment; per-connection sshd processes inherit it,
    which is how a crash finds them (sessions get the SetEnv environment).
    """
    return subprocess.Popen(
        [SSHD, "-D", "-f", str(config_file), "-E", str(log_file)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def banner_ready(address: str, port: int, timeout: float = 1.0) -> bool:
    """True when an SSH server answers with its version banner."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def wait_ready(proc: subprocess.Popen, address: str, port: int, timeout: float = 30.0) -> bool:
    """Wait until sshd answers; False if it exited first (e.g. the port was taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if banner_ready(address, port):
            return True
        time.sleep(0.02)
    return False


def generate_ed25519(private_path: Path, comment: str) -> str:
    """Write an OpenSSH ed25519 key pair; return the public key line.

    asyncssh does it in-process: 64 hosts need 64 host keys, and ssh-keygen
    processes would cost more than the keys.
    """
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    private_path.write_bytes(key.export_private_key("openssh"))
    private_path.chmod(0o600)
    public = key.export_public_key("openssh").decode().strip()
    private_path.with_name(private_path.name + ".pub").write_text(public + "\n")
    return public
