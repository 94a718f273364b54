"""Where a cold start resumed from, and a newer checkpoint it could not reach (pure).

Before workers start with no survivor, the controller restores the newest valid
checkpoint among the reachable hosts' and the mirror's (`act.restore`). A newer one may
lie where it cannot look: on a host taken out of the inventory, or one that does not
answer. The controller remembers the last checkpoint it saw (hosts.json `checkpoint`:
its step and the host that wrote it), so it can tell: training would otherwise go
backwards without a word (issue 50). `newer_out_of_reach` decides; the restore event
carries the answer (`step`, `where`, `newer`), and `up_lines` is what `eltctl up`
prints of it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from eltctl_runtime.protocol import EventKind

MIRROR_WHERE = "mirror"  # = eltctl.mirror.values.MIRROR_LABEL (not imported: this stays light for the CLI)
NOT_IN_INVENTORY = "is no longer in the inventory"
NOT_REACHED = "was not reachable"


def newer_out_of_reach(known: Mapping[str, Any] | None, chosen: int | None, looked_at: Iterable[str],
                       inventory_hosts: Iterable[str]) -> dict[str, Any] | None:
    """The last checkpoint seen (`known`: hosts.json's {step, host, ...}) when it is newer
    than the one restored (`chosen`; None: none) and lies on a host the restore did not
    look at (`looked_at`: the hosts whose checkpoints were candidates): {host, step, why};
    else None (on a host looked at, it was found, or passed over with a reason said)."""
    if not isinstance(known, Mapping):
        return None
    step, host = known.get("step"), known.get("host")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(host, str) or not host:
        return None
    if chosen is not None and step <= chosen:
        return None
    if host in set(looked_at):
        return None
    why = NOT_REACHED if host in set(inventory_hosts) else NOT_IN_INVENTORY
    return {"host": host, "step": step, "why": why}


def where_text(where: str) -> str:
    return "the mirror" if where == MIRROR_WHERE else f"host {where}"


def newer_sentence(newer: Mapping[str, Any], chosen: int | None) -> str:
    """The warning, naming the host and the step, and what to do."""
    host, step = newer.get("host"), newer.get("step")
    start = f"step {chosen}" if chosen is not None else "step 0"
    fix = (f"add {host} back to the inventory" if newer.get("why") == NOT_IN_INVENTORY
           else f"make {host} reachable (`eltctl doctor` checks it)")
    return (f"a newer checkpoint, step {step}, was last seen on host {host}, which {newer.get('why')}: "
            f"the job resumes from {start}; to train on from step {step}, `eltctl down`, {fix} "
            "(or set [storage] mirror, which keeps the checkpoints off the hosts), then `eltctl up`")


def up_lines(events: Iterable[Mapping[str, Any]], since: float) -> list[tuple[bool, str]]:
    """What `eltctl up` says of the restore of this start: [(is a warning, text)], from the
    status document's events at or after `since` (the controller's last restore event among
    them: it has a `where`; the runtime's restore events, `from_step`, say what rank 0 loaded)."""
    last = None
    for ev in events or ():
        if not isinstance(ev, Mapping) or ev.get("kind") != EventKind.RESTORE.value or "where" not in ev:
            continue
        t = ev.get("time")
        if isinstance(t, (int, float)) and t >= since:
            last = ev
    if last is None:
        return []
    out: list[tuple[bool, str]] = []
    step, where = last.get("step"), last.get("where")
    if isinstance(step, int) and isinstance(where, str):
        out.append((False, f"resumed from step {step} ({where_text(where)})"))
    newer = last.get("newer")
    if isinstance(newer, Mapping):
        out.append((True, newer_sentence(newer, step if isinstance(step, int) else None)))
    return out
