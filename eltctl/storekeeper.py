"""The store keeper: the process that serves one job's c10d TCPStore.

    python -m eltctl.storekeeper --address ADDR [--port N] --info PATH [--restarted-job JOB
                                 [--secret-file PATH [--run-file PATH]]]
                                 [--inventory PATH --forwards PATH]

It binds a listening socket to ADDR alone (never 0.0.0.0: the store has no
authentication) and hands it to torch's TCPStore with `master_listen_fd`, writes
`{"pid", "address", "port"}` to PATH (atomically) once the store answers, and then
only waits for SIGTERM. It is a process of its own, not a thread of the controller,
so a controller crash loses no store state and no worker notices it; the next
controller finds it through controller.json and reconnects.

When the keeper itself dies, the controller starts a new one on the same address
and port (`--port`, with `--restarted-job`: the new store then holds the job's
`store/restarted` mark from its first moment, so a joiner waits for the members
to re-publish their plan; runtime/storeloss.py). A port another process holds is
exit code 3 (PORT_TAKEN); the controller tries again later, never another port.

With `--inventory` and `--forwards` (the default `[controller] store = "ssh"` mode:
ADDR is 127.0.0.1), the keeper also holds one SSH remote forward per remote host
of the inventory (eltctl/storeforward.py), writes their state to the forwards file,
and re-reads the inventory when it changes or on SIGHUP (which then no longer stops
it).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from eltctl_runtime import auth
from eltctl_runtime.files import write_atomic
from eltctl_runtime.protocol import KEEPER_KEY, Keys, job_prefix

PORT_TAKEN = 3


def serve(address: str, port: int, info: Path, restarted_job: str | None = None,
          secret_file: Path | None = None, inventory: Path | None = None, forwards: Path | None = None,
          run_file: Path | None = None) -> None:
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    # use_libuv=False: the libuv backend does not take a listening fd.
    store = dist.TCPStore(address, port, is_master=True, master_listen_fd=sock.fileno(), use_libuv=False,
                          wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set(KEEPER_KEY, str(os.getpid()))
    if restarted_job:
        mark = str(time.time()).encode()
        if secret_file is not None:  # the job's readers check it like every value (runtime/auth.py)
            signer = auth.Signer(auth.read_secret(secret_file), job_prefix(restarted_job),
                                 auth.read_run_id(run_file))  # signed in this store's run
            mark = signer.seal(Keys.STORE_RESTARTED, mark)
        store.set(f"{job_prefix(restarted_job)}/{Keys.STORE_RESTARTED}", mark)
    forwarder = None
    if inventory is not None and forwards is not None:
        from eltctl.storeforward import Forwarder

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
        forwarder = Forwarder(inventory, forwards, port, insist=restarted_job is not None)
        forwarder.start()
    write_atomic(info, json.dumps({"pid": os.getpid(), "address": address, "port": port, "started": time.time()}))
    print(f"store keeper {os.getpid()}: serving the store on {address}:{port}"
          + (f", forwarded over SSH to the hosts of {inventory}" if forwarder else ""), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    signal.signal(signal.SIGHUP, (lambda *_: forwarder.reload()) if forwarder else (lambda *_: done.set()))
    while not done.wait(3600):
        pass
    print(f"store keeper {os.getpid()}: stopping", flush=True)
    # Leave without running finalizers: closing the listening socket under the
    # store's server thread makes torch abort with a core dump.
    sys.stdout.flush()
    os._exit(0)
    del store  # unreachable; keeps the store referenced until the exit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eltctl.storekeeper", description=__doc__.split("\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--info", type=Path, required=True, help="where to write pid, address and port (JSON)")
    ap.add_argument("--restarted-job", default=None, help="this keeper replaces a lost one of this job")
    ap.add_argument("--secret-file", type=Path, default=None,
                    help="with --restarted-job: the job's secret, to sign its store/restarted mark")
    ap.add_argument("--run-file", type=Path, default=None,
                    help="with --secret-file: the store's run id (the mark is signed in this run)")
    ap.add_argument("--inventory", type=Path, default=None, help="forward the store to this inventory's hosts")
    ap.add_argument("--forwards", type=Path, default=None, help="with --inventory: the forwards' state file")
    args = ap.parse_args(argv)
    try:
        serve(args.address, args.port, args.info, args.restarted_job, args.secret_file, args.inventory,
              args.forwards, args.run_file)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"store keeper: port {args.port} on {args.address} is taken by another process; the hosts "
                  "know only this port, so the controller tries it again (find the process with "
                  f"`ss -ltnp 'sport = :{args.port}'`)", file=sys.stderr)
            return PORT_TAKEN
        print(f"store keeper: cannot serve the store on {args.address}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
