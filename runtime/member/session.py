"""One member's session in the job: what ElasticJob and restart mode's supervisor
share as members, held once.

A session connects to the job's store (signed with the job's secret: the store
link comes from `plan.job_store`), starts the member's control thread (its own
store connection, control.py) and its membership state machine
(generation.py's `Generations`, with the user's hooks), waits to be admitted,
and on the way out tells the others at once when it leaves mid-job. It gives
the views of the generation the member is in (`plan`, `rank`, `pg`, `abort`)
and reports to eltctl through its `Reporter` (report.py). A session that rides
out the store's loss (store/loss.py: ElasticJob's) shares a `StoreHealth` with
its control thread, follows a keeper that moved at a reconnect, and opens a
fresh client of its own once the store is back (`reconnect_if_back`,
`await_store`), rank 0 re-publishing the generation's plan and the events held
meanwhile. Restart mode's supervisor does not ride it out (a store error there
is only logged).

Lifecycle: `connect(config)` (the first store client; no thread), `start(hooks,
device)` (the control thread and the state machine), `trap_sigterm()`,
`admit(...)`, then the user drives the state machine (`gen`); `close()` at the
end. The constructor does no I/O.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

import torch

from . import collectives
from .control import ControlThread
from .generation import GenerationHooks, Generations
from .plan import Plan, host_of, job_store
from .report import Reporter
from .config import RuntimeConfig
from ..protocol import put_dead
from ..store import client as storeclient
from ..store import loss as storeloss
from ..store.auth import Forgeries

log = logging.getLogger("eltctl_runtime")

CONNECT_TIMEOUT_S = 60


class MemberViews:
    """The generation's views (plan, rank, group) for a class that holds its member's
    MemberSession as `self._session` (ElasticJob, the restart supervisor)."""

    _session: "MemberSession"

    # The step reads these: one hop to the state machine, no property of the session between.
    @property
    def _plan(self) -> Plan | None:
        gen = self._session.gen
        return gen.plan if gen is not None else None

    @property
    def _rank(self) -> int:
        gen = self._session.gen
        return gen.rank if gen is not None else -1

    @property
    def _pg(self):
        gen = self._session.gen
        return gen.pg if gen is not None else None


class MemberSession:
    """See the module docstring. `label` ("worker", "supervisor") names the member in
    log lines; `group_name` its generations' process group; `mode` goes into its
    reports ("restart")."""

    def __init__(self, label: str = "worker", *, group_name: str = "process group", mode: str | None = None,
                 rides_store_loss: bool = True) -> None:
        self.label = label
        self._group_name = group_name
        self._rides_store_loss = rides_store_loss
        self.cfg: RuntimeConfig | None = None
        self.forgeries = Forgeries()  # forged store values read, over all of this member's connections
        self.address: storeloss.StoreAddress | None = None  # where the store is (follows a moved keeper)
        self.health: storeloss.StoreHealth | None = None  # whether the store is away (None: not ridden out)
        self.tcp = None
        self.store = None  # the job's PrefixStore over tcp (signed with the job's secret, if any)
        self.epoch = 0  # the health's reconnects when `store` was opened
        self.bind_host: str | None = None  # the data plane's address (the process groups bind it)
        self.control: ControlThread | None = None
        self.gen: Generations | None = None  # the membership state machine; made in start()
        self.report = Reporter(self, mode)
        self._old_sigterm = None

    # -- the generation's views -------------------------------------------------------
    @property
    def me(self) -> str:
        return self.cfg.worker_id

    @property
    def host(self) -> str:
        return host_of(self.cfg.worker_id)

    @property
    def plan(self) -> Plan | None:
        return self.gen.plan if self.gen is not None else None

    @property
    def rank(self) -> int:
        return self.gen.rank if self.gen is not None else -1

    @property
    def pg(self):
        return self.gen.pg if self.gen is not None else None

    @property
    def abort(self) -> threading.Event | None:
        return self.gen.abort if self.gen is not None else None

    # -- lifecycle --------------------------------------------------------------------
    def connect(self, config: RuntimeConfig) -> None:
        """The data plane's address and the first client of the job's store."""
        self.cfg = config
        self.bind_host = collectives.bind_address(config.store_host, config.store_port)
        self.address = storeloss.StoreAddress(config.store_spec, config.run_file)
        self.tcp = self._connect_raw()
        self.store = self._job_store(self.tcp)

    def start(self, hooks: GenerationHooks, device: torch.device) -> None:
        """The control thread (with the store's health, when the session rides out its
        loss) and the membership state machine, whose groups live on `device`."""
        cfg = self.cfg
        if self._rides_store_loss:
            self.health = storeloss.StoreHealth(cfg.worker_id, cfg.store_loss_timeout_s)
        self.control = ControlThread(self.connect_store, cfg.worker_id, cfg.hang_timeout_s, cfg.max_workers,
                                     health=self.health)
        self.control.start()
        self.gen = Generations(cfg.worker_id, lambda: self.store, self.control, hooks, device=device,
                               bind_host=self.bind_host, max_workers=cfg.max_workers,
                               hang_timeout_s=cfg.hang_timeout_s, label=self.label, group_name=self._group_name)

    def trap_sigterm(self) -> None:
        """SIGTERM asks this member to leave at the next boundary (a planned leave).
        Only the main thread can set a handler; close() puts the old one back."""
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self.control.request_local_leave())

    def admit(self, *, restarted_wait_s: float = 120.0, leave_gives_up: bool = False) -> Plan | None:
        """Register as a (warm) joiner and wait to be a member (generation.admit); None:
        the job is done, or (`leave_gives_up`) this member was asked to leave first."""
        give_up: Callable[[], bool] = self._asked_to_leave if leave_gives_up else (lambda: False)
        return self.gen.admit(min_workers=self.cfg.min_workers, give_up=give_up,
                              restarted_wait_s=restarted_wait_s)

    def _asked_to_leave(self) -> bool:
        if not self.control.requests.leave:
            return False
        log.info("%s %s: asked to leave before it was admitted", self.label, self.me)
        put_dead(self.store, self.me)  # so that nobody admits it any more
        return True

    def leave_abruptly(self, why: str) -> None:
        """Leaving mid-job (an error, or the script left its loop): tell the others at
        once rather than let them wait for the hang timeout. Best effort."""
        plan = self.plan
        log.error("%s %s: leaving %s abruptly: %s", self.label, self.me,
                  f"generation {plan.generation}" if plan is not None else "the job", why)
        try:
            put_dead(self.store, self.me)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    def close(self) -> None:
        """Stop the control thread, put SIGTERM's handler back, drop the group without blocking."""
        if self.control is not None:
            self.control.close()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self.gen is not None:
            self.gen.close()  # never block the exit on a group

    # -- the store and its loss (store/loss.py) ---------------------------------------
    def _connect_raw(self):
        return storeclient.connect(self.address.spec, CONNECT_TIMEOUT_S)

    def _job_store(self, tcp):
        # the run id is read at every connect: a restarted store keeper has a new one (auth.py)
        cfg = self.cfg
        return job_store(tcp, cfg.job, cfg.secret, self.forgeries, cfg.run_id())

    def connect_store(self):
        """A new client of the job's store (the control thread's factory)."""
        if self.health is not None and self.health.lost:
            self.address.follow()  # a reconnect: the direct mode's keeper may serve on a new port now
        return self._job_store(self._connect_raw())

    def store_failed(self, what: str, error: BaseException) -> None:
        """A store call of this member's own client failed (counted, store/loss.py; logged
        where the session does not ride out the store's loss)."""
        if self.health is not None:
            self.health.failed(what, error, epoch=self.epoch)
        else:
            log.warning("%s %s: could not write %s: %s", self.label, self.me, what, error)

    def store_back(self) -> None:
        """The store came back after a loss: a fresh client like the first one; rank 0
        re-publishes the generation's plan and the held events."""
        self.epoch = self.health.reconnects
        self.tcp = self._connect_raw()
        self.store = self._job_store(self.tcp)
        if self.rank == 0 and self.plan is not None:
            storeloss.republish(self.store, self.plan, self.me)
            storeloss.flush_held(self.store, self.health)

    def reconnect_if_back(self) -> None:
        """At a boundary: a fresh client if the store came back since ours was opened
        (away again: tried at the next boundary)."""
        health = self.health
        if not health.lost and health.reconnects != self.epoch:
            try:
                self.store_back()
            except Exception as e:  # noqa: BLE001 - away again: tried at the next boundary
                health.failed("reconnecting", e, epoch=self.epoch)

    def await_store(self) -> None:
        """What comes next needs the store: wait while it is away (raises StoreLost
        past the store-loss timeout), with a fresh client once it is back."""
        storeloss.wait_until_back(self.health)
        if self.health.reconnects != self.epoch:
            self.store_back()

    def read(self, get: Callable):
        """`get(store)` (protocol.get_status, get_restored), or None when it fails
        (unreadable, forged, the store away): advisory."""
        try:
            return get(self.store)
        except Exception:  # noqa: BLE001 - advisory: None
            return None
