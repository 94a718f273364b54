"""The checkpoint mirror: copies of the hosts' checkpoints on shared storage, and restore.

A checkpoint (runtime/checkpoint.py) is committed by rank 0 on ITS host, under
`~/.eltctl/jobs/<job>/<host>/checkpoints/step-NNNNNNNN/`. This module keeps copies of
them at `[storage] mirror`, under `<mirror>/<job>/step-NNNNNNNN/` (the same layout,
so `CheckpointStore` and `verify_dir` read a mirror directory as they read a host's),
and chooses, when a job starts with no survivor, the newest valid checkpoint among the
hosts' copies and the mirror.

Where the copying runs: the controller drives it over the connections it already has,
so the hosts need no credentials or packages of their own (only /bin/sh, cp, tar,
sha256sum, mv):

- a shared directory (`/mnt/nfs/ckpt`): the host holding the checkpoint copies it into
  the directory itself (one hop, it is mounted there) with eltctl/mirror_copy.py, ONE
  command: copy while a second thread hashes, compare with the source manifest's sums
  (read by the controller first), fsync, rename into place. A host without Python does
  the same with `cp -R`, `sha256sum` and `mv`, the controller comparing;
- `ssh://[user@]host[:port]/path`: the controller opens `tar -cf -` on the holding host
  and `tar -xf -` on the mirror host and relays the bytes between the two SSH channels
  (nothing lands on the control machine), then the mirror host hashes, compares and
  renames (mirror_copy.py's `publish`, or the shell tools).

Guarantees: a copy is written under `.tmp-*`, verified, then renamed (`mv` within
one directory is atomic), so a reader never sees a partial checkpoint; retention
(`retention_plan`) runs only after a newer checkpoint verified and never deletes it;
expired checkpoints are renamed to `.tmp-*` before removal, as the runtime does.

`MirrorWorker` is the background part: the controller calls `notify(host, step)` when
rank 0 reports a new committed checkpoint; an asyncio task mirrors the newest one,
retrying with exponential back-off (`backoff_delay`) while the mirror is unreachable
or full, without ever blocking training (the copy runs beside it; a newer notice
replaces an older one still waiting). `status()` is what `eltctl status` shows.

The decisions (what to restore from, what retention deletes, the back-off schedule,
lag) are pure functions tested by tables; the rest is thin shell over a `Transport`.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

from eltctl.errors import EltctlError, HostError
from eltctl.inventory import LOCAL, Host, Inventory, SSHSettings
from eltctl.transport import ErrorKind, LocalTransport, RunResult, Transport, wrap_env
from eltctl_runtime import checkpoint as ckpt

log = logging.getLogger(__name__)

MIRROR_LABEL = "mirror"  # the `where` of a mirrored checkpoint (host names are the others)
COPY_TIMEOUT = 3600.0  # seconds for one copy of one checkpoint (100 MB at 30 KB/s)
LIST_TIMEOUT = 60.0
HASH_TIMEOUT = 1800.0
RELAY_CHUNK = 1 << 20
# The copy runs on a training host: at the lowest CPU priority it takes only what
# training leaves idle, so mirroring cannot slow the steps down (the issue's "never
# blocks a training step" also in CPU time).
NICE = "nice -n 19"
STALE_TMP_MINUTES = 120  # `.tmp-*` on the mirror older than this are leftovers of a dead copy


class MirrorError(EltctlError):
    """A checkpoint could not be mirrored, listed or delivered; the message says why."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, source_gone: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.source_gone = source_gone  # the checkpoint is no longer where it was: do not retry it


# --------------------------------------------------------------------------- the target


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


# --------------------------------------------------------------------------- value types


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

    @property
    def on_mirror(self) -> bool:
        return self.where == MIRROR_LABEL

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "where": self.where, "path": self.path, "time": self.created,
                "size": self.size, "verified": self.verified, "problem": self.problem}


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


# --------------------------------------------------------------------------- pure decisions


def backoff_delay(attempt: int, *, base: float = 2.0, cap: float = 60.0) -> float:
    """Seconds to wait before retry `attempt` (1 = first retry): base * 2^(attempt-1), capped."""
    if attempt < 1:
        return 0.0
    return min(cap, base * (2 ** min(attempt - 1, 30)))


def retention_plan(present: Iterable[int], keep: int, verified: int) -> list[int]:
    """Mirrored steps to delete once `verified` has just been copied and verified.

    The newest `keep` steps stay, and so does `verified` whatever its rank; nothing
    newer than `verified` is deleted (a newer copy is not known to be good), so the
    last good checkpoint is never deleted before a newer one has been verified.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ordered = sorted(set(present) | {verified}, reverse=True)
    kept = set(ordered[:keep]) | {verified}
    return sorted(s for s in ordered if s not in kept and s < verified)


def restore_order(candidates: Iterable[Located]) -> list[Located]:
    """The order to try checkpoints in: newest step first; for one step a host's copy
    before the mirror's (no transfer, or a shorter one), then by host name."""
    return sorted(candidates, key=lambda c: (-c.step, c.on_mirror, c.where))


def lag(newest_committed: int | None, newest_mirrored: int | None) -> int | None:
    """How many steps the mirror is behind the newest committed checkpoint (None: unknown)."""
    if newest_committed is None:
        return None
    if newest_mirrored is None:
        return newest_committed
    return max(0, newest_committed - newest_mirrored)


def checkpoint_host(path: str, job: str) -> str | None:
    """The host a runtime checkpoint path belongs to, from its layout
    (`.../.eltctl/jobs/<job>/<host>/checkpoints/step-N`, see hostops.HostPaths); None if not one."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) - 3):
        if parts[i] == "jobs" and parts[i + 1] == job and parts[i + 3] == "checkpoints":
            return parts[i + 2]
    return None


def compare_sums(expected: Sequence[tuple[str, int, str]], sums: dict[str, str]) -> str | None:
    """None if every file has its manifest's sha256, else what differs."""
    for name, _size, sha in expected:
        got = sums.get(name)
        if got is None:
            return f"{name} is missing"
        if got != sha:
            return f"{name} sha256 {got[:12]}... differs from the manifest's {sha[:12]}..."
    return None


# --------------------------------------------------------------------------- manifests


def manifest_files(text: str, dirname: str) -> tuple[int, float, tuple[tuple[str, int, str], ...]]:
    """(step, created, files) of a manifest's text, with the runtime's rules; raises MirrorError."""
    try:
        m = json.loads(text)
    except ValueError as exc:
        raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} is not valid JSON: {exc}") from None
    files = m.get("files") if isinstance(m, dict) else None
    if (not isinstance(m, dict) or m.get("format") != ckpt.FORMAT or m.get("version") != ckpt.FORMAT_VERSION
            or not isinstance(m.get("step"), int) or not isinstance(m.get("created"), (int, float))
            or not isinstance(files, dict) or ckpt.STATE_FILE not in files):
        raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} is not a version {ckpt.FORMAT_VERSION} "
                          f"{ckpt.FORMAT} manifest")
    out = []
    for name, e in sorted(files.items()):
        if (not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str)
                or "/" in name or name in ("", ".", "..", ckpt.MANIFEST_FILE)):
            raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} has a bad entry {name!r}")
        out.append((name, e["size"], e["sha256"]))
    named = ckpt.parse_step_dirname(dirname)
    if named is not None and named != m["step"]:
        raise MirrorError(f"{dirname}: directory is named for step {named} but the manifest says {m['step']}")
    return m["step"], float(m["created"]), tuple(out)


_SECTION = "\n@@ELTCTL@@ "


def _parse_listing(text: str, place: Place) -> list[Located]:
    out = []
    for chunk in text.split(_SECTION)[1:]:
        name, _, body = chunk.partition("\n")
        name = name.strip()
        if ckpt.parse_step_dirname(name) is None:
            continue
        path = f"{place.directory}/{name}"
        try:
            step, created, files = manifest_files(body, name)
        except MirrorError as exc:
            step = ckpt.parse_step_dirname(name) or 0
            out.append(Located(step, place.label, path, 0.0, 0, (), verified=False, problem=str(exc)))
            continue
        out.append(Located(step, place.label, path, created, sum(f[1] for f in files), files))
    return sorted(out, key=lambda c: -c.step)


def _parse_sums(text: str) -> dict[str, str]:
    """`sha256sum` output (`HEX  path`) as {path: hex}."""
    sums = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if sep and len(digest) == 64:
            sums[name.lstrip("*")] = digest
    return sums


# --------------------------------------------------------------------------- shell on a place

def _q(s: str) -> str:
    return shlex.quote(s)


async def _run(t: Transport, command: str, what: str, timeout: float) -> RunResult:
    result = await t.run(command, timeout=timeout)
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_status}")
        raise MirrorError(f"{what} on {t.host.name} failed: {detail.splitlines()[-1][:300]}")
    return result


async def list_place(place: Place, *, verify: bool = False) -> list[Located]:
    """The committed checkpoints of one place, newest first; with verify, checksums recomputed there."""
    cmd = (f"cd {_q(place.directory)} 2>/dev/null || exit 0; for d in step-*; do "
           f"[ -d \"$d\" ] || continue; printf '\\n@@ELTCTL@@ %s\\n' \"$d\"; "
           f"cat \"$d/{ckpt.MANIFEST_FILE}\" 2>/dev/null; done; exit 0")
    listing = _parse_listing((await _run(place.transport, cmd, "listing checkpoints", LIST_TIMEOUT)).stdout, place)
    if not verify:
        return listing
    return [await verify_located(place, c) if c.verified is None else c for c in listing]


async def verify_located(place: Place, c: Located) -> Located:
    """`c` with `verified` set: sha256 of every file recomputed where it lies."""
    names = [name for name, _s, _h in c.files]
    cmd = _copy_hash_command(place.transport.host.python, None, c.path, names)
    result = await place.transport.run(cmd, timeout=HASH_TIMEOUT)
    problem = compare_sums(c.files, _parse_sums(result.stdout))
    if problem is None and not result.ok:
        problem = (result.stderr.strip() or f"sha256sum exit {result.exit_status}").splitlines()[-1]
    return replace(c, verified=problem is None, problem=problem)


async def read_located(place: Place, step: int) -> Located:
    """The manifest of one checkpoint of a place; MirrorError(source_gone) if it is not there."""
    return (await _read_manifest(place, step))[0]


async def _read_manifest(place: Place, step: int) -> tuple[Located, str]:
    """read_located, and the manifest's text."""
    name = ckpt.step_dirname(step)
    result = await place.transport.run(f"cat {_q(place.step_path(step))}/{ckpt.MANIFEST_FILE}", timeout=LIST_TIMEOUT)
    if not result.ok:
        raise MirrorError(f"checkpoint of step {step} is not on {place.label} any more "
                          f"({(result.stderr.strip() or 'no manifest').splitlines()[-1][:200]})", source_gone=True)
    s, created, files = manifest_files(result.stdout, name)
    return Located(s, place.label, place.step_path(step), created, sum(f[1] for f in files), files), result.stdout


# --------------------------------------------------------------------------- binary streams

class _Proc(Protocol):
    async def read(self, n: int) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def finish(self) -> tuple[int, str]: ...
    def kill(self) -> None: ...


class _SSHProc:
    def __init__(self, proc: Any) -> None:
        self._p = proc

    async def read(self, n: int) -> bytes:
        return await self._p.stdout.read(n)

    async def write(self, data: bytes) -> None:
        self._p.stdin.write(data)
        await self._p.stdin.drain()

    async def close_stdin(self) -> None:
        self._p.stdin.write_eof()

    async def finish(self) -> tuple[int, str]:
        err = await self._p.stderr.read()
        done = await self._p.wait()
        status = done.exit_status if done.exit_status is not None else -1
        return status, err.decode("utf-8", "replace") if isinstance(err, bytes) else str(err or "")

    def kill(self) -> None:
        self._p.close()


class _LocalProc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._p = proc

    async def read(self, n: int) -> bytes:
        assert self._p.stdout is not None
        return await self._p.stdout.read(n)

    async def write(self, data: bytes) -> None:
        assert self._p.stdin is not None
        self._p.stdin.write(data)
        await self._p.stdin.drain()

    async def close_stdin(self) -> None:
        assert self._p.stdin is not None
        self._p.stdin.close()

    async def finish(self) -> tuple[int, str]:
        assert self._p.stderr is not None
        err = await self._p.stderr.read()
        return await self._p.wait(), err.decode("utf-8", "replace")

    def kill(self) -> None:
        if self._p.returncode is None:
            try:
                os.killpg(self._p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass


async def _open_binary(t: Transport, command: str) -> _Proc:
    """A process with binary stdin/stdout on the transport's host (Transport.run is text only)."""
    conn = getattr(t, "connection", None)
    if conn is not None:  # SSHTransport: a channel of its connection
        import asyncssh

        try:
            proc = await conn.create_process(wrap_env(command, t.host.env), encoding=None)
        except (asyncssh.Error, OSError) as exc:
            raise HostError(t.host.name, f"could not start a copy: {exc}", kind=ErrorKind.UNREACHABLE) from exc
        return _SSHProc(proc)
    env = {**os.environ, **dict(t.host.env)}
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    return _LocalProc(proc)


async def _relay(src: Transport, src_cmd: str, dst: Transport, dst_cmd: str) -> int:
    """Pipe src_cmd's stdout into dst_cmd's stdin through this process; the bytes relayed."""
    a = await _open_binary(src, src_cmd)
    try:
        b = await _open_binary(dst, dst_cmd)
    except BaseException:
        a.kill()
        raise
    total = 0
    try:
        while chunk := await a.read(RELAY_CHUNK):
            await b.write(chunk)
            total += len(chunk)
        await b.close_stdin()
        (sa, ea), (sb, eb) = await asyncio.gather(a.finish(), b.finish())
    except BaseException as exc:
        a.kill()
        b.kill()
        if isinstance(exc, Exception) and not isinstance(exc, EltctlError):
            # a channel closed under us (asyncssh's errors, broken pipes): a host or the
            # mirror went away mid-copy; the caller retries
            raise MirrorError(f"the copy from {src.host.name} to {dst.host.name} was cut after "
                              f"{total} bytes: {type(exc).__name__}: {exc}") from exc
        raise
    if sa != 0:
        raise MirrorError(f"reading the checkpoint on {src.host.name} failed: {ea.strip()[-300:] or sa}",
                          source_gone="No such file" in ea)
    if sb != 0:
        raise MirrorError(f"writing the copy on {dst.host.name} failed: {eb.strip()[-300:] or sb}")
    return total


# --------------------------------------------------------------------------- copy one checkpoint


def _copy_hash_command(python: str, src: str | None, dst: str, names: Sequence[str]) -> str:
    """Shell: copy src into the new directory dst (src None: only hash dst), fsync the
    files and print `sha256  name` per file; the hashing is eltctl/mirror_copy.py's
    (`sums`) where the host has Python, else `sha256sum`."""
    quoted = " ".join(map(_q, names))
    copy = f"{NICE} cp -R -- {_q(src)} {_q(dst)} && " if src else ""
    py = f"{NICE} {_q(python)} -c {_q(_mirror_copy_source())} sums {_q(dst)} {quoted}"
    plain = f"cd {_q(dst)} && {{ sync -- {quoted} 2>/dev/null; {NICE} sha256sum -- {quoted}; }}"
    return f"{copy}if command -v {_q(python)} >/dev/null 2>&1; then {py}; else {plain}; fi"


def _tmp_name(step: int) -> str:
    return f"{ckpt.TMP_PREFIX}{ckpt.step_dirname(step)}-mirror-{uuid.uuid4().hex[:12]}"


_NO_PYTHON = "@@ELTCTL-NO-PYTHON@@"


def _one_shot_command(python: str, mode: str, src: str | None, dst: Place, step: int, tmp_name: str,
                      expected: dict[str, Any]) -> str:
    """Shell: run mirror_copy.py with the host's Python (or print _NO_PYTHON where it has none)."""
    args = " ".join(_q(a) for a in (mode, src or "-", dst.directory, ckpt.step_dirname(step), tmp_name,
                                    json.dumps(expected, separators=(",", ":"))))
    return (f"if command -v {_q(python)} >/dev/null 2>&1; then "
            f"if command -v ionice >/dev/null 2>&1; then io='ionice -c 3'; else io=; fi; "
            f"exec {NICE} $io {_q(python)} -c {_q(_mirror_copy_source())} {args}; else echo {_NO_PYTHON}; fi")


@functools.cache
def _mirror_copy_source() -> str:
    """eltctl/mirror_copy.py's text, sent to the hosts with `python -c`."""
    with open(os.path.join(os.path.dirname(__file__), "mirror_copy.py"), encoding="utf-8") as f:
        return f.read()


def _one_shot_result(result: RunResult, what: str, host: str) -> dict[str, Any] | None:
    """mirror_copy.py's answer; None if the host has no Python; MirrorError on failure."""
    if result.stdout.strip() == _NO_PYTHON:
        return None
    line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    try:
        out = json.loads(line) if line.startswith("{") else None
    except ValueError:
        out = None
    if not isinstance(out, dict):
        err = result.stderr.strip() or f"exit {result.exit_status}"
        raise MirrorError(f"{what} on {host} failed: {err.splitlines()[-1][:300]}")
    if not out.get("ok"):
        problem = str(out.get("problem") or f"exit {result.exit_status}")
        if out.get("source_gone"):
            raise MirrorError(f"{what} on {host}: the source is gone ({problem[:200]})", source_gone=True)
        raise MirrorError(f"{what} on {host}: the copy does not verify: {problem[:300]}")
    return out


async def copy_checkpoint(src: Place, step: int, dst: Place) -> Located:
    """Copy one checkpoint from src to dst atomically; returns it as it now is at dst, verified.

    Written under `.tmp-*` in dst's directory, hashed where it was written, compared with
    the SOURCE manifest (not the copy's), then renamed. An existing valid copy is kept
    (idempotent); an existing invalid one is replaced.

    Where the host doing the work has Python (job hosts do), all of that is one command
    running eltctl/mirror_copy.py there (copy, hash, compare, fsync, rename: one round
    trip); elsewhere the same steps run as separate shell commands.
    """
    source, manifest_text = await _read_manifest(src, step)
    expected = {"files": [list(f) for f in source.files], "manifest_name": ckpt.MANIFEST_FILE,
                "manifest": hashlib.sha256(manifest_text.encode("utf-8")).hexdigest()}
    done = replace(source, where=dst.label, path=dst.step_path(step), verified=True, problem=None)
    what = f"mirroring step {step} from {src.label} to {dst.label}"
    if dst.shared or src.shared:
        runner = src.transport if dst.shared else dst.transport
        tmp_name = _tmp_name(step)
        cmd = _one_shot_command(runner.host.python, "copy", source.path, dst, step, tmp_name, expected)
        try:
            if await _try_one_shot(runner, cmd, what):
                return done
        except BaseException:
            # The script removes its temporary directory itself, unless it was cut off
            # (the host vanished): then best effort from here; retention sweeps the rest.
            try:
                await asyncio.wait_for(dst.transport.run(f"rm -rf -- {_q(dst.directory + '/' + tmp_name)}",
                                                         timeout=60), 65)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the first error is the one to report
                pass
            raise
    return await _copy_checkpoint_steps(src, source, step, dst, expected)


async def _try_one_shot(runner: Transport, cmd: str, what: str) -> bool:
    """Run a mirror_copy.py command: True when it published, False when the host has no Python."""
    result = await runner.run(cmd, timeout=COPY_TIMEOUT)
    return _one_shot_result(result, what, runner.host.name) is not None


async def _copy_checkpoint_steps(src: Place, source: Located, step: int, dst: Place,
                                 expected: dict[str, Any]) -> Located:
    """copy_checkpoint one shell command at a time (a relay, or a host without Python)."""
    final = dst.step_path(step)
    try:
        existing = await read_located(dst, step)
    except MirrorError:
        existing = None
    if existing is not None and existing.files == source.files:
        checked = await verify_located(dst, existing)
        if checked.verified:
            return checked
    tmp = f"{dst.directory}/{_tmp_name(step)}"
    names = [n for n, _s, _h in source.files] + [ckpt.MANIFEST_FILE]
    quoted = " ".join(map(_q, names))
    try:
        if dst.shared or src.shared:
            # one hop: whichever side is not the shared directory sees both paths
            runner = src.transport if dst.shared else dst.transport
            cmd = (f"set -e; mkdir -p {_q(dst.directory)}; "
                   f"[ -f {_q(source.path)}/{ckpt.MANIFEST_FILE} ] || {{ echo 'No such file: source' >&2; exit 3; }}; "
                   + _copy_hash_command(runner.host.python, source.path, tmp, names))
            result = await runner.run(cmd, timeout=COPY_TIMEOUT)
            if not result.ok:
                err = (result.stderr.strip() or f"exit {result.exit_status}")
                raise MirrorError(f"copying step {step} from {src.label} to {dst.label} on {runner.host.name} "
                                  f"failed: {err.splitlines()[-1][:300]}", source_gone="No such file" in err
                                  and source.path in err or result.exit_status == 3)
            sums_text = result.stdout
        else:
            runner = dst.transport
            await _relay(src.transport, f"cd {_q(source.path)} && exec {NICE} tar -cf - -- {quoted}",
                         dst.transport, f"set -e; mkdir -p {_q(tmp)}; tar -C {_q(tmp)} -xf -")
            cmd = _one_shot_command(dst.transport.host.python, "publish", None, dst, step, tmp.rsplit("/", 1)[1],
                                    expected)
            if await _try_one_shot(dst.transport, cmd, f"verifying the copy of step {step} on {dst.label}"):
                return replace(source, where=dst.label, path=final, verified=True, problem=None)
            sums_text = (await _run(dst.transport, _copy_hash_command(dst.transport.host.python, None, tmp, names),
                                    f"hashing the copy of step {step}", HASH_TIMEOUT)).stdout
        sums = _parse_sums(sums_text)
        problem = compare_sums(source.files, sums)
        if problem is None:
            mres = await runner.run(f"cat {_q(tmp)}/{ckpt.MANIFEST_FILE}", timeout=LIST_TIMEOUT)
            try:
                if manifest_files(mres.stdout, ckpt.step_dirname(step))[2] != source.files:
                    problem = f"{ckpt.MANIFEST_FILE} of the copy differs from the source's"
            except MirrorError as exc:
                problem = str(exc)
        if problem is not None:
            raise MirrorError(f"the copy of step {step} on {dst.label} does not verify: {problem}")
        # The old copy of this step, if any, was invalid: set it aside, then publish.
        aside = f"{dst.directory}/{ckpt.TMP_PREFIX}replaced-{uuid.uuid4().hex[:12]}"
        await _run(dst.transport,
                   f"set -e; if [ -e {_q(final)} ]; then mv -- {_q(final)} {_q(aside)}; fi; "
                   f"mv -- {_q(tmp)} {_q(final)}; rm -rf -- {_q(aside)}; sync -- {_q(dst.directory)} 2>/dev/null || true",
                   f"publishing step {step}", LIST_TIMEOUT)
    except BaseException:
        try:  # best effort: a leftover is harmless (nothing reads .tmp-*) and retention sweeps it
            await asyncio.wait_for(dst.transport.run(f"rm -rf -- {_q(tmp)}", timeout=60), 65)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    return replace(source, where=dst.label, path=final, verified=True, problem=None)


async def apply_retention(place: Place, keep: int, verified: int) -> list[int]:
    """Delete what `retention_plan` says (renamed to `.tmp-*` first) and sweep stale temps."""
    present = [c.step for c in await list_place(place)]
    doomed = retention_plan(present, keep, verified)
    parts = [f"cd {_q(place.directory)} || exit 0"]
    for step in doomed:
        name = ckpt.step_dirname(step)
        gone = f"{ckpt.TMP_PREFIX}expired-{name}-{uuid.uuid4().hex[:12]}"
        parts.append(f"mv -- {name} {gone} && rm -rf -- {gone}")
    parts.append(f"find . -maxdepth 1 -name '{ckpt.TMP_PREFIX}*' -mmin +{STALE_TMP_MINUTES} "
                 f"-exec rm -rf -- {{}} + 2>/dev/null; exit 0")
    await _run(place.transport, "; ".join(parts), "retention", LIST_TIMEOUT)
    return doomed


# --------------------------------------------------------------------------- the Mirror

MirrorConnector = Callable[[], Awaitable[Transport]]


async def host_place(t: Transport, job: str) -> Place:
    """A job's checkpoint directory on one host (`hostops.HostPaths.checkpoint_dir`)."""
    from eltctl.hostops import host_paths

    return Place(t.host.name, t, (await host_paths(t, job)).checkpoint_dir)


@dataclass(frozen=True)
class RestoreChoice:
    step: int
    where: str  # host name or "mirror"
    path: str
    skipped: tuple[str, ...] = ()  # why newer candidates were passed over


class Mirror:
    """The mirror of one job. No I/O in the constructor; `close()` drops its connection.

    Hosts are given as Places (`host_place(transport, job)`), so the same code runs
    with the controller's connections, a CLI command's Fleet, or a test's.
    """

    def __init__(self, target: MirrorTarget, job: str, *, keep: int = 3,
                 ssh: SSHSettings | None = None, connector: MirrorConnector | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.target = target
        self.job = job
        self.keep = keep
        self._ssh = ssh or SSHSettings()
        self._connector = connector or self._default_connect
        self._transport: Transport | None = None
        self._lock: asyncio.Lock | None = None

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> "Mirror | None":
        """The job's mirror, or None when `[storage] mirror` is not set."""
        if not inventory.storage.mirror:
            return None
        return cls(parse_target(inventory.storage.mirror), inventory.job.name,
                   keep=inventory.storage.keep, ssh=inventory.ssh)

    async def _default_connect(self) -> Transport:
        host = self.target.host(self._ssh)
        if host.is_local:
            return LocalTransport(host, default_timeout=self._ssh.command_timeout)
        from eltctl import ssh

        return await ssh.connect(host, self._ssh)

    async def place(self) -> Place:
        """The mirror's job directory, connecting on first use (or after a failure)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._transport is None:
                self._transport = await self._connector()
        return Place(MIRROR_LABEL, self._transport, self.target.job_dir(self.job),
                     shared=self.target.kind is TargetKind.DIRECTORY)

    async def reset(self) -> None:
        """Drop the connection (after an error), so that the next use reconnects."""
        t, self._transport = self._transport, None
        if t is not None:
            try:
                await t.close()
            except Exception:  # noqa: BLE001 - the connection is being dropped anyway
                pass

    async def close(self) -> None:
        await self.reset()

    async def mirror_checkpoint(self, host: Place, step: int) -> Located:
        """Copy step `step` from `host` to the mirror, verified, then apply retention."""
        dst = await self.place()
        copied = await copy_checkpoint(host, step, dst)
        try:
            removed = await apply_retention(dst, self.keep, step)
            if removed:
                log.info("Mirror %s: removed steps %s (keeping the newest %d).", self.target, removed, self.keep)
        except (MirrorError, HostError) as exc:
            log.warning("Mirror %s: retention failed, old copies stay for now: %s", self.target, exc)
        return copied

    async def list_mirrored(self, *, verify: bool = False) -> list[Located]:
        return await list_place(await self.place(), verify=verify)

    async def list_local(self, hosts: Iterable[Place], *, verify: bool = False) -> dict[str, list[Located] | Exception]:
        """Each host's checkpoints; a host that fails gives its exception, not a failed batch."""
        hosts = list(hosts)
        results = await asyncio.gather(*(list_place(h, verify=verify) for h in hosts), return_exceptions=True)
        return {h.label: r for h, r in zip(hosts, results)}  # type: ignore[misc]

    async def choose_restore(self, hosts: Iterable[Place], *, use_mirror: bool = True) -> RestoreChoice | None:
        """The newest checkpoint that verifies where it lies, among the hosts' and the mirror's."""
        places = {h.label: h for h in hosts}
        candidates: list[Located] = []
        skipped: list[str] = []
        for label, found in (await self.list_local(places.values())).items():
            if isinstance(found, BaseException):
                skipped.append(f"{label}: not listed: {found}")
            else:
                candidates += found
        if use_mirror:
            try:
                mirror = await self.place()
                places[MIRROR_LABEL] = mirror
                candidates += await list_place(mirror)
            except (MirrorError, HostError) as exc:
                await self.reset()
                skipped.append(f"mirror: not listed: {exc}")
        for c in restore_order(candidates):
            checked = c if c.verified is False else await verify_located(places[c.where], c)
            if checked.verified:
                return RestoreChoice(c.step, c.where, c.path, tuple(skipped))
            log.warning("Restore: skipping step %d on %s: %s", c.step, c.where, checked.problem)
            skipped.append(f"step {c.step} on {c.where}: {checked.problem}")
        return None

    async def deliver(self, choice: RestoreChoice, source: Place, to_host: Place) -> Located:
        """Put the chosen checkpoint into a host's checkpoint directory (for the runtime's restore)."""
        if source.label == to_host.label and source.directory == to_host.directory:
            return await verify_located(source, await read_located(source, choice.step))
        return await copy_checkpoint(source, choice.step, to_host)


@dataclass(frozen=True)
class RestorePlan:
    """What `prepare_restore` did: the checkpoint chosen, and where it now lies ready."""

    choice: RestoreChoice | None
    ready: tuple[str, ...]  # hosts whose checkpoint directory now holds it, verified
    failed: tuple[tuple[str, str], ...]  # (host, why it could not be delivered there)


async def prepare_restore(hosts: Sequence[Place], mirror: Mirror | None) -> RestorePlan:
    """Before a start with no survivor: choose the newest valid checkpoint among the hosts'
    and the mirror's, and deliver it into the checkpoint directory of every host about to
    run workers, so that whichever becomes rank 0 restores it (`latest_valid()`).

    Without a mirror only the hosts' own copies are candidates.
    """
    chooser = mirror or Mirror(MirrorTarget(TargetKind.DIRECTORY, "/nonexistent"), "-")
    choice = await chooser.choose_restore(hosts, use_mirror=mirror is not None)
    if choice is None:
        return RestorePlan(None, (), ())
    if choice.where == MIRROR_LABEL:
        assert mirror is not None
        source = await mirror.place()
    else:
        source = next(h for h in hosts if h.label == choice.where)
    results = await asyncio.gather(*(chooser.deliver(choice, source, h) for h in hosts), return_exceptions=True)
    ready, failed = [], []
    for h, r in zip(hosts, results):
        if isinstance(r, BaseException):
            failed.append((h.label, str(r)))
        else:
            ready.append(h.label)
    return RestorePlan(choice, tuple(ready), tuple(failed))


# --------------------------------------------------------------------------- background worker

SourceLookup = Callable[[str], Awaitable[Place]]


@dataclass
class _State:
    committed: int | None = None  # newest step rank 0 reported committed
    committed_host: str | None = None
    mirrored: int | None = None  # newest step verified on the mirror
    mirrored_time: float | None = None  # its `created`
    last_error: str | None = None
    last_attempt: float | None = None
    attempts: int = 0  # failed attempts in a row at the current step
    failures: int = 0
    mirrored_count: int = 0
    history: list[str] = field(default_factory=list)


class MirrorWorker:
    """Mirrors committed checkpoints in the background (an asyncio task, started explicitly).

        worker = MirrorWorker(mirror, source=lambda name: host_place(fleet_transport(name), job))
        await worker.start()
        worker.notify("gpu3", 1200)       # rank 0 on gpu3 committed step 1200
        worker.status()                   # for `eltctl status`
        await worker.flush(timeout=120)   # `eltctl down`: the final checkpoint mirrored?
        await worker.stop()

    Only the newest notice matters: one still waiting is replaced by a newer one, and a
    failed copy is retried with back-off until it succeeds or a newer step is notified.
    A step whose source disappeared (host gone, retention) is dropped, not retried.
    """

    def __init__(self, mirror: Mirror, source: SourceLookup, *, clock: Callable[[], float] = time.time,
                 backoff_base: float = 2.0, backoff_cap: float = 60.0) -> None:
        self.mirror = mirror
        self._source = source
        self._clock = clock
        self._base = backoff_base
        self._cap = backoff_cap
        self._state = _State()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        try:  # learn what the mirror already holds (a restarted controller); best effort
            found = [c for c in await self.mirror.list_mirrored() if c.verified is not False]
            if found:
                self._state.mirrored, self._state.mirrored_time = found[0].step, found[0].created
        except (MirrorError, HostError) as exc:
            self._state.last_error = f"listing the mirror: {exc}"
            await self.mirror.reset()
        self._task = asyncio.create_task(self._loop(), name=f"mirror:{self.mirror.job}")

    def notify(self, host: str, step: int) -> None:
        """Checkpoint `step` was committed on `host` (from rank 0's status). Never blocks."""
        s = self._state
        if s.committed is not None and step <= s.committed:
            return
        s.committed, s.committed_host, s.attempts = step, host, 0
        if self._idle is not None and (s.mirrored is None or step > s.mirrored):
            self._idle.clear()
        if self._wake is not None:
            self._wake.set()

    def rewind(self, step: int) -> None:
        """The job restarted from checkpoint `step` (a restore that skipped newer, bad ones):
        notices count from there again, and a mirrored copy of a later step of the old
        run no longer counts as mirrored (its step will be committed anew and replaced)."""
        s = self._state
        s.committed, s.committed_host, s.attempts = step, None, 0
        if s.mirrored is not None and s.mirrored > step:
            s.mirrored, s.mirrored_time = step, None

    def status(self) -> dict[str, Any]:
        """{target, step, time, age_s, lag_steps, last_error, last_attempt} (+ pending, failures)."""
        s = self._state
        now = self._clock()
        return {
            "target": str(self.mirror.target),
            "step": s.mirrored,
            "time": s.mirrored_time,
            "age_s": None if s.mirrored_time is None else max(0.0, now - s.mirrored_time),
            "lag_steps": lag(s.committed, s.mirrored),
            "last_error": s.last_error,
            "last_attempt": s.last_attempt,
            "pending": s.committed if s.committed is not None and s.committed != s.mirrored else None,
            "failures": s.failures,
            "mirrored": s.mirrored_count,
        }

    def _todo(self) -> tuple[str, int] | None:
        s = self._state
        if s.committed is None or s.committed_host is None:
            return None
        if s.mirrored is not None and s.committed <= s.mirrored:
            return None
        return s.committed_host, s.committed

    async def _loop(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            todo = self._todo()
            if todo is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            host, step = todo
            s = self._state
            s.last_attempt = self._clock()
            try:
                copied = await self.mirror.mirror_checkpoint(await self._source(host), step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is recorded and retried; training goes on
                s.failures += 1
                s.last_error = f"step {step} from {host}: {exc}"
                log.warning("Mirror %s: %s", self.mirror.target, s.last_error)
                await self.mirror.reset()
                if isinstance(exc, MirrorError) and exc.source_gone and self._todo() == todo:
                    s.committed_host = None  # gone from its host: wait for the next notice
                    continue
                s.attempts += 1
                delay = backoff_delay(s.attempts, base=self._base, cap=self._cap)
                self._wake.clear()
                try:  # a newer notice ends the wait early
                    await asyncio.wait_for(self._wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            if s.mirrored is None or copied.step >= s.mirrored:
                s.mirrored, s.mirrored_time = copied.step, copied.created
            s.mirrored_count += 1
            s.attempts = 0
            s.last_error = None
            log.info("Mirror %s: step %d from %s mirrored and verified.", self.mirror.target, step, host)

    async def flush(self, timeout: float) -> bool:
        """Wait until the newest notified checkpoint is on the mirror, verified; False on timeout."""
        if self._idle is not None and self._wake is not None:
            self._wake.set()  # skip a back-off wait
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                return False
        s = self._state
        return s.committed is None or (s.mirrored is not None and s.mirrored >= s.committed)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.mirror.close()


# --------------------------------------------------------------------------- `eltctl checkpoints`


@dataclass(frozen=True)
class CheckpointListing:
    """What `eltctl checkpoints` shows: every checkpoint found, and the places that failed."""

    checkpoints: tuple[Located, ...]
    errors: tuple[tuple[str, str], ...]  # (where, why it could not be listed)
    mirror: str | None  # the target, or None when no mirror is configured

    def as_json(self) -> dict[str, Any]:
        return {"mirror": self.mirror, "checkpoints": [c.as_json() for c in self.checkpoints],
                "errors": [{"where": w, "error": e} for w, e in self.errors]}


async def list_all(inventory: Inventory, *, verify: bool = True, timeout: float | None = None) -> CheckpointListing:
    """The job's checkpoints on every inventory host (over a Fleet) and on the mirror."""
    from eltctl.transport import Fleet

    job = inventory.job.name
    found: list[Located] = []
    errors: list[tuple[str, str]] = []
    mirror = Mirror.from_inventory(inventory)

    async def one_host(_host: Host, t: Transport) -> list[Located]:
        return await list_place(await host_place(t, job), verify=verify)

    async def on_mirror() -> None:
        assert mirror is not None
        try:
            found.extend(await mirror.list_mirrored(verify=verify))
        except (MirrorError, HostError) as exc:
            errors.append((MIRROR_LABEL, str(exc)))
        finally:
            await mirror.close()

    async with Fleet(inventory) as fleet:
        tasks = [fleet.each(None, one_host, timeout=timeout)]
        if mirror is not None:
            tasks.append(on_mirror())
        outcomes = (await asyncio.gather(*tasks))[0]
    for name, outcome in outcomes.items():
        if outcome.ok:
            found.extend(outcome.value or [])
        else:
            errors.append((name, str(outcome.error)))
    order = {h.name: i for i, h in enumerate(inventory.hosts)}
    found.sort(key=lambda c: (-c.step, c.on_mirror, order.get(c.where, 0)))
    return CheckpointListing(tuple(found), tuple(errors), str(mirror.target) if mirror else None)
