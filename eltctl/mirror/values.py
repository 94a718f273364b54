"""The mirror's value types: a checkpoint somewhere (`Located`), a checkpoint directory
and its transport (`Place`), the restore choice, and `MirrorError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eltctl.errors import EltctlError
from eltctl.hosts.transport import Transport
from eltctl_runtime import checkpoint as ckpt

MIRROR_LABEL = "mirror"  # the `where` of a mirrored checkpoint (host names are the others)


class MirrorError(EltctlError):
    """A checkpoint could not be mirrored, listed or delivered; the message says why."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, source_gone: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.source_gone = source_gone  # the checkpoint is no longer where it was: do not retry it


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
