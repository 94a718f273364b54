"""The controller's reconcile loop: observe, decide, act, write the status.

Every pass (about every 0.5 s, `Controller.reconcile`):

1. observe (`observe.py`): each daemon's state, the job's event log and rank 0's
   status from the store; every `policy.probe_interval` an SSH probe of every host
   (in the background: a slow host never stalls the loop); views of the hosts;
2. decide (`policy.py`, pure): `track` folds the views into what is remembered of
   each host (hosts.json), `decide` says which slots each host runs;
3. act (`act.py`): store writes (`daemon/<host>/desired`) at once; SSH work (ship the
   runtime, sync the code, start a daemon) as one background task per host, so a
   failing host never blocks the others; its failure is recorded against it. A daemon
   is started with the slots (GPUs or CPU slots) the views of this pass say the host
   has (`observe.daemon_slots`); a live daemon whose slots are of the wrong kind is
   replaced (`replace_wrong_daemons`: its workers leave first). Before
   workers start while no survivor holds the job's state (the first `up`, or every
   host lost), the newest valid checkpoint is delivered to the hosts about to run
   workers, and nothing else is acted on until it is;
4. the status (`status.py`): the phase, and status.json about once a second; with each
   status.json the notifications it brings are queued on their own thread and
   `[controller] metrics_file` is rewritten (`outputs.py`).

The store keeper (`store.KeeperSupervisor`, set by `__main__`) is checked before
every pass (`watch_keeper`, keeperwatch.py): a lost keeper is restarted on the same address and
port, the controller's client swapped, the event log read from 0 again and every
host's desired document re-published; for KEEPER_GRACE_S after that (or until
every host that runs workers reports again) nothing is decided, so daemons that
were silent only because the store was away are never taken for failures. While
no keeper serves, passes are skipped.

Checkpoint mirror (`eltctl/mirror.py`, when `[storage] mirror` is set): every
committed checkpoint rank 0 reports is handed to a `MirrorWorker`, which copies it in
the background. `Controller` is driven by `controller/__main__.py` and answers the
command socket (`controller/socket.py`): `status_document`, `reconcile`, `scale`, `cordon`, `down`.

The round is a small coordinator over collaborators, each in its own module:
`keeperwatch.KeeperWatch` (the store keeper), `fairround.FairShareRound` (this job's
demand and fair share's plan), `upkeep.DaemonUpkeep` (the act step: desired slots,
daemon starts, replacements, retirements, fixes), `requests` (`scale`, `cordon`, `up`'s
checks, an edited inventory) and `ending` (`down`, `finish`).
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable

from eltctl import mirror as mir
from eltctl.controller import act, ending, fairshare, observe, requests
from eltctl.controller import policy as pol
from eltctl.controller import quotas, status
from eltctl.controller.fairround import FairShareRound
from eltctl.controller.keeperwatch import KeeperWatch
from eltctl.controller.outputs import Outputs
from eltctl.controller.statedir import StateDir
from eltctl.controller.status import Phase
from eltctl.controller.store import JobStore
from eltctl.controller.upkeep import DaemonUpkeep
from eltctl_runtime.protocol import Keys
from eltctl.inventory import Inventory
from eltctl.probe import probe_fleet, probe_timeout
from eltctl.hosts.fleet import Fleet
from eltctl_runtime.files import read_json, write_json_atomic
from eltctl_runtime.protocol import EventKind, event_document

log = logging.getLogger("eltctl.controller")

TICK_S = 0.5
STATUS_EVERY_S = 1.0


def probe_hosts(inventory: Inventory, fleet: Fleet, published: dict) -> Awaitable[list]:
    """A probe of the inventory's enabled hosts that publishes this job's demand entries
    (`published`: host -> Demand) there."""
    return probe_fleet(fleet, job=inventory.job.name, policy=inventory.policy,
                       hosts=[h for h in inventory.hosts if h.schedule.enabled], owner=inventory.owner_policy,
                       demand=lambda host: published.get(host.name))


def early_probe(inventory: Inventory, state: StateDir, fleet: Fleet, clock: Callable[[], float] = time.time,
                ledger=None) -> "asyncio.Task[list]":
    """The controller's first probe, started before the store keeper and its client are
    up (they take seconds, more on a loaded machine): it publishes this job's demand at
    once (`fairshare.first_demand`, from hosts.json's desired slots), so the jobs sharing
    the hosts learn of a new job within a probe of its controller's start. `Controller.run`
    takes its reports as its first."""
    doc = read_json(state.hosts_json) or {}
    records: dict[str, pol.HostRecord] = {}
    for host in inventory.hosts:
        try:
            records[host.name] = pol.HostRecord.from_json((doc.get("hosts") or {})[host.name])
        except (KeyError, TypeError, ValueError, AttributeError):
            records[host.name] = pol.HostRecord()
    now = clock()
    usage = ledger.recent_gpu_hours(now, inventory.policy.usage_half_life) if ledger is not None else 0.0
    published = fairshare.first_demand(
        job=inventory.job.name, user=getpass.getuser(), priority=inventory.job.priority,
        min_workers=inventory.job.min_workers, max_workers=inventory.job.max_workers,
        desired={name: r.desired for name, r in records.items()},
        hosts=[h.name for h in inventory.hosts if h.schedule.enabled and not records[h.name].removed],
        usage_gpu_h=usage,
        every=inventory.policy.probe_interval)
    return asyncio.ensure_future(probe_hosts(inventory, fleet, published))


class Controller:
    """One job's controller. The constructor stores its arguments; `run` does the work."""

    def __init__(self, inventory: Inventory, state: StateDir, store: JobStore, fleet: Fleet,
                 store_endpoint: str, *, clock: Callable[[], float] = time.time,
                 mirror_worker: mir.MirrorWorker | None = None,
                 quota_use: quotas.QuotaProvider = quotas.no_figures, secret: bytes | None = None) -> None:
        self.inventory = inventory
        self.state = state
        self.store = store
        self.fleet = fleet
        self.store_endpoint = store_endpoint
        self.clock = clock
        self.mirror_worker = mirror_worker  # started and stopped by __main__
        self.quota_use = quota_use  # the GPU-hours used (the usage ledger's figures; none: not enforced)
        self.limits: dict[str, pol.Limit] = {}  # each host's limits at the last pass (policy.host_limits)
        self.ledger = None  # the usage ledger's recorder (eltctl/ledger), opened and closed by __main__
        self.phase = Phase.CONNECTING
        self.message = ""
        self.records: dict[str, pol.HostRecord] = {}  # what is remembered of each host (hosts.json)
        self.seq_floor = 0  # the highest desired seq ever sent to this job's hosts (hosts.json)
        self.observed = observe.Observer()
        self.starter = act.DaemonStarter(fleet, store_endpoint, clock, secret=secret)
        self.starter.config_of = self.observed.config_of = self.host_config
        self.restorer = act.Restorer(clock)
        self.decision: pol.Decision | None = None
        self.stopping = False
        self.stopped = asyncio.Event()
        self._pass = asyncio.Lock()
        self._probe_task: asyncio.Task | None = None
        self._last_probe = 0.0
        self._probed_once = asyncio.Event()
        self._status_written = 0.0
        self.final_mirror: dict | None = None  # what `down` reported, once the worker is stopped
        self.fingerprint: dict | None = None  # what a fix can change, as last seen (hosts.json)
        self._check_fix = True  # compare the fingerprint at the next pass (at start, after a reload)
        self.keeper = None  # the store keeper's store.KeeperSupervisor, set by __main__ (None: not watched)
        self.keeper_watch = KeeperWatch(self)  # its restarts and the grace after one
        self.outputs = Outputs(inventory, state)  # notifications and metrics; started by __main__
        self.share = FairShareRound(self)  # this job's demand and fair share's last plan
        self.daemons = DaemonUpkeep(self)  # the act step: desired slots, daemon starts, replacements
        self.starter.after_retired = self.daemons.old_daemon_gone
        # Once the training returned and the hosts were tidied (`finish`): what finished
        # (hosts.json `finished`: `up` starts no new run of an unchanged job). `on_end` (set
        # by __main__) ends the controller after `finish`.
        self.finished: dict | None = None
        self.on_end: Callable[[], None] | None = None

    # ----------------------------------------------------------------- the loop

    async def run(self, first_probe: "asyncio.Future[list] | None" = None) -> None:
        """`first_probe`: a probe started before the store was up (`early_probe`); its
        reports are the first ones (else the first probe starts now)."""
        self.phase = Phase.PROBING
        if first_probe is not None:
            self._last_probe = self.clock()
            self._probe_task = asyncio.ensure_future(self._take_probe(first_probe))
        else:
            self.share.published = self.share.first_demand(self.clock())
            self.maybe_probe(self.clock(), force=True)
        if self.finished is not None:  # a new run: a finished one's record goes (`up` chose to start it)
            self.finished = None
            self.save_records()
        while not self.stopped.is_set():
            try:
                if await self.watch_keeper():
                    await self.reconcile()
                if status.training_finished(self.outputs.done) and not self.stopping:
                    await self.finish()
            except Exception:  # noqa: BLE001 - keep reconciling; the log says what broke
                log.exception("A reconcile pass failed.")
            if self.clock() - self._status_written >= STATUS_EVERY_S:
                self.write_status()
            try:
                await asyncio.wait_for(self.stopped.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass

    async def reconcile(self) -> pol.Decision | None:
        """One pass: observe, decide, act. None until the first probe has answered."""
        async with self._pass:
            now = self.clock()
            await self.observe_store()
            if self._check_fix and not self.stopping:
                await self.daemons.apply_fixes(now)
                self._check_fix = False
            self.maybe_probe(now)
            if not self._probed_once.is_set() or self.observed.settling(now):
                return None
            if self.keeper_watch.grace(now):
                return None
            views = self.observed.views(self.inventory.hosts, now, self.inventory.policy)
            if status.training_finished(self.outputs.done):
                # `run` tidies up (`finish`): no slot is asked for again (a new worker would
                # find the job done and exit at once, its host left "starting" for ever)
                return None
            # what each daemon started now would get, from the same reports as the views
            # (the probe runs on in the background while this pass awaits the store)
            start_as = {h.name: self.observed.daemon_slots(h) for h in self.inventory.hosts}
            self.observed.clear_crashes()
            before = dict(self.records)
            self.records = pol.track(self.records, views, self.inventory, now)
            self.records = pol.track_stragglers(self.records, self.observed.runtime_status, self.inventory, now)
            await self._announce_benched(before, now)
            if not self.stopping:  # giving up writes a withdrawn (stop=False) desired over `down`'s stop
                for name in self.starter.overdue(views, now):
                    await self.daemons.give_up(name, "its daemon did not report (see its daemon.log)")
            if self.stopping:
                self.save_records()
                return None
            await self.daemons.replace_wrong_daemons(views, now)
            await self.daemons.retire_stale_daemons(views)
            limits = pol.host_limits(self.inventory, self.records, now, self.quota_use(now))
            await self._announce_limits(limits)
            limits, fair_cap = await self.share.apply(limits, now, {n for n, v in views.items() if pol.cpu_host(v)})
            limits = self.daemons.replacing_limits(limits)
            decision = self.decision = pol.decide(views, self.records, self.inventory, now, limits, fair_cap)
            survivor = pol.survivor_holds_state(views, self.observed.runtime_status, now,
                                                observe.runtime_fresh_for(self.inventory.policy))
            targets = [name for name, slots in decision.desired.items() if slots]
            # hosts that run no worker now may hold the newest checkpoint (the last worker left
            # one for its owner): candidates too, while they answer
            others = [n for n, v in views.items() if n not in targets and v.reach in (
                pol.Reach.OK, pol.Reach.CPU_ONLY, pol.Reach.UNHEALTHY)]
            if not self.restorer.ready(survivor, targets, lambda names: self._restore(names, others)):
                self.phase = Phase.STARTING
                self.message = "looking on the hosts for a checkpoint to start from (if there is none: step 0)"
            else:
                await self.daemons.act(decision, now, start_as)
                self.phase, self.message = status.next_phase(
                    self.phase, self.message, now=self.clock(), inventory=self.inventory,
                    runtime_status=self.observed.runtime_status, views=views, records=self.records,
                    decision=decision, starting_daemons=self.starter.busy, limits=limits)
                if decision.paused:
                    self.phase, self.message = Phase.PAUSED, decision.paused
            if self.records != before:
                self.save_records()
            return decision

    # ----------------------------------------------------------------- the job's end (ending.py)

    async def finish(self) -> None:
        await ending.finish(self)

    async def down(self, force: bool, progress: Callable[[str], None] | None = None, why: str = "") -> dict:
        return await ending.down(self, force, progress, why)

    # ----------------------------------------------------------------- the store keeper (keeperwatch.py)

    async def watch_keeper(self) -> bool:
        """False while no keeper serves (the pass is skipped); a lost one is restarted."""
        return await self.keeper_watch.watch()

    async def store_restarted(self) -> None:
        await self.keeper_watch.restarted()

    # ----------------------------------------------------------------- observe

    async def observe_store(self) -> None:
        now = self.clock()
        await self.observed.read_store(self.store, [h.name for h in self.inventory.hosts], now)
        await self.outputs.observe(self.store, self.observed.events)
        known = self.observed.checkpoint
        self.observed.checkpoint = observe.newest_checkpoint(known, self.observed.runtime_status, now,
                                                             self.inventory.job.name)
        if self.observed.checkpoint is not known:
            self.save_records()  # hosts.json keeps it: a controller started later shows it too
        if self.ledger is not None:
            self.ledger.record(now, self.inventory, self.observed, self.records, self.limits)
        if self.mirror_worker is not None:
            hit = observe.checkpoint_to_mirror(
                self.observed.runtime_status, now, self.inventory.policy, self.restorer.restored_at,
                self.inventory.job.name, (h.name for h in self.inventory.hosts))
            if hit is not None:
                self.mirror_worker.notify(*hit)

    def maybe_probe(self, now: float, force: bool = False) -> None:
        busy = self._probe_task is not None and not self._probe_task.done()
        if busy or (not force and now - self._last_probe < self.inventory.policy.probe_interval):
            return
        self._last_probe = now
        self._probe_task = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        await self._take_probe(probe_hosts(self.inventory, self.fleet, self.share.to_publish()))

    async def _take_probe(self, probing: Awaitable[list]) -> None:
        try:
            reports = await probing
        except Exception:  # noqa: BLE001 - a probe bug must not end the controller
            log.exception("The probe failed.")
            return
        for name in self.observed.take_reports(reports):
            # The Fleet remembers a failed connection; a long-lived controller retries.
            await self.fleet.forget(name)
            self.starter.forget(name)
        self._probed_once.set()

    async def publish_withdrawn(self) -> None:
        """`down` (and a finished job's end): once nothing of the job runs, one probe
        publishes its withdrawn demand (`to_publish`) at once, before the controller ends."""
        busy = self._probe_task
        if busy is not None and not busy.done():  # a probe started before: ours writes after it
            await asyncio.wait([busy], timeout=probe_timeout(self.inventory.policy))
        try:
            await asyncio.wait_for(self._take_probe(probe_hosts(self.inventory, self.fleet, self.share.to_publish())),
                                   probe_timeout(self.inventory.policy) + 10)
        except Exception as exc:  # noqa: BLE001 - the entry goes stale by itself within a minute or two
            log.warning("Could not publish the job's withdrawn fair-share demand: %s", exc)

    # ----------------------------------------------------------------- fair share (fairround.py)

    @property
    def fair(self) -> fairshare.Plan:
        return self.share.plan

    @property
    def fair_me(self):
        return self.share.me

    @property
    def _published(self) -> dict:
        return self.share.published

    def to_publish(self) -> dict:
        return self.share.to_publish()

    async def fair_share(self, limits: dict[str, pol.Limit], now: float,
                         cpu_hosts: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, pol.Limit], int | None]:
        return await self.share.apply(limits, now, cpu_hosts)

    # ----------------------------------------------------------------- act (upkeep.py)

    @property
    def replacing(self) -> dict[str, str]:
        """host -> why its running daemon is replaced (DaemonUpkeep.replace_wrong_daemons)"""
        return self.daemons.replacing

    async def apply_fixes(self, now: float) -> list[str]:
        return await self.daemons.apply_fixes(now)

    def host_config(self, name: str) -> str:
        """The host's digest of the job's code, settings and entry as last seen (pol.host_config)."""
        return pol.host_config(self.fingerprint, name)

    def _shipping(self) -> None:
        self.phase = Phase.SHIPPING if self.phase in (Phase.CONNECTING, Phase.PROBING) else self.phase

    def _daemon_started(self) -> None:
        if self.phase == Phase.SHIPPING:
            self.phase = Phase.STARTING

    async def _restore(self, names: list[str], others: list[str]) -> None:
        told = await act.restore(self.fleet, self.inventory, names, self.mirror_worker, self._event,
                                 others=others, known=self.observed.checkpoint)
        try:  # a worker that started while the job's last members paused it waits for this
            await self.store.set_json(Keys.RESTORED, told)
        except Exception as exc:  # noqa: BLE001 - advisory; the worker stops waiting after RESTORE_WAIT_S
            log.warning("Restore: could not tell the workers: %s", exc)

    # ----------------------------------------------------------------- events

    async def _announce_benched(self, before: dict[str, pol.HostRecord], now: float) -> None:
        for name, rec in self.records.items():
            if rec.benched_until > now and before.get(name, pol.HostRecord()).benched_until <= now:
                log.warning("Host %s is benched until %s: %s.", name, time.ctime(rec.benched_until),
                            rec.last_problem)
                await self._event(EventKind.BENCH, name, rec.last_problem)

    async def _announce_limits(self, limits: dict[str, pol.Limit]) -> None:
        """An event when a host enters or leaves a limit's phase (off-hours: `window`,
        quota: `quota`; a cordon's events are the command's), and when the job pauses."""
        before, self.limits = self.limits, limits
        kinds = {pol.HostPhase.OFF_HOURS: EventKind.WINDOW, pol.HostPhase.QUOTA: EventKind.QUOTA}
        for name, lim in limits.items():
            old = before.get(name, pol.NO_LIMIT)
            if lim.phase == old.phase:
                continue
            if lim.phase in kinds:
                log.info("Host %s: %s.", name, lim.reason)
                await self._event(kinds[lim.phase], name, lim.reason, state=lim.phase.value)
            elif old.phase in kinds and before:
                what = "a working-hours window opened" if old.phase is pol.HostPhase.OFF_HOURS else "its quota lifted"
                log.info("Host %s: %s.", name, what)
                await self._event(kinds[old.phase], name, what, state="open")

    async def _event(self, kind: EventKind, host: str | None, detail: str, **extra: Any) -> None:
        ev = event_document(kind, host=host, detail=detail, time=self.clock(), **extra)
        try:
            await self.store.event(ev)
        except Exception:  # noqa: BLE001 - events are advisory
            self.observed.events.append(ev)

    # ----------------------------------------------------------------- memory

    def load_records(self) -> None:
        doc = read_json(self.state.hosts_json) or {}
        for name, d in (doc.get("hosts") or {}).items():
            try:
                self.records[name] = pol.HostRecord.from_json(d)
            except (TypeError, ValueError):
                log.warning("Ignoring the unreadable memory of host %s in %s.", name, self.state.hosts_json)
        # Desired documents only move forward (a daemon ignores an older seq: a replay), so
        # the seq counter outlives a run: a host without a record, or whose record was
        # dropped, continues above the highest seq this job's hosts were ever sent.
        self.seq_floor = max([int(doc.get("desired_seq", 0) or 0)] + [r.seq for r in self.records.values()])
        for host in self.inventory.hosts:
            rec = self.records.get(host.name, pol.HostRecord())
            if rec.seq < self.seq_floor:
                self.records[host.name] = replace(rec, seq=self.seq_floor)
        self.observed.events_read = int(doc.get("events_read", 0))
        ck = doc.get("checkpoint")
        self.observed.checkpoint = ck if isinstance(ck, dict) and isinstance(ck.get("step"), int) else None
        fp = doc.get("fingerprint")
        self.fingerprint = fp if isinstance(fp, dict) else None
        fin = doc.get("finished")
        self.finished = fin if isinstance(fin, dict) else None

    def save_records(self) -> None:
        write_json_atomic(self.state.hosts_json, {
            "hosts": {name: r.to_json() for name, r in self.records.items()},
            "desired_seq": max([self.seq_floor] + [r.seq for r in self.records.values()]),
            "events_read": self.observed.events_read, "fingerprint": self.fingerprint,
            "checkpoint": self.observed.checkpoint, "finished": self.finished})

    async def adopt_desired(self) -> None:
        """Seed the memory from the store's desired keys: a controller that lost
        hosts.json still continues exactly what the daemons were told."""
        for host in self.inventory.hosts:
            rec = self.records.get(host.name, pol.HostRecord())
            new = observe.adopted(rec, await act.read_desired(self.store, host.name))
            if new is not rec:
                self.records[host.name] = new

    # ----------------------------------------------------------------- requests (requests.py)

    def reload_inventory(self, inventory: Inventory) -> None:
        requests.reload_inventory(self, inventory)

    def reread_inventory(self) -> str | None:
        return requests.reread_inventory(self)

    async def retry_failed(self) -> None:
        await requests.retry_failed(self)

    async def leave_out(self, left_out: dict[str, str]) -> None:
        await requests.leave_out(self, left_out)

    async def scale(self, add: list[str], remove: list[str], force: bool) -> dict:
        return await requests.scale(self, add, remove, force)

    async def cordon(self, names: list[str], on: bool) -> dict:
        return await requests.cordon(self, names, on)

    async def checkpoint_place(self, name: str) -> mir.Place:
        """A host's checkpoint directory over the controller's connection (the mirror's source).
        A host no longer in the inventory is a source gone (its notice is dropped, not retried)."""
        try:
            host = self.inventory.host(name)
        except KeyError:
            raise mir.MirrorError(f"host {name} is no longer in the inventory", source_gone=True) from None
        return await mir.host_place(await self.fleet.transport(host), self.inventory.job.name)

    # ----------------------------------------------------------------- status

    def status_document(self) -> dict:
        now = self.clock()
        doc = status.status_document(
            now=now, inventory=self.inventory, phase=self.phase, message=self.message,
            runtime_status=self.observed.runtime_status,
            views=self.observed.views(self.inventory.hosts, now, self.inventory.policy),
            records=self.records, seen=self.observed.seen, events=self.observed.events,
            checkpoint=self.observed.checkpoint,
            store_endpoint=self.store_endpoint,
            mirror=self.mirror_worker.status() if self.mirror_worker is not None else self.final_mirror,
            limits=pol.host_limits(self.inventory, self.records, now, self.quota_use(now)),
            forged=status.forged_summary(self.store_forgeries(), self.observed.seen, self.observed.runtime_status,
                                         self.observed.events_skipped),
            keeper=self.keeper_watch.status(),
            starts_at=(self.decision.starts_at if self.decision is not None and self.phase == Phase.STARTING
                       else None),
            # before `extend`: what the outputs derive from the document (metrics) sees it
            fairshare=fairshare.plan_to_json(self.share.plan, self.share.me))
        return self.outputs.extend(doc)

    def store_forgeries(self) -> dict[str, int]:
        """The forged values the controller's own store client read, per key family."""
        counts = getattr(self.store, "forgeries", None)
        return counts.counts() if counts is not None else {}

    def write_status(self) -> None:
        self._status_written = self.clock()
        doc = self.status_document()
        status.write_status(self.state.status_json, doc)
        self.outputs.published(doc, self._status_written)


__all__ = ["Controller", "Phase"]
