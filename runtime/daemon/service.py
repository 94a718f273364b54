"""The host daemon's executor: each tick it observes (its workers, the GPU watch,
the store link), calls the pure `logic.decide`, and acts (starts, signals and
reaps workers, writes pid and memory files, queues store messages).

The state document it publishes (`daemon/<host>/state`) and the events it
appends are described in the package docstring (__init__.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .. import claims, files
from ..owner import OwnerSignal, OwnerWatch, Sources, Verdict
from ..pids import read_pid_file
from ..protocol import EventKind, add_event, event_document, put_dead, put_leave
from . import courtesy, procs
from .config import DaemonConfig, data_plane, worker_env
from .history import History, process_start
from .gpuwatch import Ownership, SmiPoller, WatchHealth, WatchResult, classify_pid, descendants, intruders
from ..store.auth import Forgeries
from .link import StoreLink
from .logic import (
    Decision, Exit, Foreign, Kill, Leave, MarkStopping, Memory, Note, RecordYield, Start, View,
    TAIL_BYTES, WorkerState, WorkerView, cause_line, decide, exit_outcome, first_incarnation, followed_slots,
    incarnation_of,
)

log = logging.getLogger("eltctl_runtime.daemon")

TICK_S = 0.1
ADOPTED_VERDICT_S = 1.0  # a few store polls (0.25 s each)
# A worker that exited 0 unasked: the runtime wrote `done` first, so a few store polls
# tell whether `eltctl down` stopped it or the job finished (the usage ledger's how).
DONE_VERDICT_S = 2.0
STATE_EVERY_S = 1.0
EXIT_OK, EXIT_CONFIG, EXIT_RUNNING = 0, 2, 3


@dataclass
class _Worker:
    """The executor's record of one worker process (mutable: it is bookkeeping)."""

    slot: int
    worker_id: str
    pid: int
    proc: subprocess.Popen | None  # None: adopted from an earlier daemon (not our child)
    state: WorkerState
    since: float  # monotonic
    since_wall: float
    detail: str = ""
    gone_since: float | None = None  # monotonic: when an adopted worker was first seen gone
    log_offset: int = 0  # the size of its log when it started: its own output begins there
    start_wall: float = 0.0  # when its process started (wall clock): the usage ledger's start

    def view(self) -> WorkerView:
        return WorkerView(self.slot, self.worker_id, self.pid, self.state, self.since)

    def to_dict(self) -> dict:
        return {"slot": self.slot, "worker_id": self.worker_id, "pid": self.pid, "state": self.state.value,
                "since": round(self.since_wall, 3), "adopted": self.proc is None, "detail": self.detail,
                "start": round(self.start_wall or self.since_wall, 3)}


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
        self._workers: dict[int, _Worker] = {}
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
        self._owner: OwnerWatch | None = None  # made in run() when the config watches owner signals
        self._owner_verdict: Verdict | None = None  # None: not judged yet
        self._owner_next = 0.0
        self._owner_fired: OwnerSignal | None = None  # the leave signal last logged
        # GPU claims (runtime/claims.py): slot -> the other job's claim that keeps us off it
        self._claims_dir = claims.claims_dir(cfg.claims_dir, self._base_env)
        self._taken: dict[int, claims.Claim] = {}
        self._claims_next = 0.0
        # the fair-share demand entries of the jobs sharing the host (the state's `demands`)
        self._demand_reader = claims.DemandReader(self._claims_dir)
        self._demands: list[dict] = []
        self._claims_problem = ""
        # entries of the claims directory not believed (claims.judge): name -> Refusal, each watch interval
        self._refused: dict[str, claims.Refusal] = {}

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
            if self.cfg.owner.enabled:
                self._owner = OwnerWatch(self.cfg.owner, Sources.from_env(self._base_env))
                self._owner.look(time.monotonic(), time.time())  # the first of the two looks a load rate needs
                self._owner_next = time.monotonic() + min(0.5, self.cfg.watch_interval)
                log.info("host %s: watching owner signals %s (user %s is not an owner)", self.cfg.host,
                         ", ".join(self.cfg.owner.signals), self._owner.user)
            self._link.start()
            clean = self._loop()
        except Exception:
            log.exception("host %s: the daemon failed; its workers keep running and the next daemon adopts them",
                          self.cfg.host)
            raise
        finally:
            if self._poller is not None:
                self._poller.close()
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
            self._reap(now)
            self._observe_claims(now)
            self._observe_gpus(now)
            self._observe_owner(now)
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
        highest = 0
        for pid_file in sorted(self._workers_dir.glob("*.pid")):
            if not pid_file.stem.isdigit():
                continue
            slot = int(pid_file.stem)
            pid = read_pid_file(pid_file)
            wid = procs.worker_identity(pid, self.cfg.job) if pid else None
            if wid is None or not wid.startswith(f"{self.cfg.host}/{slot}/"):
                log.info("host %s: %s names no live worker of this job (pid %s); removing it", self.cfg.host,
                         pid_file.name, pid)
                files.remove(pid_file)
                continue
            state = WorkerState.LEAVING if wid in self._memory.leaving else WorkerState.RUNNING
            self._workers[slot] = _Worker(slot, wid, pid, None, state, time.monotonic(), time.time(),
                                          detail="adopted", start_wall=process_start(pid) or time.time())
            highest = max(highest, incarnation_of(wid) or 0)
            log.info("host %s: adopted worker %s (pid %d) on slot %d, %s", self.cfg.host, wid, pid, slot,
                     state.value)
        # A daemon killed between starting a worker and writing its pid file leaves
        # a worker without one: find it by its environment.
        known = {w.pid for w in self._workers.values()}
        for pid, wid in procs.session_leaders_of(self.cfg.job, f"{self.cfg.host}/").items():
            parts = wid.split("/")
            if pid in known or len(parts) < 3 or not parts[-2].isdigit() or int(parts[-2]) in self._workers:
                continue
            slot = int(parts[-2])
            state = WorkerState.LEAVING if wid in self._memory.leaving else WorkerState.RUNNING
            self._workers[slot] = _Worker(slot, wid, pid, None, state, time.monotonic(), time.time(),
                                          detail="adopted", start_wall=process_start(pid) or time.time())
            files.write_atomic(self._workers_dir / f"{slot}.pid", f"{pid}\n")
            highest = max(highest, incarnation_of(wid) or 0)
            log.info("host %s: adopted worker %s (pid %d) on slot %d, found without a pid file", self.cfg.host,
                     wid, pid, slot)
        if highest >= self._memory.next_incarnation:
            self._memory = replace(self._memory, next_incarnation=highest + 1)
            self._save_memory()

    # -- observe -------------------------------------------------------------------
    def _reap(self, now: float) -> None:
        for slot, w in list(self._workers.items()):
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

    def _ended_worker(self, w: _Worker, rc: int | None) -> None:
        out = exit_outcome(rc, w.state, left_job=w.worker_id in self._link.departed(),
                           job_done=self._link.job_done,
                           joined=w.proc is None or w.worker_id in self._link.joined())
        cause = self._cause(w) if out.crash_event else ""
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

    def _cause(self, w: _Worker) -> str:
        """The line of its log (from where its own output began) that says why it ended."""
        path = self._workers_dir / f"{w.slot}.log"
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = w.log_offset if w.proc is not None and w.log_offset <= size else 0
                f.seek(max(start, size - TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return cause_line(text)

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
                                              claimed_by_its_user=env is None and self._claimed_by_user_of(app))
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
        by_uuid = {g.uuid: g.index for g in result.gpus}
        foreign_on: dict[int, list[int]] = {}
        taken_on: dict[int, list[int]] = {}
        for app in result.apps:
            if ownership.get(app.pid) is Ownership.FOREIGN and app.gpu_uuid in by_uuid:
                foreign_on.setdefault(by_uuid[app.gpu_uuid], []).append(app.pid)
            elif ownership.get(app.pid) is Ownership.TAKEN and app.gpu_uuid in by_uuid:
                taken_on.setdefault(by_uuid[app.gpu_uuid], []).append(app.pid)
        for g in result.gpus:
            w = self._workers.get(g.index)
            if g.index in foreign_on:
                state, reason = "busy", "used by pid " + ", ".join(map(str, sorted(foreign_on[g.index])))
            elif w is not None:
                state, reason = "ours", f"worker {w.worker_id}"
            elif g.index in self._taken or g.index in taken_on:
                state, reason = "taken", self._taken_reason(g.index, taken_on.get(g.index, ()), other_job)
            else:
                state, reason = "free", ""
            old = self._gpu_states.get(g.index)
            since = old[2] if old and old[0] == state else time.time()
            self._gpu_states[g.index] = (state, reason, since)

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

    def _observe_owner(self, now: float) -> None:
        if self._owner is None or now < self._owner_next:
            return
        self._owner_next = now + self.cfg.watch_interval
        v = self._owner.step(now, time.time())
        self._owner_verdict = v
        if v.leave is not None and (self._owner_fired is None or self._owner_fired.name != v.leave.name):
            log.warning("host %s: owner signal %s: %s; the workers here leave", self.cfg.host, v.leave.name,
                        v.leave.detail)
        elif v.holding is None and self._owner_fired is not None:
            log.info("host %s: the owner signals are quiet again (%s idle)", self.cfg.host,
                     ", ".join(self.cfg.owner.signals))
        if v.leave is not None or v.holding is None:
            self._owner_fired = v.leave

    def _decide(self, now: float) -> Decision:
        view = View(
            now=now, wall=time.time(), host=self.cfg.host, desired=self._link.desired(), memory=self._memory,
            workers=tuple(w.view() for w in self._workers.values()), foreign=dict(self._foreign),
            terminating=self._terminating, valid_slots=self._valid_slots,
            departed=self._link.departed(), leave_timeout=self.cfg.leave_timeout,
            stop_timeout=self.cfg.stop_timeout, evict_grace=self.cfg.evict_grace,
            owner_leave=self._owner_verdict.leave if self._owner_verdict else None,
            owner_wait=self._owner_verdict.wait if self._owner_verdict else None,
            owner_pending=self._owner is not None and self._owner_verdict is None,
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
        held = self._claim(slot, wid)
        if held is False:
            return
        try:
            proc = procs.start_worker(cfg.argv, env, cfg.code_dir, log_path, cfg.courtesy, cfg.device,
                                      pass_fds=(held.fd,) if held else ())
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
        self._workers[slot] = _Worker(slot, wid, proc.pid, proc, WorkerState.RUNNING, now, time.time(),
                                      log_offset=offset, start_wall=time.time())
        self._ended.pop(slot, None)
        log.info("host %s: started worker %s (pid %d) on %s %d; log %s", cfg.host, wid, proc.pid,
                 "GPU" if cfg.gpu_host else "CPU slot", slot, log_path)

    # -- GPU claims (runtime/claims.py) ------------------------------------------------
    def _claim_name(self, slot: int) -> str:
        return claims.slot_file(slot, gpu=self.cfg.gpu_host, host=self.cfg.host)

    def _claim(self, slot: int, wid: str) -> "claims.Held | None | bool":
        """Claim the slot for the worker `wid` about to start: the Held claim; None when
        the worker starts without one (the directory cannot be used, or a lingering
        process of this job still holds it); False when another job holds it (the slot
        is then taken: nothing starts, no yield, no crash)."""
        cfg = self.cfg
        mine = claims.Claim(job=cfg.job, user=procs.user_of(os.getpid()) or "", host=cfg.host, slot=slot,
                            pid=os.getpid(), since=round(time.time(), 3))
        try:
            held = claims.take(self._claims_dir, self._claim_name(slot), mine)
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
            if str(e) != self._claims_problem:
                self._claims_problem = str(e)
                log.warning("host %s: %s; workers start without GPU claims, so another eltctl job could start "
                            "on the same GPU", cfg.host, e)
            return None
        self._claims_problem = ""
        self._taken.pop(slot, None)
        return held

    def _set_taken(self, slot: int, holder: "claims.Claim | None") -> None:
        old = self._taken.get(slot)
        if holder is None:
            if old is not None:
                self._taken.pop(slot)
                log.info("host %s: %s %d is no longer claimed by %s", self.cfg.host,
                         "GPU" if self.cfg.gpu_host else "CPU slot", slot, old.describe())
            return
        self._taken[slot] = holder
        if old is None or old.job != holder.job:
            log.info("host %s: %s %d is taken by %s: no worker of this job starts there", self.cfg.host,
                     "GPU" if self.cfg.gpu_host else "CPU slot", slot, holder.describe())

    def _observe_claims(self, now: float) -> None:
        """Every watch interval: which of this host's slots without a worker of ours another
        job holds (their claims), for the state document's `taken` and the GPU states."""
        if now < self._claims_next:
            return
        self._claims_next = now + self.cfg.watch_interval
        refused: list[claims.Refusal] = []
        try:
            problem = claims.check_dir(self._claims_dir) if self._claims_dir.exists() else None
        except claims.ClaimError as e:  # not trusted at all: nothing in it keeps us off a GPU
            self._demands = []
            self._refused = {str(self._claims_dir): claims.Refusal(str(self._claims_dir), "?", str(e))}
            for slot in list(self._taken):
                self._set_taken(slot, None)
            return
        refused += [problem] if problem else []
        self._demands = self._demand_reader.read(time.time())
        refused += self._demand_reader.refused
        slots = set(self.cfg.valid_slots or ()) | set(self._memory.wanted)
        if self._last_watch is not None:
            slots |= {g.index for g in self._last_watch.gpus}
        for slot in sorted(slots):
            holder = claims.holder(self._claims_dir, self._claim_name(slot), refused=refused)
            if slot in self._workers:
                self._set_taken(slot, None)
                continue
            self._set_taken(slot, holder if holder is not None and holder.job != self.cfg.job else None)
        self._note_refused(refused, fresh=True)

    def _note_refused(self, refused, fresh: bool = False) -> None:
        """Keep the refused entries (claims.Refusal) for the state document (`fresh`: the
        whole list of this look, replacing the last); log each new one once."""
        before = self._refused
        self._refused = {} if fresh else dict(before)
        for r in refused:
            key = f"{r.file} {r.owner}"
            if key not in before:
                log.warning("host %s: not believed in the GPU claims directory: %s", self.cfg.host, r.describe())
            self._refused[key] = r

    def _claimed_by_user_of(self, app) -> bool:
        """An unreadable process (another user's) on a GPU another job claims as that user."""
        index = next((g.index for g in (self._last_watch.gpus if self._last_watch else ()) if g.uuid == app.gpu_uuid),
                     None)
        claim = self._taken.get(index) if index is not None else None
        return claim is not None and bool(claim.user) and claim.user == procs.user_of(app.pid)

    def _taken_reason(self, index: int, pids, other_job: Mapping[int, str]) -> str:
        claim = self._taken.get(index)
        if claim is not None:
            return f"taken by {claim.describe()}"
        jobs = sorted({other_job[p] for p in pids if p in other_job})
        who = f"job {', '.join(jobs)}" if jobs else "another eltctl job"
        return f"taken by {who} (pid {', '.join(map(str, sorted(pids)))})"

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
            "taken": {str(s): c.job for s, c in sorted(self._taken.items())},
            "health": "ok" if healthy else "unhealthy", "watch": dict(self._watch),
            "store": {"connected": self._link.connected, "reconnects": 0, "last_error": self._link.error},
            "signal": self._signal_doc(), "forged": self._forgeries.counts(),
            "demands": self._demands,
            # entries of the claims directory not believed, named with their owner (runtime/claims.py `judge`)
            "refused": claims.refusal_doc(self._refused.values()),
        }

    def _signal_doc(self) -> dict | None:
        """The owner signal that holds this host now (owner.OwnerSignal.to_dict), or None."""
        v = self._owner_verdict
        return v.holding.to_dict() if v is not None and v.holding is not None else None
