"""`Mirror`: the mirror of one job, its connection, and what it does with it (mirror a
checkpoint, list, choose and deliver a restore)."""

from __future__ import annotations

import asyncio
import logging
import shlex
from typing import Awaitable, Callable, Iterable

from eltctl.errors import HostError
from eltctl.hosts.fleet import open_transport
from eltctl.hosts.transport import Transport
from eltctl.inventory import Inventory, SSHSettings
from eltctl.mirror.copy import copy_checkpoint
from eltctl.mirror.decisions import classify, fault_fix, restore_order
from eltctl.mirror.places import list_place, read_located, verify_located, with_manifest
from eltctl.mirror.retention import apply_retention
from eltctl.mirror.signing import checked_text, write_mac
from eltctl.mirror.target import MirrorTarget, TargetKind, parse_target
from eltctl.mirror.values import MIRROR_LABEL, Fault, Located, MirrorError, Place, RestoreChoice

log = logging.getLogger("eltctl.mirror")

MirrorConnector = Callable[[], Awaitable[Transport]]
LIST_RETRY_S = (1.0, 3.0)  # a restore lists the mirror again after these pauses before it gives up on it
MIRROR_UNLISTED = "mirror: not listed"  # how choose_restore's `skipped` names a mirror it could not list


async def claim_job_dir(t: Transport, directory: str) -> None:
    """Make sure the mirror's job directory is this account's own and private, or, in a
    group-shared mirror, the group's.

    Private (the default): created with mode 0700 where missing; an existing one must
    belong to the account the mirror is reached as (another user's job of the same name,
    or a directory someone created first to feed us checkpoints, is refused) and is
    tightened to 0700. Only one account can then use it: the hosts of a directory
    mirror must log in as this machine's uid (`eltctl doctor` checks it).

    Group-shared: when the mirror's root directory is group-writable with the setgid
    bit (`chgrp lab ROOT; chmod 2770 ROOT`, docs/checkpoints.md), the job directory is
    made 2770 and kept in the root's group, whoever of the group created it: every
    account of the group (this machine's, each host's login) copies, verifies and
    removes there. The group is then the trust boundary; restore still checks each
    checkpoint's MAC. Portable sh (`ls -ldn`), for a storage host without Python."""
    q = shlex.quote(directory)
    root = shlex.quote(directory.rsplit("/", 1)[0] or "/")
    result = await t.run(
        # group-shared: the root is group-writable and setgid (`ls -l` shows rwxrws---)
        f"set -- $(ls -ldn {root} 2>/dev/null) x; case $1 in ?????w[sS]*) g=$4;; *) g=;; esac; "
        f'if [ -n "$g" ]; then mkdir -p -m 2770 {q} 2>&1 || exit 4; set -- $(ls -ldn {q}); '
        # one this account made private before the root was shared: give it to the group
        f'if [ "$3" = "$(id -u)" ]; then chgrp "$g" {q} 2>/dev/null; chmod 2770 {q} 2>/dev/null; '
        f'set -- $(ls -ldn {q}); fi; '
        f'case $1 in ????rw[sx]*) ;; *) echo "mode $1"; exit 7;; esac; '
        f'[ "$4" = "$g" ] || {{ echo "group $4, the mirror\'s $g"; exit 7; }}; echo ok; exit 0; fi; '
        f"mkdir -p -m 700 {q} 2>&1 || exit 4; set -- $(ls -ldn {q}); me=$(id -u); "
        f'[ "$3" = "$me" ] || {{ echo "owner $3 me $me"; exit 5; }}; chmod 700 {q} 2>&1 || exit 6; echo ok',
        timeout=60)
    out = (result.stdout + result.stderr).strip()
    if result.exit_status == 7:
        raise MirrorError(
            f"the mirror directory {directory} on {t.host.name} is in a group-shared mirror but not the "
            f"group's ({out[-200:]})", hint=f"chgrp it to the mirror's group and chmod 2770 {directory}, "
                                            "or move it away")
    if result.exit_status == 5:
        raise MirrorError(
            f"the mirror directory {directory} on {t.host.name} belongs to another account ({out}): "
            "eltctl reads and writes checkpoints only in a directory of its own",
            hint="use another [storage] mirror path or job name; if the directory is yours from another "
                 "account, move it away")
    if not result.ok or not out.endswith("ok"):
        raise MirrorError(f"the mirror directory {directory} on {t.host.name} cannot be created or made "
                          f"private: {out[-300:] or result.exit_status}",
                          hint="check the path and its permissions on the mirror")


class Mirror:
    """The mirror of one job. No I/O in the constructor; `close()` drops its connection.

    Hosts are given as Places (`host_place(transport, job)`), so the same code runs
    with the controller's connections, a CLI command's Fleet, or a test's.
    """

    def __init__(self, target: MirrorTarget, job: str, *, keep: int = 3,
                 ssh: SSHSettings | None = None, connector: MirrorConnector | None = None,
                 secret: bytes | None = None, trust_unsigned: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.target = target
        self.job = job
        self.keep = keep
        self._ssh = ssh or SSHSettings()
        self._connector = connector or self._default_connect
        self.secret = secret  # the job's: mirrored manifests get a MAC, restore checks it (signing.py)
        self.trust_unsigned = trust_unsigned
        self._transport: Transport | None = None
        self._lock: asyncio.Lock | None = None

    @classmethod
    def from_inventory(cls, inventory: Inventory, secret: bytes | None = None) -> "Mirror | None":
        """The job's mirror, or None when `[storage] mirror` is not set."""
        if not inventory.storage.mirror:
            return None
        return cls(parse_target(inventory.storage.mirror), inventory.job.name,
                   keep=inventory.storage.keep, ssh=inventory.ssh, secret=secret,
                   trust_unsigned=inventory.storage.trust_unsigned)

    def detached(self) -> "Mirror":
        """The same mirror on a connection of its own (made at its first use; `close()` it
        after). A restore uses one: the background copier drops its connection after each
        failed copy (`reset`), which must not cut a restore's listing or delivery."""
        return Mirror(self.target, self.job, keep=self.keep, ssh=self._ssh, connector=self._connector,
                      secret=self.secret, trust_unsigned=self.trust_unsigned)

    async def _default_connect(self) -> Transport:
        return await open_transport(self.target.host(self._ssh), self._ssh)

    async def place(self) -> Place:
        """The mirror's job directory, connecting on first use (or after a failure)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._transport is None:
                transport = await self._connector()
                try:
                    await claim_job_dir(transport, self.target.job_dir(self.job))
                except BaseException:
                    await transport.close()
                    raise
                self._transport = transport
        return Place(MIRROR_LABEL, self._transport, self.target.job_dir(self.job),
                     shared=self.target.kind is TargetKind.DIRECTORY)

    def fault(self, exc: BaseException) -> Fault:
        """`exc` (from `mirror_checkpoint`) sorted: retried, or permanent with its fix."""
        login = str(exc.kind) if isinstance(exc, HostError) and exc.kind is not None else None
        kind = classify(str(getattr(exc, "message", exc)), errno=getattr(exc, "errno", None),
                        login_error=login if self.target.kind is TargetKind.SSH else None,
                        source_gone=bool(getattr(exc, "source_gone", False)))
        fix = fault_fix(kind, target=str(self.target), directory=self.target.kind is TargetKind.DIRECTORY,
                        job_dir=self.target.job_dir(self.job))
        return Fault(kind, str(getattr(exc, "message", exc)), fix)

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
        if self.secret is not None:
            await write_mac(dst, step, self.secret, self.job)
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

    async def choose_restore(self, hosts: Iterable[Place], *, use_mirror: bool = True,
                             skipped: list[str] | None = None) -> RestoreChoice | None:
        """The newest checkpoint that verifies where it lies, among the hosts' and the mirror's.
        `skipped`, if given, receives why places or candidates were passed over (also when
        none is chosen)."""
        places = {h.label: h for h in hosts}
        candidates: list[Located] = []
        skipped = [] if skipped is None else skipped
        for label, found in (await self.list_local(places.values())).items():
            if isinstance(found, BaseException):
                skipped.append(f"{label}: not listed: {found}")
            else:
                candidates += found
        if use_mirror:
            # A mirror that cannot be listed leaves its checkpoints out, and with every host
            # lost the job would start from step 0: a cut connection or a busy storage host
            # is tried again first, on a new connection.
            for pause in (*LIST_RETRY_S, None):
                try:
                    mirror = await self.place()
                    found = await list_place(mirror)
                except (MirrorError, HostError) as exc:
                    await self.reset()
                    if pause is None or self.fault(exc).permanent:
                        skipped.append(f"{MIRROR_UNLISTED}: {exc}")
                        break
                    log.warning("Restore: listing the mirror %s failed (%s); trying again in %g s.",
                                self.target, exc, pause)
                    await asyncio.sleep(pause)
                    continue
                places[MIRROR_LABEL] = mirror
                candidates += found
                break
        for c in restore_order(candidates):
            refused, text = await self._refused(places[c.where], c)
            if refused is None and text is not None:
                # the files are checked against the hashes of the manifest whose MAC was
                # checked (those bytes, not the listing's read nor a later one)
                try:
                    c = with_manifest(c, text)
                except MirrorError as exc:
                    refused = f"step {c.step} on the {c.where}: {exc}"
            if refused is not None:
                log.warning("Restore: refusing step %d on %s: %s", c.step, c.where, refused)
                skipped.append(refused)
                continue
            checked = c if c.verified is False else await verify_located(places[c.where], c)
            if checked.verified:
                return RestoreChoice(c.step, c.where, c.path, tuple(skipped), manifest=text)
            log.warning("Restore: skipping step %d on %s: %s", c.step, c.where, checked.problem)
            skipped.append(f"step {c.step} on {c.where}: {checked.problem}")
        return None

    async def _refused(self, place: Place, c: Located) -> tuple[str | None, str | None]:
        """(why a mirrored checkpoint is not restored: its manifest's MAC (signing.py), or
        None; the manifest's text that was checked, or None when none was)."""
        if c.where != MIRROR_LABEL or self.secret is None or c.verified is False:
            return None, None
        try:
            problem, text = await checked_text(place, c, self.secret, self.job)
        except (MirrorError, HostError) as exc:
            return f"step {c.step} on the {c.where}: its MAC cannot be read: {exc}", None
        if problem is not None and self.trust_unsigned:
            log.warning("Restore: %s; restoring it all the same ([storage] trust_unsigned).", problem)
            return None, text
        return problem, text

    async def deliver(self, choice: RestoreChoice, source: Place, to_host: Place) -> Located:
        """Put the chosen checkpoint into a host's checkpoint directory (for the runtime's restore)."""
        if source.label == to_host.label and source.directory == to_host.directory:
            return await verify_located(source, await read_located(source, choice.step))
        manifest = choice.manifest if source.label == choice.where else None  # the MAC-checked bytes
        return await copy_checkpoint(source, choice.step, to_host, manifest_text=manifest)
