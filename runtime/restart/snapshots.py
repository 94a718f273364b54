"""Restart mode's snapshots as bytes: a script's checkpoint directory packed into
an uncompressed tar, and such a tar unpacked in place of the directory.

A snapshot can come back from elsewhere (another member's broadcast, or an eltctl
checkpoint the controller restored from its mirror), so unpacking believes none of
its names: every member must be a regular file, a directory or a link that stays
inside the directory (no absolute path, no `..`, no link pointing outside, no member
under a link, no device or FIFO), else the whole snapshot is refused
(`UnsafeSnapshot`) before anything is written. Pythons with `tarfile.data_filter`
extract with it as well; on older ones the same checks and the mode bits' clean-up
are done here, never an unfiltered `extractall`.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import tarfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Mapping

FilterFn = Callable[[tarfile.TarInfo, str], "tarfile.TarInfo | None"]


class UnsafeSnapshot(ValueError):
    """A snapshot's tar holds a member that could write outside the directory (or is not a tar)."""


def pack_dir(path: Path) -> bytes:
    """The directory's files as an uncompressed tar (relative names)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if path.is_dir():
            for entry in sorted(path.iterdir()):
                tar.add(entry, arcname=entry.name)
    return buf.getvalue()


# ---- the members' checks (pure) --------------------------------------------------------


MAX_LINK_HOPS = 40  # as the kernel's ELOOP


def _parts(name: str) -> tuple[str, ...]:
    return tuple(p for p in PurePosixPath(name).parts if p != ".")


def _escapes(name: str) -> bool:
    p = PurePosixPath(name)
    return p.is_absolute() or ".." in p.parts


def resolves_inside(folder: tuple[str, ...], target: str, links: Mapping[tuple[str, ...], str]) -> bool:
    """Whether `target`, read from `folder` (parts), stays inside the directory once
    the symbolic links among the members (`links`: parts -> target) are followed."""
    at, todo, hops = list(folder), list(PurePosixPath(target).parts), 0
    if PurePosixPath(target).is_absolute():
        return False
    while todo:
        part = todo.pop(0)
        if part in (".", ""):
            continue
        if part == "..":
            if not at:
                return False
            at.pop()
            continue
        at.append(part)
        link = links.get(tuple(at))
        if link is not None:
            hops += 1
            if hops > MAX_LINK_HOPS or PurePosixPath(link).is_absolute():
                return False
            at.pop()
            todo = list(PurePosixPath(link).parts) + todo
    return True


def unsafe_member(member: tarfile.TarInfo, links: Mapping[tuple[str, ...], str]) -> str | None:
    """Why `member` may not be extracted into a directory (None: it may). `links`:
    every symbolic link among the snapshot's members (parts -> target)."""
    name = member.name
    if not _parts(name) or _escapes(name):
        return "an absolute path or a '..' component"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return "a device, FIFO or other special file"
    parts = _parts(name)
    for i in range(1, len(parts)):
        if parts[:i] in links:
            return f"a member under the link {'/'.join(parts[:i])!r}"
    if member.issym():
        if PurePosixPath(member.linkname).is_absolute():
            return f"a link to an absolute path ({member.linkname!r})"
        if not resolves_inside(parts[:-1], member.linkname, links):
            return f"a link pointing outside the directory ({member.linkname!r})"
    if member.islnk() and (not member.linkname or _escapes(member.linkname)
                           or not resolves_inside((), member.linkname, links)):
        return f"a hard link to {member.linkname!r}, outside the directory"
    return None


def check_members(members: Iterable[tarfile.TarInfo], what: str = "the snapshot") -> list[tarfile.TarInfo]:
    """Every member, checked against all the links of the snapshot, whatever their
    order (`UnsafeSnapshot` names the first bad one and what is wrong)."""
    members = list(members)
    links = {_parts(m.name): m.linkname for m in members if m.issym() and _parts(m.name)}
    for m in members:
        why = unsafe_member(m, links)
        if why is not None:
            raise UnsafeSnapshot(f"{what} holds {m.name!r}: {why}; refusing to unpack it. A snapshot eltctl "
                                 "packs never does: the checkpoint was altered or is not restart mode's "
                                 "(delete it, or restore an older one)")
    return members


def _cleaned(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What data_filter does to a member that passed the checks: no setuid, setgid,
    sticky or group/other write bits; owned by whoever unpacks it."""
    m = copy.copy(member)
    if m.isreg() or m.islnk():
        m.mode = (m.mode & 0o755) | 0o600
    elif m.isdir():
        m.mode = (m.mode & 0o755) | 0o700
    m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
    return m


# ---- unpacking ------------------------------------------------------------------------


def extract(data: bytes, dest: Path, data_filter: FilterFn | None, what: str = "the snapshot") -> None:
    """Extract the tar `data` into the existing directory `dest` after checking every
    member; `data_filter`: tarfile.data_filter where the Python has it, else None."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = check_members(tar.getmembers(), what)
            if data_filter is not None:
                try:
                    tar.extractall(dest, members=members, filter=data_filter)
                except tarfile.FilterError as e:  # a case the checks above did not name
                    raise UnsafeSnapshot(f"{what} holds an unsafe member ({e}); refusing to unpack it") from e
            else:
                cleaned = [_cleaned(m) for m in members]
                trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
                tar.extractall(dest, members=cleaned, **trusted)  # every member checked above
    except tarfile.ReadError as e:
        raise UnsafeSnapshot(f"{what} is not a readable tar ({e}); refusing to unpack it") from e


def unpack_dir(data: bytes, path: Path, *, data_filter: FilterFn | None = getattr(tarfile, "data_filter", None)
               ) -> None:
    """Replace the directory's contents with the tar `data` (empty: an empty
    directory). The new tree is extracted beside it and swapped in; a refused
    snapshot (`UnsafeSnapshot`) leaves the directory as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.new-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if data:
            extract(data, tmp, data_filter)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
