"""The hosts' daemons kept right, the loop's act step: the desired slots a decision gives
each host written to the store, and its daemon started (act.DaemonStarter) with the
slots a probe says it has; a live daemon whose slots are of the wrong kind replaced
(`replace_wrong_daemons`: its workers leave first), an idle one started with the job's
code or settings from before a change retired (`retire_stale_daemons`), a fix applied at
once (`apply_fixes`), a host whose daemon would not start given up on (`give_up`). What
acts over SSH and on the store is act.py's; this is the bookkeeping of which host's
daemon is being replaced or retired, and since when.
"""

from __future__ import annotations

import asyncio
import logging
import time

from eltctl.controller import act, observe
from eltctl.controller import policy as pol
from eltctl.hosts import ops as hostops
from eltctl_runtime.protocol import desired_key

log = logging.getLogger("eltctl.controller")


class DaemonUpkeep:
    """The daemons' lives for the loop.Controller `ctl` (its records, starter, store and
    observations): what acts on them, and which are being replaced or retired."""

    def __init__(self, ctl) -> None:
        self.ctl = ctl
        self.replacing: dict[str, str] = {}  # host -> why its running daemon is replaced (replace_wrong_daemons)
        self.replaced_at: dict[str, float] = {}  # host -> when its daemon was last found wrong
        self.retired_at: dict[str, float] = {}  # host -> when its old daemon was asked to exit (retire)
        self.start_waits: set[str] = set()  # hosts whose daemon start waits for a probe that tells their slots

    async def act(self, decision: pol.Decision, now: float,
                  start_as: dict[str, pol.DaemonSlots | None] | None = None) -> None:
        """`start_as`: what each host's daemon is started with (`observe.daemon_slots`,
        taken with the views the decision was made on); a host missing there or None
        waits for a probe that says what it has."""
        ctl = self.ctl
        for a in decision.actions:
            if isinstance(a, pol.SetDesired):
                if a.slots and a.host in ctl.starter.retired:
                    # its old daemon may still run (asked to exit, not gone yet, or launched and
                    # not heard from): slots written now would start workers with the old code
                    # and settings; they are asked of the new daemon (act.DaemonStarter._start)
                    continue
                rec = ctl.records.get(a.host, pol.HostRecord())
                ctl.records[a.host] = await act.set_desired(ctl.store, a.host, rec, a.slots)
        waiting = set()
        for a in decision.actions:
            if isinstance(a, pol.StartDaemon):
                host = ctl.inventory.host(a.host)
                slots = (start_as or {}).get(a.host)
                if slots is None:
                    waiting.add(a.host)
                    if a.host not in self.start_waits:
                        report = ctl.observed.reports.get(a.host)
                        log.warning("Host %s: its daemon is not started yet: no probe has said whether it has "
                                    "GPUs (the last one: %s); a daemon keeps its slots for life, so it starts "
                                    "once a probe tells.", a.host,
                                    f"{report.state}: {report.reason}" if report is not None else "none yet")
                    continue
                ctl.starter.start(ctl.inventory, host, slots, now, on_shipping=ctl._shipping,
                                  on_started=ctl._daemon_started, on_failure=self.give_up)
        self.start_waits = waiting

    async def replace_wrong_daemons(self, views: dict[str, pol.HostView], now: float) -> None:
        """A live daemon whose slots are not those of a daemon started now (`observe.wrong_slots`:
        CPU slots on a host whose latest probe lists GPUs, or the other way; a daemon keeps
        its slots for life) is replaced: its workers leave in the planned way (its slots
        are held at none, `replacing_limits`), then the idle daemon is asked to exit and
        the next pass starts one with the right slots. Judged on a probe that tells (or the
        inventory's gpus), never on the last-known fallback; one log line per replacement,
        at most one replacement per host every act.REPLACE_AGAIN_S."""
        ctl = self.ctl
        for host in ctl.inventory.hosts:
            name = host.name
            view = views.get(name)
            if view is None:
                continue
            if name in self.replacing:
                if not view.daemon_alive:  # gone (its last word read) or silent: the next start is right
                    del self.replacing[name]
                elif not view.workers and name not in ctl.starter.retired:
                    await self.retire(name)
                continue
            seen = ctl.observed.seen.get(name)
            slots = observe.daemon_slots(host, ctl.observed.reports.get(name))
            if (not view.daemon_alive or seen is None or slots is None or name in ctl.starter.retired
                    or name in ctl.starter.tasks or now - self.replaced_at.get(name, -1e18) < act.REPLACE_AGAIN_S):
                continue
            why = observe.wrong_slots(hostops.daemon_slot_kind(ctl.inventory, host, slots.gpus), seen.state)
            if why is None:
                continue
            self.replacing[name], self.replaced_at[name] = why, now
            log.warning("Host %s: %s (%s): it is replaced by a daemon with %s%s.", name, why, slots.source,
                        slots.describe(), ", once its workers have left in the planned way" if view.workers else "")
            if not view.workers:
                await self.retire(name)

    async def retire_stale_daemons(self, views: dict[str, pol.HostView]) -> None:
        """An idle live daemon started with the job's code or settings from before a change
        (its state's config is not the host's digest now) is asked to exit, and the next
        start ships the change; however it escaped `apply_fixes` (it reported only later).
        One with workers is left alone, as `apply_fixes` leaves it: its workers run on.
        A host whose old daemon is not gone act.RETIRE_HOLD_S after it was asked to exit
        is given slots again (one log line), so that a daemon that cannot exit holds none for ever."""
        ctl = self.ctl
        now = ctl.clock()
        for name in list(ctl.starter.retired):
            if name not in ctl.starter.tasks and now - self.retired_at.get(name, now) > act.RETIRE_HOLD_S:
                log.warning("Host %s: its old daemon, asked to exit %.0f s ago, still runs; its slots are "
                            "asked of it again.", name, now - self.retired_at[name])
                ctl.starter.retired.discard(name)
        for host in ctl.inventory.hosts:
            name, view = host.name, views.get(host.name)
            seen = ctl.observed.seen.get(name)
            if (view is None or seen is None or not view.daemon_alive or view.workers or name in ctl.starter.retired
                    or name in ctl.starter.tasks or name in self.replacing):
                continue
            if seen.state.get("pid") in ctl.starter.asked_to_exit.get(name, ()):
                continue  # its last state, from before it went (a new one may be starting)
            if pol.stale_config(seen.state.get("config"), ctl.host_config(name)):
                log.info("Host %s: its idle daemon (pid %s) was started with the job's code or settings from "
                         "before the last change: it is replaced.", name, seen.state.get("pid"))
                await self.retire(name)

    async def old_daemon_gone(self, name: str) -> None:
        """A retired host's old daemon is gone and the new one is about to ship: the stop
        written for the old one (`retire`) is replaced by the slots the last decision gave
        the host (none: an idle document), so that the new daemon never reads that stop and
        exits (CI: one read it before the next pass asked for slots and never reported).
        The record is updated before the write: a pass writing meanwhile takes the next seq."""
        ctl = self.ctl
        if ctl.stopping:
            return
        want = tuple((ctl.decision.desired if ctl.decision is not None else {}).get(name, ()))
        new = pol.applied(ctl.records.get(name, pol.HostRecord()), want)
        ctl.records[name] = new
        ctl.save_records()
        await ctl.store.set_json(desired_key(name), act.desired_document(new.seq, want, stop=False))
        log.info("Host %s: its old daemon is gone; the new one is asked for slots %s (seq %d).", name,
                 list(want) or "none", new.seq)

    async def retire(self, name: str) -> None:
        """Ask the host's idle daemon to exit; the next start waits for it to be gone."""
        ctl = self.ctl
        seen = ctl.observed.seen.get(name)
        pids = {seen.state.get("pid") if seen is not None else None, ctl.starter.launched.get(name)} - {None}
        ctl.starter.asked_to_exit.setdefault(name, set()).update(pids)
        ctl.records[name] = await act.retire_daemon(ctl.store, name, ctl.records.get(name, pol.HostRecord()))
        ctl.starter.retired.add(name)
        self.retired_at[name] = ctl.clock()
        ctl.starter.started_at.pop(name, None)
        ctl.starter.forget(name)

    def replacing_limits(self, limits: dict[str, pol.Limit]) -> dict[str, pol.Limit]:
        """A host whose daemon is being replaced runs no slot until the new daemon is up."""
        if not self.replacing:
            return limits
        out = dict(limits)
        for name, why in self.replacing.items():
            out[name] = pol.Limit(0, None, f"its daemon is replaced: {why}")
        return out

    async def give_up(self, name: str, problem: str) -> None:
        """Count a failure against the host and withdraw its slots."""
        ctl = self.ctl
        rec = pol.record_failure(ctl.records.get(name, pol.HostRecord()), ctl.inventory, ctl.clock(), problem)
        ctl.records[name] = new = pol.applied(rec, ())
        await act.write_withdrawn(ctl.store, name, new)

    async def apply_fixes(self, now: float) -> list[str]:
        """A fix takes effect at once: the hosts a change of the code, the job's settings
        or their entry concerns forget their failures, failure cooldown and benching
        (an owner's cooldown stays), and an idle daemon of theirs is replaced by one
        with the new configuration and code. Returns the hosts concerned."""
        ctl = self.ctl
        code = await asyncio.get_running_loop().run_in_executor(None, act.code_digest, ctl.inventory)
        new = pol.fingerprint(ctl.inventory, code)
        changed = pol.changed_hosts(ctl.fingerprint, new)
        if not changed:
            if new != ctl.fingerprint:
                ctl.fingerprint = new
                ctl.save_records()
            return []
        log.info("The inventory or the job's code changed: host(s) %s are tried again at once.", ", ".join(changed))
        ctl.records = pol.fixed(ctl.records, changed)
        retired = []
        for name in changed:
            if name not in ctl.records:
                continue
            view = ctl.observed.view(ctl.inventory.host(name), now, ctl.inventory.policy)
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
            if name in ctl.starter.tasks and name not in ctl.starter.launching:
                ctl.starter.stale.add(name)
                log.info("Host %s: its daemon start in flight is dropped: it shipped what was there "
                         "before the change.", name)
            elif not view.workers and (view.daemon_alive or observe.daemon_may_run(ctl.observed.seen.get(name))
                                       or name in ctl.starter.launching or name in ctl.starter.started_at):
                await self.retire(name)
                retired.append(name)
        ctl.fingerprint = new
        ctl.save_records()
        deadline = time.monotonic() + act.RETIRE_WAIT_S
        while retired and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            await ctl.observe_store()
            # gone once its last word (phase stopped) is read: a stale state is no exit
            retired = [n for n in retired if observe.daemon_may_run(ctl.observed.seen.get(n))]
        return changed

