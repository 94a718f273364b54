"""Copying one checkpoint from one place to another, verified, published atomically.

Where the host doing the work has Python (job hosts do), the copy is one command
running the `mirror_copy` host program there (copy, hash, compare, fsync, rename);
between two hosts that do not share the directory, the controller relays a `tar`
stream between two `Transport.open_stream`s (nothing lands on the control machine);
a host without Python gets the same steps as separate shell commands.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import uuid
from dataclasses import replace
from typing import Any

from eltctl.errors import EltctlError
from eltctl.hosts import programs
from eltctl.hosts.transport import RunResult, Transport
from eltctl.mirror.decisions import compare_sums
from eltctl.mirror.manifests import manifest_files, parse_sums
from eltctl.mirror.places import (HASH_TIMEOUT, LIST_TIMEOUT, NICE, copy_hash_command, read_located, read_manifest,
                                  run_checked, verify_located, with_manifest)
from eltctl.mirror.values import Located, MirrorError, Place
from eltctl_runtime.checkpoint import format as ckpt

COPY_TIMEOUT = 3600.0  # seconds for one copy of one checkpoint (100 MB at 30 KB/s)
RELAY_CHUNK = 1 << 20


def _q(s: str) -> str:
    return shlex.quote(s)


async def _relay(src: Transport, src_cmd: str, dst: Transport, dst_cmd: str) -> int:
    """Pipe src_cmd's stdout into dst_cmd's stdin through this process; the bytes relayed."""
    a = await src.open_stream(src_cmd)
    try:
        b = await dst.open_stream(dst_cmd)
    except BaseException:
        a.kill()
        raise
    total = 0
    try:
        while chunk := await a.read(RELAY_CHUNK):
            await b.write(chunk)
            total += len(chunk)
        await b.close_stdin()
        (sa, ea), (sb, eb) = await asyncio.gather(a.wait(), b.wait())
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


def _tmp_name(step: int) -> str:
    return f"{ckpt.TMP_PREFIX}{ckpt.step_dirname(step)}-mirror-{uuid.uuid4().hex[:12]}"


_NO_PYTHON = "@@ELTCTL-NO-PYTHON@@"


def _one_shot_command(python: str, mode: str, src: str | None, dst: Place, step: int, tmp_name: str,
                      expected: dict[str, Any]) -> str:
    """Shell: run the mirror_copy program with the host's Python (or print _NO_PYTHON where it has none)."""
    args = (mode, src or "-", dst.directory, ckpt.step_dirname(step), tmp_name,
            json.dumps(expected, separators=(",", ":")))
    return (f"if command -v {_q(python)} >/dev/null 2>&1; then "
            f"if command -v ionice >/dev/null 2>&1; then io='ionice -c 3'; else io=; fi; "
            f"exec {NICE} $io {programs.command(python, 'mirror_copy', *args)}; else echo {_NO_PYTHON}; fi")


def _one_shot_result(result: RunResult, what: str, host: str) -> dict[str, Any] | None:
    """The mirror_copy program's answer; None if the host has no Python; MirrorError on failure."""
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
        if out.get("errno") or result.exit_status == 5:
            raise MirrorError(f"{what} on {host} failed: {problem[:300]}", errno=out.get("errno"))
        raise MirrorError(f"{what} on {host}: the copy does not verify: {problem[:300]}")
    return out


async def copy_checkpoint(src: Place, step: int, dst: Place, manifest_text: str | None = None) -> Located:
    """Copy one checkpoint from src to dst atomically; returns it as it now is at dst, verified.

    Written under `.tmp-*` in dst's directory, hashed where it was written, compared with
    the SOURCE manifest (not the copy's), then renamed. An existing valid copy is kept
    (idempotent); an existing invalid one is replaced.

    Where the host doing the work has Python (job hosts do), all of that is one command
    running the mirror_copy program there (copy, hash, compare, fsync, rename: one round
    trip); elsewhere the same steps run as separate shell commands.

    `manifest_text`: the source's manifest as already read (restore: the bytes whose MAC
    was checked); the copy, its manifest included, is checked against those bytes, and
    the source's manifest is not read again. None: read it here, once.
    """
    if manifest_text is None:
        source, manifest_text = await read_manifest(src, step)
    else:
        source = with_manifest(Located(step, src.label, src.step_path(step), 0.0, 0, ()), manifest_text)
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
    return await _copy_checkpoint_steps(src, source, step, dst, expected, manifest_text)


async def _try_one_shot(runner: Transport, cmd: str, what: str) -> bool:
    """Run a mirror_copy command: True when it published, False when the host has no Python."""
    result = await runner.run(cmd, timeout=COPY_TIMEOUT)
    return _one_shot_result(result, what, runner.host.name) is not None


async def _copy_checkpoint_steps(src: Place, source: Located, step: int, dst: Place,
                                 expected: dict[str, Any], manifest_text: str) -> Located:
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
                   + copy_hash_command(runner.host.python, source.path, tmp, names))
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
                         dst.transport, f"set -e; mkdir -p {_q(tmp)}; tar -C {_q(tmp)} --no-same-permissions -xf -")
            cmd = _one_shot_command(dst.transport.host.python, "publish", None, dst, step, tmp.rsplit("/", 1)[1],
                                    expected)
            if await _try_one_shot(dst.transport, cmd, f"verifying the copy of step {step} on {dst.label}"):
                return replace(source, where=dst.label, path=final, verified=True, problem=None)
            hashing = copy_hash_command(dst.transport.host.python, None, tmp, names)
            sums_text = (await run_checked(dst.transport, hashing, f"hashing the copy of step {step}",
                                           HASH_TIMEOUT)).stdout
        sums = parse_sums(sums_text)
        problem = compare_sums(source.files, sums)
        if problem is None:
            # the copy's manifest must be the very bytes checked (the hash in `expected`)
            if sums.get(ckpt.MANIFEST_FILE) != expected["manifest"]:
                problem = f"{ckpt.MANIFEST_FILE} of the copy differs from the source's as read and checked"
        if problem is not None:
            raise MirrorError(f"the copy of step {step} on {dst.label} does not verify: {problem}")
        # The old copy of this step, if any, was invalid: set it aside, then publish.
        aside = f"{dst.directory}/{ckpt.TMP_PREFIX}replaced-{uuid.uuid4().hex[:12]}"
        await run_checked(dst.transport,
                          f"set -e; if [ -e {_q(final)} ]; then mv -- {_q(final)} {_q(aside)}; fi; "
                          f"mv -- {_q(tmp)} {_q(final)}; rm -rf -- {_q(aside)}; "
                          f"sync -- {_q(dst.directory)} 2>/dev/null || true",
                          f"publishing step {step}", LIST_TIMEOUT)
    except BaseException:
        try:  # best effort: a leftover is harmless (nothing reads .tmp-*) and retention sweeps it
            await asyncio.wait_for(dst.transport.run(f"rm -rf -- {_q(tmp)}", timeout=60), 65)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    return replace(source, where=dst.label, path=final, verified=True, problem=None)
