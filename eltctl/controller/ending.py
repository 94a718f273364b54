"""The job's end: `down` (the final checkpoint, then every worker and daemon stops, or is
killed with force; the withdrawn fair-share demand published; the final checkpoint
mirrored before the answer) and `finish` (the training returned: its last workers' exit
awaited, then as `down`, and the end remembered in hosts.json). The loop.Controller's
methods of the same names call these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from eltctl.controller import act, observe, status
from eltctl.controller.status import Phase

log = logging.getLogger("eltctl.controller")

DOWN_TIMEOUT_S = 90.0
# After the training returned: how long its last workers may take to exit (they do in about
# 0.3 s) before every daemon is stopped anyway (`down` then waits for what is left).
FINISH_WAIT_S = 30.0


async def finish(ctl) -> None:
    """The training returned: its last workers' exit is awaited (FINISH_WAIT_S), then
    every daemon stops as for `down` (the final checkpoint mirrored), the end is
    remembered (hosts.json `finished`, with the job's fingerprint) and the controller
    ends (`on_end`). status.json keeps the phase `finished`."""
    step = (ctl.outputs.done or {}).get("step")
    log.info("The training finished at step %s.", step)
    deadline = time.monotonic() + FINISH_WAIT_S
    while time.monotonic() < deadline:
        views = ctl.observed.views(ctl.inventory.hosts, ctl.clock(), ctl.inventory.policy)
        if not any(v.workers for v in views.values()):
            break
        await asyncio.sleep(0.5)
        await ctl.observe_store()
    result = await down(ctl, force=False, why=f"the training finished at step {step}; stopping the daemons: ")
    fp = ctl.fingerprint or {}
    ctl.finished = {"step": step, "at": ctl.clock(), "code": fp.get("code"), "job": fp.get("job")}
    ctl.save_records()
    ctl.phase = Phase.FINISHED
    ctl.message = status.finished_message(step, result)
    ctl.write_status()
    log.info("The job finished at step %s: %s; the controller exits.", step, result["message"])
    if ctl.on_end is not None:
        ctl.on_end()


async def down(ctl, force: bool, progress: Callable[[str], None] | None = None, why: str = "") -> dict:
    """The final checkpoint, then every worker and daemon stops (or is killed with force).
    `why` leads the messages while it runs (`finish`: the training finished)."""
    ctl.stopping = True
    ctl.finished = None  # after `down` a new `up` starts the job again, finished or not
    ctl.phase, ctl.message = Phase.STOPPING, why + "final checkpoint"
    ctl.write_status()
    store_ok = True
    try:
        await act.request_stop(ctl.store, ctl.records, ctl.inventory, ctl.clock())
    except Exception as exc:  # noqa: BLE001 - no store: stop the daemons by signal instead
        log.warning("The store is unreachable (%s): stopping the daemons by signal.", exc)
        store_ok = False
    ctl.save_records()
    job = ctl.inventory.job.name
    deadline = time.monotonic() + DOWN_TIMEOUT_S + ctl.inventory.policy.hang_timeout
    signalled = False
    while True:
        left = await act.leftovers(ctl.fleet, job)
        if not any(left.values()) or time.monotonic() > deadline:
            break
        if not store_ok and not signalled:
            await act.signal_daemons(ctl.fleet, left)
            signalled = True
        ctl.message = why + "waiting for " + ", ".join(f"{h} ({len(p)} process(es))" for h, p in left.items() if p)
        ctl.write_status()
        await asyncio.sleep(1.0)
    killed = {}
    if any(left.values()) and force:
        killed = await act.kill(ctl.fleet, job, left)
        left = await act.leftovers(ctl.fleet, job)
    if not any(left.values()) and ctl._probed_once.is_set():  # (`--down` alone never published)
        await ctl.publish_withdrawn()
    checkpoint = None
    try:
        await ctl.observe_store()
        checkpoint = observe.final_checkpoint(ctl.observed.runtime_status)
    except Exception:  # noqa: BLE001 - the store may be gone already
        pass
    mirrored = await mirror_final(ctl, checkpoint)
    remaining = {h: [p.pid for p in ps] for h, ps in left.items() if ps}
    ok = not remaining
    if ok:
        msg = "every worker and daemon stopped"
    else:
        msg = "still running: " + "; ".join(f"{h}: pids {', '.join(map(str, p))}" for h, p in remaining.items())
        if not force:
            msg += " (eltctl down --force kills them)"
    ctl.phase = Phase.STOPPED if ok else Phase.STOPPING
    ctl.message = msg
    ctl.write_status()
    return {"ok": ok, "checkpoint": checkpoint, "message": msg, "left": remaining,
            "killed": {h: p for h, p in killed.items() if p}, "mirror": mirrored}


async def mirror_final(ctl, checkpoint: dict | None) -> dict | None:
    """`down`: the final checkpoint onto the mirror, verified, before the answer."""
    worker = ctl.mirror_worker
    if worker is None:
        return None

    def announce() -> None:
        ctl.message = "mirroring the final checkpoint"
        ctl.write_status()

    result = await act.mirror_final(worker, checkpoint, ctl.inventory.job.name, announce)
    ctl.mirror_worker = None  # stopped: the status document shows it no more
    ctl.final_mirror = result
    return result

