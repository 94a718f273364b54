"""The daemon's fork server: one interpreter that imported torch, forked for each worker.

A worker's start is mostly imports: `import torch` (about 2 CPU-s here) and, at the
script's first optimizer, `torch._dynamo` (torch's optimizers import it lazily: 1.5
CPU-s more), every time, in every worker, on a host whose cores the job's other
workers and the owner are using. The daemon (forkserver.py) starts this process once,
when it starts its first worker, as::

    python -m eltctl_runtime.daemon.zygote FD PAD

with the workers' environment (less what differs per worker: forkserver.shared_env)
and a padding variable. It imports torch (nothing initialises CUDA or a thread pool:
it stays one thread, so forking it is safe), says so on FD (a SOCK_SEQPACKET socket
to the daemon) and then serves, one JSON message per request::

    daemon -> {"spawn": {"argv": [...], "env": {...}, "cwd": "...", "courtesy": {...},
               "device": "cpu", "fds_at": [n...], "streams": "log", "group": false}}
               with descriptors [log, claim...]
    zygote -> {"spawned": pid} | {"failed": "why"}; later {"exit": pid, "code": rc}

(`fds_at`: the numbers the descriptors after the log land at in the fork, the sender's own, as
pass_fds leaves them.) Restart mode's supervisor (restart/launch.py) is the other client: it
sends `"streams": "pipes"` with descriptors [stdout, stderr, ...] (the fork's stdout and stderr
apart, through its pipes) and `"group": true` (the fork takes a process group of its own in
the supervisor's session, not a session, and PR_SET_PDEATHSIG: it dies with the zygote, which
ends when the supervisor does), as its Popen of a warm interpreter did.

Each worker is a fork that becomes what `subprocess.Popen(argv, env=env, cwd=cwd,
start_new_session=True, stdin=DEVNULL, stdout=log, stderr=STDOUT, pass_fds=claims,
preexec_fn=courtesy)` of `python script.py ...` (or `python -m module ...`) would
have made: its own session, those descriptors and no others, that directory, the
courtesy's nice level, I/O class and memory limit, and that environment, in
os.environ and in /proc/<pid>/environ too (what the daemon's adoption, the probe and
the GPU watch read to know whose a process is): the fork writes its environment and
its command line over the zygote's own, in place (the padding is the room for it),
before the zygote answers. It then runs the script as `__main__` (restart/warmstart.py's
`run_script`, the same path restart mode's warm interpreters take) and exits as
Python does. The zygote reaps its children and reports each exit status; it ends when
the daemon's end of FD closes (its workers run on, in their sessions).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import sys

from ..restart.warmstart import import_torch
from .forkserver import MAX_FDS, MAX_MESSAGE


try:  # looked up here, not in a fork (no dynamic loading between fork and the script)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _send(sock: socket.socket, doc: dict) -> None:
    try:
        sock.send(json.dumps(doc).encode())
    except OSError:
        pass  # the daemon is gone: the loop sees the end of its socket next


def _regions() -> tuple[int, int, int, int]:
    """arg_start, arg_end, env_start, env_end of this process (/proc/self/stat, fields 48-51)."""
    with open("/proc/self/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return tuple(int(rest[i - 3]) for i in (48, 49, 50, 51))  # type: ignore[return-value]


def _overwrite(start: int, end: int, items: list[str]) -> None:
    data = b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in items)
    if len(data) > end - start:
        raise OSError(f"{len(data)} bytes does not fit in the zygote's {end - start}")
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def take_identity(argv: list[str], env: dict[str, str]) -> None:
    """Make /proc/self/cmdline and /proc/self/environ read `argv` and `env` (OSError: too long)."""
    a0, a1, e0, e1 = _regions()
    entries = [f"{k}={v}" for k, v in env.items()]
    need = sum(len(s.encode("utf-8", "surrogateescape")) + 1 for s in entries)
    if need > e1 - e0:
        raise OSError(f"the environment ({need} bytes) does not fit in the zygote's ({e1 - e0})")
    _overwrite(a0, a1, argv)
    _overwrite(e0, e1, entries)


def _child(spec: dict, fds: list[int], sock: socket.socket, ready_w: int, zygote: int) -> dict:
    """In the fork: become the worker (all but running its script). Never returns on failure."""
    try:
        if spec.get("group"):  # restart mode's script: its own group, and gone with the zygote
            os.setpgrp()
            if _prctl is not None:
                _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != zygote:
                os._exit(127)  # the zygote (and so its client) died before prctl took effect
        else:
            os.setsid()
        sock.detach()  # its number is closed below; the object must not close a reused one later
        pipes = spec.get("streams") == "pipes"  # stdout and stderr apart; else one log for both
        n = 2 if pipes else 1
        streams, extra = fds[:n], fds[n:]
        at = [int(x) for x in spec.get("fds_at") or []]
        if len(at) != len(extra) or any(x < 3 for x in at) or len(set(at)) != len(at):
            at = list(extra)  # where they arrived (the request named no numbers, or wrong ones)
        # Every descriptor to keep above every number one is placed at, so no dup2 closes another.
        top = max([2, ready_w, *fds, *at]) + 1
        ready_w, streams, extra = (fcntl.fcntl(ready_w, fcntl.F_DUPFD_CLOEXEC, top),
                                   [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in streams],
                                   [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in extra])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(streams[0], 1)
        os.dup2(streams[-1], 2)
        for fd, target in zip(extra, at):
            os.dup2(fd, target)  # inheritable, as pass_fds leaves them: a script's own children get them too
        keep = {0, 1, 2, ready_w, *at}
        for fd in _open_fds():
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir(spec["cwd"])
        courtesy = spec.get("courtesy")
        if courtesy is not None:
            from .courtesy import Courtesy, preexec
            apply = preexec(Courtesy(**courtesy), spec.get("device", "cpu"))
            if apply is not None:
                apply()
        argv, env = list(spec["argv"]), dict(spec["env"])
        # os.environ first: unsetenv drops the C environment's pointers into the zygote's original
        # strings while they are still those strings, and setenv's copies live elsewhere, so what
        # the script's own children inherit is exactly `env`, whatever is then written over the region
        os.environ.clear()
        os.environ.update(env)
        take_identity([sys.executable, *argv[1:]], env)
        os.write(ready_w, b"1")
        os.close(ready_w)
    except BaseException as e:  # noqa: BLE001 - the parent reports it; nothing of the zygote's may run on
        try:
            os.write(ready_w, f"0{type(e).__name__}: {e}".encode()[:512])
        finally:
            os._exit(127)
    return spec


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def _spawn(sock: socket.socket, spec: dict, fds: list[int], wake: tuple[int, int]) -> dict | None:
    """Fork a worker; in the parent answer and return None, in the child return its spec."""
    ready_r, ready_w = os.pipe()
    zygote = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing of the zygote's in a worker's log
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (ready_r, *wake):
            os.close(fd)
        return _child(spec, fds, sock, ready_w, zygote)
    os.close(ready_w)
    for fd in fds:
        os.close(fd)
    with os.fdopen(ready_r, "rb") as r:
        said = r.read()
    if said[:1] == b"1":
        _send(sock, {"spawned": pid})
    else:
        _send(sock, {"failed": said[1:].decode(errors="replace") or "the fork ended before it was ready"})
    return None


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> dict | None:
    """The zygote's loop: None when the daemon went away, a worker's spec in a fork."""
    sock = socket.socket(fileno=fd)
    try:
        import_torch()
    except BaseException as e:  # noqa: BLE001 - no torch here: the daemon starts its workers itself
        _send(sock, {"error": f"{type(e).__name__}: {e}"})
        return None
    wake = os.pipe()
    for end in wake:
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, {"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sock, wake[0]], [], [])
        if wake[0] in readable:
            try:
                while os.read(wake[0], 512):
                    pass
            except BlockingIOError:
                pass
            _reap(sock)
        if sock in readable:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                return None  # the daemon ended: its workers run on, in their own sessions
            try:
                spec = json.loads(data)["spawn"]
            except (ValueError, KeyError, TypeError) as e:
                for x in fds:
                    os.close(x)
                _send(sock, {"failed": f"a request it cannot read: {e}"})
                continue
            if not fds:
                _send(sock, {"failed": "a request without its log's descriptor"})
                continue
            child = _spawn(sock, spec, fds, wake)
            if child is not None:
                return child
            _reap(sock)


def main() -> None:
    spec = serve(int(sys.argv[1]))
    if spec is None:
        sys.exit(0)
    from ..restart import warmstart
    from ..restart.warmstart import run_script, warm_form
    prog = spec["argv"][0]
    _python, args, module = warm_form(spec["argv"])  # type: ignore[misc] - forkable (forkserver.py)
    if module and args[0] == warmstart.__name__:  # restart mode's warm interpreter: imported here already
        sys.argv = [warmstart.__file__, *args[1:]]
        warmstart.main()
        return
    if module:
        import importlib.util
        try:
            found = importlib.util.find_spec(args[0])
        except (ImportError, ValueError) as e:
            found, why = None, f"Error while finding module specification for {args[0]!r} ({type(e).__name__}: {e})"
        else:
            why = f"No module named {args[0]}"
        if found is None:  # as `python -m` says it
            print(f"{prog}: {why}", file=sys.stderr)
            sys.exit(1)
    else:
        try:
            with open(args[0], "rb"):
                pass
        except OSError as e:  # as `python script` says it
            print(f"{prog}: can't open file {os.path.abspath(args[0])!r}: [Errno {e.errno}] {e.strerror}",
                  file=sys.stderr)
            sys.exit(2)
    run_script(args, module=module)


if __name__ == "__main__":
    main()
