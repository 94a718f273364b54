"""The owner signals beyond the GPU (runtime/owner.py: another user's login, console
input, foreign CPU load, foreign memory) as one daemon follows them: the watch made
at its start when daemon.json's `owner` names signals, looked at every watch
interval, its verdict for `logic.decide`, and one log line when a signal fires or
the signals go quiet again.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from ..owner import OwnerSignal, OwnerWatch, Sources, Verdict
from .config import DaemonConfig

log = logging.getLogger("eltctl_runtime.daemon")


class OwnerSignals:
    """Nothing is watched until `start`; `verdict` is None until the first judgement."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self._watch: OwnerWatch | None = None  # made in start() when the config watches owner signals
        self.verdict: Verdict | None = None  # None: not judged yet
        self._next = 0.0
        self._fired: OwnerSignal | None = None  # the leave signal last logged

    def start(self, base_env: Mapping[str, str]) -> None:
        if not self.cfg.owner.enabled:
            return
        self._watch = OwnerWatch(self.cfg.owner, Sources.from_env(base_env))
        self._watch.look(time.monotonic(), time.time())  # the first of the two looks a load rate needs
        self._next = time.monotonic() + min(0.5, self.cfg.watch_interval)
        log.info("host %s: watching owner signals %s (user %s is not an owner)", self.cfg.host,
                 ", ".join(self.cfg.owner.signals), self._watch.user)

    @property
    def pending(self) -> bool:
        """Watched, but not judged yet (a load rate needs two looks): `View.owner_pending`."""
        return self._watch is not None and self.verdict is None

    def observe(self, now: float) -> None:
        if self._watch is None or now < self._next:
            return
        self._next = now + self.cfg.watch_interval
        v = self._watch.step(now, time.time())
        self.verdict = v
        if v.leave is not None and (self._fired is None or self._fired.name != v.leave.name):
            log.warning("host %s: owner signal %s: %s; the workers here leave", self.cfg.host, v.leave.name,
                        v.leave.detail)
        elif v.holding is None and self._fired is not None:
            log.info("host %s: the owner signals are quiet again (%s idle)", self.cfg.host,
                     ", ".join(self.cfg.owner.signals))
        if v.leave is not None or v.holding is None:
            self._fired = v.leave

    def doc(self) -> dict | None:
        """The owner signal that holds this host now (owner.OwnerSignal.to_dict), or None."""
        v = self.verdict
        return v.holding.to_dict() if v is not None and v.holding is not None else None
