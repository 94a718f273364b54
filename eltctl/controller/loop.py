"""The controller's reconcile loop: observe, decide, act.

Observe (about every 0.5 s): each daemon's `daemon/<host>/state` key and the job's
event log in the store; every `policy.probe_interval` an SSH probe of every host (in
the background: a slow host never stalls the loop). Decide: `policy.track` and
`policy.decide`, pure. Act: store writes (`daemon/<host>/desired`) at once; SSH work
(ship the runtime, sync the code, start a daemon) as one background task per host,
so a failing host never blocks the others; its failure is recorded against it.

`Controller` is driven by `controller/__main__.py` and answers the command socket
(`controller/socket.py`): `status_document`, `reconcile`, `scale`, `down`.

Checkpoint mirror (`eltctl/mirror.py`, when `[storage] mirror` is set): every
committed checkpoint rank 0 reports in the runtime's status is handed to a
`MirrorWorker`, which copies it in the background. Before workers start while no
survivor holds the job's state (the first `up`, or every host lost), the newest
valid checkpoint among the hosts' and the mirror's is delivered into the checkpoint
directory of every host about to run workers (`prepare_restore`), because the
runtime restores from its own host's directory; no worker starts until that is done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

from eltctl import mirror as mir
from eltctl.controller import policy as pol
from eltctl.controller.statedir import StateDir, read_json, write_json_atomic
from eltctl.controller.store import JobStore
from eltctl.errors import HostError
from eltctl.hosts import ops as hostops
from eltctl.hosts.fleet import Fleet
from eltctl.inventory import Host, Inventory
from eltctl.probe import GpuState, HostReport, HostState, probe_fleet

log = logging.getLogger("eltctl.controller")

TICK_S = 0.5
STATUS_EVERY_S = 1.0
DAEMON_START_GRACE_S = 45.0  # python + torch import on a loaded host
DOWN_TIMEOUT_S = 90.0
MIRROR_FLUSH_S = 120.0  # `down` waits this long for the final checkpoint to be mirrored
EVENTS_KEPT = 50
# Worker states (runtime/daemon_logic.py WorkerState) of a worker that has ended.
FINISHED_WORKER_STATES = {"left", "finished", "crashed", "lost"}


class Phase:
    CONNECTING = "connecting"
    PROBING = "probing"
    SHIPPING = "shipping"
    STARTING = "starting"
    WAITING = "waiting"
    TRAINING = "training"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class DaemonSeen:
    raw: bytes
    changed: float  # controller clock: when the state value last changed
    state: dict


def _slot_of(worker_id: str) -> int | None:
    parts = str(worker_id).split("/")
    if len(parts) >= 2 and parts[-2].lstrip("-").isdigit():
        return int(parts[-2])
    return None


class Controller:
    """One job's controller. The constructor stores its arguments; `run` does the work."""

    def __init__(self, inventory: Inventory, state: StateDir, store: JobStore, fleet: Fleet,
                 store_endpoint: str, *, clock: Callable[[], float] = time.time,
                 mirror_worker: mir.MirrorWorker | None = None) -> None:
        self.inventory = inventory
        self.state = state
        self.store = store
        self.fleet = fleet
        self.store_endpoint = store_endpoint
        self.clock = clock
        self.phase = Phase.CONNECTING
        self.message = ""
        self.records: dict[str, pol.HostRecord] = {}
        self.reports: dict[str, HostReport] = {}
        self.seen: dict[str, DaemonSeen] = {}
        self.paths: dict[str, hostops.HostPaths] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.started_at: dict[str, float] = {}  # when we last started each host's daemon
        self.crashed: dict[str, set[int]] = {}
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.events_read = 0
        self.runtime_status: dict | None = None
        self.decision: pol.Decision | None = None
        self.stopping = False
        self.stopped = asyncio.Event()
        self._probe_task: asyncio.Task | None = None
        self._last_probe = 0.0
        self._probed_once = asyncio.Event()
        self._pass = asyncio.Lock()
        self._status_written = 0.0
        self._runtime_files: dict[str, bytes] | None = None
        self._born: float | None = None  # when this controller first read the store
        self.mirror_worker = mirror_worker  # started and stopped by __main__
        self._restore_task: asyncio.Task | None = None
        # Set once the checkpoint was delivered for the current cold start; cleared
        # when a survivor holds the state again (so a later loss of every host restores anew).
        self._restored = False
        self._restored_at = 0.0  # runtime statuses older than this are of the run before it
        self._final_mirror: dict | None = None  # what `down` reported, once the worker is stopped

    # ----------------------------------------------------------------- memory

    def load_records(self) -> None:
        doc = read_json(self.state.hosts_json) or {}
        for name, d in (doc.get("hosts") or {}).items():
            try:
                self.records[name] = pol.HostRecord.from_json(d)
            except (TypeError, ValueError):
                log.warning("Ignoring the unreadable memory of host %s in %s.", name, self.state.hosts_json)
        self.events_read = int(doc.get("events_read", 0))

    def save_records(self) -> None:
        write_json_atomic(self.state.hosts_json, {
            "hosts": {name: r.to_json() for name, r in self.records.items()},
            "events_read": self.events_read})

    async def adopt_desired(self) -> None:
        """Seed the memory from the store's desired keys: a controller that lost
        hosts.json still continues exactly what the daemons were told."""
        for host in self.inventory.hosts:
            d = await self.store.get_json(f"daemon/{host.name}/desired")
            if not isinstance(d, dict):
                continue
            rec = self.records.get(host.name, pol.HostRecord())
            seq = int(d.get("seq", 0))
            if seq >= rec.seq:
                slots = () if d.get("stop") else tuple(int(s) for s in d.get("slots", ()))
                self.records[host.name] = replace(rec, seq=seq, desired=slots)

    # ----------------------------------------------------------------- observing

    async def observe_store(self) -> None:
        now = self.clock()
        if self._born is None:
            self._born = now
        for host in self.inventory.hosts:
            raw = await self.store.get_raw(f"daemon/{host.name}/state")
            if raw is None:
                continue
            old = self.seen.get(host.name)
            if old is None or old.raw != raw:
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = {}
                self.seen[host.name] = DaemonSeen(raw=raw, changed=now, state=parsed if isinstance(parsed, dict) else {})
        last = await self.store.add("events/seq", 0)
        if last < self.events_read:  # a new store: its log starts again
            self.events_read = 0
        for n in range(self.events_read + 1, last + 1):
            ev = await self.store.get_json(f"events/{n}")
            self.events_read = n
            if not isinstance(ev, dict):
                continue
            self.events.append(ev)
            # A crash reported before this controller started was handled by the one
            # before it (an adopted job): counting it again would drop a running slot.
            if ev.get("kind") == "crash" and float(ev.get("time") or 0) >= self._born - 1.0:
                host = ev.get("host")
                for w in ev.get("workers") or ([ev.get("worker")] if ev.get("worker") else []):
                    slot = _slot_of(w)
                    h = host or (str(w).split("/")[0] if w else None)
                    if slot is not None and h:
                        self.crashed.setdefault(h, set()).add(slot)
        status = await self.store.get_json("status")
        self.runtime_status = status if isinstance(status, dict) else None
        self._notify_mirror(now)

    def runtime_fresh(self, now: float) -> bool:
        rs = self.runtime_status or {}
        t = rs.get("time")
        return bool(t) and now - float(t) < self.runtime_fresh_for()

    def _notify_mirror(self, now: float) -> None:
        """Hand rank 0's newest committed checkpoint to the mirror worker. Only a fresh
        status of the current run counts: after a restore the old run's status (a step
        the new run will commit again) must not be taken for a new checkpoint."""
        rs = self.runtime_status or {}
        ck = rs.get("checkpoint")
        if self.mirror_worker is None or not isinstance(ck, dict) or not self.runtime_fresh(now):
            return
        if float(rs.get("time") or 0) < self._restored_at or not isinstance(ck.get("step"), int):
            return
        host = mir.checkpoint_host(str(ck.get("path") or ""), self.inventory.job.name)
        if host is not None and any(h.name == host for h in self.inventory.hosts):
            self.mirror_worker.notify(host, ck["step"])

    def daemon_alive(self, name: str, now: float) -> bool:
        seen = self.seen.get(name)
        if seen is None:
            return False
        fresh_for = max(5.0, 5 * self.inventory.policy.watch_interval)
        if now - seen.changed > fresh_for:
            return False
        # A state written long ago by a daemon that has died looks new to a controller
        # that has just started; its own timestamp tells (clocks agree within seconds).
        if now - float(seen.state.get("time") or now) > 6 * fresh_for:
            return False
        return seen.state.get("phase") not in ("stopped", "failed")

    def maybe_probe(self, now: float, force: bool = False) -> None:
        busy = self._probe_task is not None and not self._probe_task.done()
        if busy or (not force and now - self._last_probe < self.inventory.policy.probe_interval):
            return
        self._last_probe = now
        self._probe_task = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        try:
            reports = await probe_fleet(self.fleet, job=self.inventory.job.name, policy=self.inventory.policy,
                                        hosts=self.inventory.hosts)
        except Exception:  # noqa: BLE001 - a probe bug must not end the controller
            log.exception("The probe failed.")
            return
        for r in reports:
            self.reports[r.name] = r
            if r.state is HostState.UNREACHABLE:
                # The Fleet remembers a failed connection; a long-lived controller retries.
                await self.fleet.forget(r.name)
                self.paths.pop(r.name, None)
        self._probed_once.set()

    def view(self, host: Host, now: float) -> pol.HostView:
        report = self.reports.get(host.name)
        alive = self.daemon_alive(host.name, now)
        seen = self.seen.get(host.name)
        crashed = tuple(sorted(self.crashed.get(host.name, ())))
        if report is None:
            reach, reason, slots = pol.Reach.UNKNOWN, "", ()
        else:
            reach = {HostState.OK: pol.Reach.OK, HostState.CPU_ONLY: pol.Reach.CPU_ONLY,
                     HostState.UNHEALTHY: pol.Reach.UNHEALTHY,
                     HostState.UNREACHABLE: pol.Reach.UNREACHABLE}[report.state]
            reason = report.reason
            if report.state is HostState.OK:
                slots = tuple(pol.SlotView(g.gpu.index, pol.GpuUse(g.state.value), g.reason) for g in report.gpus)
            elif report.state is HostState.CPU_ONLY:
                slots = tuple(pol.SlotView(i, pol.GpuUse.FREE, "CPU slot") for i in range(host.slots))
            else:
                slots = ()
        workers: tuple[int, ...] = ()
        yielded: tuple[int, ...] = ()
        seq_applied = -1
        watched = False
        if alive and seen is not None:
            st = seen.state
            if reach is pol.Reach.UNREACHABLE or reach is pol.Reach.UNKNOWN:
                # SSH is down (or not probed yet) but the daemon reports: the host works.
                reach, reason = pol.Reach.OK if st.get("gpus") else pol.Reach.CPU_ONLY, "daemon reporting"
                if reach is pol.Reach.CPU_ONLY:
                    slots = tuple(pol.SlotView(i, pol.GpuUse.FREE, "CPU slot") for i in range(host.slots))
            workers = tuple(sorted({int(w["slot"]) for w in st.get("workers", [])
                                    if isinstance(w, dict) and w.get("slot") is not None
                                    and str(w.get("state", "running")) not in FINISHED_WORKER_STATES}))
            yielded = tuple(sorted({int(y["slot"]) for y in st.get("yielded", [])
                                    if isinstance(y, dict) and y.get("slot") is not None}))
            seq_applied = int(st.get("seq_applied", -1) if st.get("seq_applied") is not None else -1)
            daemon_gpus = {int(g["index"]): g for g in st.get("gpus", []) if isinstance(g, dict) and "index" in g}
            watched = bool(daemon_gpus) and st.get("health") == "ok"
            if daemon_gpus and slots:
                merged = []
                for s in slots:
                    g = daemon_gpus.get(s.index)
                    if g is not None and str(g.get("state")) == "busy":
                        merged.append(pol.SlotView(s.index, pol.GpuUse.BUSY, str(g.get("reason", ""))))
                    else:
                        merged.append(s)
                slots = tuple(merged)
        return pol.HostView(name=host.name, reach=reach, reason=reason, slots=slots, daemon_alive=alive,
                            workers=workers, yielded=yielded, crashed=crashed, seq_applied=seq_applied,
                            watched=watched)

    # ----------------------------------------------------------------- one pass

    async def reconcile(self) -> pol.Decision | None:
        async with self._pass:
            now = self.clock()
            await self.observe_store()
            self.maybe_probe(now)
            if not self._probed_once.is_set():
                return None
            views = {h.name: self.view(h, now) for h in self.inventory.hosts}
            self.crashed.clear()
            before = dict(self.records)
            self.records = pol.track(self.records, views, self.inventory, now)
            for name, rec in self.records.items():
                if rec.benched_until > now and before.get(name, pol.HostRecord()).benched_until <= now:
                    log.warning("Host %s is benched until %s: %s.", name, time.ctime(rec.benched_until),
                                rec.last_problem)
                    await self._event("bench", name, rec.last_problem)
            await self._check_starts(views, now)
            if self.stopping:
                self.save_records()
                return None
            decision = pol.decide(views, self.records, self.inventory, now)
            self.decision = decision
            if not await self._restore_ready(decision, views, now):
                self.phase, self.message = Phase.STARTING, "restoring the newest checkpoint onto the hosts"
                if self.records != before:
                    self.save_records()
                return decision
            await self.act(decision, views, now)
            if self.records != before:
                self.save_records()
            self._update_phase(views, decision)
            return decision

    def runtime_fresh_for(self) -> float:
        """Rank 0 writes its status about every second; this long without one, it is gone."""
        return max(10.0, 2 * self.inventory.policy.hang_timeout)

    async def _restore_ready(self, decision: pol.Decision, views: dict[str, pol.HostView], now: float) -> bool:
        """False while the checkpoint is being delivered to the hosts about to start
        workers with no survivor (then nothing is acted on); True once it has been, or
        when no restore is needed."""
        if pol.survivor_holds_state(views, self.runtime_status, now, self.runtime_fresh_for()):
            self._restored = False
            return True
        targets = [name for name, slots in decision.desired.items() if slots]
        if self._restored or not targets:
            return True
        if self._restore_task is None:
            self._restore_task = asyncio.ensure_future(self._restore(targets))
            return False
        if not self._restore_task.done():
            return False
        self._restore_task = None
        self._restored = True
        self._restored_at = self.clock()
        return True

    async def _restore(self, names: list[str]) -> None:
        """Choose the newest valid checkpoint among these hosts' and the mirror's and
        deliver it to each of them (mirror.prepare_restore). A failure is logged and the
        start goes on: the runtime then restores whatever its host holds."""
        job = self.inventory.job.name
        mirror = self.mirror_worker.mirror if self.mirror_worker is not None else None
        try:
            places = []
            for name in names:
                try:
                    places.append(await mir.host_place(await self.fleet.transport(self.inventory.host(name)), job))
                except HostError as exc:
                    log.warning("Restore: host %s is left out: %s", name, exc)
            plan = await mir.prepare_restore(places, mirror)
        except Exception as exc:  # noqa: BLE001 - a failed restore must not end the controller
            log.exception("Restore: choosing or delivering the checkpoint failed.")
            await self._event("restore", None, f"restore failed: {exc}; the hosts restore what they hold")
            return
        if plan.choice is None:
            log.info("Restore: no checkpoint on %s%s; the job starts from step 0.", ", ".join(names),
                     " or the mirror" if mirror is not None else "")
            return
        c = plan.choice
        detail = f"step {c.step} from {c.where}, delivered to {', '.join(plan.ready) or 'no host'}"
        if plan.failed:
            detail += "; not delivered to " + "; ".join(f"{h}: {why}" for h, why in plan.failed)
        if c.skipped:
            detail += "; skipped " + "; ".join(c.skipped)
        log.info("Restore: %s.", detail)
        await self._event("restore", None, detail, step=c.step, where=c.where, skipped=list(c.skipped),
                          ready=list(plan.ready))
        if self.mirror_worker is not None:
            # Steps after c.step will be committed anew by this run: count from c.step
            # again (also when the newer ones were not skipped but lost with their hosts).
            self.mirror_worker.rewind(c.step)

    async def _check_starts(self, views: dict[str, pol.HostView], now: float) -> None:
        """A daemon we started that never reported within the grace is a failure."""
        for name, t0 in list(self.started_at.items()):
            if views[name].daemon_alive:
                del self.started_at[name]
            elif now - t0 > DAEMON_START_GRACE_S and name not in self.tasks:
                del self.started_at[name]
                log.warning("Host %s: the daemon started %.0f s ago never reported.", name, now - t0)
                await self._give_up(name, "its daemon did not report (see its daemon.log)")

    async def _give_up(self, name: str, problem: str) -> None:
        """Count a failure against the host and withdraw its slots, in the store too:
        a daemon that comes up late must not start workers nobody wants."""
        rec = pol.record_failure(self.records.get(name, pol.HostRecord()), self.inventory, self.clock(), problem)
        new = pol.applied(rec, ())
        self.records[name] = new
        try:
            await self.store.set_json(f"daemon/{name}/desired", {"seq": new.seq, "slots": [], "stop": False})
        except Exception as exc:  # noqa: BLE001 - the next pass writes it when the store is back
            log.warning("Host %s: cannot withdraw its slots: %s", name, exc)

    async def act(self, decision: pol.Decision, views: dict[str, pol.HostView], now: float) -> None:
        for a in decision.actions:
            rec = self.records.get(a.host, pol.HostRecord())
            if isinstance(a, pol.SetDesired):
                new = pol.applied(rec, a.slots)
                await self.store.set_json(f"daemon/{a.host}/desired",
                                          {"seq": new.seq, "slots": list(a.slots), "stop": False})
                self.records[a.host] = new
                log.info("Host %s: asked for slots %s (seq %d).", a.host, list(a.slots) or "none", new.seq)
        for a in decision.actions:
            if isinstance(a, pol.StartDaemon):
                if a.host in self.tasks or (a.host in self.started_at
                                            and now - self.started_at[a.host] < DAEMON_START_GRACE_S):
                    continue
                self.tasks[a.host] = asyncio.ensure_future(self._start_daemon(self.inventory.host(a.host)))

    async def _start_daemon(self, host: Host) -> None:
        try:
            self.phase = Phase.SHIPPING if self.phase in (Phase.CONNECTING, Phase.PROBING) else self.phase
            t = await self.fleet.transport(host)
            paths = self.paths.get(host.name) or await hostops.host_paths(t, self.inventory.job.name)
            self.paths[host.name] = paths
            running = await hostops.daemon_pid(t, paths)
            if running is not None:
                log.info("Host %s: its daemon (pid %d) runs already; waiting for its state.", host.name, running)
                self.started_at[host.name] = self.clock()
                return
            if self._runtime_files is None:
                self._runtime_files = hostops.runtime_files()
            runtime_dir, sent = await hostops.ensure_runtime(t, paths, self._runtime_files)
            if sent:
                log.info("Host %s: shipped the runtime to %s.", host.name, runtime_dir)
            if not self.inventory.job.shared_filesystem:
                synced = await hostops.sync_code(t, self.inventory.job.workdir, paths.code_dir)
                if synced.sent or synced.deleted:
                    log.info("Host %s: code synced (%d sent, %d deleted).", host.name, len(synced.sent),
                             len(synced.deleted))
            config = hostops.daemon_config(self.inventory, host, paths, self.store_endpoint, self._gpus_of(host))
            pid = await hostops.start_daemon(t, paths, runtime_dir, config)
            self.started_at[host.name] = self.clock()
            log.info("Host %s: daemon started (pid %s).", host.name, pid)
            if self.phase == Phase.SHIPPING:
                self.phase = Phase.STARTING
        except HostError as exc:
            log.warning("Host %s: could not start its daemon: %s", host.name, exc)
            await self._give_up(host.name, exc.message)
            await self.fleet.forget(host.name)
            self.paths.pop(host.name, None)
        except Exception:  # noqa: BLE001 - one host's bug must not end the controller
            log.exception("Host %s: starting its daemon failed.", host.name)
        finally:
            self.tasks.pop(host.name, None)

    def _gpus_of(self, host: Host) -> tuple[int, ...] | None:
        if host.gpus is not None:
            return host.gpus
        report = self.reports.get(host.name)
        if report is not None and report.state is HostState.OK:
            return tuple(sorted(g.gpu.index for g in report.gpus))
        return None

    def _update_phase(self, views: dict[str, pol.HostView], decision: pol.Decision) -> None:
        rs = self.runtime_status or {}
        running = sum(len(v.workers) for v in views.values())
        fresh = rs and self.clock() - float(rs.get("time", 0)) < max(30.0, 3 * self.inventory.policy.hang_timeout)
        if fresh and int(rs.get("world_size", 0)) > 0 and running:
            self.phase, self.message = Phase.TRAINING, ""
        elif decision.waiting and not running:
            self.phase, self.message = Phase.WAITING, decision.message
        elif decision.message and not running and not any(
                self.records.get(h.name, pol.HostRecord()).desired for h in self.inventory.hosts):
            self.phase, self.message = Phase.STARTING, decision.message
        elif self.tasks:
            self.phase = Phase.SHIPPING if self.phase in (Phase.CONNECTING, Phase.PROBING) else self.phase
        elif any(self.records.get(h.name, pol.HostRecord()).desired for h in self.inventory.hosts):
            self.phase = Phase.STARTING
            self.message = "waiting for the first step" if running else "starting workers"

    # ----------------------------------------------------------------- the loop

    async def run(self) -> None:
        self.phase = Phase.PROBING
        self.maybe_probe(self.clock(), force=True)
        while not self.stopped.is_set():
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - keep reconciling; the log says what broke
                log.exception("A reconcile pass failed.")
            now = self.clock()
            if now - self._status_written >= STATUS_EVERY_S:
                self.write_status()
            try:
                await asyncio.wait_for(self.stopped.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass

    async def _event(self, kind: str, host: str | None, detail: str, **extra: Any) -> None:
        ev = {"time": self.clock(), "kind": kind, "host": host, "workers": [], "pause_s": None,
              "detail": detail, **extra}
        try:
            await self.store.event(ev)
        except Exception:  # noqa: BLE001 - events are advisory
            self.events.append(ev)

    # ----------------------------------------------------------------- requests

    def reload_inventory(self, inventory: Inventory) -> None:
        """Apply an edited inventory. The Fleet learns the new host list too (the probe
        and `down` go over `fleet.hosts`); a host removed or moved loses its connection."""
        old = {h.name: h for h in self.inventory.hosts}
        self.inventory = inventory
        self.fleet.hosts = tuple(inventory.hosts)
        for name, host in old.items():
            if host != next((h for h in inventory.hosts if h.name == name), None):
                self.paths.pop(name, None)
                asyncio.ensure_future(self.fleet.forget(name))

    async def checkpoint_place(self, name: str) -> mir.Place:
        """A host's checkpoint directory over the controller's connection (the mirror's source)."""
        return await mir.host_place(await self.fleet.transport(self.inventory.host(name)), self.inventory.job.name)

    async def scale(self, add: list[str], remove: list[str], force: bool) -> dict:
        names = {h.name for h in self.inventory.hosts}
        results = []
        for name in add + remove:
            if name not in names:
                results.append({"host": name, "ok": False,
                                "message": f"no host {name!r} in the inventory (hosts: {', '.join(sorted(names))})"})
        for name in remove:
            if name not in names:
                continue
            rec = self.records.get(name, pol.HostRecord())
            self.records[name] = replace(rec, removed=True, join_now=False, force=False)
            await self._event("remove", name, "removed by eltctl scale --remove")
            results.append({"host": name, "ok": True,
                            "message": f"removed; its workers leave at the next step boundary"})
        probe_targets = [self.inventory.host(n) for n in add if n in names]
        reports = {}
        if probe_targets:
            for r in await probe_fleet(self.fleet, job=self.inventory.job.name, policy=self.inventory.policy,
                                       hosts=probe_targets):
                reports[r.name] = r
                self.reports[r.name] = r
                if r.state is HostState.UNREACHABLE:
                    await self.fleet.forget(r.name)
        for host in probe_targets:
            r = reports[host.name]
            rec = self.records.get(host.name, pol.HostRecord())
            usable = r.state is HostState.CPU_ONLY or bool(r.gpus_in(GpuState.FREE)) or bool(r.gpus_in(GpuState.OURS))
            if r.state is HostState.UNREACHABLE:
                results.append({"host": host.name, "ok": False, "message": f"unreachable: {r.reason}"})
                continue
            if not usable and not force:
                why = "; ".join(f"GPU {g.gpu.index}: {g.reason}" for g in r.gpus) or r.reason
                results.append({"host": host.name, "ok": False,
                                "message": f"refused: no free GPU ({why}); --force adds it anyway"})
                continue
            self.records[host.name] = replace(rec, removed=False, join_now=True, force=force,
                                              benched_until=0.0 if force else rec.benched_until,
                                              failures=0)
            await self._event("add", host.name, "added by eltctl scale --add" + (" --force" if force else ""))
            results.append({"host": host.name, "ok": True, "message": "added; its free GPUs join now"})
        self.save_records()
        await self.reconcile()
        self.write_status()
        return {"ok": all(r["ok"] for r in results), "results": results}

    async def down(self, force: bool, progress: Callable[[str], None] | None = None) -> dict:
        """The final checkpoint, then every worker and daemon stops (or is killed with force)."""
        self.stopping = True
        self.phase, self.message = Phase.STOPPING, "final checkpoint"
        self.write_status()
        store_ok = True
        try:
            await self.store.set_raw("stop", str(self.clock()))
            for host in self.inventory.hosts:
                rec = self.records.get(host.name, pol.HostRecord())
                seq = rec.seq + 1
                await self.store.set_json(f"daemon/{host.name}/desired",
                                          {"seq": seq, "slots": list(rec.desired), "stop": True})
                self.records[host.name] = replace(rec, seq=seq, desired=())
        except Exception as exc:  # noqa: BLE001 - no store: stop the daemons by signal instead
            log.warning("The store is unreachable (%s): stopping the daemons by signal.", exc)
            store_ok = False
        self.save_records()
        deadline = time.monotonic() + DOWN_TIMEOUT_S + self.inventory.policy.hang_timeout
        left: dict[str, list[hostops.JobProcess]] = {}
        signalled = False
        while True:
            left = await self.leftovers()
            if not any(left.values()) or time.monotonic() > deadline:
                break
            if not store_ok and not signalled:
                await self._signal_daemons(left)
                signalled = True
            self.message = "waiting for " + ", ".join(f"{h} ({len(p)} process(es))" for h, p in left.items() if p)
            self.write_status()
            await asyncio.sleep(1.0)
        killed = {}
        if any(left.values()) and force:
            killed = await self._kill(left)
            left = await self.leftovers()
        checkpoint = None
        try:
            await self.observe_store()
            ck = (self.runtime_status or {}).get("checkpoint")
            if isinstance(ck, dict):
                checkpoint = {"step": ck.get("step"), "path": ck.get("path"), "time": ck.get("time")}
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
        mirrored = await self._mirror_final(checkpoint)
        remaining = {h: [p.pid for p in ps] for h, ps in left.items() if ps}
        ok = not remaining
        if ok:
            msg = "every worker and daemon stopped"
        else:
            msg = "still running: " + "; ".join(f"{h}: pids {', '.join(map(str, p))}" for h, p in remaining.items())
            if not force:
                msg += " (eltctl down --force kills them)"
        self.phase = Phase.STOPPED if ok else Phase.STOPPING
        self.message = msg
        self.write_status()
        return {"ok": ok, "checkpoint": checkpoint, "message": msg, "left": remaining,
                "killed": {h: p for h, p in killed.items() if p}, "mirror": mirrored}

    async def _mirror_final(self, checkpoint: dict | None) -> dict | None:
        """`down`: the final checkpoint onto the mirror, verified, before the answer."""
        worker = self.mirror_worker
        if worker is None:
            return None
        if checkpoint and isinstance(checkpoint.get("step"), int):
            host = mir.checkpoint_host(str(checkpoint.get("path") or ""), self.inventory.job.name)
            if host is not None:
                worker.notify(host, checkpoint["step"])
        self.message = "mirroring the final checkpoint"
        self.write_status()
        try:
            ok = await worker.flush(timeout=MIRROR_FLUSH_S)
            result = {"ok": ok, **worker.status()}
            await worker.stop()
        except Exception as exc:  # noqa: BLE001 - `down` answers whatever the mirror does
            log.exception("Mirroring the final checkpoint failed.")
            result = {**worker.status(), "ok": False, "last_error": f"mirror worker failed: {exc}"}
        self.mirror_worker = None  # stopped: the status document shows it no more
        self._final_mirror = result
        return result

    async def leftovers(self) -> dict[str, list[hostops.JobProcess]]:
        """This job's processes on every host (an unreachable host: an empty list and a log line)."""
        async def one(host: Host, t) -> list[hostops.JobProcess]:
            return await hostops.job_processes(t, self.inventory.job.name)

        outcomes = await self.fleet.each(None, one, timeout=60)
        out = {}
        for name, o in outcomes.items():
            if o.error is not None:
                log.warning("Host %s: cannot list the job's processes: %s", name, o.error)
                await self.fleet.forget(name)
                out[name] = []
            else:
                out[name] = o.value or []
        return out

    async def _signal_daemons(self, left: dict[str, list[hostops.JobProcess]]) -> None:
        async def one(host: Host, t) -> None:
            pids = [p.pid for p in left.get(host.name, []) if hostops.DAEMON_MODULE in p.command]
            await hostops.kill_pids(t, pids, "TERM")

        await self.fleet.each(None, one, timeout=30)

    async def _kill(self, left: dict[str, list[hostops.JobProcess]]) -> dict[str, list[int]]:
        async def one(host: Host, t) -> list[int]:
            pids = [p.pid for p in left.get(host.name, [])]
            await hostops.kill_pids(t, pids, "TERM")
            await asyncio.sleep(2.0)
            still = {p.pid for p in await hostops.job_processes(t, self.inventory.job.name)}
            await hostops.kill_pids(t, [p for p in pids if p in still], "KILL")
            return pids

        outcomes = await self.fleet.each(None, one, timeout=60)
        return {n: (o.value or []) for n, o in outcomes.items()}

    # ----------------------------------------------------------------- status

    def status_document(self) -> dict:
        now = self.clock()
        rs = self.runtime_status or {}
        job = self.inventory.job
        phase = self.phase
        state = {Phase.TRAINING: "training", Phase.WAITING: "waiting", Phase.STOPPING: "stopping",
                 Phase.STOPPED: "stopped"}.get(phase, "starting")
        ck = rs.get("checkpoint") if isinstance(rs.get("checkpoint"), dict) else None
        hosts = []
        for host in self.inventory.hosts:
            view = self.view(host, now)
            rec = self.records.get(host.name, pol.HostRecord())
            hstate, reason = pol.host_state(view, rec, now)
            seen = self.seen.get(host.name)
            gpus = []
            for s in view.slots:
                use = s.use.value
                if s.index in view.workers:
                    use = "ours"
                gpus.append({"index": s.index, "state": use, "reason": s.reason})
            hosts.append({
                "name": host.name, "state": hstate.value, "reason": reason, "workers": len(view.workers),
                "heartbeat_age_s": round(now - seen.changed, 2) if seen is not None else None,
                "benched_until": rec.benched_until if rec.benched_until > now else None,
                "cooldown_until": rec.cooldown_until if rec.cooldown_until > now else None,
                "failures": rec.failures, "desired": list(rec.desired), "gpus": gpus,
            })
        return {
            "job": job.name, "state": state, "phase": phase, "message": self.message, "updated": now,
            "generation": rs.get("generation"), "world_size": int(rs.get("world_size") or 0),
            "members": rs.get("members", []),
            "min_workers": job.min_workers, "max_workers": job.max_workers,
            "step": rs.get("step"), "epoch": rs.get("epoch"), "samples_per_s": rs.get("samples_per_s"),
            "loss": rs.get("loss"),
            "checkpoint": ({"step": ck.get("step"), "time": ck.get("time"), "path": ck.get("path"),
                            "age_s": round(now - float(ck["time"]), 1) if ck.get("time") else None}
                           if ck else None),
            "runtime_status_age_s": round(now - float(rs["time"]), 2) if rs.get("time") else None,
            "controller": {"pid": os.getpid(), "alive": True},
            "store": self.store_endpoint,
            "hosts": hosts,
            "events": list(self.events)[-20:],
            "mirror": (self.mirror_worker.status() if self.mirror_worker is not None
                       else self._final_mirror),
        }

    def write_status(self) -> None:
        self._status_written = self.clock()
        try:
            write_json_atomic(self.state.status_json, self.status_document())
        except OSError as exc:
            log.warning("Cannot write %s: %s", self.state.status_json, exc)
