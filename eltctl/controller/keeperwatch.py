"""The store keeper watched from the controller's loop: a lost keeper restarted on the
same address and port, the controller's client swapped, the event log read from 0 again
and every host's desired document re-published; for KEEPER_GRACE_S after that (or until
every host that runs workers reports again) nothing is decided, so daemons that were
silent only because the store was away are never taken for failures (`KeeperWatch.grace`).
A keeper that refuses requests (an attack) is reported, not restarted. The keeper's
process and its supervision are store.py's (`KeeperSupervisor`); this is the loop's side.
"""

from __future__ import annotations

import asyncio
import logging
import time

from eltctl.controller import act
from eltctl.controller import store as kstore
from eltctl_runtime.protocol import EventKind

log = logging.getLogger("eltctl.controller")

# After a keeper restart: the daemons reconnect (their back-off is at most 10 s)
# before anything is decided on what they report.
KEEPER_GRACE_S = 20.0
KEEPER_RETRY_S = 3.0  # a keeper that cannot be restarted (its port taken) is tried again this often


class KeeperWatch:
    """The controller's watch over its store keeper (`ctl.keeper`, the supervisor set by
    __main__; None: not watched). `ctl` is the loop.Controller it serves: its store client,
    records and events."""

    def __init__(self, ctl) -> None:
        self.ctl = ctl
        self.grace_until = 0.0  # controller clock: nothing is decided before (a keeper restart)
        self.restarted_at = 0.0
        self.next_try = 0.0  # monotonic: the next restart attempt of a keeper that could not be
        self.down_logged = False
        self.attack_said = (0, 0.0)  # (refused count, when) last reported

    async def watch(self) -> bool:
        """Check the store keeper; restart a lost one on the same address and port.
        Returns False while no keeper serves (the pass is skipped)."""
        ctl = self.ctl
        sup = ctl.keeper
        if sup is None:
            return True
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, sup.check):
            await self._report_attack(sup)
            return True
        if time.monotonic() < self.next_try:
            return False
        self.next_try = time.monotonic() + KEEPER_RETRY_S
        old = sup.info
        if not self.down_logged:
            log.warning("The store keeper %d on %s is gone: starting a new one on the same address and port; "
                        "the workers train on meanwhile.", old.pid, old.endpoint)
            self.down_logged = True
        try:
            info = await loop.run_in_executor(None, sup.restart)
            client = await loop.run_in_executor(None, kstore.connect_client, info.endpoint, ctl.inventory.job.name)
        except Exception as exc:  # noqa: BLE001 - tried again in KEEPER_RETRY_S
            ctl.message = f"the store keeper is down: {sup.problem or exc}"
            log.error("The store keeper cannot be restarted (retrying in %.0f s): %s", KEEPER_RETRY_S,
                      sup.problem or exc)
            return False
        self.down_logged = False
        async with ctl._pass:  # not between a pass's reading and acting
            ctl.store.swap(client)
            if info.endpoint != old.endpoint and not callable(ctl.starter.store_endpoint):
                # direct mode: a new port; the running daemons and workers read it from the hosts'
                # store.address (the keeper writes it there) when they reconnect
                ctl.store_endpoint = ctl.starter.store_endpoint = info.endpoint
                log.warning("The store moved from %s to %s (another process holds the old port); the hosts "
                            "find the new address beside their run id when they reconnect.", old.endpoint,
                            info.endpoint)
            await self.restarted()
        log.warning("Restarted the store keeper on %s (pid %d, restart %d); the desired slots were written "
                    "again.", info.endpoint, info.pid, sup.restarts)
        await ctl._event(EventKind.STORE, None, f"the store keeper was restarted on {info.endpoint} (pid "
                         f"{info.pid})", restarts=sup.restarts)
        return True

    async def _report_attack(self, sup) -> None:
        """The keeper's store refused requests (storestats.json): an event and a log line,
        once a minute at most while the count grows. The keeper is not restarted for it."""
        ctl = self.ctl
        attack = sup.attack()
        refused = int(sup.stats().get("refused") or 0)
        said_count, said_at = self.attack_said
        if attack is None or refused <= said_count or ctl.clock() - said_at < 60:
            return
        self.attack_said = (refused, ctl.clock())
        log.warning("Store keeper %d: %s.", sup.info.pid, attack)
        await ctl._event(EventKind.STORE, None, attack, refused=refused)

    async def restarted(self) -> None:
        """The store is a new, empty one on the old port: read its event log from 0,
        write every host's desired document again, and decide nothing until the
        daemons report (`grace`)."""
        ctl = self.ctl
        ctl.observed.store_restarted()
        self.restarted_at = ctl.clock()
        self.grace_until = self.restarted_at + KEEPER_GRACE_S
        await act.republish_desired(ctl.store, ctl.records, ctl.inventory.hosts, ctl.stopping)
        ctl.save_records()

    def grace(self, now: float) -> bool:
        """After a keeper restart, until KEEPER_GRACE_S passed or every host that runs
        workers has its daemon reporting again: nothing is decided."""
        ctl = self.ctl
        if now >= self.grace_until:
            return False
        seen = ctl.observed.seen
        waiting = [name for name, rec in ctl.records.items() if rec.desired
                   and (name not in seen or seen[name].changed < self.restarted_at)]
        if not waiting:
            self.grace_until = 0.0
            return False
        ctl.message = f"the store keeper was restarted; waiting for {', '.join(sorted(waiting))} to reconnect"
        return True

    def status(self) -> dict | None:
        """The keeper's part of the status document (None: not watched)."""
        ctl = self.ctl
        sup = ctl.keeper
        if sup is None:
            return None
        doc = {"pid": sup.info.pid, "endpoint": sup.info.endpoint, "restarts": sup.restarts,
               "problem": sup.problem or None, "attack": sup.attack(),
               "refused": int(sup.stats().get("refused") or 0)}
        if sup.forward_inventory is not None:  # the "ssh" store mode: each remote host's forward
            from eltctl.storeforward import read_forwards

            forwards = read_forwards(kstore.forwards_path(ctl.state))
            doc["forwards"] = (forwards.get("hosts") or {}) if forwards.get("keeper") == sup.info.pid else {}
        return doc

