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
every pass (`watch_keeper`): a lost keeper is restarted on the same address and
port, the controller's client swapped, the event log read from 0 again and every
host's desired document re-published; for KEEPER_GRACE_S after that (or until
every host that runs workers reports again) nothing is decided, so daemons that
were silent only because the store was away are never taken for failures. While
no keeper serves, passes are skipped.

Checkpoint mirror (`eltctl/mirror.py`, when `[storage] mirror` is set): every
committed checkpoint rank 0 reports is handed to a `MirrorWorker`, which copies it in
the background. `Controller` is driven by `controller/__main__.py` and answers the
command socket (`controller/socket.py`): `status_document`, `reconcile`, `scale`, `cordon`, `down`.
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable

from eltctl import mirror as mir
from eltctl.controller import act, observe
from eltctl.controller import policy as pol
from eltctl.controller import quotas, status
from eltctl.controller.outputs import Outputs
from eltctl.controller.statedir import StateDir
from eltctl.controller.status import Phase
from eltctl.controller import store as kstore
from eltctl.controller.store import JobStore
from eltctl_runtime.protocol import Keys, desired_key
from eltctl.inventory import Inventory
from eltctl.controller import fairshare
from eltctl.demand import Demand
from eltctl.probe import probe_fleet, probe_timeout
from eltctl.hosts.fleet import Fleet
from eltctl.hosts import ops as hostops
from eltctl_runtime.files import read_json, write_json_atomic
from eltctl_runtime.protocol import EventKind, event_document

log = logging.getLogger("eltctl.controller")

TICK_S = 0.5
# After a keeper restart: the daemons reconnect (their back-off is at most 10 s)
# before anything is decided on what they report.
KEEPER_GRACE_S = 20.0
KEEPER_RETRY_S = 3.0  # a keeper that cannot be restarted (its port taken) is tried again this often
STATUS_EVERY_S = 1.0
DOWN_TIMEOUT_S = 90.0
# After the training returned: how long its last workers may take to exit (they do in about
# 0.3 s) before every daemon is stopped anyway (`down` then waits for what is left).
FINISH_WAIT_S = 30.0


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
        self.starter.after_retired = self._old_daemon_gone
        self.restorer = act.Restorer(clock)
        self.decision: pol.Decision | None = None
        self.stopping = False
        self.stopped = asyncio.Event()
        self._pass = asyncio.Lock()
        self._probe_task: asyncio.Task | None = None
        self._last_probe = 0.0
        self._probed_once = asyncio.Event()
        self._status_written = 0.0
        self._final_mirror: dict | None = None  # what `down` reported, once the worker is stopped
        self.fingerprint: dict | None = None  # what a fix can change, as last seen (hosts.json)
        self._check_fix = True  # compare the fingerprint at the next pass (at start, after a reload)
        self.keeper = None  # the store keeper's store.KeeperSupervisor, set by __main__ (None: not watched)
        self._keeper_grace_until = 0.0  # controller clock: nothing is decided before (a keeper restart)
        self._keeper_restarted_at = 0.0
        self._keeper_next_try = 0.0  # monotonic: the next restart attempt of a keeper that could not be
        self._keeper_down_logged = False
        self.outputs = Outputs(inventory, state)  # notifications and metrics; started by __main__
        self.fair = fairshare.Plan()  # fair share's last plan (controller/fairshare.py)
        self.fair_me = None  # this job's demand as last published (eltctl/demand.py Demand)
        self._published: dict = {}  # host -> this job's demand entry to publish there at the next probe
        self._usage: tuple[float, float] = (-1e18, 0.0)  # (when, recent GPU-hours) from the ledger
        self._released_at = -1e18  # when fair share last released GPUs
        self._start_waits: set[str] = set()  # hosts whose daemon start waits for a probe that tells their slots
        self.replacing: dict[str, str] = {}  # host -> why its running daemon is replaced (replace_wrong_daemons)
        self._replaced_at: dict[str, float] = {}  # host -> when its daemon was last found wrong
        self._retired_at: dict[str, float] = {}  # host -> when its old daemon was asked to exit (_retire)
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
            self._published = self.first_demand(self.clock())
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
                await self.apply_fixes(now)
                self._check_fix = False
            self.maybe_probe(now)
            if not self._probed_once.is_set() or self.observed.settling(now):
                return None
            if self._keeper_grace(now):
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
                    await self._give_up(name, "its daemon did not report (see its daemon.log)")
            if self.stopping:
                self.save_records()
                return None
            await self.replace_wrong_daemons(views, now)
            await self.retire_stale_daemons(views)
            limits = pol.host_limits(self.inventory, self.records, now, self.quota_use(now))
            await self._announce_limits(limits)
            limits, fair_cap = await self.fair_share(limits, now, {n for n, v in views.items() if pol.cpu_host(v)})
            limits = self._replacing_limits(limits)
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
                await self.act(decision, now, start_as)
                self.phase, self.message = status.next_phase(
                    self.phase, self.message, now=self.clock(), inventory=self.inventory,
                    runtime_status=self.observed.runtime_status, views=views, records=self.records,
                    decision=decision, starting_daemons=self.starter.busy, limits=limits)
                if decision.paused:
                    self.phase, self.message = Phase.PAUSED, decision.paused
            if self.records != before:
                self.save_records()
            return decision

    # ----------------------------------------------------------------- the job's end

    async def finish(self) -> None:
        """The training returned: its last workers' exit is awaited (FINISH_WAIT_S), then
        every daemon stops as for `down` (the final checkpoint mirrored), the end is
        remembered (hosts.json `finished`, with the job's fingerprint) and the controller
        ends (`on_end`). status.json keeps the phase `finished`."""
        step = (self.outputs.done or {}).get("step")
        log.info("The training finished at step %s.", step)
        deadline = time.monotonic() + FINISH_WAIT_S
        while time.monotonic() < deadline:
            views = self.observed.views(self.inventory.hosts, self.clock(), self.inventory.policy)
            if not any(v.workers for v in views.values()):
                break
            await asyncio.sleep(0.5)
            await self.observe_store()
        result = await self.down(force=False, why=f"the training finished at step {step}; stopping the daemons: ")
        fp = self.fingerprint or {}
        self.finished = {"step": step, "at": self.clock(), "code": fp.get("code"), "job": fp.get("job")}
        self.save_records()
        self.phase = Phase.FINISHED
        self.message = status.finished_message(step, result)
        self.write_status()
        log.info("The job finished at step %s: %s; the controller exits.", step, result["message"])
        if self.on_end is not None:
            self.on_end()

    # ----------------------------------------------------------------- the store keeper

    async def watch_keeper(self) -> bool:
        """Check the store keeper; restart a lost one on the same address and port.
        Returns False while no keeper serves (the pass is skipped)."""
        sup = self.keeper
        if sup is None:
            return True
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, sup.check):
            await self._report_attack(sup)
            return True
        if time.monotonic() < self._keeper_next_try:
            return False
        self._keeper_next_try = time.monotonic() + KEEPER_RETRY_S
        old = sup.info
        if not self._keeper_down_logged:
            log.warning("The store keeper %d on %s is gone: starting a new one on the same address and port; "
                        "the workers train on meanwhile.", old.pid, old.endpoint)
            self._keeper_down_logged = True
        try:
            info = await loop.run_in_executor(None, sup.restart)
            client = await loop.run_in_executor(None, kstore.connect_client, info.endpoint, self.inventory.job.name)
        except Exception as exc:  # noqa: BLE001 - tried again in KEEPER_RETRY_S
            self.message = f"the store keeper is down: {sup.problem or exc}"
            log.error("The store keeper cannot be restarted (retrying in %.0f s): %s", KEEPER_RETRY_S,
                      sup.problem or exc)
            return False
        self._keeper_down_logged = False
        async with self._pass:  # not between a pass's reading and acting
            self.store.swap(client)
            if info.endpoint != old.endpoint and not callable(self.starter.store_endpoint):
                # direct mode: a new port; the running daemons and workers read it from the hosts'
                # store.address (the keeper writes it there) when they reconnect
                self.store_endpoint = self.starter.store_endpoint = info.endpoint
                log.warning("The store moved from %s to %s (another process holds the old port); the hosts "
                            "find the new address beside their run id when they reconnect.", old.endpoint,
                            info.endpoint)
            await self.store_restarted()
        log.warning("Restarted the store keeper on %s (pid %d, restart %d); the desired slots were written "
                    "again.", info.endpoint, info.pid, sup.restarts)
        await self._event(EventKind.STORE, None, f"the store keeper was restarted on {info.endpoint} (pid "
                          f"{info.pid})", restarts=sup.restarts)
        return True

    async def _report_attack(self, sup) -> None:
        """The keeper's store refused requests (storestats.json): an event and a log line,
        once a minute at most while the count grows. The keeper is not restarted for it."""
        attack = sup.attack()
        refused = int(sup.stats().get("refused") or 0)
        said_count, said_at = getattr(self, "_attack_said", (0, 0.0))
        if attack is None or refused <= said_count or self.clock() - said_at < 60:
            return
        self._attack_said = (refused, self.clock())
        log.warning("Store keeper %d: %s.", sup.info.pid, attack)
        await self._event(EventKind.STORE, None, attack, refused=refused)

    async def store_restarted(self) -> None:
        """The store is a new, empty one on the old port: read its event log from 0,
        write every host's desired document again, and decide nothing until the
        daemons report (`_keeper_grace`)."""
        self.observed.store_restarted()
        self._keeper_restarted_at = self.clock()
        self._keeper_grace_until = self._keeper_restarted_at + KEEPER_GRACE_S
        await act.republish_desired(self.store, self.records, self.inventory.hosts, self.stopping)
        self.save_records()

    def _keeper_grace(self, now: float) -> bool:
        """After a keeper restart, until KEEPER_GRACE_S passed or every host that runs
        workers has its daemon reporting again: nothing is decided."""
        if now >= self._keeper_grace_until:
            return False
        seen = self.observed.seen
        waiting = [name for name, rec in self.records.items() if rec.desired
                   and (name not in seen or seen[name].changed < self._keeper_restarted_at)]
        if not waiting:
            self._keeper_grace_until = 0.0
            return False
        self.message = f"the store keeper was restarted; waiting for {', '.join(sorted(waiting))} to reconnect"
        return True

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
        await self._take_probe(probe_hosts(self.inventory, self.fleet, self.to_publish()))

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

    # ----------------------------------------------------------------- fair share

    def first_demand(self, now: float) -> dict:
        """The demand entries the first probe publishes (fairshare.first_demand): the jobs
        sharing the hosts learn of this one at its first probe, not its second."""
        inv = self.inventory
        if self.ledger is not None:
            self._usage = (now, self.ledger.recent_gpu_hours(now, inv.policy.usage_half_life))
        return fairshare.first_demand(
            job=inv.job.name, user=getpass.getuser(), priority=inv.job.priority, min_workers=inv.job.min_workers,
            max_workers=inv.job.max_workers,
            desired={h.name: self.records.get(h.name, pol.HostRecord()).desired for h in inv.hosts},
            hosts=[h.name for h in inv.hosts if h.schedule.enabled
                   and not self.records.get(h.name, pol.HostRecord()).removed],
            usage_gpu_h=self._usage[1], every=inv.policy.probe_interval)

    def to_publish(self) -> dict:
        """This job's demand entries for the next probe (host -> Demand): the last measured
        ones; held 0 and wanted 0 once the training finished or `down` began
        (`fairshare.withdrawn`): its last entry would say it holds its GPUs, to the jobs
        sharing its hosts and to `eltctl lab`, until it went stale (issue 50)."""
        if not (self.stopping or status.training_finished(self.outputs.done)):
            return self._published
        inv = self.inventory
        me = self.fair_me or Demand(job=inv.job.name, user=getpass.getuser(), priority=inv.job.priority,
                                    min_workers=inv.job.min_workers, every=inv.policy.probe_interval)
        return fairshare.withdrawn(me, [h.name for h in inv.hosts if h.schedule.enabled])

    async def publish_withdrawn(self) -> None:
        """`down` (and a finished job's end): once nothing of the job runs, one probe
        publishes its withdrawn demand (`to_publish`) at once, before the controller ends."""
        busy = self._probe_task
        if busy is not None and not busy.done():  # a probe started before: ours writes after it
            await asyncio.wait([busy], timeout=probe_timeout(self.inventory.policy))
        try:
            await asyncio.wait_for(self._take_probe(probe_hosts(self.inventory, self.fleet, self.to_publish())),
                                   probe_timeout(self.inventory.policy) + 10)
        except Exception as exc:  # noqa: BLE001 - the entry goes stale by itself within a minute or two
            log.warning("Could not publish the job's withdrawn fair-share demand: %s", exc)

    async def fair_share(self, limits: dict[str, pol.Limit], now: float,
                         cpu_hosts: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, pol.Limit], int | None]:
        """This job's demand to publish at the next probe, and fair share's plan
        (controller/fairshare.py): the limits with its releases, and the cap on new GPUs.
        `cpu_hosts`: the hosts whose slots are CPU slots (policy.cpu_host), which fair
        share does not count."""
        inv = self.inventory
        reports = fairshare.with_daemon_demands(self.observed.reports,
                                                {n: s.state for n, s in self.observed.seen.items()})
        desired = {h.name: self.records.get(h.name, pol.HostRecord()).desired for h in inv.hosts}
        usable = [h.name for h in inv.hosts if limits.get(h.name, pol.NO_LIMIT).cap != 0
                  and not self.records.get(h.name, pol.HostRecord()).removed]
        if self.ledger is not None and now - self._usage[0] >= inv.policy.probe_interval:
            self._usage = (now, self.ledger.recent_gpu_hours(now, inv.policy.usage_half_life))
        me, self._published = fairshare.own_demand(
            job=inv.job.name, user=fairshare.own_user(reports, inv.job.name, getpass.getuser()),
            priority=inv.job.priority, min_workers=inv.job.min_workers, max_workers=inv.job.max_workers,
            desired=desired, reports=reports, usable=usable, usage_gpu_h=self._usage[1],
            every=inv.policy.probe_interval, cpu_hosts=cpu_hosts)
        plan = fairshare.plan(me, fairshare.others_seen(reports, inv.job.name),
                              fairshare.holds(desired, reports, inv.job.name, cpu_hosts),
                              free=fairshare.free_gpus(reports, usable), half_life_s=inv.policy.usage_half_life,
                              slack=inv.policy.fairshare_slack, hold_s=inv.policy.fairshare_hold,
                              seen=fairshare.shared_gpus(reports, usable),
                              settling=now - self._released_at < fairshare.settle_s(inv.policy.idle_for,
                                                                                    inv.policy.probe_interval))
        before, self.fair, self.fair_me = self.fair, plan, me
        if plan.release and plan.release != before.release:
            self._released_at = now
            log.info("Fair share: %s.", plan.reason)
            for host, n in plan.release.items():
                await self._event(EventKind.FAIRSHARE, host,
                                  f"released {n} GPU{'s' if n != 1 else ''} on {host} to job "
                                  f"{plan.to.split('/', 1)[-1]} (fair share {plan.share} of {plan.pool})")
        if plan.release:
            limits = pol.fair_limits(limits, self.records, plan.release, plan.reason)
        return limits, plan.cap

    # ----------------------------------------------------------------- act

    async def act(self, decision: pol.Decision, now: float,
                  start_as: dict[str, pol.DaemonSlots | None] | None = None) -> None:
        """`start_as`: what each host's daemon is started with (`observe.daemon_slots`,
        taken with the views the decision was made on); a host missing there or None
        waits for a probe that says what it has."""
        for a in decision.actions:
            if isinstance(a, pol.SetDesired):
                if a.slots and a.host in self.starter.retired:
                    # its old daemon may still run (asked to exit, not gone yet, or launched and
                    # not heard from): slots written now would start workers with the old code
                    # and settings; they are asked of the new daemon (act.DaemonStarter._start)
                    continue
                rec = self.records.get(a.host, pol.HostRecord())
                self.records[a.host] = await act.set_desired(self.store, a.host, rec, a.slots)
        waiting = set()
        for a in decision.actions:
            if isinstance(a, pol.StartDaemon):
                host = self.inventory.host(a.host)
                slots = (start_as or {}).get(a.host)
                if slots is None:
                    waiting.add(a.host)
                    if a.host not in self._start_waits:
                        report = self.observed.reports.get(a.host)
                        log.warning("Host %s: its daemon is not started yet: no probe has said whether it has "
                                    "GPUs (the last one: %s); a daemon keeps its slots for life, so it starts "
                                    "once a probe tells.", a.host,
                                    f"{report.state}: {report.reason}" if report is not None else "none yet")
                    continue
                self.starter.start(self.inventory, host, slots, now, on_shipping=self._shipping,
                                   on_started=self._daemon_started, on_failure=self._give_up)
        self._start_waits = waiting

    async def replace_wrong_daemons(self, views: dict[str, pol.HostView], now: float) -> None:
        """A live daemon whose slots are not those of a daemon started now (`observe.wrong_slots`:
        CPU slots on a host whose latest probe lists GPUs, or the other way; a daemon keeps
        its slots for life) is replaced: its workers leave in the planned way (its slots
        are held at none, `_replacing_limits`), then the idle daemon is asked to exit and
        the next pass starts one with the right slots. Judged on a probe that tells (or the
        inventory's gpus), never on the last-known fallback; one log line per replacement,
        at most one replacement per host every act.REPLACE_AGAIN_S."""
        for host in self.inventory.hosts:
            name = host.name
            view = views.get(name)
            if view is None:
                continue
            if name in self.replacing:
                if not view.daemon_alive:  # gone (its last word read) or silent: the next start is right
                    del self.replacing[name]
                elif not view.workers and name not in self.starter.retired:
                    await self._retire(name)
                continue
            seen = self.observed.seen.get(name)
            slots = observe.daemon_slots(host, self.observed.reports.get(name))
            if (not view.daemon_alive or seen is None or slots is None or name in self.starter.retired
                    or name in self.starter.tasks or now - self._replaced_at.get(name, -1e18) < act.REPLACE_AGAIN_S):
                continue
            why = observe.wrong_slots(hostops.daemon_slot_kind(self.inventory, host, slots.gpus), seen.state)
            if why is None:
                continue
            self.replacing[name], self._replaced_at[name] = why, now
            log.warning("Host %s: %s (%s): it is replaced by a daemon with %s%s.", name, why, slots.source,
                        slots.describe(), ", once its workers have left in the planned way" if view.workers else "")
            if not view.workers:
                await self._retire(name)

    def host_config(self, name: str) -> str:
        """The host's digest of the job's code, settings and entry as last seen (pol.host_config)."""
        return pol.host_config(self.fingerprint, name)

    async def retire_stale_daemons(self, views: dict[str, pol.HostView]) -> None:
        """An idle live daemon started with the job's code or settings from before a change
        (its state's config is not the host's digest now) is asked to exit, and the next
        start ships the change; however it escaped `apply_fixes` (it reported only later).
        One with workers is left alone, as `apply_fixes` leaves it: its workers run on.
        A host whose old daemon is not gone act.RETIRE_HOLD_S after it was asked to exit
        is given slots again (one log line), so that a daemon that cannot exit holds none for ever."""
        now = self.clock()
        for name in list(self.starter.retired):
            if name not in self.starter.tasks and now - self._retired_at.get(name, now) > act.RETIRE_HOLD_S:
                log.warning("Host %s: its old daemon, asked to exit %.0f s ago, still runs; its slots are "
                            "asked of it again.", name, now - self._retired_at[name])
                self.starter.retired.discard(name)
        for host in self.inventory.hosts:
            name, view = host.name, views.get(host.name)
            seen = self.observed.seen.get(name)
            if (view is None or seen is None or not view.daemon_alive or view.workers or name in self.starter.retired
                    or name in self.starter.tasks or name in self.replacing):
                continue
            if seen.state.get("pid") in self.starter.asked_to_exit.get(name, ()):
                continue  # its last state, from before it went (a new one may be starting)
            if pol.stale_config(seen.state.get("config"), self.host_config(name)):
                log.info("Host %s: its idle daemon (pid %s) was started with the job's code or settings from "
                         "before the last change: it is replaced.", name, seen.state.get("pid"))
                await self._retire(name)

    async def _old_daemon_gone(self, name: str) -> None:
        """A retired host's old daemon is gone and the new one is about to ship: the stop
        written for the old one (`_retire`) is replaced by the slots the last decision gave
        the host (none: an idle document), so that the new daemon never reads that stop and
        exits (CI: one read it before the next pass asked for slots and never reported).
        The record is updated before the write: a pass writing meanwhile takes the next seq."""
        if self.stopping:
            return
        want = tuple((self.decision.desired if self.decision is not None else {}).get(name, ()))
        new = pol.applied(self.records.get(name, pol.HostRecord()), want)
        self.records[name] = new
        self.save_records()
        await self.store.set_json(desired_key(name), act.desired_document(new.seq, want, stop=False))
        log.info("Host %s: its old daemon is gone; the new one is asked for slots %s (seq %d).", name,
                 list(want) or "none", new.seq)

    async def _retire(self, name: str) -> None:
        """Ask the host's idle daemon to exit; the next start waits for it to be gone."""
        seen = self.observed.seen.get(name)
        pids = {seen.state.get("pid") if seen is not None else None, self.starter.launched.get(name)} - {None}
        self.starter.asked_to_exit.setdefault(name, set()).update(pids)
        self.records[name] = await act.retire_daemon(self.store, name, self.records.get(name, pol.HostRecord()))
        self.starter.retired.add(name)
        self._retired_at[name] = self.clock()
        self.starter.started_at.pop(name, None)
        self.starter.forget(name)

    def _replacing_limits(self, limits: dict[str, pol.Limit]) -> dict[str, pol.Limit]:
        """A host whose daemon is being replaced runs no slot until the new daemon is up."""
        if not self.replacing:
            return limits
        out = dict(limits)
        for name, why in self.replacing.items():
            out[name] = pol.Limit(0, None, f"its daemon is replaced: {why}")
        return out

    def _shipping(self) -> None:
        self.phase = Phase.SHIPPING if self.phase in (Phase.CONNECTING, Phase.PROBING) else self.phase

    def _daemon_started(self) -> None:
        if self.phase == Phase.SHIPPING:
            self.phase = Phase.STARTING

    async def _give_up(self, name: str, problem: str) -> None:
        """Count a failure against the host and withdraw its slots."""
        rec = pol.record_failure(self.records.get(name, pol.HostRecord()), self.inventory, self.clock(), problem)
        self.records[name] = new = pol.applied(rec, ())
        await act.write_withdrawn(self.store, name, new)

    async def _restore(self, names: list[str], others: list[str]) -> None:
        told = await act.restore(self.fleet, self.inventory, names, self.mirror_worker, self._event,
                                 others=others, known=self.observed.checkpoint)
        try:  # a worker that started while the job's last members paused it waits for this
            await self.store.set_json(Keys.RESTORED, told)
        except Exception as exc:  # noqa: BLE001 - advisory; the worker stops waiting after RESTORE_WAIT_S
            log.warning("Restore: could not tell the workers: %s", exc)

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

    # ----------------------------------------------------------------- fixes

    async def apply_fixes(self, now: float) -> list[str]:
        """A fix takes effect at once: the hosts a change of the code, the job's settings
        or their entry concerns forget their failures, failure cooldown and benching
        (an owner's cooldown stays), and an idle daemon of theirs is replaced by one
        with the new configuration and code. Returns the hosts concerned."""
        code = await asyncio.get_running_loop().run_in_executor(None, act.code_digest, self.inventory)
        new = pol.fingerprint(self.inventory, code)
        changed = pol.changed_hosts(self.fingerprint, new)
        if not changed:
            if new != self.fingerprint:
                self.fingerprint = new
                self.save_records()
            return []
        log.info("The inventory or the job's code changed: host(s) %s are tried again at once.", ", ".join(changed))
        self.records = pol.fixed(self.records, changed)
        retired = []
        for name in changed:
            if name not in self.records:
                continue
            view = self.observed.view(self.inventory.host(name), now, self.inventory.policy)
            # Every daemon that may still run with the old configuration is retired, not
            # only one whose state is fresh: one whose state merely went stale would
            # otherwise be kept ("its daemon runs already") and start the next workers
            # with the old command and code, which then fail with the old cause. A start in
            # flight that has not launched its daemon yet shipped the code from before the
            # change: it launches none, and the next pass starts one that ships the new
            # (CI: a host whose start was in flight when the fixed code's `up` came ran the
            # old code and went to cooldown with the old failure).
            # A daemon launched but not heard from yet (or launching now) has the old
            # configuration too: it is asked to exit before it starts a worker (CI: one that
            # reported after the fixed code's `up` started workers with the old code).
            if name in self.starter.tasks and name not in self.starter.launching:
                self.starter.stale.add(name)
                log.info("Host %s: its daemon start in flight is dropped: it shipped what was there "
                         "before the change.", name)
            elif not view.workers and (view.daemon_alive or observe.daemon_may_run(self.observed.seen.get(name))
                                       or name in self.starter.launching or name in self.starter.started_at):
                await self._retire(name)
                retired.append(name)
        self.fingerprint = new
        self.save_records()
        deadline = time.monotonic() + act.RETIRE_WAIT_S
        while retired and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            await self.observe_store()
            # gone once its last word (phase stopped) is read: a stale state is no exit
            retired = [n for n in retired if observe.daemon_may_run(self.observed.seen.get(n))]
        return changed

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

    # ----------------------------------------------------------------- requests

    def reload_inventory(self, inventory: Inventory) -> None:
        """Apply an edited inventory. The Fleet learns the new host list too (the probe
        and `down` go over `fleet.hosts`); a host removed or moved loses its connection."""
        old = {h.name: h for h in self.inventory.hosts}
        self.inventory = inventory
        self.outputs.reload(inventory)
        self.fleet.hosts = tuple(inventory.hosts)
        for name, host in old.items():
            new = next((h for h in inventory.hosts if h.name == name), None)
            if host != new:
                self.starter.forget(name)
                asyncio.ensure_future(self.fleet.forget(name))
            if new is None or (new.address, new.port) != (host.address, host.port):
                self.observed.forget_machine(name)
        top = max([self.seq_floor] + [r.seq for r in self.records.values()])
        for host in inventory.hosts:  # a new host continues above every seq sent (as in load_records)
            self.records.setdefault(host.name, pol.HostRecord(seq=top))
        self._check_fix = True  # the next pass compares what changed (`apply_fixes`)
        if self.keeper is not None:  # the keeper re-reads it now: a new host's run id (and forward)
            from eltctl.storeforward import nudge_keeper

            nudge_keeper(kstore.forwards_path(self.state), self.keeper.info.pid)

    def reread_inventory(self) -> str | None:
        """Read the inventory file again and apply it (`reload_inventory`); the error, if
        it cannot be read (a bad edit: what runs is kept)."""
        from eltctl.errors import ConfigError
        from eltctl.inventory import load_inventory

        try:
            new = load_inventory(self.inventory.path)
        except ConfigError as exc:
            return str(exc)
        if new.job.name != self.inventory.job.name:
            return (f"{self.inventory.path} now names job {new.job.name!r}, not {self.inventory.job.name!r}; "
                    "`eltctl down` this job before renaming it")
        self.reload_inventory(new)
        return None

    async def retry_failed(self) -> None:
        """`eltctl up` run by a person: the hosts held by a failure are tried at once (policy.retried)."""
        async with self._pass:
            before = self.records
            self.records = pol.retried(before, self.clock())
            if self.records != before:
                log.info("Host(s) %s held by a failure are tried again at once (`eltctl up`).",
                         ", ".join(n for n in self.records if self.records[n] != before.get(n)))
                self.save_records()

    async def checkpoint_place(self, name: str) -> mir.Place:
        """A host's checkpoint directory over the controller's connection (the mirror's source).
        A host no longer in the inventory is a source gone (its notice is dropped, not retried)."""
        try:
            host = self.inventory.host(name)
        except KeyError:
            raise mir.MirrorError(f"host {name} is no longer in the inventory", source_gone=True) from None
        return await mir.host_place(await self.fleet.transport(host), self.inventory.job.name)

    async def leave_out(self, left_out: dict[str, str]) -> None:
        """`eltctl up`'s checks: these hosts are left out with their reasons, the ones
        left out before and fixed now come back (policy.leave_out)."""
        async with self._pass:  # not between a pass's reading and writing of the records
            before = self.records
            self.records = pol.leave_out(before, left_out, [h.name for h in self.inventory.hosts])
            if self.records != before:
                self.save_records()
        for name, reason in left_out.items():
            if self.records.get(name) != before.get(name):
                log.warning("Host %s: %s.", name, reason)
                await self._event(EventKind.REMOVE, name, reason)

    async def scale(self, add: list[str], remove: list[str], force: bool) -> dict:
        if any(n not in {h.name for h in self.inventory.hosts} for n in add + remove):
            error = self.reread_inventory()  # a host just written into the file (issue 50)
            if error is not None:
                return {"ok": False, "error": error}
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
            self.records[name] = replace(rec, removed=True, removed_reason="", join_now=False, force=False)
            await self._event(EventKind.REMOVE, name, "removed by eltctl scale --remove")
            results.append({"host": name, "ok": True,
                            "message": "removed; its workers leave at the next step boundary"})
        probe_targets = [self.inventory.host(n) for n in add if n in names]
        reports = {}
        if probe_targets:
            probed = await probe_fleet(self.fleet, job=self.inventory.job.name, policy=self.inventory.policy,
                                       hosts=probe_targets, owner=self.inventory.owner_policy)
            reports = {r.name: r for r in probed}
            for name in self.observed.take_reports(probed):
                await self.fleet.forget(name)
        for host in probe_targets:
            refusal = observe.add_refusal(reports[host.name], force)
            if refusal is not None:
                results.append({"host": host.name, "ok": False, "message": refusal})
                continue
            rec = self.records.get(host.name, pol.HostRecord())
            self.records[host.name] = replace(rec, removed=False, removed_reason="", join_now=True, force=force,
                                              benched_until=0.0 if force else rec.benched_until,
                                              failures=0)
            await self._event(EventKind.ADD, host.name, "added by eltctl scale --add" + (" --force" if force else ""))
            results.append({"host": host.name, "ok": True, "message": observe.added_message(reports[host.name])})
        self.save_records()
        await self.reconcile()
        self.write_status()
        # what an added host does now that the pass decided: its slots join, or what holds them
        entries = {h["name"]: h for h in self.status_document()["hosts"]}
        for r in results:
            if r["ok"] and r["host"] in reports and r["host"] in entries:
                r["message"] = observe.added_message(reports[r["host"]], self.records[r["host"]].desired,
                                                     entries[r["host"]].get("waiting"))
        return {"ok": all(r["ok"] for r in results), "results": results}

    async def cordon(self, names: list[str], on: bool) -> dict:
        """`eltctl cordon` (`on`) / `uncordon`: the hosts' workers leave in the planned way
        and none start there until uncordoned; remembered in hosts.json."""
        known = {h.name for h in self.inventory.hosts}
        results = []
        for name in names:
            if name not in known:
                results.append({"host": name, "ok": False,
                                "message": f"no host {name!r} in the inventory (hosts: {', '.join(sorted(known))})"})
                continue
            rec = self.records.get(name, pol.HostRecord())
            if rec.cordoned == on:
                results.append({"host": name, "ok": True,
                                "message": "already cordoned" if on else "not cordoned"})
                continue
            # uncordon: "used again", at once: not held by a failure cooldown from before
            self.records[name] = replace(rec if on else pol.failure_cleared(rec), cordoned=on)
            what = "cordoned by eltctl cordon" if on else "uncordoned by eltctl uncordon"
            log.info("Host %s: %s.", name, what)
            await self._event(EventKind.CORDON, name, what, state="cordoned" if on else "uncordoned")
            results.append({"host": name, "ok": True,
                            "message": ("cordoned; its workers leave at the next step boundary and none start "
                                        "there until `eltctl uncordon`") if on
                            else "uncordoned; its free GPUs (or CPU slots) are used again"})
        self.save_records()
        await self.reconcile()
        self.write_status()
        return {"ok": all(r["ok"] for r in results), "results": results}

    async def down(self, force: bool, progress: Callable[[str], None] | None = None, why: str = "") -> dict:
        """The final checkpoint, then every worker and daemon stops (or is killed with force).
        `why` leads the messages while it runs (`finish`: the training finished)."""
        self.stopping = True
        self.finished = None  # after `down` a new `up` starts the job again, finished or not
        self.phase, self.message = Phase.STOPPING, why + "final checkpoint"
        self.write_status()
        store_ok = True
        try:
            await act.request_stop(self.store, self.records, self.inventory, self.clock())
        except Exception as exc:  # noqa: BLE001 - no store: stop the daemons by signal instead
            log.warning("The store is unreachable (%s): stopping the daemons by signal.", exc)
            store_ok = False
        self.save_records()
        job = self.inventory.job.name
        deadline = time.monotonic() + DOWN_TIMEOUT_S + self.inventory.policy.hang_timeout
        signalled = False
        while True:
            left = await act.leftovers(self.fleet, job)
            if not any(left.values()) or time.monotonic() > deadline:
                break
            if not store_ok and not signalled:
                await act.signal_daemons(self.fleet, left)
                signalled = True
            self.message = why + "waiting for " + ", ".join(f"{h} ({len(p)} process(es))" for h, p in left.items() if p)
            self.write_status()
            await asyncio.sleep(1.0)
        killed = {}
        if any(left.values()) and force:
            killed = await act.kill(self.fleet, job, left)
            left = await act.leftovers(self.fleet, job)
        if not any(left.values()) and self._probed_once.is_set():  # (`--down` alone never published)
            await self.publish_withdrawn()
        checkpoint = None
        try:
            await self.observe_store()
            checkpoint = observe.final_checkpoint(self.observed.runtime_status)
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

        def announce() -> None:
            self.message = "mirroring the final checkpoint"
            self.write_status()

        result = await act.mirror_final(worker, checkpoint, self.inventory.job.name, announce)
        self.mirror_worker = None  # stopped: the status document shows it no more
        self._final_mirror = result
        return result

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
            mirror=self.mirror_worker.status() if self.mirror_worker is not None else self._final_mirror,
            limits=pol.host_limits(self.inventory, self.records, now, self.quota_use(now)),
            forged=status.forged_summary(self.store_forgeries(), self.observed.seen, self.observed.runtime_status,
                                         self.observed.events_skipped),
            keeper=self._keeper_status(),
            starts_at=(self.decision.starts_at if self.decision is not None and self.phase == Phase.STARTING
                       else None),
            # before `extend`: what the outputs derive from the document (metrics) sees it
            fairshare=fairshare.plan_to_json(self.fair, self.fair_me))
        return self.outputs.extend(doc)

    def store_forgeries(self) -> dict[str, int]:
        """The forged values the controller's own store client read, per key family."""
        counts = getattr(self.store, "forgeries", None)
        return counts.counts() if counts is not None else {}

    def _keeper_status(self) -> dict | None:
        sup = self.keeper
        if sup is None:
            return None
        doc = {"pid": sup.info.pid, "endpoint": sup.info.endpoint, "restarts": sup.restarts,
               "problem": sup.problem or None, "attack": sup.attack(),
               "refused": int(sup.stats().get("refused") or 0)}
        if sup.forward_inventory is not None:  # the "ssh" store mode: each remote host's forward
            from eltctl.storeforward import read_forwards

            forwards = read_forwards(kstore.forwards_path(self.state))
            doc["forwards"] = (forwards.get("hosts") or {}) if forwards.get("keeper") == sup.info.pid else {}
        return doc

    def write_status(self) -> None:
        self._status_written = self.clock()
        doc = self.status_document()
        status.write_status(self.state.status_json, doc)
        self.outputs.published(doc, self._status_written)


__all__ = ["Controller", "Phase"]
