"""Acting: what the controller does to the hosts and the store once the policy decided.

Thin, over the hosts' transports (`eltctl.hosts.ops`, the `Fleet`) and the job's store:
write a host's desired slots (or withdraw them), record an event, start a daemon
(ship the runtime, sync the code, start it; `DaemonStarter`, one background task
per host so a failing host never blocks the others), deliver the newest checkpoint
before a cold start (`Restorer`, over `eltctl.mirror`), and for `down`: ask every
daemon to stop, list and signal or kill what is left, mirror the final checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Mapping

from eltctl.hosts import ops as hostops
from eltctl import mirror as mir
from eltctl.controller import policy as pol
from eltctl.controller.statedir import control_id
from eltctl.errors import HostError
from eltctl.inventory import Host, Inventory
from eltctl.hosts.fleet import Fleet
from eltctl_runtime.protocol import Desired, EventKind, Keys, desired_key

log = logging.getLogger("eltctl.controller")

DAEMON_START_GRACE_S = 45.0  # python + torch import on a loaded host
RETIRE_WAIT_S = 15  # an idle daemon asked to exit is gone well within this
RETIRE_HOLD_S = 120.0  # a host whose old daemon was asked to exit gets no slots this long, unless it is gone
REPLACE_AGAIN_S = 300.0  # a host's daemon found with the wrong slots is replaced at most this often
MIRROR_FLUSH_S = 120.0  # `down` waits this long for the final checkpoint to be mirrored


def desired_document(seq: int, slots, stop: bool) -> dict:
    """What a host's daemon is asked to run (`protocol.Desired`)."""
    return Desired(seq=seq, slots=tuple(slots), stop=stop).to_dict()


# --------------------------------------------------------------------------- the store


async def read_desired(store, host: str) -> Any:
    return await store.get_json(desired_key(host))


async def set_desired(store, host: str, record: pol.HostRecord, slots: tuple[int, ...]) -> pol.HostRecord:
    """Ask the host's daemon for `slots` (the next seq); returns the record that remembers it."""
    new = pol.applied(record, slots)
    await store.set_json(desired_key(host), desired_document(new.seq, slots, stop=False))
    log.info("Host %s: asked for slots %s (seq %d).", host, list(slots) or "none", new.seq)
    return new


async def write_withdrawn(store, name: str, record: pol.HostRecord) -> None:
    """Withdraw a failed host's slots in the store too: a daemon that comes up late must
    not start workers nobody wants."""
    try:
        await store.set_json(desired_key(name), desired_document(record.seq, (), stop=False))
    except Exception as exc:  # noqa: BLE001 - the next pass writes it when the store is back
        log.warning("Host %s: cannot withdraw its slots: %s", name, exc)


async def retire_daemon(store, name: str, record: pol.HostRecord) -> pol.HostRecord:
    """Ask an idle daemon to exit (a desired document with stop) so that a new one starts
    with the job's new configuration and code; returns the record that remembers it."""
    seq = record.seq + 1
    await store.set_json(desired_key(name), desired_document(seq, (), stop=True))
    log.info("Host %s: its idle daemon is asked to exit (seq %d); a new one starts with the change.", name, seq)
    return replace(record, seq=seq, desired=())


async def republish_desired(store, records: Mapping[str, pol.HostRecord], hosts, stopping: bool) -> None:
    """Every host's desired document written again, as remembered (its seq unchanged:
    a daemon that applied it does nothing), into a store that came back empty (a
    restarted keeper); and the job's stop request while `down` runs."""
    if stopping:
        await store.set_raw(Keys.STOP, "republished")
    for host in hosts:
        rec = records.get(host.name)
        if rec is not None and rec.seq > 0:
            await store.set_json(desired_key(host.name), desired_document(rec.seq, rec.desired, stop=stopping))


def code_digest(inventory: Inventory) -> str:
    """A digest of the job's code directory as the controller syncs it (`hostops.code_rules`:
    a file left out, the metrics file rewritten every second, changes nothing; "" if unreadable)."""
    import hashlib
    import json

    try:
        manifest = hostops.local_manifest(inventory.job.workdir, hostops.code_rules(inventory))
    except OSError:
        return ""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


async def request_stop(store, records: dict[str, pol.HostRecord], inventory: Inventory, now: float) -> None:
    """`down`: the job's stop key, and every daemon told to stop; `records` remember each
    request as it is made (raises when the store is gone)."""
    await store.set_raw(Keys.STOP, str(now))
    for host in inventory.hosts:
        rec = records.get(host.name, pol.HostRecord())
        seq = rec.seq + 1
        await store.set_json(desired_key(host.name), desired_document(seq, rec.desired, stop=True))
        records[host.name] = replace(rec, seq=seq, desired=())


# --------------------------------------------------------------------------- daemons


@dataclass
class DaemonStarter:
    """Starts hosts' daemons, one background task per host, and remembers when."""

    fleet: Fleet
    # the store's host:port for a host's daemon.json: one for all (the "direct" mode), or
    # per host (the "ssh" mode: its forward's port; None while that forward is not up)
    store_endpoint: str | Callable[[Host], str | None]
    clock: Callable[[], float]
    secret: bytes | None = None  # the job's secret, written to each host with daemon.json (0600)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)  # when we last started each daemon
    paths: dict[str, hostops.HostPaths] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)  # hosts whose old daemon was asked to exit
    # hosts whose start in flight was overtaken by a change of the job's configuration or
    # code (`Controller.apply_fixes`) before it launched the daemon: it launches none
    stale: set[str] = field(default_factory=set)
    launching: set[str] = field(default_factory=set)  # hosts whose start is launching the daemon now
    # each host's digest of the job's code, settings and entry (pol.host_config), taken as the
    # daemon is launched (daemon.json's config): a daemon from before a fix is told by it
    config_of: Callable[[str], str] = lambda name: ""
    # called once a retired host's old daemon is gone, before the new one ships: its desired
    # document is rewritten so that the new daemon never reads the stop meant for the old one
    after_retired: Callable[[str], Awaitable[None]] | None = None
    launched: dict[str, int] = field(default_factory=dict)  # the pid of each host's daemon we last launched
    asked_to_exit: dict[str, set[int]] = field(default_factory=dict)  # pids of daemons asked to exit, per host
    _runtime_files: dict[str, bytes] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.tasks)

    async def _address_here(self, inventory: Inventory) -> str | None:
        """The address remote hosts reach this machine at (the local side of an SSH
        connection to one), for a local host's workers in the "ssh" store mode; None
        without remote hosts or when none answers."""
        for other in inventory.hosts:
            if other.is_local:
                continue
            try:
                address = (await self.fleet.transport(other)).local_address()
            except HostError:
                continue
            if address:
                return address
        return None

    def forget(self, name: str) -> None:
        """A host lost or changed: its paths are learned again over a new connection."""
        self.paths.pop(name, None)

    def overdue(self, views: Mapping[str, pol.HostView], now: float) -> list[str]:
        """The hosts whose daemon, started more than the grace ago, never reported."""
        late = []
        for name, t0 in list(self.started_at.items()):
            if views[name].daemon_alive:
                del self.started_at[name]
            elif now - t0 > DAEMON_START_GRACE_S and name not in self.tasks:
                del self.started_at[name]
                log.warning("Host %s: the daemon started %.0f s ago never reported.", name, now - t0)
                late.append(name)
        return late

    def start(self, inventory: Inventory, host: Host, slots: pol.DaemonSlots, now: float, *,
              on_shipping: Callable[[], None], on_started: Callable[[], None],
              on_failure: Callable[[str, str], Awaitable[None]]) -> None:
        """Start the host's daemon in the background, unless it is being started already.
        `slots`: what it is started with, as known when the start was decided (never
        looked up again later: a probe that fails meanwhile must not turn a GPU host's
        daemon into a CPU host's)."""
        if host.name in self.tasks or (host.name in self.started_at
                                       and now - self.started_at[host.name] < DAEMON_START_GRACE_S):
            return
        self.tasks[host.name] = asyncio.ensure_future(
            self._start(inventory, host, slots, on_shipping, on_started, on_failure))

    async def _start(self, inventory: Inventory, host: Host, slots: pol.DaemonSlots,
                     on_shipping: Callable[[], None], on_started: Callable[[], None],
                     on_failure: Callable[[str, str], Awaitable[None]]) -> None:
        try:
            on_shipping()
            t = await self.fleet.transport(host)
            paths = self.paths.get(host.name) or await hostops.host_paths(t, inventory.job.name)
            self.paths[host.name] = paths
            running = await hostops.daemon_pid(t, paths)
            if running is not None and host.name in self.retired:
                for _ in range(RETIRE_WAIT_S * 4):  # the old daemon exits: it has no worker
                    await asyncio.sleep(0.25)
                    running = await hostops.daemon_pid(t, paths)
                    if running is None:
                        break
            if host.name in self.retired:
                self.retired.discard(host.name)
                if running is None and self.after_retired is not None:
                    await self.after_retired(host.name)
            store = self.store_endpoint(host) if callable(self.store_endpoint) else self.store_endpoint
            owner = hostops.Owner(control_id(), socket.gethostname(), str(inventory.path))
            if running is not None:
                theirs = await hostops.daemon_owner(t, paths)
                if theirs is not None and theirs.control != owner.control:
                    raise hostops.foreign_owner_error(host.name, inventory.job.name, theirs)
                log.info("Host %s: its daemon (pid %d) runs already; waiting for its state.", host.name, running)
                self.started_at[host.name] = self.clock()
                return
            if store is None:  # started once its store forward is up (the keeper opens it)
                return  # store_through_forwards logs why, once
            if self._runtime_files is None:
                self._runtime_files = hostops.runtime_files()
            runtime_dir, sent = await hostops.ensure_runtime(t, paths, self._runtime_files)
            if sent:
                log.info("Host %s: shipped the runtime to %s.", host.name, runtime_dir)
            if not inventory.job.shared_filesystem:
                synced = await hostops.sync_code(t, inventory.job.workdir, paths.code_dir,
                                                 hostops.code_rules(inventory))
                if synced.sent or synced.deleted:
                    log.info("Host %s: code synced (%d sent, %d deleted).", host.name, len(synced.sent),
                             len(synced.deleted))
            config = hostops.daemon_config(inventory, host, paths, store, slots.gpus, secret=self.secret is not None)
            if callable(self.store_endpoint) and host.is_local and "ELTCTL_BIND_ADDRESS" not in config["env"]:
                bind = await self._address_here(inventory)
                if bind:  # the store is a Unix socket here: gloo binds where the remote hosts reach this machine
                    config["env"]["ELTCTL_BIND_ADDRESS"] = bind
            if host.name in self.stale:  # what it shipped is from before the change: not started
                log.info("Host %s: its daemon is not started with the configuration and code from before "
                         "the change; the next start ships the new ones.", host.name)
                return
            # taken now, with no await since the check above: a change after this point
            # finds this daemon with the digest from before it and replaces it
            config["config"] = self.config_of(host.name)
            self.launching.add(host.name)
            pid = await hostops.start_daemon(t, paths, runtime_dir, config, owner, self.secret,
                                             bind_from_ssh=callable(self.store_endpoint) and not host.is_local)
            if pid is not None:
                self.launched[host.name] = pid
            if host.name in self.retired:  # a change came while it launched: asked to exit already
                if pid is not None:
                    self.asked_to_exit.setdefault(host.name, set()).add(pid)
                log.info("Host %s: daemon started (pid %s) as the job's code or settings changed; it is "
                         "asked to exit, and the next start ships the change.", host.name, pid)
                return
            self.started_at[host.name] = self.clock()
            log.info("Host %s: daemon started (pid %s) with %s (from %s).", host.name, pid, slots.describe(),
                     slots.source)
            on_started()
        except HostError as exc:
            log.warning("Host %s: could not start its daemon: %s", host.name, exc)
            await on_failure(host.name, exc.message)
            await self.fleet.forget(host.name)
            self.forget(host.name)
        except Exception:  # noqa: BLE001 - one host's bug must not end the controller
            log.exception("Host %s: starting its daemon failed.", host.name)
        finally:
            self.tasks.pop(host.name, None)
            self.stale.discard(host.name)
            self.launching.discard(host.name)


# --------------------------------------------------------------------------- restoring


@dataclass
class Restorer:
    """Delivers the newest valid checkpoint before workers start with no survivor.

    `ready` is asked every pass: False while the checkpoint is being delivered to the
    hosts about to start workers (then nothing is acted on); True once it has been, or
    when no restore is needed. Done once per cold start: a survivor holding the state
    again re-arms it, so a later loss of every host restores anew."""

    clock: Callable[[], float]
    restored: bool = False
    restored_at: float = 0.0  # runtime statuses older than this are of the run before it
    _task: asyncio.Task | None = None

    def ready(self, survivor: bool, targets: list[str], restore: Callable[[list[str]], Awaitable[None]]) -> bool:
        if survivor:
            self.restored = False
            return True
        if self.restored or not targets:
            return True
        if self._task is None:
            self._task = asyncio.ensure_future(restore(targets))
            return False
        if not self._task.done():
            return False
        self._task = None
        self.restored = True
        self.restored_at = self.clock()
        return True


async def restore(fleet: Fleet, inventory: Inventory, names: list[str], mirror_worker,
                  event: Callable[..., Awaitable[None]], others: list[str] = (),
                  known: dict | None = None) -> dict:
    """Choose the newest valid checkpoint among these hosts', the other reachable hosts'
    (`others`: the job's last worker may have left from one of them) and the mirror's, and
    deliver it to each of `names` (mirror.prepare_restore). A failure is logged and the
    start goes on: the runtime then restores whatever its host holds. Returns what the
    runtime is told (Keys.RESTORED): {"step" (None: none delivered), "targets", "ready"}.

    `known`: the last checkpoint the controller saw (hosts.json); newer than the one
    chosen and on a host not looked at (out of the inventory, unreachable), it is warned
    of, naming the host and the step (`resume.newer_out_of_reach`), in the log and in the
    restore event (`newer`) that `eltctl up` prints."""
    from eltctl.controller import resume

    job = inventory.job.name
    looked_at: list[str] = []
    # its own connection: the background copier's resets must not cut this one
    mirror = mirror_worker.mirror.detached() if mirror_worker is not None else None
    try:
        places, sources = [], []
        for name in [*names, *(o for o in others if o not in names)]:
            try:
                place = await mir.host_place(await fleet.transport(inventory.host(name)), job)
            except HostError as exc:
                log.warning("Restore: host %s is left out: %s", name, exc)
                continue
            (places if name in names else sources).append(place)
            looked_at.append(name)
        plan = await mir.prepare_restore(places, mirror, sources)
    except Exception as exc:  # noqa: BLE001 - a failed restore must not end the controller
        log.exception("Restore: choosing or delivering the checkpoint failed.")
        await event(EventKind.RESTORE, None, f"restore failed: {exc}; the hosts restore what they hold")
        return {"step": None, "targets": list(names), "ready": []}
    finally:
        if mirror is not None:
            await mirror.close()
    chosen = plan.choice.step if plan.choice is not None else None
    newer = resume.newer_out_of_reach(known, chosen, looked_at, (h.name for h in inventory.hosts))
    if newer is not None:
        log.warning("Restore: %s.", resume.newer_sentence(newer, chosen))
    if plan.choice is None:
        unlisted = [why for why in plan.skipped if why.startswith(mir.MIRROR_UNLISTED)]
        if newer is not None:  # the job goes back to step 0: said in the event `up` prints
            await event(EventKind.RESTORE, None, resume.newer_sentence(newer, None), step=None, where=None,
                        skipped=list(plan.skipped), newer=newer)
        elif unlisted:  # its checkpoints may be the job's only ones: said loudly, not as "none"
            log.warning("Restore: no checkpoint on %s, and %s; the job starts from step 0.",
                        ", ".join(names), unlisted[0])
            await event(EventKind.RESTORE, None, f"no checkpoint on {', '.join(names)}, and the {unlisted[0]}; "
                        "the job starts from step 0", skipped=list(plan.skipped))
        else:
            log.info("Restore: no checkpoint on %s%s; the job starts from step 0.", ", ".join(names),
                     " or the mirror" if mirror is not None else "")
        return {"step": None, "targets": list(names), "ready": []}
    c = plan.choice
    detail = f"step {c.step} from {c.where}, delivered to {', '.join(plan.ready) or 'no host'}"
    if plan.failed:
        detail += "; not delivered to " + "; ".join(f"{h}: {why}" for h, why in plan.failed)
    if c.skipped:
        detail += "; skipped " + "; ".join(c.skipped)
    if newer is not None:
        detail += f"; newer: step {newer['step']} on {newer['host']}, which {newer['why']}"
    log.info("Restore: %s.", detail)
    await event(EventKind.RESTORE, None, detail, step=c.step, where=c.where, skipped=list(c.skipped),
                ready=list(plan.ready), **({"newer": newer} if newer is not None else {}))
    if mirror_worker is not None:
        # Steps after c.step will be committed anew by this run: count from c.step
        # again (also when the newer ones were not skipped but lost with their hosts).
        mirror_worker.rewind(c.step)
    return {"step": c.step, "targets": list(names), "ready": list(plan.ready)}


# --------------------------------------------------------------------------- stopping


async def leftovers(fleet: Fleet, job: str) -> dict[str, list[hostops.JobProcess]]:
    """This job's processes on every host (an unreachable host: an empty list and a log line)."""
    async def one(host: Host, t) -> list[hostops.JobProcess]:
        return await hostops.job_processes(t, job, control_id())

    outcomes = await fleet.each(None, one, timeout=60)
    out = {}
    for name, o in outcomes.items():
        if o.error is not None:
            log.warning("Host %s: cannot list the job's processes: %s", name, o.error)
            await fleet.forget(name)
            out[name] = []
        else:
            out[name] = o.value or []
    return out


async def signal_daemons(fleet: Fleet, left: Mapping[str, list[hostops.JobProcess]]) -> None:
    """SIGTERM to each host's daemon (when the store cannot tell them to stop)."""
    async def one(host: Host, t) -> None:
        pids = [p.pid for p in left.get(host.name, []) if hostops.DAEMON_MODULE in p.command]
        await hostops.kill_pids(t, pids, "TERM")

    await fleet.each(None, one, timeout=30)


async def kill(fleet: Fleet, job: str, left: Mapping[str, list[hostops.JobProcess]]) -> dict[str, list[int]]:
    """SIGTERM to every process left, SIGKILL two seconds later to those still there."""
    async def one(host: Host, t) -> list[int]:
        pids = [p.pid for p in left.get(host.name, [])]
        await hostops.kill_pids(t, pids, "TERM")
        await asyncio.sleep(2.0)
        still = {p.pid for p in await hostops.job_processes(t, job, control_id())}
        await hostops.kill_pids(t, [p for p in pids if p in still], "KILL")
        return pids

    outcomes = await fleet.each(None, one, timeout=60)
    return {n: (o.value or []) for n, o in outcomes.items()}


async def mirror_final(worker, checkpoint: dict | None, job: str, announce: Callable[[], None]) -> dict:
    """`down`: the final checkpoint onto the mirror, verified; then the worker stops.
    `announce` is called once the copy is asked for, before waiting on it."""
    if checkpoint and isinstance(checkpoint.get("step"), int):
        host = mir.checkpoint_host(str(checkpoint.get("path") or ""), job)
        if host is not None:
            worker.notify(host, checkpoint["step"])
    announce()
    try:
        ok = await worker.flush(timeout=MIRROR_FLUSH_S)
        result = {"ok": ok, **worker.status()}
        await worker.stop()
    except Exception as exc:  # noqa: BLE001 - `down` answers whatever the mirror does
        log.exception("Mirroring the final checkpoint failed.")
        result = {**worker.status(), "ok": False, "last_error": f"mirror worker failed: {exc}"}
    return result
