"""The policy: which hosts and GPUs the job uses now. Pure functions of a view and a clock.

The controller observes each host (`HostView`: probe results and the daemon's
state), remembers things about it across observations (`HostRecord`: when each GPU
was first seen free, cooldowns, benching, removal), and asks `decide` what to do.
`track` folds a new observation into the records; `decide` turns views and records
into actions; `host_state` says how a host looks to a person. None of them does I/O,
so tables of cases test them (tests/controller/test_policy.py).

The rules (the README's "Policy"):

- A slot is a GPU index (or a CPU slot number on a host without GPUs). A free GPU is
  used only after it has looked free for `idle_for`; a busy one never (except once
  after `scale --add --force`). A CPU slot has no owner process to watch: it waits for
  `cpu_idle_for` (default 0, at once; `owner_signals` watch the owner there). While
  free slots only wait for that, the job is starting and `Decision.starts_at` says when.
  A GPU another eltctl job holds (`GpuUse.TAKEN`, its claim: runtime/claims.py) is
  never used and is no owner's: a slot its daemon reports taken leaves the desired
  slots with no failure and no cooldown. Its free clock keeps running while another
  eltctl job holds it (no owner used it): a GPU fair share hands over, or another
  job lets go, is used at once once `idle_for` has passed since its owner last used
  it, not `idle_for` after the other job left (first come, first served; the claim
  decides).
- At most `max_workers` slots are used; fewer than `min_workers` usable slots and the
  job waits (nothing new starts; what runs keeps running).
- A host whose worker left (its owner came back, a crash, the host vanished) rests for
  `cooldown` before new slots start there; the slots still running there stay. The
  two cooldowns are kept apart: a failure's (`cooldown_until`) and an owner's
  (`owner_until`: it protects a person).
- A fix takes effect at once: when the job's code, its [job] or [ssh] settings or a
  host's entry change, the failures, failure cooldown and benching of the hosts
  concerned are forgotten (`after_fix`); an owner's cooldown stays.
- `bench_after` failures in a row (a worker crash, a daemon that would not start, the
  host vanishing while used) bench the host for `max(cooldown, 30 s) * 2**n` (n: how
  often it was benched before), capped at a day. A host that runs cleanly for that
  long has its failure count reset.
- `scale --remove` keeps a host out until `scale --add`; an add waives `idle_for`,
  cooldown and benching once (`--force` also takes GPUs that look busy).
- Stragglers (`track_stragglers`): rank 0 reports, per worker, how much faster the job
  would be without it (the runtime's prediction from every worker's measured speed,
  the others taking its samples). A worker the job would be at least
  `straggler_gain_percent` faster without, in every status for `straggler_for` in a
  row, is dropped in the planned way (its slot leaves the host's desired slots) while
  more than `min_workers` run, and its host rests for `cooldown`, as after an owner's
  return (`straggler_until`). `drop_stragglers = false`: reported, never dropped.

Host state graph (what `host_state` shows)::

    idle --free for idle_for--> starting --daemon reports workers--> running
    running --owner/crash/vanished--> cooldown --cooldown over--> idle
    any --bench_after failures--> benched --back-off over--> idle
    any --scale --remove--> removed --scale --add--> idle
    any --`up`'s checks fail there--> removed (their reason) --an `up` finds it fixed--> idle
    any --`eltctl cordon`--> cordoned --`eltctl uncordon`--> idle
    any --its window closes (hours, hours_margin)--> off-hours --a window opens--> idle
    any --a gpu-hours quota is reached--> quota --its local midnight--> idle
    any --`enabled = false` in the inventory--> disabled

Limits (`host_limits`, from the inventory, a cordon, the clock and the quota figures)
cap a host's slots apart from its GPUs: a host that is disabled, cordoned, outside
its working hours or over a quota gets none (its workers leave in the planned way at
a step boundary, no cooldown), and `max_gpus_per_host` caps the rest. When the limits
alone leave fewer than `min_workers` slots, the job pauses: every worker leaves,
rank 0 writes a checkpoint first (the runtime's "every member leaves": the mirror
copies it), and when a window opens (or a quota lifts) the job restarts from the
newest checkpoint as after the loss of every host (`Decision.paused`).

Where each part lives: the values in values.py (`HostView`, `HostRecord`, `Limit`,
`Decision`), tracking in tracking.py (`track`, `track_stragglers`, benching), a fix in
fixes.py (`fingerprint`, `after_fix`), the limits in limits.py (`host_limits`,
`pause_reason`); here `decide` and how a host looks (`host_state`). Every name is
importable from here too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from eltctl.controller.fixes import (after_fix, changed_hosts, failure_cleared, fingerprint, fixed,
                                     host_config, retried, stale_config)
from eltctl.controller.limits import fair_limits, host_limits, pause_reason
from eltctl.controller.tracking import (BENCH_BASE_S, BENCH_MAX_S, bench_duration, crash_problem, next_step,
                                        record_failure, track, track_stragglers, worker_slot)
from eltctl.controller.values import (LIMIT_PHASES, NO_LIMIT, Action, Crash, DaemonSlots, Decision, HostPhase,
                                      HostRecord, HostView, Limit, Reach, SetDesired, SlotView, StartDaemon)
from eltctl.durations import format_duration, format_left
from eltctl.inventory import Inventory
from eltctl.probe import GpuUse  # one vocabulary: what the probe classified a GPU as


# --------------------------------------------------------------------------- deciding

def _slot_indices(view: HostView) -> list[int]:
    return sorted(s.index for s in view.slots)


def eligible_slots(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[int]:
    """Slots of this host that may start a worker now (not counting those it runs)."""
    if record.removed or view.reach not in (Reach.OK, Reach.CPU_ONLY):
        return []
    waived = record.join_now
    if not waived and (record.benched_until > now or record.cooling(now)):
        return []
    out = []
    for s in sorted(view.slots, key=lambda s: s.index):
        if s.index in record.desired or s.use is GpuUse.TAKEN:  # another eltctl job's: never, even forced
            continue
        if s.use is GpuUse.BUSY:
            if record.force:
                out.append(s.index)
            continue
        since = record.free_since_of(s.index)
        if waived or (since is not None and now - since >= idle_for(view, inventory)):
            out.append(s.index)
    return out


def cpu_host(view: HostView | None) -> bool:
    """The host's slots are CPU slots (it has no GPU, or its daemon reports none while SSH
    is down: observe.host_view). Fair share counts GPUs only (controller/fairshare.py)."""
    return view is not None and view.reach is Reach.CPU_ONLY


def idle_for(view: HostView, inventory: Inventory) -> float:
    """How long a slot of this host must look free before it is used: `idle_for` for a
    GPU, `cpu_idle_for` (default 0: at once) for a CPU slot of a host without GPUs, where
    no owner's process can be seen (`owner_signals` watch the owner there)."""
    policy = inventory.policy
    return policy.cpu_idle_for if view.reach is Reach.CPU_ONLY else policy.idle_for


def idle_for_key(view: HostView) -> str:
    """The inventory key `idle_for` reads for this host."""
    return "cpu_idle_for" if view.reach is Reach.CPU_ONLY else "idle_for"


def maturing_slots(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[int]:
    """Free slots that only wait for their `idle_for` to pass (usable soon)."""
    return [i for i, _ in maturing(view, record, inventory, now)]


def maturing(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[tuple[int, float]]:
    """(slot, when it is usable) of the free slots that only wait for their `idle_for`."""
    if record.removed or record.join_now or view.reach not in (Reach.OK, Reach.CPU_ONLY):
        return []
    if record.benched_until > now or record.cooling(now):
        return []
    wait = idle_for(view, inventory)
    out = []
    for s in view.slots:
        since = record.free_since_of(s.index)
        if (s.use not in (GpuUse.BUSY, GpuUse.TAKEN) and s.index not in record.desired and since is not None
                and now - since < wait):
            out.append((s.index, since + wait))
    return out


def kept_slots(view: HostView | None, record: HostRecord, now: float) -> list[int]:
    """Slots asked of this host before that it keeps: not removed or benched, not taken by someone."""
    if record.removed or view is None or not record.desired:
        return []
    if record.benched_until > now and not record.join_now:
        return []
    if view.reach is Reach.UNREACHABLE:
        return []
    out = []
    for index in record.desired:
        s = view.slot(index)
        if s is not None and s.use is GpuUse.BUSY and not record.force and not view.watched:
            continue  # the owner is back and no daemon watches: leave it
        out.append(index)
    return out


def _capacity(view: HostView | None, limit: Limit) -> float:
    """The most slots the limits leave this host, whatever its GPUs do now (unknown: any)."""
    if limit.cap == 0:
        return 0
    if view is None or view.reach not in (Reach.OK, Reach.CPU_ONLY, Reach.UNHEALTHY):
        return float("inf")
    return min(len(view.slots), limit.cap if limit.cap is not None else len(view.slots))


def decide(views: Mapping[str, HostView], records: Mapping[str, HostRecord], inventory: Inventory,
           now: float, limits: Mapping[str, Limit] | None = None, fair_cap: int | None = None) -> Decision:
    """What to do now: the slots each host should run, and the daemon starts and stops.
    `limits` (`host_limits`) cap each host's slots; none: no cap. `fair_cap`: the most
    GPUs fair share lets the job hold while another job waits (no new ones beyond it);
    it caps the slots of GPU hosts only: fair share counts no CPU slot (`cpu_host`)."""
    job = inventory.job
    limits = limits or {}
    cap = job.max_workers if job.max_workers is not None else 1 << 30
    gpu_cap = None if fair_cap is None else max(fair_cap, job.min_workers)
    gpu_hosts = {h.name for h in inventory.hosts if not cpu_host(views.get(h.name))}
    kept: dict[str, list[int]] = {}
    candidates: list[tuple[str, int]] = []
    soon_at: list[tuple[float, str, str]] = []  # (when usable, the key that delays it, host) per maturing slot
    kinds: set[str] = set()  # "idle_for" (GPUs) / "cpu_idle_for" (CPU slots) of the free slots counted
    capacity = 0.0
    for host in inventory.hosts:
        view = views.get(host.name)
        rec = records.get(host.name, HostRecord())
        lim = limits.get(host.name, NO_LIMIT)
        here = kept_slots(view, rec, now)
        if lim.cap is not None:
            here = here[:lim.cap]  # over its cap: the last slots leave in the planned way
        kept[host.name] = here
        room = None if lim.cap is None else max(lim.cap - len(here), 0)
        capacity += _capacity(view, lim)
        if view is not None:
            new = [i for i in eligible_slots(view, rec, inventory, now) if i not in here]
            soon = maturing(view, rec, inventory, now)
            if room is not None:
                new, soon = new[:room], soon[:max(room - len(new), 0)]
            candidates += [(host.name, i) for i in new]
            soon_at += [(at, idle_for_key(view), host.name) for _, at in soon]
            if new or soon:
                kinds.add(idle_for_key(view))
    if capacity < job.min_workers and any(lim.phase for lim in limits.values()):
        # The limits alone leave too few slots: pause (every worker leaves; rank 0
        # checkpoints first) and start again from that checkpoint when they lift.
        desired_none = {h.name: () for h in inventory.hosts}
        actions = tuple(SetDesired(h.name, ()) for h in inventory.hosts
                        if records.get(h.name, HostRecord()).desired)
        return Decision(actions=actions, desired=desired_none, usable=0, waiting=False,
                        message="", paused=pause_reason(limits, inventory))
    n_kept = sum(len(v) for v in kept.values())
    n_gpus = sum(len(v) for k, v in kept.items() if k in gpu_hosts)
    extra_gpus = 0 if gpu_cap is None else n_gpus - gpu_cap
    usable = n_kept + len(candidates)
    maturing_n = len(soon_at)
    waiting = False
    message = ""
    starts_at = None
    desired = {name: list(slots) for name, slots in kept.items()}
    if n_kept > cap or extra_gpus > 0:  # max_workers or fair share's cap lowered: drop from the last hosts first
        extra = n_kept - cap
        for host in reversed(inventory.hosts):
            gpu = host.name in gpu_hosts
            while (extra > 0 or (gpu and extra_gpus > 0)) and desired[host.name]:
                desired[host.name].pop()
                extra -= 1
                extra_gpus -= gpu
    elif usable < job.min_workers and n_kept == 0:
        # Free GPUs that only wait for idle_for will do: the job is starting, not waiting.
        waiting = usable + maturing_n < job.min_workers
        if waiting:
            message = (f"{usable + maturing_n} {_slot_word(kinds)} free, min_workers is {job.min_workers}: "
                       "waiting for more to be free")
        else:
            # The job starts when the min_workers-th slot is usable: the last of the
            # soonest maturing slots it needs.
            starts_at, key, host_name = sorted(soon_at)[max(job.min_workers - usable, 1) - 1]
            wait = inventory.policy.cpu_idle_for if key == "cpu_idle_for" else inventory.policy.idle_for
            message = (f"starts in {format_left(starts_at - now)}: {maturing_n} free {_slot_word(kinds)} are used once "
                       f"they have been free for {key} ({format_duration(wait)}); "
                       f"`eltctl scale --add {host_name}` uses them now")
    else:
        room = cap - n_kept
        gpu_room = None if gpu_cap is None else gpu_cap - n_gpus
        for name, index in candidates:
            if room <= 0:
                break
            if name in gpu_hosts and gpu_room is not None:
                if gpu_room <= 0:
                    continue  # fair share's cap: no new GPU; a CPU slot still joins
                gpu_room -= 1
            desired[name].append(index)
            room -= 1
    actions: list[Action] = []
    for host in inventory.hosts:
        view = views.get(host.name)
        rec = records.get(host.name, HostRecord())
        want = tuple(sorted(desired[host.name]))
        alive = view is not None and view.daemon_alive
        if want and not alive and view is not None and view.reach in (Reach.OK, Reach.CPU_ONLY, Reach.UNHEALTHY):
            actions.append(StartDaemon(host.name))
        if want != tuple(rec.desired):
            actions.append(SetDesired(host.name, want))
        # An idle daemon is left running (it costs one sleeping process): a daemon
        # restarted after a clean stop would start its worker ids over, and a reused
        # id finds its old `leave/<id>` key in the store and leaves at once.
    return Decision(actions=tuple(actions), desired={k: tuple(sorted(v)) for k, v in desired.items()},
                    usable=usable, waiting=waiting, message=message, starts_at=starts_at)


def _slot_word(kinds: set[str]) -> str:
    """What the free slots counted are called: GPUs, CPU slots (hosts without GPUs), or both."""
    if kinds == {"cpu_idle_for"}:
        return "CPU slot(s)"
    return "GPU(s)" if kinds == {"idle_for"} else "GPU/slot(s)"


def leave_out(records: Mapping[str, HostRecord], left_out: Mapping[str, str],
              names: Iterable[str]) -> dict[str, HostRecord]:
    """`eltctl up`'s verdict on `names`: the hosts in `left_out` are removed with that
    reason; a host it left out before and not now comes back. A host removed by
    `scale --remove` stays removed (and keeps its reason)."""
    out = dict(records)
    for name in names:
        rec = out.get(name, HostRecord())
        if name in left_out:
            if not (rec.removed and not rec.removed_reason):
                out[name] = replace(rec, removed=True, removed_reason=left_out[name], join_now=False, force=False)
        elif rec.removed and rec.removed_reason:
            out[name] = replace(rec, removed=False, removed_reason="")
    return out


def applied(record: HostRecord, slots: tuple[int, ...]) -> HostRecord:
    """The record once `SetDesired(slots)` was written: a new seq, the one-shot waivers used.
    A `scale --add` that waived a failure cooldown used it up (`failure_cleared`): kept,
    it hid under the host's workers and came back as a stale cooldown once they left
    (issue 50: after a cordon and uncordon)."""
    if slots and record.join_now:
        record = failure_cleared(record)
    return replace(record, desired=tuple(slots), seq=record.seq + 1,
                   join_now=False if slots else record.join_now,
                   force=False if slots else record.force)


# --------------------------------------------------------------------------- showing

def host_state(view: HostView | None, record: HostRecord, now: float,
               limit: Limit = NO_LIMIT) -> tuple[HostPhase, str]:
    """The host's state for `eltctl status`, with the reason a person wants."""
    if limit.phase is not None and not record.removed:
        leaving = len(view.workers) if view is not None else 0
        return limit.phase, limit.reason + (f"; {leaving} worker(s) leaving" if leaving else "")
    if record.removed and record.removed_reason:
        return HostPhase.REMOVED, record.removed_reason
    if record.removed:
        return HostPhase.REMOVED, "removed by `eltctl scale --remove`; `scale --add` brings it back"
    if view is None or view.reach is Reach.UNKNOWN:
        return HostPhase.STARTING, "not observed yet"
    if view.reach is Reach.UNREACHABLE:
        return HostPhase.UNREACHABLE, view.reason
    if record.benched_until > now:
        return HostPhase.BENCHED, (f"{record.last_problem} (for {record.benched_until - now:.0f} s more; "
                                   f"{next_step(view.name, record.last_problem)})")
    if view.workers:
        return HostPhase.RUNNING, f"{len(view.workers)} worker(s)"
    if record.desired:
        return HostPhase.STARTING, f"starting {len(record.desired)} worker(s)"
    if view.reach is Reach.UNHEALTHY:
        return HostPhase.UNHEALTHY, view.reason
    if record.cooldown_until > now:
        return HostPhase.COOLDOWN, (f"{record.last_problem} (usable again in {record.cooldown_until - now:.0f} s; "
                                    f"{next_step(view.name, record.last_problem)})")
    if record.owner_until > now:
        return HostPhase.COOLDOWN, f"{record.owner_note} (usable again in {record.owner_until - now:.0f} s)"
    if record.straggler_until > now:
        return HostPhase.COOLDOWN, f"{record.straggler_note} (usable again in {record.straggler_until - now:.0f} s)"
    if view.slots and all(s.use in (GpuUse.BUSY, GpuUse.TAKEN) for s in view.slots):
        return HostPhase.BUSY, "; ".join(f"GPU {s.index}: {s.reason}" for s in view.slots)
    return HostPhase.IDLE, view.reason or "usable, not used"


def survivor_holds_state(views: Mapping[str, HostView], runtime_status: Mapping | None, now: float,
                         fresh_for: float) -> bool:
    """Does some worker of the job still hold its state? (If not, a start must restore a
    checkpoint first.) Yes when a daemon reports a live worker, or when rank 0's status
    was written within `fresh_for` and names a worker on a host of `views` (the
    inventory) that is not known to be unreachable: workers outlive a dead daemon,
    while a status naming only lost or removed hosts is the last word of a dead run.
    A status its last members wrote as they all left (`paused`) counts only those
    members: a worker started since holds nothing."""
    rs = runtime_status or {}
    if rs.get("paused"):
        # Its last members paused the job (every one left, the newest checkpoint on their
        # host): a live worker now is one that started since, holding nothing, unless its
        # daemon does not name its workers (then it may be a member still).
        members = {str(m) for m in rs.get("members") or ()}
        return any(v.workers and (len(v.worker_ids) < len(v.workers) or members & set(v.worker_ids))
                   for v in views.values())
    if any(v.workers for v in views.values()):
        return True
    try:
        seen = float(rs.get("seen") or 0.0)  # when the controller saw it change (its own clock)
    except (TypeError, ValueError):
        return False
    if not seen or now - seen >= fresh_for:
        return False
    for member in rs.get("members") or []:
        view = views.get(str(member).split("/")[0])
        if view is not None and view.reach is not Reach.UNREACHABLE:
            return True
    return False


def ordered(names: Iterable[str], inventory: Inventory) -> list[str]:
    order = {h.name: i for i, h in enumerate(inventory.hosts)}
    return sorted(names, key=lambda n: order.get(n, 1 << 30))


__all__ = ["BENCH_BASE_S", "BENCH_MAX_S", "LIMIT_PHASES", "NO_LIMIT", "Action", "Crash", "DaemonSlots", "Decision",
           "GpuUse", "HostRecord", "HostPhase", "HostView", "Limit", "Reach", "SetDesired", "SlotView", "StartDaemon",
           "after_fix", "applied", "bench_duration", "changed_hosts", "cpu_host", "crash_problem", "decide",
           "eligible_slots", "failure_cleared", "fair_limits", "fingerprint", "fixed", "host_config", "host_limits",
           "host_state", "idle_for", "idle_for_key", "kept_slots", "leave_out", "maturing", "maturing_slots",
           "next_step", "ordered", "pause_reason", "record_failure", "retried", "stale_config",
           "survivor_holds_state", "track", "track_stragglers", "worker_slot"]
