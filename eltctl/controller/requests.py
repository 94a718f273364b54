"""A person's requests to the running controller (over control.sock, controller/socket.py;
the loop.Controller's methods of the same names call these): an edited inventory applied
(`reload_inventory`, `reread_inventory`: what runs is kept on a bad edit), the hosts held
by a failure tried at once (`retry_failed`), `up`'s checks (`leave_out`), `scale --add` /
`--remove` and `cordon` / `uncordon`. Each changes the hosts' records under the pass lock
or before a pass, which then acts on them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from eltctl.controller import observe
from eltctl.controller import policy as pol
from eltctl.controller import store as kstore
from eltctl.inventory import Inventory
from eltctl.probe import probe_fleet
from eltctl_runtime.protocol import EventKind

log = logging.getLogger("eltctl.controller")


def reload_inventory(ctl, inventory: Inventory) -> None:
    """Apply an edited inventory. The Fleet learns the new host list too (the probe
    and `down` go over `fleet.hosts`); a host removed or moved loses its connection."""
    old = {h.name: h for h in ctl.inventory.hosts}
    ctl.inventory = inventory
    ctl.outputs.reload(inventory)
    ctl.fleet.hosts = tuple(inventory.hosts)
    for name, host in old.items():
        new = next((h for h in inventory.hosts if h.name == name), None)
        if host != new:
            ctl.starter.forget(name)
            asyncio.ensure_future(ctl.fleet.forget(name))
        if new is None or (new.address, new.port) != (host.address, host.port):
            ctl.observed.forget_machine(name)
    top = max([ctl.seq_floor] + [r.seq for r in ctl.records.values()])
    for host in inventory.hosts:  # a new host continues above every seq sent (as in load_records)
        ctl.records.setdefault(host.name, pol.HostRecord(seq=top))
    ctl._check_fix = True  # the next pass compares what changed (`apply_fixes`)
    if ctl.keeper is not None:  # the keeper re-reads it now: a new host's run id (and forward)
        from eltctl.storeforward import nudge_keeper

        nudge_keeper(kstore.forwards_path(ctl.state), ctl.keeper.info.pid)


def reread_inventory(ctl) -> str | None:
    """Read the inventory file again and apply it (`reload_inventory`); the error, if
    it cannot be read (a bad edit: what runs is kept)."""
    from eltctl.errors import ConfigError
    from eltctl.inventory import load_inventory

    try:
        new = load_inventory(ctl.inventory.path)
    except ConfigError as exc:
        return str(exc)
    if new.job.name != ctl.inventory.job.name:
        return (f"{ctl.inventory.path} now names job {new.job.name!r}, not {ctl.inventory.job.name!r}; "
                "`eltctl down` this job before renaming it")
    reload_inventory(ctl, new)
    return None


async def retry_failed(ctl) -> None:
    """`eltctl up` run by a person: the hosts held by a failure are tried at once (policy.retried)."""
    async with ctl._pass:
        before = ctl.records
        ctl.records = pol.retried(before, ctl.clock())
        if ctl.records != before:
            log.info("Host(s) %s held by a failure are tried again at once (`eltctl up`).",
                     ", ".join(n for n in ctl.records if ctl.records[n] != before.get(n)))
            ctl.save_records()


async def leave_out(ctl, left_out: dict[str, str]) -> None:
    """`eltctl up`'s checks: these hosts are left out with their reasons, the ones
    left out before and fixed now come back (policy.leave_out)."""
    async with ctl._pass:  # not between a pass's reading and writing of the records
        before = ctl.records
        ctl.records = pol.leave_out(before, left_out, [h.name for h in ctl.inventory.hosts])
        if ctl.records != before:
            ctl.save_records()
    for name, reason in left_out.items():
        if ctl.records.get(name) != before.get(name):
            log.warning("Host %s: %s.", name, reason)
            await ctl._event(EventKind.REMOVE, name, reason)


async def scale(ctl, add: list[str], remove: list[str], force: bool) -> dict:
    if any(n not in {h.name for h in ctl.inventory.hosts} for n in add + remove):
        error = reread_inventory(ctl)  # a host just written into the file (issue 50)
        if error is not None:
            return {"ok": False, "error": error}
    names = {h.name for h in ctl.inventory.hosts}
    results = []
    for name in add + remove:
        if name not in names:
            results.append({"host": name, "ok": False,
                            "message": f"no host {name!r} in the inventory (hosts: {', '.join(sorted(names))})"})
    for name in remove:
        if name not in names:
            continue
        rec = ctl.records.get(name, pol.HostRecord())
        ctl.records[name] = replace(rec, removed=True, removed_reason="", join_now=False, force=False)
        await ctl._event(EventKind.REMOVE, name, "removed by eltctl scale --remove")
        results.append({"host": name, "ok": True,
                        "message": "removed; its workers leave at the next step boundary"})
    probe_targets = [ctl.inventory.host(n) for n in add if n in names]
    reports = {}
    if probe_targets:
        probed = await probe_fleet(ctl.fleet, job=ctl.inventory.job.name, policy=ctl.inventory.policy,
                                   hosts=probe_targets, owner=ctl.inventory.owner_policy)
        reports = {r.name: r for r in probed}
        for name in ctl.observed.take_reports(probed):
            await ctl.fleet.forget(name)
    for host in probe_targets:
        refusal = observe.add_refusal(reports[host.name], force)
        if refusal is not None:
            results.append({"host": host.name, "ok": False, "message": refusal})
            continue
        rec = ctl.records.get(host.name, pol.HostRecord())
        ctl.records[host.name] = replace(rec, removed=False, removed_reason="", join_now=True, force=force,
                                         benched_until=0.0 if force else rec.benched_until,
                                         failures=0)
        await ctl._event(EventKind.ADD, host.name, "added by eltctl scale --add" + (" --force" if force else ""))
        results.append({"host": host.name, "ok": True, "message": observe.added_message(reports[host.name])})
    ctl.save_records()
    await ctl.reconcile()
    ctl.write_status()
    # what an added host does now that the pass decided: its slots join, or what holds them
    entries = {h["name"]: h for h in ctl.status_document()["hosts"]}
    for r in results:
        if r["ok"] and r["host"] in reports and r["host"] in entries:
            r["message"] = observe.added_message(reports[r["host"]], ctl.records[r["host"]].desired,
                                                 entries[r["host"]].get("waiting"))
    return {"ok": all(r["ok"] for r in results), "results": results}


async def cordon(ctl, names: list[str], on: bool) -> dict:
    """`eltctl cordon` (`on`) / `uncordon`: the hosts' workers leave in the planned way
    and none start there until uncordoned; remembered in hosts.json."""
    known = {h.name for h in ctl.inventory.hosts}
    results = []
    for name in names:
        if name not in known:
            results.append({"host": name, "ok": False,
                            "message": f"no host {name!r} in the inventory (hosts: {', '.join(sorted(known))})"})
            continue
        rec = ctl.records.get(name, pol.HostRecord())
        if rec.cordoned == on:
            results.append({"host": name, "ok": True,
                            "message": "already cordoned" if on else "not cordoned"})
            continue
        # uncordon: "used again", at once: not held by a failure cooldown from before
        ctl.records[name] = replace(rec if on else pol.failure_cleared(rec), cordoned=on)
        what = "cordoned by eltctl cordon" if on else "uncordoned by eltctl uncordon"
        log.info("Host %s: %s.", name, what)
        await ctl._event(EventKind.CORDON, name, what, state="cordoned" if on else "uncordoned")
        results.append({"host": name, "ok": True,
                        "message": ("cordoned; its workers leave at the next step boundary and none start "
                                    "there until `eltctl uncordon`") if on
                        else "uncordoned; its free GPUs (or CPU slots) are used again"})
    ctl.save_records()
    await ctl.reconcile()
    ctl.write_status()
    return {"ok": all(r["ok"] for r in results), "results": results}

