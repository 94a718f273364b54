"""Can the job use its mirror, as every account that touches it will? Asked before
anything starts: by `eltctl doctor` and by `eltctl up`'s checks (eltctl/preflight.py).

Which accounts touch `[storage] mirror` (docs/checkpoints.md):

- a directory mirror: this machine's account (the controller claims the job's
  directory, lists, verifies, signs and removes copies there) AND each host's login
  account (the host holding a checkpoint copies it in itself, `mirror_copy`). With
  different uids on different machines, or NFS `root_squash` when this side runs as
  root, those are different accounts, and a directory one of them made private is
  useless to the others;
- an `ssh://` mirror: only the login on the mirror host (the controller relays the
  bytes), so the check is that login and its path.

The check does what a copy will do, no more: the controller claims the job's
directory as it will (`claim_job_dir`: private 0700, or the group's 2770 in a
group-shared mirror) and creates, writes, renames and removes a file there; then
each host runs the `mirror_copy` program's `probe` in it (a directory made as a copy
makes it, a file written, fsynced and renamed), and the controller reads, writes
into, renames and removes what the host made, as retention and signing will. A
failure names the host, its account, the path and the fix.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import uuid
from typing import Callable, Iterable

from eltctl.checks import Check, Report, Status
from eltctl.errors import HostError
from eltctl.hosts import programs
from eltctl.hosts.transport import Transport
from eltctl.inventory import Host, Inventory
from eltctl.mirror.decisions import classify, fault_fix
from eltctl.mirror.job import Mirror
from eltctl.mirror.target import TargetKind
from eltctl.mirror.values import FaultKind, MirrorError

CHECK_TIMEOUT = 60.0
GUIDE = 'docs/checkpoints.md, "Which accounts touch the mirror"'


class MirrorCheckError(MirrorError):
    """`eltctl up`: the mirror cannot be used as the job would; nothing was started."""

    exit_code = 3  # a failed `doctor` check (README, "Exit codes")


def _finding(name: str, ok: bool, detail: str, fix: str | None = None) -> Check:
    """One account's (or step's) answer; `name` a host, `this machine`, `job directory`, `login`."""
    return Check(name, Status.OK if ok else Status.FAIL, detail, fix)


def _report(target, checks) -> Report:
    """The mirror's report: doctor shows it as one more entry, `mirror`."""
    return Report("mirror", str(target), tuple(checks))


def _q(s: str) -> str:
    return shlex.quote(s)


def accounts_fix(job_dir: str, me: str) -> str:
    """The fix when accounts other than this machine's cannot use a directory mirror."""
    root = job_dir.rsplit("/", 1)[0] or "/"
    return (f"every account that touches the mirror must be able to write {job_dir}: log in to every host as "
            f"the same uid as this machine's {me}; or use an ssh:// mirror ([storage] mirror = "
            f"\"ssh://HOST{root}\": only that login touches it); or make {root} group-writable for a group all "
            f"those accounts are in: chgrp GROUP {root} && chmod 2770 {root}, and move away a {job_dir} that "
            f"eltctl made private before ({GUIDE})")


async def _describe(t: Transport, path: str) -> str:
    """`ls -ld` of path: its owner, group and mode, for a failure's detail."""
    try:
        res = await t.run(f"ls -ld {_q(path)} 2>&1", timeout=CHECK_TIMEOUT)
    except HostError:
        return ""
    words = res.stdout.split()
    return f"{words[0]} {words[2]} {words[3]}" if res.ok and len(words) >= 4 else ""


async def _controller_side(t: Transport, job_dir: str, who: str) -> tuple[Check, str]:
    """This side's account creates, writes, renames and removes in the job directory."""
    tmp = f"{job_dir}/.tmp-check-{uuid.uuid4().hex[:12]}"
    res = await t.run(f"id -un; mkdir {_q(tmp)} && printf x > {_q(tmp)}/.f && mv {_q(tmp)}/.f {_q(tmp)}/f "
                      f"&& rm -rf {_q(tmp)} && echo ok", timeout=CHECK_TIMEOUT)
    lines = res.stdout.split()
    me = lines[0] if lines else "?"
    if res.ok and lines[-1:] == ["ok"]:
        return _finding(who, True, f"account {me} creates, writes, renames and removes in {job_dir}"), me
    await t.run(f"rm -rf {_q(tmp)}", timeout=CHECK_TIMEOUT)
    err = (res.stderr.strip().splitlines() or [f"exit {res.exit_status}"])[-1][:300]
    return _finding(who, False, f"account {me} cannot write {job_dir}: {err}",
                   "fix the directory's owner or mode for that account"), me


async def _host_side(host: Host, ht: Transport, mt: Transport, job_dir: str, me: str) -> Check:
    """The host's login makes a directory and a file as a copy does; this machine's
    account then reads, writes into, renames and removes it."""
    name = f".tmp-check-{uuid.uuid4().hex[:12]}"
    tmp = f"{job_dir}/{name}"
    cmd = programs.command(host.python, "mirror_copy", "probe", job_dir, name)
    res = await ht.run(cmd, timeout=CHECK_TIMEOUT)
    line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    try:
        out = json.loads(line) if line.startswith("{") else {}
    except ValueError:
        out = {}
    user = str(out.get("user") or host.user or "?")
    if not out.get("ok"):
        problem = str(out.get("problem") or (res.stderr.strip().splitlines() or [f"exit {res.exit_status}"])[-1])
        kind = classify(problem, errno=out.get("errno"))
        seen = await _describe(mt, job_dir)
        detail = (f"account {user} (uid {out.get('uid', '?')}) on {host.name} cannot write {job_dir}"
                  + (f" ({seen})" if seen else "") + f": {problem[:300]}")
        fix = accounts_fix(job_dir, me) if kind is FaultKind.PERMISSION else \
            fault_fix(kind, target=job_dir, directory=True, job_dir=job_dir) or "see the detail"
        return _finding(f"{host.name} ({user})", False, detail, fix)
    moved = f"{tmp}.renamed"
    back = await mt.run(f"cat {_q(tmp)}/probe >/dev/null && printf x > {_q(tmp)}/mac && mv {_q(tmp)} {_q(moved)} "
                        f"&& rm -rf {_q(moved)}", timeout=CHECK_TIMEOUT)
    if back.ok:
        return _finding(f"{host.name} ({user})", True,
                       f"account {user} writes and renames in {job_dir}; this machine's {me} reads, renames "
                       "and removes what it wrote")
    await ht.run(f"rm -rf {_q(tmp)} {_q(moved)}", timeout=CHECK_TIMEOUT)
    err = (back.stderr.strip().splitlines() or [f"exit {back.exit_status}"])[-1][:300]
    return _finding(f"{host.name} ({user})", False,
                   f"this machine's account {me} cannot read, rename or remove what account {user} on "
                   f"{host.name} wrote in {job_dir}: {err}", accounts_fix(job_dir, me))


async def check_mirror(inventory: Inventory, transport: Callable[[Host], "asyncio.Future[Transport]"],
                       hosts: Iterable[Host]) -> Report | None:
    """The mirror as the job will use it (None: no `[storage] mirror`).

    `transport(host)` gives a connected host (a Fleet's `transport`); a host that cannot
    be reached is left out (doctor's own checks say why)."""
    mirror = Mirror.from_inventory(inventory)
    if mirror is None:
        return None
    target, job_dir = mirror.target, mirror.target.job_dir(inventory.job.name)
    directory = target.kind is TargetKind.DIRECTORY
    findings: list[Check] = []
    try:
        try:
            place = await mirror.place()  # connects (ssh://) and claims the job directory, as the controller will
        except HostError as exc:
            kind = classify(exc.message, login_error=str(exc.kind))
            return _report(target, [_finding(
                "login", False, f"the mirror host cannot be used: {exc.message}",
                fault_fix(kind, target=str(target), directory=False, job_dir=job_dir) or exc.hint)])
        except MirrorError as exc:
            kind = classify(exc.message)
            fix = exc.hint if kind is FaultKind.TRANSIENT else fault_fix(
                kind, target=str(target), directory=directory, job_dir=job_dir)
            return _report(target, [_finding("job directory", False, exc.message, fix)])
        who = "this machine" if directory else f"mirror host ({target.user or 'the [ssh] user'})"
        mine, me = await _controller_side(place.transport, job_dir, who)
        findings.append(mine)
        if directory and mine.ok:
            findings += await asyncio.gather(*(_one_host(h, transport, place.transport, job_dir, me)
                                               for h in hosts))
    finally:
        await mirror.close()
    return _report(target, (f for f in findings if f is not None))


async def _one_host(host: Host, transport, mt: Transport, job_dir: str, me: str) -> Check | None:
    try:
        ht = await transport(host)
    except HostError:
        return None  # unreachable: doctor's connection checks say so
    try:
        return await _host_side(host, ht, mt, job_dir, me)
    except HostError as exc:
        return _finding(host.name, False, f"the mirror check did not complete: {exc.message}", exc.hint)


def up_error(result: Report) -> MirrorCheckError:
    """`eltctl up`'s error for a mirror that fails its check (nothing was started)."""
    lines = [f"the checkpoint mirror {result.address} cannot be used as the job would; `eltctl up` started "
             "nothing:"]
    for f in result.problems:
        lines.append(f"  {f.name}: {f.detail}")
        if f.fix:
            lines.append(f"    fix: {f.fix}")
    return MirrorCheckError("\n".join(lines),
                            hint="fix it, then run `eltctl up` again (`eltctl doctor` checks it alone); "
                                 "`eltctl up --ignore-mirror-check` trains without a working mirror, "
                                 "`eltctl status` warning about it")


def for_up(inventory: Inventory, hosts: Iterable[Host], progress: Callable[[str], None], *,
           ignore: bool = False) -> Report | None:
    """`eltctl up`: check the mirror with the hosts about to be used; raise MirrorCheckError
    when it fails, unless `ignore` (then each problem is a warning)."""
    if not inventory.storage.mirror:
        return None
    from eltctl.hosts.fleet import Fleet

    async def main() -> Report | None:
        async with Fleet(inventory) as fleet:
            return await check_mirror(inventory, fleet.transport, hosts)

    progress(f"checking the checkpoint mirror {inventory.storage.mirror}")
    result = asyncio.run(main())
    if result is None or result.ok:
        return result
    if not ignore:
        raise up_error(result)
    for f in result.problems:
        progress(f"warning: mirror: {f.name}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else "")
                 + "; going on (--ignore-mirror-check): checkpoints stay on the hosts only")
    return result
