"""This host's slots as the GPU claims say (runtime/claims.py), seen by one daemon:
claiming a slot for a worker about to start, which slots without a worker of ours
another eltctl job holds (`taken`: the state document's `taken` and the GPU states),
the fair-share demand entries of the jobs sharing the host (`demands`), and the
entries of the claims directory not believed (`refused`), each logged once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Collection, Iterable, Mapping

from .. import claims
from . import procs
from .config import DaemonConfig

log = logging.getLogger("eltctl_runtime.daemon")


class SlotClaims:
    """The claims side of one daemon; `observe` looks every watch interval."""

    def __init__(self, cfg: DaemonConfig, base_env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.dir = claims.claims_dir(cfg.claims_dir, base_env)
        # slot -> the other job's claim that keeps us off it
        self.taken: dict[int, claims.Claim] = {}
        self._next = 0.0
        # the fair-share demand entries of the jobs sharing the host (the state's `demands`)
        self._demand_reader = claims.DemandReader(self.dir)
        self.demands: list[dict] = []
        self._problem = ""
        # entries of the claims directory not believed (claims.judge): name -> Refusal, each watch interval
        self.refused: dict[str, claims.Refusal] = {}

    def _name(self, slot: int) -> str:
        return claims.slot_file(slot, gpu=self.cfg.gpu_host, host=self.cfg.host)

    def claim(self, slot: int, wid: str) -> "claims.Held | None | bool":
        """Claim the slot for the worker `wid` about to start: the Held claim; None when
        the worker starts without one (the directory cannot be used, or a lingering
        process of this job still holds it); False when another job holds it (the slot
        is then taken: nothing starts, no yield, no crash)."""
        cfg = self.cfg
        mine = claims.Claim(job=cfg.job, user=procs.user_of(os.getpid()) or "", host=cfg.host, slot=slot,
                            pid=os.getpid(), since=round(time.time(), 3))
        try:
            held = claims.take(self.dir, self._name(slot), mine)
            self._note_refused(held.refused)
        except claims.Taken as e:
            holder = e.holder or claims.Claim(job="")
            if holder.job == cfg.job and holder.user in ("", mine.user, claims.my_account()):
                log.warning("host %s: the claim of %s %d is still held by a process of this job (%s); worker %s "
                            "starts without one", cfg.host, "GPU" if cfg.gpu_host else "CPU slot", slot,
                            holder.describe(), wid)
                return None
            self._set_taken(slot, holder)
            return False
        except claims.ClaimError as e:
            if str(e) != self._problem:
                self._problem = str(e)
                log.warning("host %s: %s; workers start without GPU claims, so another eltctl job could start "
                            "on the same GPU", cfg.host, e)
            return None
        self._problem = ""
        self.taken.pop(slot, None)
        return held

    def _set_taken(self, slot: int, holder: "claims.Claim | None") -> None:
        old = self.taken.get(slot)
        if holder is None:
            if old is not None:
                self.taken.pop(slot)
                log.info("host %s: %s %d is no longer claimed by %s", self.cfg.host,
                         "GPU" if self.cfg.gpu_host else "CPU slot", slot, old.describe())
            return
        self.taken[slot] = holder
        if old is None or old.job != holder.job:
            log.info("host %s: %s %d is taken by %s: no worker of this job starts there", self.cfg.host,
                     "GPU" if self.cfg.gpu_host else "CPU slot", slot, holder.describe())

    def observe(self, now: float, slots: Iterable[int], ours: Collection[int]) -> None:
        """Every watch interval: which of this host's `slots` without a worker of ours
        (`ours`: the slots with one) another job holds (their claims)."""
        if now < self._next:
            return
        self._next = now + self.cfg.watch_interval
        refused: list[claims.Refusal] = []
        try:
            problem = claims.check_dir(self.dir) if self.dir.exists() else None
        except claims.ClaimError as e:  # not trusted at all: nothing in it keeps us off a GPU
            self.demands = []
            self.refused = {str(self.dir): claims.Refusal(str(self.dir), "?", str(e))}
            for slot in list(self.taken):
                self._set_taken(slot, None)
            return
        refused += [problem] if problem else []
        self.demands = self._demand_reader.read(time.time())
        refused += self._demand_reader.refused
        for slot in sorted(slots):
            holder = claims.holder(self.dir, self._name(slot), refused=refused)
            if slot in ours:
                self._set_taken(slot, None)
                continue
            self._set_taken(slot, holder if holder is not None and holder.job != self.cfg.job else None)
        self._note_refused(refused, fresh=True)

    def _note_refused(self, refused, fresh: bool = False) -> None:
        """Keep the refused entries (claims.Refusal) for the state document (`fresh`: the
        whole list of this look, replacing the last); log each new one once."""
        before = self.refused
        self.refused = {} if fresh else dict(before)
        for r in refused:
            key = f"{r.file} {r.owner}"
            if key not in before:
                log.warning("host %s: not believed in the GPU claims directory: %s", self.cfg.host, r.describe())
            self.refused[key] = r

    def claimed_by_user_of(self, app, gpus) -> bool:
        """An unreadable process (another user's) on a GPU another job claims as that user
        (`gpus`: the GPUs nvidia-smi listed last)."""
        index = next((g.index for g in gpus if g.uuid == app.gpu_uuid), None)
        claim = self.taken.get(index) if index is not None else None
        return claim is not None and bool(claim.user) and claim.user == procs.user_of(app.pid)

    def doc(self) -> dict:
        """The state document's `taken`, `demands` and `refused`."""
        return {
            "taken": {str(s): c.job for s, c in sorted(self.taken.items())},
            "demands": self.demands,
            # entries of the claims directory not believed, named with their owner (runtime/claims.py `judge`)
            "refused": claims.refusal_doc(self.refused.values()),
        }
