"""The host daemon's command line: `python -m eltctl_runtime.daemon --config
daemon.json [--detach]`.

`--detach` starts the daemon again as a fresh interpreter in a new session
(stdin /dev/null, output appended to daemon.log) and waits for its readiness
line on a pipe: it prints `ok PID` once the daemon holds its pid file and
exits 0, or prints `running PID` and exits 3 when another daemon of the job
already runs there; a bad configuration exits 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from .config import DaemonConfig, DaemonConfigError
from .service import EXIT_CONFIG, EXIT_OK, EXIT_RUNNING, Daemon

def _setup_logging(job_dir: Path) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(job_dir / "daemon.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("eltctl_runtime")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _detach(config: Path, job_dir: Path) -> int:
    """Start the daemon again as a detached process (new session, stdin
    /dev/null, output appended to daemon.log) and wait for its readiness line.
    A fresh interpreter rather than a fork: torch is already imported here."""
    r, w = os.pipe()
    with open(job_dir / "daemon.log", "ab") as out:
        subprocess.Popen([sys.executable, "-m", "eltctl_runtime.daemon", "--config", str(config),
                          "--ready-fd", str(w)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True, pass_fds=(w,), close_fds=True)
    os.close(w)
    try:
        return _wait_ready(r)
    finally:
        os.close(r)


def _ready_writer(fd: int):
    def ready(message: str) -> None:
        try:
            os.write(fd, (message + "\n").encode())
            os.close(fd)
        except OSError:
            pass
    return ready


def _wait_ready(r: int, timeout: float = 60.0) -> int:
    import select

    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and b"\n" not in buf:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(r, 256)
        if not chunk:
            break
        buf += chunk
    line = buf.decode(errors="replace").strip()
    print(line or "failed: the daemon did not answer (see daemon.log)")
    if line.startswith("ok"):
        return EXIT_OK
    return EXIT_RUNNING if line.startswith("running") else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eltctl_runtime.daemon",
                                 description="eltctl's host daemon: runs one job's workers on this host.")
    ap.add_argument("--config", type=Path, required=True, help="daemon.json written by the controller")
    ap.add_argument("--detach", action="store_true",
                    help="run detached (new session); print 'ok PID' (exit 0) or 'running PID' (exit 3)")
    ap.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        cfg = DaemonConfig.load(args.config)
    except DaemonConfigError as e:
        print(f"eltctl daemon: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.detach:
        cfg.job_dir.mkdir(parents=True, exist_ok=True)
        return _detach(args.config.resolve(), cfg.job_dir)
    _setup_logging(cfg.job_dir)
    ready = _ready_writer(args.ready_fd) if args.ready_fd is not None else None
    return Daemon(cfg, dict(os.environ)).run(ready=ready)
