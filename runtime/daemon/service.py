"""The host daemon's executor: each tick it observes (its workers, the GPU watch,
the store link), calls the pure `logic.decide`, and acts (starts, signals and
reaps workers, writes pid and memory files, queues store messages). What it drives
lives beside it, one concern a module: its worker records and their adoption
(workers.py), the slots' GPU claims (slotclaims.py), the owner signals (owners.py),
the nvidia-smi watch and each GPU's state (gpuwatch.py), the store link (link.py).

The state document it publishes (`daemon/<host>/state`) and the events it
appends are described in the package docstring (__init__.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from dataclasses import replace
from typing import Any, Mapping

from .. import files
from ..protocol import EventKind, add_event, event_document, put_dead, put_leave
from . import courtesy, procs
from .config import DaemonConfig, data_plane, worker_env
from .forkserver import ForkServer
from .history import History
from .gpuwatch import (Ownership, SmiPoller, WatchHealth, WatchResult, classify_pid, descendants, gpu_states,
                       intruders)
from ..store.auth import Forgeries
from .link import StoreLink
from .logic import (
    Decision, Exit, Foreign, Kill, Leave, MarkStopping, Memory, Note, RecordYield, Start, View,
    WorkerState, decide, exit_outcome, first_incarnation, followed_slots,
)
from .owners import OwnerSignals
from .slotclaims import SlotClaims
from .workers import Worker, adopt, cause as cause_of

log = logging.getLogger("eltctl_runtime.daemon")

TICK_S = 0.1
ADOPTED_VERDICT_S = 1.0  # a few store polls (0.25 s each)
# A worker that exited 0 unasked: the runtime wrote `done` first, so a few store polls
# tell whether `eltctl down` stopped it or the job finished (the usage ledger's how).
DONE_VERDICT_S = 2.0
STATE_EVERY_S = 1.0
EXIT_OK, EXIT_CONFIG, EXIT_RUNNING = 0, 2, 3


class Daemon:
    """The executor: observes (workers, GPUs, the store), calls `decide`, acts.
    Nothing happens until `run()`."""

    def __init__(self, cfg: DaemonConfig, base_env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self._base_env = dict(base_env)
        self._dir = cfg.job_dir
        self._workers_dir = cfg.job_dir / "workers"
        self._memory_path = cfg.job_dir / "daemon.memory.json"
        self._lock = procs.PidLock(cfg.job_dir / "daemon.pid")
        self._forgeries = Forgeries()  # forged store values the link read (the state document's `forged`)
        self._link = StoreLink(cfg.store, cfg.job, cfg.host, secret=cfg.secret, forgeries=self._forgeries,
                               run_file=cfg.run_file)
        self._poller: SmiPoller | None = None
        self._memory = Memory()
        self._workers: dict[int, Worker] = {}
        self._ended: dict[int, dict] = {}  # slot -> the last ended worker (for the state document)
        self._history = History(cfg.job_dir / "history.json")  # every ended worker, for the usage ledger
        self._foreign: dict[int, Foreign] = {}
        self._watch: dict[str, Any] = {"health": WatchHealth.NONE.value, "reason": "", "since": time.time()}
        self._gpu_states: dict[int, tuple[str, str, float]] = {}  # index -> (state, reason, since)
        # the slots it has: fixed at its start, but for a daemon that follows its GPUs
        # (cfg.follow_gpus: the probe's list, not the inventory's), what nvidia-smi lists
        self._valid_slots = cfg.valid_slots
        self._last_watch: WatchResult | None = None
        self._terminating = False
        self._crashes = 0
        self._phase = "running"
        self._started = time.time()
        self._owners = OwnerSignals(cfg)  # watched from run() when the config names owner signals
        self._claims = SlotClaims(cfg, self._base_env)  # GPU claims (runtime/claims.py)
        self._forks = ForkServer(cfg.host, cfg.job)  # the workers' interpreter with torch imported (forkserver.py)

    # -- life ------------------------------------------------------------------
    def run(self, ready=None) -> int:
        """Run until stopped. `ready(message)` is called once the pid file is held
        (or another daemon was found): --detach answers its parent with it."""
        self._workers_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except procs.AlreadyRunning as e:
            log.error("host %s: another daemon of job %s already runs here (pid %s); this one exits",
                      self.cfg.host, self.cfg.job, e.pid)
            if ready:
                ready(f"running {e.pid}")
            return EXIT_RUNNING
        clean = False
        try:
            log.info("host %s: daemon pid %d of job %s starts (store %s, %s)", self.cfg.host, os.getpid(),
                     self.cfg.job, self.cfg.store,
                     f"GPUs {list(self.cfg.gpus)}{' (following nvidia-smi)' if self.cfg.follow_gpus else ''}"
                     if self.cfg.gpus is not None else
                     ("any GPU" if self.cfg.device == "cuda" else f"{self.cfg.slots} CPU slot(s)"))
            log.info("host %s: workers run with %s", self.cfg.host,
                     courtesy.describe(self.cfg.courtesy, self.cfg.device))
            self._data_plane()
            self._install_signals()
            if ready:
                ready(f"ok {os.getpid()}")
            self._load_memory()
            self._link.floor(self._memory.seq_applied)  # a replayed older desired document is never applied
            self._history.load()
            self._adopt()
            self._memory = replace(self._memory, next_incarnation=first_incarnation(
                self._memory.next_incarnation, 0, self._started))
            self._save_memory()
            smi = shutil.which("nvidia-smi", path=self._base_env.get("PATH", os.defpath))
            if smi is None:
                log.info("host %s: no nvidia-smi on PATH: a CPU-only host, no GPU watch", self.cfg.host)
            elif not self.cfg.gpu_host:
                smi = None  # CPU slots only: nothing of ours to watch
            self._poller = SmiPoller(smi, self.cfg.watch_interval, self.cfg.nvidia_smi_timeout, self._base_env)
            self._owners.start(self._base_env)
            self._link.start()
            clean = self._loop()
        except Exception:
            log.exception("host %s: the daemon failed; its workers keep running and the next daemon adopts them",
                          self.cfg.host)
            raise
        finally:
            if self._poller is not None:
                self._poller.close()
            self._forks.close()
            self._phase = "stopped" if clean else "failed"
            self._link.publish_state(self._state_doc(), urgent=True)
            self._link.close(flush_s=5.0)
            if clean:
                files.remove(self._memory_path)
            self._lock.release()
            log.info("host %s: daemon pid %d exits", self.cfg.host, os.getpid())
        return EXIT_OK

    def _install_signals(self) -> None:
        def terminate(signum, _frame):
            if not self._terminating:
                log.info("host %s: %s received: the workers leave in the planned way, then the daemon exits",
                         self.cfg.host, signal.Signals(signum).name)
            self._terminating = True

        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGINT, terminate)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the SSH session that started us may end

    def _loop(self) -> bool:
        next_state = 0.0
        while True:
            now = time.monotonic()
            self._forks.tick(now)
            self._reap(now)
            self._observe_claims(now)
            self._observe_gpus(now)
            self._owners.observe(now)
            decision = self._decide(now)
            if decision.memory != self._memory:
                self._memory = decision.memory
                self._save_memory()
                self._link.floor(self._memory.seq_applied)
            done = self._act(decision, now)
            if self._terminating or (self._link.desired() and self._link.desired().stop):
                self._phase = "stopping"
            if done:
                return True
            if now >= next_state:
                next_state = now + STATE_EVERY_S
                self._link.publish_state(self._state_doc())
            time.sleep(TICK_S)

    # -- memory and adoption -----------------------------------------------------
    def _load_memory(self) -> None:
        raw = files.read_json(self._memory_path)
        if raw is not None:
            try:
                self._memory = Memory.from_json(json.dumps(raw))
                log.info("host %s: resuming from memory: desired seq %s applied, next incarnation %d",
                         self.cfg.host, self._memory.seq_applied, self._memory.next_incarnation)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("host %s: ignoring unreadable %s: %s", self.cfg.host, self._memory_path, e)

    def _save_memory(self) -> None:
        files.write_atomic(self._memory_path, self._memory.to_json())

    def _adopt(self) -> None:
        """Take over the workers an earlier daemon of this job and host left running."""
        self._workers, highest = adopt(self._workers_dir, self.cfg.job, self.cfg.host, self._memory.leaving)
        if highest >= self._memory.next_incarnation:
            self._memory = replace(self._memory, next_incarnation=highest + 1)
            self._save_memory()

    # -- observe -------------------------------------------------------------------
    def _reap(self, now: float) -> None:
        for slot, w in list(self._workers.items()):
            if w.proc is not None and getattr(w.proc, "orphaned", False):
                w.proc = None  # its fork server died: no exit status will come; watched as an adopted worker
            if w.proc is not None:
                rc = w.proc.poll()
                if rc is None:
                    continue
                if rc == 0 and not self._link.job_done and not w.state.asked_to_go and self._link.connected:
                    w.gone_since = now if w.gone_since is None else w.gone_since
                    if now - w.gone_since < DONE_VERDICT_S:
                        continue
            elif procs.worker_identity(w.pid, self.cfg.job) == w.worker_id:  # alive, and not a reused pid
                continue
            else:
                rc = None
                # An adopted worker's exit status is unknown: before calling it lost,
                # give the store link a moment to learn that it left or the job ended.
                known = w.worker_id in self._link.departed() or self._link.job_done
                if not known and not w.state.asked_to_go:
                    w.gone_since = now if w.gone_since is None else w.gone_since
                    if now - w.gone_since < ADOPTED_VERDICT_S:
                        continue
            self._ended_worker(w, rc)

    def _ended_worker(self, w: Worker, rc: int | None) -> None:
        out = exit_outcome(rc, w.state, left_job=w.worker_id in self._link.departed(),
                           job_done=self._link.job_done,
                           joined=w.proc is None or w.worker_id in self._link.joined())
        cause = cause_of(self._workers_dir, w) if out.crash_event else ""
        if out.state is WorkerState.FINISHED and self._link.done_reason == "stop":
            self._history.note_why(w.worker_id, "down")  # it saw the stop before this daemon did
        elif out.state is WorkerState.FINISHED and self._link.done_reason == "failed":
            self._history.note_why(w.worker_id, "failed")  # restart mode: the script hit max_restarts
        ran_s = round(time.monotonic() - w.since, 1) if out.at_start else None
        del self._workers[w.slot]
        self._history.ended(w.worker_id, w.slot, w.start_wall or w.since_wall, time.time(), out.state.value)
        files.remove(self._workers_dir / f"{w.slot}.pid")
        cfg = self.cfg
        if out.report_dead:
            wid = w.worker_id
            self._link.send(f"the death report of {wid}", lambda js: put_dead(js, wid))
        detail = f"{out.detail}: {cause}" if cause else out.detail
        if out.crash_event:
            self._crashes += 1
            self._event(EventKind.CRASH, [w.worker_id], f"worker {w.worker_id} (pid {w.pid}) {detail}",
                        cause=cause, at_start=out.at_start, exit_code=rc, ran_s=ran_s)
        level = logging.WARNING if out.state in (WorkerState.CRASHED, WorkerState.KILLED, WorkerState.LOST) \
            else logging.INFO
        log.log(level, "host %s: worker %s (pid %d, slot %d) %s: %s%s", cfg.host, w.worker_id, w.pid, w.slot,
                out.state.value, detail, "; reported dead" if out.report_dead else "")
        self._ended[w.slot] = {"slot": w.slot, "worker_id": w.worker_id, "pid": w.pid, "state": out.state.value,
                               "since": round(time.time(), 3), "adopted": w.proc is None, "detail": detail,
                               "exit_code": rc, "cause": cause, "at_start": out.at_start,
                               # where its own output begins in workers/<slot>.log (`eltctl logs --failed`)
                               "log_offset": w.log_offset if w.proc is not None else None}

    def _observe_gpus(self, now: float) -> None:
        if self._poller is None:
            return
        result = self._poller.poll(now)
        if result is None:
            return
        previous = self._watch["health"]
        if result.health.value != previous:
            self._watch = {"health": result.health.value, "reason": result.reason, "since": time.time()}
            if result.health in (WatchHealth.FAILED, WatchHealth.HUNG):
                log.warning("host %s: the GPU watch is unhealthy: %s; the workers keep running", self.cfg.host,
                            result.reason)
            elif result.health is WatchHealth.OK and previous != WatchHealth.NONE.value:
                log.info("host %s: the GPU watch answers again", self.cfg.host)
        self._watch["last_s"] = round(result.duration_s, 3)
        self._watch["reason"] = result.reason
        if result.health is not WatchHealth.OK:
            self._foreign = {}  # no information is not a reason to evict anyone
            self._last_watch = result
            return
        self._last_watch = result
        if self.cfg.follow_gpus:
            self._follow_gpus(result)
        ours_roots = {w.pid for w in self._workers.values()}
        closed: frozenset[int] | None = None
        ownership: dict[int, Ownership] = {}
        other_job: dict[int, str] = {}  # pid -> the other eltctl job its environment names
        for app in result.apps:
            if app.pid in ours_roots:
                ownership[app.pid] = Ownership.OURS
                continue
            if closed is None:
                closed = descendants(ours_roots, procs.parent_map())
            env = procs.environ_of(app.pid)
            ownership[app.pid] = classify_pid(app.pid, closed, procs.is_visible(app.pid),
                                              env.get("ELTCTL_JOB") if env else None, self.cfg.job,
                                              claimed_by_its_user=env is None
                                              and self._claims.claimed_by_user_of(app, result.gpus))
            if ownership[app.pid] is Ownership.TAKEN and env and env.get("ELTCTL_JOB"):
                other_job[app.pid] = env["ELTCTL_JOB"]
        watched = {w.slot for w in self._workers.values() if w.state is WorkerState.RUNNING} | set(self._memory.armed)
        found = intruders(result.gpus, result.apps, watched, ownership)
        foreign: dict[int, Foreign] = {}
        for i in found:
            if i.gpu not in foreign:
                foreign[i.gpu] = Foreign(i.pid, procs.user_of(i.pid) or "an unknown user")
        self._foreign = foreign
        # The GPUs' states for the state document.
        states = gpu_states(result.gpus, result.apps, ownership, {s: w.worker_id for s, w in self._workers.items()},
                            {i: c.describe() for i, c in self._claims.taken.items()}, other_job)
        for index, (state, reason) in states.items():
            old = self._gpu_states.get(index)
            since = old[2] if old and old[0] == state else time.time()
            self._gpu_states[index] = (state, reason, since)

    def _follow_gpus(self, result: WatchResult) -> None:
        """The host's GPU list as this round's nvidia-smi gives it (logic.followed_slots): a
        GPU that was not seen when the daemon was configured (a driver reset, a probe that
        caught it mid-change) is used once it is listed, with no new daemon; one that is
        gone is refused to later desired documents (its worker, if any, ends on its own)."""
        new = followed_slots(self._valid_slots, (g.index for g in result.gpus))
        if new != self._valid_slots:
            log.warning("host %s: nvidia-smi now lists GPUs %s (the daemon had %s): its slots follow",
                        self.cfg.host, sorted(new or ()), sorted(self._valid_slots or ()))
            self._valid_slots = new

    def _decide(self, now: float) -> Decision:
        view = View(
            now=now, wall=time.time(), host=self.cfg.host, desired=self._link.desired(), memory=self._memory,
            workers=tuple(w.view() for w in self._workers.values()), foreign=dict(self._foreign),
            terminating=self._terminating, valid_slots=self._valid_slots,
            departed=self._link.departed(), leave_timeout=self.cfg.leave_timeout,
            stop_timeout=self.cfg.stop_timeout, evict_grace=self.cfg.evict_grace,
            owner_leave=self._owners.verdict.leave if self._owners.verdict else None,
            owner_wait=self._owners.verdict.wait if self._owners.verdict else None,
            owner_pending=self._owners.pending,
        )
        return decide(view)

    # -- act ---------------------------------------------------------------------
    def _act(self, decision: Decision, now: float) -> bool:
        done = False
        for a in decision.actions:
            if isinstance(a, Start):
                self._start(a.slot, a.worker_id, now)
            elif isinstance(a, Leave):
                self._leave(a, now)
            elif isinstance(a, MarkStopping):
                w = self._workers[a.slot]
                self._history.note_why(a.worker_id, "down")
                w.state, w.since, w.since_wall = WorkerState.STOPPING, now, time.time()
                log.info("host %s: the job is stopping; waiting for worker %s (pid %d) to exit", self.cfg.host,
                         a.worker_id, w.pid)
            elif isinstance(a, Kill):
                w = self._workers[a.slot]
                log.log(logging.INFO if a.evict else logging.WARNING, "host %s: killing worker %s (pid %d): %s",
                        self.cfg.host, a.worker_id, w.pid, a.reason)
                procs.signal_group(w.pid, signal.SIGKILL)
                w.state = WorkerState.EVICTED if a.evict else WorkerState.KILLED
                w.since, w.since_wall = now, time.time()
            elif isinstance(a, RecordYield):
                r = a.record
                if a.worker_id:
                    self._history.note_why(a.worker_id, "yield")
                if r.signal:
                    detail = (f"owner signal {r.signal}: {r.user}; " +
                              (f"worker {a.worker_id} leaves" if a.worker_id else f"no worker started on slot {r.slot}"))
                elif a.worker_id:
                    detail = f"{r.user} (pid {r.pid}) took GPU {r.slot}; worker {a.worker_id} leaves"
                else:
                    detail = f"{r.user} (pid {r.pid}) holds GPU {r.slot}; no worker started there"
                log.warning("host %s: %s", self.cfg.host, detail)
                self._event(EventKind.YIELD, [a.worker_id] if a.worker_id else [], detail)
            elif isinstance(a, Note):
                log.info("%s", a.message)
            elif isinstance(a, Exit):
                log.info("host %s: %s; the daemon stops", self.cfg.host, a.reason)
                done = True
        return done

    def _data_plane(self) -> None:
        """Name the data plane's interface to the workers (config.data_plane, runtime/netif.py)."""
        try:
            plane, env = data_plane(self.cfg, self._base_env)
        except (OSError, ValueError) as e:  # an interface that vanished since load; no table
            log.warning("host %s: the data plane's interface is unknown (%s); gloo and NCCL choose their own",
                        self.cfg.host, e)
            return
        self._base_env.update(env)
        if plane.interface is None:
            log.warning("host %s: no interface holds the data-plane address %s; gloo and NCCL choose their own "
                        "interface (set data_interface in the inventory)", self.cfg.host, plane.address)
        else:
            log.info("host %s: data plane on interface %s (%s, from %s)", self.cfg.host, plane.interface,
                     plane.address, "the inventory's data_interface" if plane.source == "inventory"
                     else "the host's address")

    def _start(self, slot: int, wid: str, now: float) -> None:
        cfg = self.cfg
        log_path = self._workers_dir / f"{slot}.log"
        env = worker_env(cfg, self._base_env, slot, wid)
        env["ELTCTL_STORE"] = self._link.address  # the direct mode's keeper may have moved since daemon.json
        try:
            offset = log_path.stat().st_size
        except OSError:
            offset = 0
        held = self._claims.claim(slot, wid)
        if held is False:
            return
        try:
            fds = (held.fd,) if held else ()  # restart mode's supervisor: not forked (it forks its scripts' warm interpreters itself)
            proc = (None if cfg.mode == "restart" else
                    self._forks.try_spawn(cfg.argv, env, cfg.code_dir, log_path, cfg.courtesy, cfg.device, fds)) \
                or procs.start_worker(cfg.argv, env, cfg.code_dir, log_path, cfg.courtesy, cfg.device, pass_fds=fds)
        except OSError as e:
            if held:
                held.close()
            detail = f"could not be started: {e.strerror or e} ({cfg.argv[0]}, in {cfg.code_dir})"
            log.error("host %s: worker %s %s", cfg.host, wid, detail)
            self._crashes += 1
            cause = f"{cfg.argv[0]}: {e.strerror or e}"
            self._event(EventKind.CRASH, [wid], f"worker {wid} {detail}", cause=cause, at_start=True,
                        exit_code=None, ran_s=0.0)
            self._history.ended(wid, slot, time.time(), time.time(), WorkerState.CRASHED.value)
            self._ended[slot] = {"slot": slot, "worker_id": wid, "pid": None, "state": WorkerState.CRASHED.value,
                                 "since": round(time.time(), 3), "adopted": False, "detail": detail,
                                 "exit_code": None, "cause": cause, "at_start": True}
            return
        if held:
            held.record(replace(held.claim, pid=proc.pid))
            held.close()  # the worker holds the claim now, for exactly its life
        files.write_atomic(self._workers_dir / f"{slot}.pid", f"{proc.pid}\n")
        self._workers[slot] = Worker(slot, wid, proc.pid, proc, WorkerState.RUNNING, now, time.time(),
                                     log_offset=offset, start_wall=time.time())
        self._ended.pop(slot, None)
        log.info("host %s: started worker %s (pid %d) on %s %d; log %s", cfg.host, wid, proc.pid,
                 "GPU" if cfg.gpu_host else "CPU slot", slot, log_path)

    def _observe_claims(self, now: float) -> None:
        """Which of this host's slots without a worker of ours another job holds (slotclaims.py)."""
        slots = set(self.cfg.valid_slots or ()) | set(self._memory.wanted)
        if self._last_watch is not None:
            slots |= {g.index for g in self._last_watch.gpus}
        self._claims.observe(now, slots, self._workers)

    def _leave(self, a: Leave, now: float) -> None:
        w = self._workers[a.slot]
        wid = a.worker_id
        self._link.send(f"the leave request of {wid}", lambda js: put_leave(js, wid))
        stop = self._terminating or bool(self._link.desired() and self._link.desired().stop)
        self._history.note_why(wid, "down" if stop else "planned")
        # SIGTERM too: the runtime leaves at the next step boundary even if the store is away.
        try:
            os.kill(w.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        w.state, w.since, w.since_wall = WorkerState.LEAVING, now, time.time()
        log.info("host %s: worker %s (pid %d) leaves in the planned way: %s", self.cfg.host, wid, w.pid, a.reason)

    def _event(self, kind: EventKind, workers: list[str], detail: str, **extra: Any) -> None:
        if kind is EventKind.CRASH and self.cfg.config:  # the controller tells a failure of what it
            extra.setdefault("config", self.cfg.config)  # shipped before a fix by it
        ev = event_document(kind, host=self.cfg.host, workers=workers, detail=detail, **extra)
        self._link.send(f"a {kind.value} event", lambda js: add_event(js, ev))

    # -- report ------------------------------------------------------------------
    def _state_doc(self) -> dict:
        now = time.time()
        workers = [w.to_dict() for w in sorted(self._workers.values(), key=lambda w: w.slot)]
        workers += [e for s, e in sorted(self._ended.items()) if s not in self._workers]
        healthy = self._watch["health"] in (WatchHealth.OK.value, WatchHealth.NONE.value)
        if self._poller is not None and self._poller.enabled and healthy:
            gpus = [{"index": i, "state": s, "reason": r, "since": round(t, 3)}
                    for i, (s, r, t) in sorted(self._gpu_states.items())]
        elif not healthy:
            known = sorted(self._gpu_states) or (sorted(self._valid_slots or ()) if self.cfg.gpus is not None else [])
            gpus = [{"index": i, "state": "unknown", "reason": self._watch["reason"], "since": self._watch["since"]}
                    for i in known]
        else:
            gpus = []
        m = self._memory
        return {
            "time": now, "heartbeat": now, "pid": os.getpid(), "started": self._started, "phase": self._phase,
            "host": self.cfg.host, "job": self.cfg.job, "seq_applied": m.seq_applied,
            # what its slots are (daemon.json's gpus and device; the kind for its whole life, the
            # GPUs following nvidia-smi with follow_gpus): the controller replaces a daemon whose
            # slots are not what the host has
            "slot_kind": "gpu" if self.cfg.gpu_host else "cpu",
            "valid_slots": sorted(self._valid_slots) if self._valid_slots is not None else None,
            "follows_gpus": self.cfg.follow_gpus,
            "config": self.cfg.config,  # what it was started with (daemon.json): replaced after a fix
            "wanted": sorted(m.wanted), "workers": workers, "gpus": gpus,
            "yielded": [y.to_dict() for y in m.yielded], "crashes": self._crashes,
            "history": self._history.entries(),
            **self._claims.doc(),  # taken, demands, refused
            "health": "ok" if healthy else "unhealthy", "watch": dict(self._watch),
            "store": {"connected": self._link.connected, "reconnects": 0, "last_error": self._link.error},
            "signal": self._owners.doc(), "forged": self._forgeries.counts(),
        }
