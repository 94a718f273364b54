"""The job's status as the controller tells it: its phase and the status document.

`next_phase` says which phase the job is in after a pass (pure); `waiting_message`
what a waiting job waits for (pure: it counts why slots are held back);
`start_failures` whether the job's workers failed at start on every host given
slots, so that `eltctl up` stops waiting (pure); `status_document`
builds the document `eltctl status` shows and the controller writes to status.json
and answers on its socket (its shape: docs/control-plane.md); `write_status` writes it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from eltctl.controller import observe
from eltctl.controller import policy as pol
from eltctl.controller.observe import DaemonSeen
from eltctl_runtime.files import write_json_atomic
from eltctl_runtime.protocol import NETWORK_FIELDS, WORKER_FIELDS
from eltctl.inventory import Inventory
from eltctl.sharedir import refused_of_state, refused_summary

log = logging.getLogger("eltctl.controller")

EVENTS_SHOWN = 20


class Phase:
    CONNECTING = "connecting"
    PROBING = "probing"
    SHIPPING = "shipping"
    STARTING = "starting"
    WAITING = "waiting"
    PAUSED = "paused"  # the limits (working hours, quotas, cordons) leave too few slots: resumes by itself
    TRAINING = "training"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"  # the training returned (rank 0's `done`, "finished"): every worker and daemon ended


def next_phase(phase: str, message: str, *, now: float, inventory: Inventory,
               runtime_status: Mapping | None, views: Mapping[str, pol.HostView],
               records: Mapping[str, pol.HostRecord], decision: pol.Decision,
               starting_daemons: bool, limits: Mapping[str, pol.Limit] | None = None) -> tuple[str, str]:
    """The phase and message after a pass that acted on `decision`."""
    running = sum(len(v.workers) for v in views.values())
    desired = any(records.get(h.name, pol.HostRecord()).desired for h in inventory.hosts)
    if running and current_members(runtime_status, views, now, inventory):
        return Phase.TRAINING, ""
    if (decision.waiting and not running) or start_failures(now=now, inventory=inventory, views=views,
                                                            records=records):
        # waiting, or every host given slots failed at start: say what holds the slots back
        return Phase.WAITING, waiting_message(now=now, inventory=inventory, views=views, records=records,
                                              limits=limits)
    if decision.message and not running and not desired:
        return Phase.STARTING, decision.message
    if starting_daemons:
        if phase == Phase.WAITING:  # no longer waiting: a fix or free slots, and daemons start
            return Phase.STARTING, "starting the hosts' daemons"
        return (Phase.SHIPPING if phase in (Phase.CONNECTING, Phase.PROBING) else phase), message
    if desired:
        return Phase.STARTING, "waiting for the first step" if running else "starting workers"
    return phase, message


def training_finished(done: Mapping | None) -> bool:
    """Whether rank 0's `done` (the store's key) says the training returned."""
    return isinstance(done, Mapping) and done.get("reason") == "finished"


def finished_message(step: Any, down: Mapping) -> str:
    """A finished job's message: where it ended, what was tidied, how to train on."""
    where = f"the training finished at step {step}" if step is not None else "the training finished"
    tidy = "every worker and daemon stopped" if down.get("ok") else str(down.get("message") or "")
    return (f"{where}; {tidy}. To train on, raise the job's steps (or change its code) and run `eltctl up`; "
            "to run it again unchanged: `eltctl down`, then `eltctl up`")


def current_members(runtime_status: Mapping | None, views: Mapping[str, pol.HostView], now: float,
                    inventory: Inventory) -> list[str]:
    """The members of rank 0's status that run now, when that status is the running
    job's: fresh, and naming at least one live worker. [] otherwise: a crashed run's last
    status (its workers gone, or replaced by new ones with new ids) describes no one."""
    rs = runtime_status or {}
    try:
        fresh = bool(rs) and now - float(rs.get("seen") or 0) < max(30.0, 3 * inventory.policy.hang_timeout)
    except (TypeError, ValueError):
        fresh = False
    return observe.live_members(rs, views) if fresh else []


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


def waiting_message(*, now: float, inventory: Inventory, views: Mapping[str, pol.HostView],
                    records: Mapping[str, pol.HostRecord], limits: Mapping[str, pol.Limit] | None = None) -> str:
    """What a job that waits for slots waits for: the free slots and, counted, why the
    others are held back (a failure's cooldown with its cause, an owner's, benching,
    busy GPUs, hosts unreachable, unhealthy, not probed yet, removed); then min_workers."""
    free = busy = busy_cpu = taken = taken_cpu = 0
    cooling: list[tuple[int, pol.HostRecord, str]] = []  # (slots, record, host)
    owner: list[int] = []
    straggler: list[int] = []
    benched: list[tuple[int, pol.HostRecord, str]] = []
    unreachable: list[str] = []
    unhealthy: list[str] = []
    unknown = removed = 0
    held: dict[str, int] = {}  # limit phase (off-hours, quota, cordoned, disabled) -> hosts
    for host in inventory.hosts:
        view = views.get(host.name)
        rec = records.get(host.name, pol.HostRecord())
        lim = (limits or {}).get(host.name, pol.NO_LIMIT)
        if lim.phase is not None and not rec.removed:
            held[lim.phase.value] = held.get(lim.phase.value, 0) + 1
            continue
        if rec.removed:
            removed += 1
            continue
        if view is None or view.reach is pol.Reach.UNKNOWN:
            unknown += 1
            continue
        if view.reach is pol.Reach.UNREACHABLE:
            unreachable.append(f"{host.name}: {view.reason}" if view.reason else host.name)
            continue
        if view.reach is pol.Reach.UNHEALTHY:
            unhealthy.append(f"{host.name}: {view.reason}" if view.reason else host.name)
            continue
        slots = [s for s in view.slots if s.index not in rec.desired and s.index not in view.workers]
        n_busy = sum(1 for s in slots if s.use is pol.GpuUse.BUSY and not rec.force)
        n_taken = sum(1 for s in slots if s.use is pol.GpuUse.TAKEN)
        others = len(slots) - n_busy - n_taken
        if view.reach is pol.Reach.CPU_ONLY:  # CPU slots: held by an owner signal or another job, no GPU
            busy_cpu += n_busy
            taken_cpu += n_taken
        else:
            busy += n_busy
            taken += n_taken
        waived = rec.join_now
        if not others:
            continue
        if rec.benched_until > now and not waived:
            benched.append((others, rec, host.name))
        elif rec.cooldown_until > now and not waived:
            cooling.append((others, rec, host.name))
        elif rec.owner_until > now and not waived:
            owner.append(others)
        elif rec.straggler_until > now and not waived:
            straggler.append(others)
        else:
            free += others
    parts = [f"{_n(free, 'slot')} free"] if free else []
    if cooling:
        n = sum(c for c, _, _ in cooling)
        first = cooling[0][1]
        parts.append(f"{_n(n, 'slot')} cooling down after a failure ({first.last_problem}; "
                     f"{first.cooldown_until - now:.0f} s more; {pol.next_step(cooling[0][2], first.last_problem)})")
    if owner:
        parts.append(f"{_n(sum(owner), 'slot')} cooling down after an owner came back")
    if straggler:
        parts.append(f"{_n(sum(straggler), 'slot')} resting after a straggler was dropped there")
    if benched:
        n = sum(c for c, _, _ in benched)
        first = benched[0][1]
        parts.append(f"{_n(n, 'slot')} on a benched host ({first.last_problem}; "
                     f"{first.benched_until - now:.0f} s more; {pol.next_step(benched[0][2], first.last_problem)})")
    if busy:
        parts.append(f"{_n(busy, 'GPU')} busy " + ("(its owner's process)" if busy == 1 else
                                                  "(their owners' processes)"))
    if busy_cpu:
        parts.append(f"{_n(busy_cpu, 'CPU slot')} held by {'its owner' if busy_cpu == 1 else 'their owners'} "
                     "(an owner signal)")
    if taken:
        parts.append(f"{_n(taken, 'GPU')} taken by another eltctl job")
    if taken_cpu:
        parts.append(f"{_n(taken_cpu, 'CPU slot')} taken by another eltctl job")
    if unreachable:
        parts.append(f"{_n(len(unreachable), 'host')} unreachable ({'; '.join(unreachable)})")
    if unhealthy:
        parts.append(f"{_n(len(unhealthy), 'host')} unhealthy ({'; '.join(unhealthy)})")
    if unknown:
        parts.append(f"{_n(unknown, 'host')} not probed yet")
    if removed:
        parts.append(f"{_n(removed, 'host')} removed (`eltctl scale --add` brings it back)")
    parts += [f"{_n(n, 'host')} {phase}" for phase, n in held.items()]
    return f"{', '.join(parts) or 'no slot free'}; min_workers is {inventory.job.min_workers}"


def start_failures(*, now: float, inventory: Inventory, views: Mapping[str, pol.HostView],
                   records: Mapping[str, pol.HostRecord]) -> dict[str, str]:
    """{host: cause} when the job's workers failed at start on every host given slots
    (none reached a first step) and no other host runs, starts or soon will start
    workers; {} otherwise. A failed host tried again counts as failed until one of its
    workers reaches a step (or a fix clears it): `up` then says why instead of waiting."""
    failed = {h.name: records[h.name].start_failure for h in inventory.hosts
              if h.name in records and records[h.name].start_failure and not records[h.name].removed}
    if not failed or any(v.in_job for v in views.values()):
        return {}
    for host in inventory.hosts:
        if host.name in failed:
            continue
        rec = records.get(host.name, pol.HostRecord())
        view = views.get(host.name)
        if rec.removed:
            continue
        if rec.desired or (view is not None and view.workers):
            return {}  # a host that did not fail runs or starts workers
        if view is not None and (pol.eligible_slots(view, rec, inventory, now)
                                 or pol.maturing_slots(view, rec, inventory, now)):
            return {}  # it is about to be given slots
    return failed


def fix_hint(cause: str) -> str:
    """What to do about a worker's failure at start, from its cause line."""
    if "can't open file" in cause or "No such file or directory" in cause:
        return ("check the script in [job] command: it runs in the job's workdir, synced to each host's "
                "code directory")
    if "ModuleNotFoundError" in cause or "No module named" in cause:
        return "install the module in the host's python (hosts.python), or add it to the job's workdir"
    if "command not found" in cause or "Permission denied" in cause:
        return "check [job] command and the host's PATH"
    return "fix the job's command or code (`eltctl logs HOST` shows the worker's output)"


def job_state(phase: str) -> str:
    """The job's state in the document: the phase as a person reads it."""
    return {Phase.TRAINING: "training", Phase.WAITING: "waiting", Phase.PAUSED: "paused", Phase.STOPPING: "stopping",
            Phase.STOPPED: "stopped", Phase.FINISHED: "finished"}.get(phase, "starting")


def host_entry(view: pol.HostView, record: pol.HostRecord, seen: DaemonSeen | None, now: float,
               limit: pol.Limit = pol.NO_LIMIT) -> dict:
    phase, reason = pol.host_state(view, record, now, limit)
    cooling = max(record.cooldown_until, record.owner_until, record.straggler_until)
    gpus = [{"index": s.index, "state": "ours" if s.index in view.workers else s.use.value, "reason": s.reason}
            for s in view.slots]
    return {
        "name": view.name, "state": phase.value, "reason": reason, "workers": len(view.workers),
        "device": device_of(view),
        "heartbeat_age_s": round(now - seen.changed, 2) if seen is not None else None,
        "benched_until": record.benched_until if record.benched_until > now else None,
        "cooldown_until": cooling if cooling > now else None,
        "failures": record.failures, "desired": list(record.desired), "gpus": gpus,
        "last_problem": record.last_problem or record.owner_note or record.straggler_note,
        "start_failure": record.start_failure or None,
        "daemon": daemon_summary(seen.state) if seen is not None else None,
        "usable_at": limit.until if limit.phase is not None and limit.until is not None else None,
        "signal": owner_signal(view, seen),
        # entries of its GPU claims directory its daemon did not believe (eltctl/sharedir.py)
        "refused": refused_summary(refused_of_state(seen.state)) if seen is not None else None,
    }


def device_of(view: pol.HostView) -> str | None:
    """What a host's slots (its entry's `gpus`) are: "gpu", "cpu" (CPU slots, on a host
    without GPUs), or None while it is not known (not probed, unreachable)."""
    if view.reach is pol.Reach.CPU_ONLY:
        return "cpu"
    return "gpu" if view.slots else None


def owner_signal(view: pol.HostView, seen: DaemonSeen | None) -> dict[str, Any] | None:
    """The owner signal that holds the host ({"name", "detail", "since"}): its live daemon's
    (the state document's `signal`), else the probe's (its owner answer, or a busy slot's
    reason "owner: ..." where only that is known)."""
    if seen is not None and view.daemon_alive and isinstance(seen.state.get("signal"), dict):
        return dict(seen.state["signal"])
    if isinstance(view.owner, dict) and view.owner.get("name"):
        return {"name": view.owner.get("name"), "detail": str(view.owner.get("detail", "")),
                "since": view.owner.get("since")}
    for s in view.slots:
        if s.reason.startswith("owner: "):
            return {"name": None, "detail": s.reason[len("owner: "):], "since": None}
    return None


def daemon_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    """What `eltctl status HOST` and `logs --failed` read of a daemon's own state document."""
    return {k: state[k] for k in ("pid", "phase", "health", "workers", "taken") if k in state}


def status_document(*, now: float, inventory: Inventory, phase: str, message: str,
                    runtime_status: Mapping | None, views: Mapping[str, pol.HostView],
                    records: Mapping[str, pol.HostRecord], seen: Mapping[str, DaemonSeen],
                    events: Iterable[dict], store_endpoint: str, mirror: dict | None,
                    limits: Mapping[str, pol.Limit] | None = None,
                    forged: Mapping[str, Any] | None = None, keeper: dict | None = None,
                    checkpoint: Mapping[str, Any] | None = None,
                    starts_at: float | None = None, fairshare: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The status document (status.json): the job, rank 0's figures, each host, recent
    events, the forged store values ignored (`forged_summary`), `keeper`: the store
    keeper's pid, restarts and the problem restarting it (when supervised), and
    `starts_at`: when a starting job starts by itself (its free slots waiting for their
    idle_for, `Decision.starts_at`).

    Every line is derived from what holds now: `members`, `world_size` and `workers`
    name only the members that run now (`current_members`; none once the job ended or its
    last members paused it); with none, the last status is history (`runtime_current`
    false: its step and loss stay as the last seen, no speed, no worker). Progress
    (`progress_fields`): `total_steps`, `steps_per_s` and `eta_s` beside `step`, and one
    `samples_per_s` (observe.pace); `network`, where the steps' time goes (`network_entry`,
    while workers run). `fairshare` is fair share's plan (fairshare.plan_to_json),
    none once the job ended, with its `unit`; each host's `waiting` says what holds its
    slots back (`host_wait`). `checkpoint` is the job's last checkpoint (observe.newest_checkpoint:
    rank 0's, else the last the controller saw), not only the current rank 0's."""
    rs = runtime_status or {}
    job = inventory.job
    # a job that ended (down, finished) has no members, whatever rank 0's last status says:
    # its daemons are gone, so nothing contradicts it (observe.member_alive)
    # a status its last members wrote as they all left (`paused`) names no one who runs
    ended = phase in (Phase.STOPPED, Phase.FINISHED)
    live = [] if ended or rs.get("paused") else current_members(rs, views, now, inventory)
    if checkpoint is None:
        checkpoint = observe.newest_checkpoint(None, rs, now, job.name)
    limits = limits or {}
    hosts = [host_entry(views[h.name], records.get(h.name, pol.HostRecord()), seen.get(h.name), now,
                        limits.get(h.name, pol.NO_LIMIT))
             for h in inventory.hosts]
    doc = {
        "job": job.name, "state": job_state(phase), "phase": phase, "message": message, "updated": now,
        "generation": rs.get("generation"), "world_size": len(live),
        "members": live, "runtime_current": bool(live),
        "min_workers": job.min_workers, "max_workers": job.max_workers,
        "step": rs.get("step"), "epoch": rs.get("epoch"),
        "samples_per_s": rs.get("samples_per_s") if live else None,
        "loss": rs.get("loss"),
        "network": network_entry(rs) if live else None,
        "checkpoint": _checkpoint_entry(checkpoint, now),
        "runtime_status_age_s": round(now - float(rs["seen"]), 2) if rs.get("seen") else None,
        "controller": {"pid": os.getpid(), "alive": True},
        "store": store_endpoint,
        "hosts": hosts,
        "events": list(events)[-EVENTS_SHOWN:],
        "mirror": mirror,
        "start_failed": start_failures(now=now, inventory=inventory, views=views, records=records) or None,
        "mode": job.mode.value,
        "restarts": rs.get("restarts") if job.mode.value == "restart" else None,
        **(restart_fields(rs) if job.mode.value == "restart" else {}),
        "forged": dict(forged) if forged is not None else forged_summary({}, {}, None),
        "starts_at": starts_at,
        **progress_fields(rs, bool(live), job.mode.value == "restart"),
    }
    ended = ended or bool(doc.get("failed"))  # restart mode's limit stopped it
    if fairshare is not None:  # a job that ended holds nothing and asks for nothing
        # fair share counts GPUs only (controller/fairshare.py): its counts are never CPU slots
        doc["fairshare"] = None if ended else {**fairshare, "unit": "GPU"}
    total = sum(len(records[h.name].desired) for h in inventory.hosts
                if h.name in records and not records[h.name].removed)
    for entry, h in zip(hosts, inventory.hosts):
        entry["waiting"] = None if ended else host_wait(
            views[h.name], records.get(h.name, pol.HostRecord()), limits.get(h.name, pol.NO_LIMIT), now=now,
            inventory=inventory, total=total, fair=fairshare)
    if doc.get("failed"):  # restart mode: the script failed max_restarts times; the job stopped
        doc["state"] = doc["phase"] = "failed"
        doc["message"] = doc["failed"]
    workers = [w for w in worker_entries(rs) if w["worker"] in live]
    if workers:
        doc["workers"] = workers
    if keeper is not None:
        doc["keeper"] = keeper
        forwards = keeper.get("forwards") if isinstance(keeper.get("forwards"), dict) else {}
        for h in hosts:  # the "ssh" store mode: the host's own forward, beside its other notes
            f = forwards.get(h["name"])
            if isinstance(f, dict):
                h["forward"] = {"socket": f.get("socket"), "up": bool(f.get("up")), "error": f.get("error") or None}
    return doc


def progress_fields(rs: Mapping[str, Any], live: bool, restart: bool = False) -> dict[str, Any]:
    """`total_steps` (the step the training ends at, from rank 0; null when unknown),
    `steps_per_s` (over the last observe.RATE_WINDOW_S of commits) and `eta_s`, the
    seconds to `total_steps` at that rate (null while unknown or no worker runs)."""
    def number(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    total, step = rs.get("total_steps"), rs.get("step")
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    sps = number(rs.get("steps_per_s")) if live else None
    if sps is None and live and restart and isinstance(rs.get("script"), dict):
        sps = number(rs["script"].get("steps_per_s"))  # the script's own figure (its output's steps)
    eta = None
    if total is not None and isinstance(step, int) and sps and sps > 0:
        eta = round(max(0, total - step) / sps, 1)
    return {"total_steps": total, "steps_per_s": sps, "eta_s": eta}


def _jobs_wanting(fair: Mapping[str, Any], me: str) -> str:
    """The other jobs of fair share's table that want more: "job b (bob: holds 1, share 2)"."""
    out = []
    for j in fair.get("jobs") or []:
        if isinstance(j, dict) and j.get("job") != me and (j.get("wanted") or 0) > 0:
            out.append(f"job {j.get('job')} ({j.get('user')}: holds {j.get('held')}, share {j.get('share')})")
    return ", ".join(out)


def host_wait(view: pol.HostView, record: pol.HostRecord, limit: pol.Limit, *, now: float,
              inventory: Inventory, total: int, fair: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """What holds back the slots of a host that it does not run or start: `{kind, detail,
    until}` (until: when it lifts by itself, else null), or None when nothing waits there
    (every slot used, or the host is out: removed, unreachable, not probed). Kinds: a limit's
    phase (off-hours, quota, cordoned, disabled), "benched", "cooldown" (its cause),
    "fair share" (which jobs it yields to), "host cap" (max_gpus_per_host or a quota),
    "max_workers", "idle_for" (free, not for long enough yet), "owner", "taken" (another
    eltctl job), "joining" (usable: the next pass gives them, or the job starts once
    min_workers are). `total`: the slots the job asks of all its hosts; `fair`: fair share's
    plan (status.json `fairshare`)."""
    def wait(kind: str, detail: str, until: float | None = None) -> dict[str, Any]:
        return {"kind": kind, "detail": detail, "until": until}

    if record.removed:
        return None
    if limit.phase is not None:
        return wait(limit.phase.value, limit.reason, limit.until)
    if view.reach not in (pol.Reach.OK, pol.Reach.CPU_ONLY):
        return None
    unit = "CPU slot" if view.reach is pol.Reach.CPU_ONLY else "GPU"
    open_slots = [s for s in view.slots if s.index not in record.desired and s.index not in view.workers]
    if not open_slots:
        return None
    if not record.join_now:
        if record.benched_until > now:
            return wait("benched", f"{record.last_problem}; {record.benched_until - now:.0f} s more",
                        record.benched_until)
        for until, note in ((record.cooldown_until, record.last_problem), (record.owner_until, record.owner_note),
                            (record.straggler_until, record.straggler_note)):
            if until > now:
                return wait("cooldown", f"cooling down after {note or 'a failure'}; {until - now:.0f} s more", until)
    job = inventory.job
    if pol.eligible_slots(view, record, inventory, now):
        here = len(record.desired)
        if limit.cap is not None and here >= limit.cap:
            if limit.reason:  # fair share's release (policy.fair_limits)
                return wait("fair share", limit.reason)
            return wait("host cap", f"max_gpus_per_host or a gpu-hours quota lets it run {limit.cap} here")
        if job.max_workers is not None and total >= job.max_workers:
            return wait("max_workers", f"the job runs max_workers ({job.max_workers}) already")
        # fair share caps GPUs only (policy.decide): a CPU slot is never held back by it
        cap = fair.get("cap") if isinstance(fair, dict) and not pol.cpu_host(view) else None
        gpus = fair.get("held") if isinstance(fair, dict) and isinstance(fair.get("held"), int) else total
        if isinstance(cap, int) and gpus >= max(cap, job.min_workers):
            others = _jobs_wanting(fair, job.name) or "another job"
            return wait("fair share", f"fair share holds the job at {_n(gpus, unit)} (its share "
                                      f"{fair.get('share')} of {fair.get('pool')}) while {others} wants more")
        if total == 0 and job.min_workers > 1:
            return wait("joining", f"usable; the job starts once {job.min_workers} slots are usable (min_workers)")
        return wait("joining", "usable: the controller's next pass gives it workers")
    soon = pol.maturing(view, record, inventory, now)
    if soon:
        at = min(t for _, t in soon)
        key = pol.idle_for_key(view)
        return wait("idle_for", f"free, used once free for {key} ({pol.idle_for(view, inventory):.0f} s): "
                                f"in {at - now:.0f} s; `eltctl scale --add {view.name}` uses it now", at)
    busy = [s for s in open_slots if s.use is pol.GpuUse.BUSY]
    if busy:
        return wait("owner", f"{unit} {busy[0].index}: {busy[0].reason or 'its owner uses it'}")
    taken = [s for s in open_slots if s.use is pol.GpuUse.TAKEN]
    if taken:
        return wait("taken", f"{unit} {taken[0].index}: {taken[0].reason or 'another eltctl job holds it'}")
    return None


def restart_fields(rs: Mapping[str, Any]) -> dict[str, Any]:
    """Restart mode's figures from rank 0's status: `snapshot` (the counter of the
    script directory's snapshots; `step` is the script's own step, null until it is
    known), `script` (where the step came from, whether every member's script runs)
    and `failed` (why the job stopped on its restart limit; null while it runs)."""
    script = rs.get("script") if isinstance(rs.get("script"), dict) else {}
    return {"snapshot": rs.get("snapshot"),
            "script": {k: script.get(k) for k in ("step", "step_from", "running", "running_since", "ever_running", "updated",
                                                  "steps_per_s", "epoch")},
            "failed": rs.get("failed") or None}


def _counts(value: Any) -> dict[str, int]:
    """A `forged` document's counts ({family: n}); anything else (missing, malformed) is {}."""
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def forged_summary(controller: Mapping[str, int], seen: Mapping[str, DaemonSeen],
                   runtime_status: Mapping[str, Any] | None, events_skipped: int = 0) -> dict[str, Any]:
    """The store values that were not signed with the job's secret, ignored and counted,
    by whom they were read: `{"controller": {family: n}, "hosts": {host: {family: n}},
    "rank0": {family: n}, "total": n, "events_skipped": n}`. The hosts' counts are their daemons' (the state
    document's `forged`), rank 0's its status document's; a missing count is {}. Only
    verified documents carry them, so an attacker cannot write these counts either.
    `events_skipped`: event numbers the controller never read because the (unsigned)
    counter jumped by more than a window (observe.events_window); not in `total`."""
    ctl = _counts(dict(controller))
    hosts = {name: c for name, s in sorted(seen.items()) if (c := _counts(s.state.get("forged")))}
    rank0 = _counts((runtime_status or {}).get("forged"))
    total = sum(ctl.values()) + sum(sum(c.values()) for c in hosts.values()) + sum(rank0.values())
    return {"controller": ctl, "hosts": hosts, "rank0": rank0, "total": total, "events_skipped": events_skipped}


def worker_entries(runtime_status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each member's share of the global batch and its own compute speed, in
    rank order, from rank 0's `workers` (eltctl_runtime.protocol.status_document):
    `[{worker, share, samples_per_s, relative_speed, speedup_without, straggler}]`.
    Empty while the runtime has not reported them (no step in this generation yet)."""
    per = runtime_status.get("workers")
    if not isinstance(per, dict):
        return []
    out = []
    for w in runtime_status.get("members") or list(per):
        entry = per.get(w)
        if isinstance(entry, dict):
            out.append({"worker": w, **{k: entry.get(k) for k in WORKER_FIELDS}})
    return out


def network_entry(runtime_status: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where rank 0's steps' time goes, from its status document's `network`
    (eltctl_runtime.protocol.NETWORK_FIELDS: wait_s, compute_s, share, bytes_per_step),
    each a number or null; None when the runtime does not report it (an older runtime,
    restart mode, sharded training, no step yet) or no worker runs now."""
    net = runtime_status.get("network")
    if not isinstance(net, dict):
        return None
    out = {k: net.get(k) if isinstance(net.get(k), (int, float)) and not isinstance(net.get(k), bool) else None
           for k in NETWORK_FIELDS}
    every = net.get("sync_every")
    if net.get("mode") == "local" and isinstance(every, int) and not isinstance(every, bool):
        out.update(mode="local", sync_every=every)  # local steps (runtime/train/local.py), and its options:
        if net.get("sync_overlap") is True:
            out["sync_overlap"] = True
        inner = net.get("inner_batch")
        if isinstance(inner, int) and not isinstance(inner, bool) and inner > 0:
            out["inner_batch"] = inner
        if net.get("grad_dtype") == "bf16":
            out["grad_dtype"] = "bf16"
    return out if out["share"] is not None else None


def _checkpoint_entry(ck: Mapping[str, Any] | None, now: float) -> dict[str, Any] | None:
    """The document's `checkpoint`: {step, time, path, host, age_s}. Its age is by the
    controller's clock: the age it had when the controller saw it (rank 0's clock
    measures both its time and the status's, so their difference holds whatever that
    clock's offset) plus how long ago that was."""
    if not ck or not isinstance(ck.get("step"), int):
        return None
    try:
        age = round(float(ck["age_s"]) + now - float(ck["seen"]), 1)
    except (KeyError, TypeError, ValueError):
        age = None
    return {"step": ck["step"], "time": ck.get("time"), "path": ck.get("path"), "host": ck.get("host"),
            "age_s": age, **({"script_step": ck.get("script_step")} if "script_step" in ck else {})}


def write_status(path: Path, document: dict) -> None:
    """status.json, replaced whole (a reader never sees half a document)."""
    try:
        write_json_atomic(path, document, mkdir=True, sync=False)  # rewritten every second
    except OSError as exc:
        log.warning("Cannot write %s: %s", path, exc)
