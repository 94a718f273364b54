"""`python -m eltctl.controller --inventory PATH [--down [--force]]`: run a job's controller.

Normal mode (what `eltctl up` starts, detached): take the job's lock (another live
controller: exit 0 at once), adopt the store keeper named by controller.json when it
still serves (else start one: on a Unix socket in the state directory, forwarded to each remote host over SSH
by the keeper itself, eltctl/storeforward.py; with `[controller] store = "direct"`
bound to the one address the hosts use to reach this machine), write controller.json, serve control.sock and reconcile until `down`.
SIGTERM or SIGINT end the controller alone: the workers keep training and the next
`eltctl up` adopts them. While it runs it supervises the store keeper: a lost one is
restarted at the same address (controller/loop.py `watch_keeper`).

`--down` (what `eltctl down` runs when no controller is alive): adopt what is there,
take the job down, print the result as one JSON line and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from eltctl.controller import socket as csock
from eltctl.controller.statedir import ControllerLock, StateDir, job_secret, lock_holder
from eltctl_runtime.files import write_json_atomic
from eltctl.errors import ConfigError, EltctlError
from eltctl.inventory import Inventory, load_inventory
from eltctl_runtime.store.auth import SecretError

log = logging.getLogger("eltctl.controller")


class _NoStore:
    """Stands in for the store when its keeper is gone (only `--down` runs without one)."""

    def _gone(self, *_a, **_k):
        raise RuntimeError("the job's store is not running")

    set = get = add = check = _gone


async def choose_address(inventory: Inventory, fleet) -> str:
    """The one address the hosts reach this machine at (docs/control-plane.md)."""
    from eltctl.hosts.ops import local_address

    if inventory.controller.address:
        return inventory.controller.address
    remote = [h for h in inventory.hosts if not h.is_local]
    if not remote:
        return "127.0.0.1"

    async def one(host, t):
        return local_address(t)

    outcomes = await fleet.each(remote, one, timeout=inventory.ssh.connect_timeout + 15)
    seen: dict[str, list[str]] = {}
    for name, o in outcomes.items():
        if o.ok and o.value:
            seen.setdefault(o.value, []).append(name)
        elif not o.ok:
            await fleet.forget(name)
    if len(seen) == 1:
        return next(iter(seen))
    if not seen:
        raise EltctlError("no host answered over SSH, so the address the workers should use to reach "
                          "the store is unknown", hint="check the hosts with `eltctl doctor`, or set "
                          "[controller] address in the inventory")
    listed = "; ".join(f"{a} (to {', '.join(n)})" for a, n in seen.items())
    raise ConfigError(f"the hosts are reached from different local addresses: {listed}; the store can "
                      "be bound to one address only", path=str(inventory.path), key="controller.address",
                      hint="set [controller] address to an address of this machine every host can reach")


def store_through_forwards(state: StateDir, ctl):
    """The "ssh" store mode's store address for a host's daemon.json: the Unix socket
    of the host's forward in its job directory (eltctl/storeforward.py), None while it
    is not up; a local host reaches the keeper's own socket, once the keeper wrote its
    run id there (a local host added while the job runs: storeforward.run_delivered)."""
    from eltctl.controller import store as kstore
    from eltctl.storeforward import forward_socket, read_forwards, run_delivered

    said: dict[str, str] = {}

    def store_for(host) -> str | None:
        info = ctl.keeper.info
        doc = read_forwards(kstore.forwards_path(state))
        if host.is_local:
            return info.endpoint if run_delivered(doc, host.name, info.pid) else None
        path = forward_socket(doc, host.name, info.pid)
        if path:
            said.pop(host.name, None)
            return f"unix:{path}"
        entry = (doc.get("hosts") or {}).get(host.name) or {} if doc.get("keeper") == info.pid else {}
        why = str(entry.get("error") or "the store keeper has not opened it yet")
        if said.get(host.name) != why:  # once per reason, not every pass
            said[host.name] = why
            log.warning("Host %s: its daemon waits for the store's SSH forward (%s; forwards.json in the state "
                        "directory, storekeeper.log).", host.name, why)
        return None

    return store_for


def warn_direct_store(address: str) -> None:
    """[controller] store = "direct": the store listens on a LAN address (finding 10 of
    issue 14: say so, loudly when the address is public)."""
    import ipaddress

    log.warning("[controller] store = \"direct\": the job's store listens on %s, reachable by anyone on "
                "that network (every value is signed with the job's secret, but the port is open); the "
                "default \"ssh\" mode keeps it on a Unix socket only the job's account reaches.", address)
    try:
        public = ipaddress.ip_address(address).is_global
    except ValueError:
        public = False
    if public:
        log.warning("[controller] address %s is a PUBLIC address: the store is open to the Internet.", address)


async def start_mirror_worker(inventory: Inventory, source, secret: bytes | None = None):
    """The background copier of committed checkpoints to `[storage] mirror` (None without one).

    `source` is the controller's `checkpoint_place`: a checkpoint's host is reached over
    the controller's own connection, looked up in the inventory as it is now."""
    from eltctl.mirror import Mirror, MirrorWorker

    mirror = Mirror.from_inventory(inventory, secret=secret)
    if mirror is None:
        return None
    worker = MirrorWorker(mirror, source=source)
    await worker.start()
    log.info("Mirroring checkpoints to %s.", mirror.target)
    return worker


def ledger_quotas(recorder, inventory):
    """The quotas' figures from the usage ledger (controller/quotas.py `QuotaProvider`):
    each host's GPU-seconds since its own local midnight (its `timezone`), and the job's."""
    from datetime import datetime

    from eltctl.controller import hours, quotas
    from eltctl.inventory.hours import for_host

    zones = {h.name: hours.zone(for_host(inventory.schedule, h.schedule).timezone) for h in inventory.hosts}

    def provide(now: float) -> quotas.QuotaUse:
        day_start = {}
        for name, tz in zones.items():
            d = datetime.fromtimestamp(now, tz).date()
            day_start[name] = datetime(d.year, d.month, d.day, tzinfo=tz).timestamp()
        today, total = recorder.quota_figures(now, day_start)
        return quotas.QuotaUse(today=today, total=total)

    return provide


def open_ledger(state: StateDir, job: str):
    """The usage ledger's recorder, open; None (and a warning) when the file cannot be
    opened: the job runs without an account rather than not at all."""
    import sqlite3

    from eltctl.ledger.recorder import UsageRecorder

    try:
        return UsageRecorder(state.usage_db, job).open()
    except sqlite3.Error as exc:
        log.warning("The usage ledger %s cannot be opened (%s): usage is not recorded. Move the file away "
                    "to start a new one.", state.usage_db, exc)
        return None


async def amain(inventory: Inventory, state: StateDir, *, down: bool, force: bool,
                left_out: dict[str, str] | None = None) -> int:
    from eltctl.controller import store as kstore
    from eltctl.controller.loop import Controller, Phase, early_probe
    from eltctl.hosts.fleet import Fleet

    ctl: Controller | None = None
    shutdown = asyncio.Event()
    connecting_message = ["connecting to the hosts"]

    async def handle(req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "phase": ctl.phase if ctl else Phase.CONNECTING,
                    "message": ctl.message if ctl else connecting_message[0], "inventory": str(inventory.path)}
        if ctl is None:
            if op == "status":
                return {"job": inventory.job.name, "state": "starting", "phase": Phase.CONNECTING,
                        "message": connecting_message[0], "updated": time.time(), "hosts": [], "events": [],
                        "controller": {"pid": os.getpid(), "alive": True}}
            if op == "reconcile":  # a controller still starting reconciles first thing anyway
                return {"ok": True, "phase": Phase.CONNECTING, "message": connecting_message[0]}
            return {"ok": False, "error": f"the controller is still {connecting_message[0]}; try again"}
        if op == "status":
            return ctl.status_document()
        if op == "reconcile":
            if req.get("reload", True):
                try:
                    new = load_inventory(inventory.path)
                    if new.job.name == inventory.job.name:
                        ctl.reload_inventory(new)
                except ConfigError as exc:
                    return {"ok": False, "error": str(exc)}
            if isinstance(req.get("left_out"), dict):
                await ctl.leave_out({str(k): str(v) for k, v in req["left_out"].items()})
            if req.get("retry"):  # a person's `up`: the hosts held by a failure are tried at once
                await ctl.retry_failed()
            if ctl.mirror_worker is not None:
                ctl.mirror_worker.retry()  # a mirror failure someone may have fixed: try now
            await ctl.reconcile()
            ctl.write_status()
            return {"ok": True, "phase": ctl.phase, "message": ctl.message}
        if op == "scale":
            return await ctl.scale(list(req.get("add") or []), list(req.get("remove") or []),
                                   bool(req.get("force", False)))
        if op in ("cordon", "uncordon"):
            return await ctl.cordon([str(h) for h in req.get("hosts") or []], op == "cordon")
        if op == "down":
            result = await ctl.down(bool(req.get("force", False)))
            shutdown.set()
            return result
        return {"ok": False, "error": f"unknown op {op!r}"}

    server = await csock.serve(state.socket, handle)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    fleet = Fleet(inventory)
    mirror_worker = None
    keeper = None
    run_task = None
    ledger = None
    first_probe = None
    try:
        if not down:
            # The first probe starts now, beside the store keeper's start (seconds on a
            # loaded machine): it publishes the job's demand, so the jobs sharing the
            # hosts learn of it at once (loop.early_probe).
            ledger = open_ledger(state, inventory.job.name)
            first_probe = early_probe(inventory, state, fleet, ledger=ledger)
        secret = job_secret(state)  # before any store client: each one is signed with it
        ssh_store = inventory.controller.store == "ssh"
        forward_to = inventory.path.resolve() if ssh_store else None
        keeper = kstore.live_keeper(state, inventory.job.name)
        previous = kstore.previous_keeper(state) if keeper is None else None
        if keeper is not None:
            log.info("Adopting the store keeper %d on %s.", keeper.pid, keeper.endpoint)
        elif not down:
            while keeper is None and not shutdown.is_set():
                try:
                    address = None if ssh_store else await choose_address(inventory, fleet)
                except ConfigError:
                    raise
                except EltctlError as exc:
                    connecting_message[0] = f"waiting for a host to answer: {exc.message}"
                    log.warning("%s; retrying.", exc.message)
                    try:
                        await asyncio.wait_for(shutdown.wait(), inventory.policy.probe_interval)
                    except asyncio.TimeoutError:
                        pass
                    continue
                # The last keeper died with the job running: its address is the one the hosts know.
                same = previous is not None and (bool(previous.socket) if ssh_store else
                                                 not previous.socket and previous.address == address)
                port, restarted = (previous.port, inventory.job.name) if same else (0, None)
                try:
                    keeper = await loop.run_in_executor(None, functools.partial(
                        kstore.start_keeper, state, address, port, restarted, forward_to,
                        inventory=None if ssh_store else inventory.path.resolve(), any_port=not ssh_store))
                except kstore.KeeperPortTaken as exc:
                    connecting_message[0] = f"waiting for the store's port {address}:{port}: {exc}"
                    log.error("The store's port %s:%d (the one the hosts know) is taken: %s; retrying.", address,
                              port, exc)
                    try:
                        await asyncio.wait_for(shutdown.wait(), inventory.policy.probe_interval)
                    except asyncio.TimeoutError:
                        pass
                    continue
                log.info("Started the store keeper %d on %s%s.", keeper.pid, keeper.endpoint,
                         " (the lost keeper's port)" if restarted else "")
            if keeper is None:
                return 0
        if keeper is not None and not ssh_store:
            warn_direct_store(keeper.address)
        if keeper is not None:
            client = await loop.run_in_executor(None, kstore.connect_client, keeper.endpoint, inventory.job.name)
            endpoint = keeper.endpoint
        else:
            client, endpoint = _NoStore(), ""
        store = kstore.JobStore(client)
        write_json_atomic(state.controller_json, {
            "pid": os.getpid(), "started": time.time(), "inventory": str(inventory.path),
            "store": keeper.to_json() if keeper else None, "socket": str(state.socket)})
        ctl = Controller(inventory, state, store, fleet, endpoint, secret=secret)
        ctl.outputs.start()
        if keeper is not None and not down:
            ctl.keeper = kstore.KeeperSupervisor(state, inventory.job.name, keeper, forward_inventory=forward_to,
                                                 inventory=None if ssh_store else inventory.path.resolve())
            if ssh_store:
                ctl.starter.store_endpoint = store_through_forwards(state, ctl)
        ctl.ledger, ledger = ledger if ledger is not None else open_ledger(state, inventory.job.name), None
        if ctl.ledger is not None:
            ctl.quota_use = ledger_quotas(ctl.ledger, inventory)
        ctl.mirror_worker = mirror_worker = await start_mirror_worker(inventory, ctl.checkpoint_place, secret)
        ctl.load_records()
        if left_out is not None:
            await ctl.leave_out(left_out)
        if keeper is not None:
            await ctl.adopt_desired()
        if keeper is not None and previous is not None and keeper.endpoint == previous.endpoint:
            await ctl.store_restarted()  # this controller replaced a keeper lost while none ran
        if down:
            result = await ctl.down(force)
            print(json.dumps(result), flush=True)
            kstore.stop_keeper(keeper)
            return 0 if result["ok"] else 1
        ctl.on_end = shutdown.set  # the training returned and the hosts are tidied (Controller.finish)
        run_task = asyncio.ensure_future(ctl.run(first_probe))
        first_probe = None
        await shutdown.wait()
        await asyncio.sleep(0.3)  # let the answer to `down` reach its caller
        if ctl.stopping:
            kstore.stop_keeper(ctl.keeper.info if ctl.keeper is not None else keeper)
            if ctl.phase != Phase.FINISHED:  # finish logged its own end
                log.info("The job is down; the controller exits.")
        else:
            log.info("The controller exits on a signal; the workers keep training.")
        return 0
    finally:
        if ctl is not None:
            ctl.stopped.set()
            ctl.write_status()
        if mirror_worker is not None:
            await mirror_worker.stop()  # idempotent: `down` has stopped it already
        if run_task is not None:
            try:
                await asyncio.wait_for(run_task, 10)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - exiting anyway
                pass
        if ctl is not None:
            ctl.outputs.stop()  # what is still queued gets a few seconds more
        if ctl is not None and ctl.ledger is not None:
            # Down: what is still open ended (inferred) when it was last seen.
            ctl.ledger.close(ctl.clock(), job_down=ctl.phase in (Phase.STOPPED, Phase.FINISHED))
        if ledger is not None:  # opened for the first probe, never handed to a controller
            ledger.close()
        if first_probe is not None:
            first_probe.cancel()
        server.close()
        try:
            state.socket.unlink()
        except FileNotFoundError:
            pass
        await fleet.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eltctl.controller", description=__doc__.split("\n")[0])
    ap.add_argument("--inventory", required=True, type=Path)
    ap.add_argument("--down", action="store_true", help="take the job down and exit")
    ap.add_argument("--force", action="store_true", help="with --down: kill what does not stop")
    ap.add_argument("--left-out", type=json.loads, default=None, metavar="JSON",
                    help="{host: reason}: hosts `eltctl up`'s checks left out (until the next `up`)")
    args = ap.parse_args(argv)
    try:
        inventory = load_inventory(args.inventory)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state = StateDir.for_job(inventory.job.name)
    state.create()
    lock = ControllerLock(state.lock)
    if not lock.acquire():
        holder = lock_holder(state.lock)
        print(f"another controller{f' (pid {holder})' if holder else ''} runs job {inventory.job.name}; "
              "nothing to do", file=sys.stderr)
        return 3 if args.down else 0
    handler = logging.FileHandler(state.controller_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("asyncssh").setLevel(logging.WARNING)  # one line per channel otherwise
    log.info("Controller %d of job %s starts (inventory %s).", os.getpid(), inventory.job.name, inventory.path)
    try:
        return asyncio.run(amain(inventory, state, down=args.down, force=args.force,
                                 left_out=args.left_out if isinstance(args.left_out, dict) else None))
    except SecretError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EltctlError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
