"""The store keeper: the process that serves one job's store.

    python -m eltctl.storekeeper (--socket PATH | --address ADDR [--port N]) --info PATH
                                 [--run-file PATH] [--stats PATH] [--restarted-job JOB]
                                 [--inventory PATH [--forwards PATH] [--no-forward]]

It serves eltctl_runtime.store.server's store (the standard library only: the keeper
imports no torch): on the Unix socket PATH (the default `[controller] store = "ssh"`
mode: in the controller's 0700 state directory, so only the job's account can
connect), or on TCP at ADDR:N (the warned "direct" mode). Either way the store's
limits hold (sockstore.Limits). It writes `{"pid", "address", "port", "socket",
"spec", "started"}` to the info file (atomically) once the store serves, and then
only waits for SIGTERM, writing the store's counters (connections, requests,
refusals by reason) to the stats file every few seconds: refusals mean someone
other than the job's clients is talking to it, and the controller reports them.
It is a process of its own, not a thread of the controller, so a controller crash
loses no store state and no worker notices it; the next controller finds it
through controller.json and reconnects.

At every start the keeper makes a fresh run id (`secrets.token_hex(16)`) and writes
it, mode 0600, to the run file (the state directory's `run`) and to the job
directory of every "local" inventory host BEFORE it serves; the forwarder writes it
to each remote host's job directory before it opens that host's forward, and to a
local host added to the inventory later when it re-reads the file
(eltctl/storeforward.py). A store reachable anywhere is thus always the keeper
whose run id is written there.

When the keeper itself dies, the controller starts a new one at the same address
(`--socket` again, or `--port`; with `--restarted-job`: the new store then holds the
job's `store/restarted` mark from its first moment, so a joiner waits for the
members to re-publish their plan; runtime/storeloss.py). An address another process
holds (a port, or a socket a live store answers on) is exit code 3 (PORT_TAKEN),
except with `--any-port` (the direct mode's restarts): a port another process took
is given up for one the OS picks, and the info file names it (anyone on the LAN can
take a port; the ssh mode's socket is in a 0700 directory). A direct-mode keeper
with `--inventory` writes its address beside the run id on every host
(`store.address`), where the daemons and workers already running find it when they
reconnect.

The keeper raises its open-file limit to its hard limit and keeps the store's
connection limit below it (`keeper_limits`), so a flood of connections is refused
by the store, counted, before `accept` could fail; `--limit NAME=VALUE` sets one of
the store's other limits (sockstore.Limits).

With `--inventory`, the keeper writes the run id to its local hosts and (with
`--forwards`) holds one SSH forward per remote host of the inventory
(eltctl/storeforward.py; `--no-forward`, the direct mode: it only delivers the run
id), writes their state to the forwards file, and re-reads the inventory when it
changes or on SIGHUP (which then no longer stops it).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from eltctl_runtime.store import auth
from eltctl_runtime.files import write_atomic
from eltctl_runtime.protocol import KEEPER_KEY, Keys, job_prefix
from eltctl_runtime.store.server import Limits, Spec, StoreServer, answers, connection_cap, raise_nofile

PORT_TAKEN = 3
STATS_EVERY_S = 2.0


class AddressTaken(OSError):
    """Another live store serves the keeper's socket."""


def keeper_limits(nofile: int, forwarding: bool, overrides: dict[str, float] | None = None) -> Limits:
    """The store's limits in a keeper whose soft open-file limit is `nofile`: the
    connection limit below it (each forwarded client also holds an SSH channel's
    socket in this process: two descriptors), so the limit refuses a connection before
    `accept` fails for want of one. `overrides`: Limits' fields by name (--limit)."""
    fields = dict(overrides or {})
    wanted = int(fields.pop("max_connections", Limits.max_connections))
    cap = connection_cap(nofile, wanted, fds_per_client=2 if forwarding else 1)
    kinds = {f: type(getattr(Limits, f)) for f in Limits.__dataclass_fields__}
    return Limits(max_connections=cap, **{k: kinds[k](v) for k, v in fields.items()})


def parse_limit(text: str) -> tuple[str, float]:
    """`NAME=VALUE` for --limit: a field of sockstore.Limits and a number."""
    name, sep, value = text.partition("=")
    if not sep or name not in Limits.__dataclass_fields__:
        raise argparse.ArgumentTypeError(f"--limit {text!r}: give NAME=VALUE, NAME one of "
                                         f"{', '.join(Limits.__dataclass_fields__)}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit {text!r}: {value!r} is not a number") from None


def serve(info: Path, *, socket_path: Path | None = None, address: str | None = None, port: int = 0,
          restarted_job: str | None = None, secret_file: Path | None = None, inventory: Path | None = None,
          forwards: Path | None = None, forward: bool = True, run_file: Path | None = None,
          stats_file: Path | None = None, limits: dict[str, float] | None = None, any_port: bool = False) -> None:
    nofile = raise_nofile()
    server = StoreServer(keeper_limits(nofile, socket_path is not None and inventory is not None and forward
                                       and forwards is not None, limits))
    if socket_path is not None:
        if answers(str(socket_path)):
            raise AddressTaken(errno.EADDRINUSE, f"a live store answers on {socket_path}")
        server.listen_unix(socket_path)
        where = Spec("unix", path=str(socket_path))
    else:
        try:
            port = server.listen_tcp(address, port)
        except OSError as exc:
            if not (any_port and port and exc.errno == errno.EADDRINUSE):
                raise
            # another process took the lost keeper's port: never wait for it (anyone on the
            # LAN may hold it for ever); a new one, published as the first was (the info
            # file, controller.json, each new daemon's store address)
            print(f"store keeper: the port {port} is taken by another process; serving on a new one",
                  file=sys.stderr, flush=True)
            port = server.listen_tcp(address, 0)
        where = Spec("tcp", host=address, port=port)
    run_id = secrets.token_hex(16)
    # 0600, before anyone can connect: the sockets are bound, not listening, until
    # server.start() (a client that connected earlier would read the last run's id)
    write_atomic(run_file or info.parent / auth.RUN_FILE_NAME, run_id + "\n")
    server.set(KEEPER_KEY, str(os.getpid()))
    if restarted_job:
        mark = str(time.time()).encode()
        if secret_file is not None:  # the job's readers check it like every value (runtime/auth.py)
            signer = auth.Signer(auth.read_secret(secret_file), job_prefix(restarted_job), run_id)  # this store's run
            mark = signer.seal(Keys.STORE_RESTARTED, mark)
        server.set(f"{job_prefix(restarted_job)}/{Keys.STORE_RESTARTED}", mark)
    forwarder = None
    if inventory is not None:
        from eltctl.storeforward import FORWARDS_FILE, Forwarder

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
        forwarder = Forwarder(inventory, forwards or info.parent / FORWARDS_FILE,
                              str(socket_path) if socket_path is not None else None, run_id,
                              forward=forward and forwards is not None,
                              store=str(where) if socket_path is None else None)  # direct: the address moves
        # the local hosts' run ids before the store serves; the forwarder writes them again
        # to a local host added to the inventory later (at its re-read), before its daemon starts
        forwarder.deliver_local()
    server.start()
    if forwarder is not None:
        forwarder.start()
    write_atomic(info, json.dumps({"pid": os.getpid(), "address": where.host or "", "port": where.port,
                                   "socket": where.path or None, "spec": str(where), "started": time.time()}))
    print(f"store keeper {os.getpid()}: serving the store on {where} (at most "
          f"{server.limits.max_connections} connections; {nofile} open files)"
          + (f", forwarded over SSH to the hosts of {inventory}" if forwarder and forwarder.forward else ""),
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    signal.signal(signal.SIGHUP, (lambda *_: forwarder.reload()) if forwarder else (lambda *_: done.set()))
    stats_file = stats_file or info.parent / "storestats.json"
    written = None
    while not done.wait(STATS_EVERY_S):
        stats = server.stats()
        if stats != written:
            write_atomic(stats_file, json.dumps(dict(stats, keeper=os.getpid(), time=time.time())), sync=False)
            written = stats
    print(f"store keeper {os.getpid()}: stopping", flush=True)
    server.stop()
    sys.stdout.flush()
    os._exit(0)  # the forwarder's and the server's threads end with the process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eltctl.storekeeper", description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", type=Path, help="serve on this Unix socket (its directory: 0700)")
    where.add_argument("--address", help="serve on TCP at this address (the direct mode)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--any-port", action="store_true",
                    help="with --port: when another process holds it, serve on a port the OS picks")
    ap.add_argument("--limit", action="append", type=parse_limit, default=[], metavar="NAME=VALUE",
                    help="one of the store's limits (eltctl_runtime.store.server.Limits), e.g. idle_timeout_s=600")
    ap.add_argument("--info", type=Path, required=True, help="where to write pid and address (JSON)")
    ap.add_argument("--run-file", type=Path, default=None, help="where to write the run id (default: run beside --info)")
    ap.add_argument("--stats", type=Path, default=None, help="the store's counters (default: storestats.json beside --info)")
    ap.add_argument("--restarted-job", default=None, help="this keeper replaces a lost one of this job")
    ap.add_argument("--secret-file", type=Path, default=None,
                    help="with --restarted-job: the job's secret, to sign its store/restarted mark")
    ap.add_argument("--inventory", type=Path, default=None,
                    help="write the run id to this inventory's hosts (and forward the store to them)")
    ap.add_argument("--forwards", type=Path, default=None, help="with --inventory: the forwards' state file")
    ap.add_argument("--no-forward", action="store_true", help="with --inventory: deliver the run id only")
    args = ap.parse_args(argv)
    shown = str(args.socket) if args.socket else f"{args.address}:{args.port}"
    try:
        serve(args.info, socket_path=args.socket, address=args.address, port=args.port,
              restarted_job=args.restarted_job, secret_file=args.secret_file, inventory=args.inventory,
              forwards=args.forwards, forward=not args.no_forward, run_file=args.run_file, stats_file=args.stats,
              limits=dict(args.limit), any_port=args.any_port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"store keeper: {shown} is taken by another process; the hosts know only this address, so "
                  "the controller tries it again"
                  + (f" (find the process with `ss -ltnp 'sport = :{args.port}'`)" if not args.socket else
                     f" (find the process with `ss -lxp src {args.socket}`)"), file=sys.stderr)
            return PORT_TAKEN
        print(f"store keeper: cannot serve the store on {shown}: {exc}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
