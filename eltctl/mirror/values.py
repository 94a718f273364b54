"""The mirror's value types: a checkpoint somewhere (`Located`), a checkpoint directory
and its transport (`Place`), the restore choice, `MirrorError`, and what kind of failure
it was (`FaultKind`, `Fault`: retried, or waiting for a person)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from eltctl.errors import EltctlError
from eltctl.hosts.transport import Transport
from eltctl_runtime.checkpoint import format as ckpt

MIRROR_LABEL = "mirror"  # the `where` of a mirrored checkpoint (host names are the others)


class MirrorError(EltctlError):
    """A checkpoint could not be mirrored, listed or delivered; the message says why."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, source_gone: bool = False,
                 errno: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.source_gone = source_gone  # the checkpoint is no longer where it was: do not retry it
        self.errno = errno  # the OS error's name where the host program said it ("EACCES")


class FaultKind(str, enum.Enum):
    """Why mirroring failed, sorted by what helps: waiting, or a person.

    TRANSIENT (a reset connection, a timeout, the mirror host rebooting) is retried with
    back-off. Every other kind cannot succeed by retrying: the worker stops retrying the
    checkpoint, `eltctl status` shows it with its fix, and `eltctl down` reports it
    without waiting; the next committed checkpoint tries once more (so a fix is seen).
    """

    TRANSIENT = "transient"
    PERMISSION = "permission"  # an account cannot create, write, rename or remove there
    NO_SPACE = "no-space"  # the filesystem or the account's quota is full
    READ_ONLY = "read-only"  # the filesystem is mounted read-only
    MISSING_PATH = "missing-path"  # the mirror's path (or a directory on it) is not there
    HOST_KEY = "host-key"  # the ssh:// mirror host's key is unknown or changed
    AUTH = "auth"  # the ssh:// mirror host refused the login

    def __str__(self) -> str:
        return self.value

    @property
    def permanent(self) -> bool:
        return self is not FaultKind.TRANSIENT


@dataclass(frozen=True)
class Fault:
    """A mirror failure sorted (`decisions.classify`): its kind, what happened, the fix."""

    kind: FaultKind
    message: str
    fix: str | None = None

    @property
    def permanent(self) -> bool:
        return self.kind.permanent

    def as_json(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class Located:
    """One checkpoint somewhere: on a host (`where` = host name) or on the mirror."""

    step: int
    where: str
    path: str
    created: float
    size: int  # bytes of every file the manifest lists
    files: tuple[tuple[str, int, str], ...]  # (name, size, sha256) from the manifest
    verified: bool | None = None  # None: not checked; False: `problem` says why
    problem: str | None = None
    script_step: int | None = None  # restart mode: the script's step when this snapshot was taken (manifest meta)

    @property
    def on_mirror(self) -> bool:
        return self.where == MIRROR_LABEL

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "where": self.where, "path": self.path, "time": self.created,
                "size": self.size, "verified": self.verified, "problem": self.problem,
                **({"script_step": self.script_step} if self.script_step is not None else {})}


@dataclass(frozen=True)
class Place:
    """A checkpoint directory and the transport that reaches it.

    `shared`: the directory is the same path on every host (a shared-directory
    mirror), so a host copies into or out of it with `cp` instead of a relay.
    """

    label: str
    transport: Transport
    directory: str
    shared: bool = False

    def step_path(self, step: int) -> str:
        return f"{self.directory}/{ckpt.step_dirname(step)}"


@dataclass(frozen=True)
class RestoreChoice:
    step: int
    where: str  # host name or "mirror"
    path: str
    skipped: tuple[str, ...] = ()  # why newer candidates were passed over
    # The mirrored manifest's text whose MAC was checked (None: not a signed mirror
    # copy): the copy is checked against THESE bytes, never a second read of the file.
    manifest: str | None = field(default=None, repr=False, compare=False)
