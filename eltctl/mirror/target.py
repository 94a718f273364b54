"""Where the mirror is: `[storage] mirror` parsed into a `MirrorTarget`."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from eltctl.inventory import LOCAL, Host, SSHSettings
from eltctl.mirror.values import MIRROR_LABEL, MirrorError


class TargetKind(str, enum.Enum):
    DIRECTORY = "directory"  # a path every host and the controller see (NFS)
    SSH = "ssh"  # ssh://[user@]host[:port]/path, reached from the controller only

    def __str__(self) -> str:
        return self.value


_SSH_TARGET = re.compile(r"ssh://(?:(?P<user>[^@/\s]+)@)?(?P<host>[^:/\s]+)(?::(?P<port>\d+))?(?P<path>/\S*)")


@dataclass(frozen=True)
class MirrorTarget:
    kind: TargetKind
    path: str  # absolute directory: on the shared filesystem, or on the ssh host
    address: str | None = None
    port: int | None = None
    user: str | None = None

    def job_dir(self, job: str) -> str:
        return f"{self.path.rstrip('/') or ''}/{job}"

    def __str__(self) -> str:
        if self.kind is TargetKind.DIRECTORY:
            return self.path
        who = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"ssh://{who}{self.address}{port}{self.path}"

    def host(self, ssh: SSHSettings) -> Host:
        """The mirror host as an inventory Host (same SSH settings as the job's hosts)."""
        if self.kind is not TargetKind.SSH or self.address is None:
            return Host(name=MIRROR_LABEL, address=LOCAL)
        return Host(name=MIRROR_LABEL, address=self.address, port=self.port or ssh.port, user=self.user)


def parse_target(spec: str) -> MirrorTarget:
    """`[storage] mirror` as a MirrorTarget; raises MirrorError for what the inventory would refuse."""
    if spec.startswith("ssh://"):
        m = _SSH_TARGET.fullmatch(spec)
        if not m or m.group("path") in ("", "/"):
            raise MirrorError(f"{spec!r} is not an ssh:// mirror",
                              hint="write ssh://[user@]host[:port]/absolute/path")
        return MirrorTarget(TargetKind.SSH, m.group("path"), m.group("host"),
                            int(m.group("port")) if m.group("port") else None, m.group("user"))
    if "://" in spec or not spec.startswith("/"):
        raise MirrorError(f"{spec!r}: a mirror is an absolute directory or an ssh:// address")
    return MirrorTarget(TargetKind.DIRECTORY, spec.rstrip("/") or "/")
