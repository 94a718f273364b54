"""A quick process exit once this worker is out of the job.

A worker that has left (planned leave) or finished has nothing left to do in
the job, but an ordinary interpreter exit takes seconds: torch's module and
C++ static teardown, the destructors of gloo groups that daemon threads still
hold (they block on their sockets), and the garbage collector over a large
heap. On a GPU host the memory stays held until the process is gone, so that
time is what the GPU's owner waits (measured here: 1-2.4 s from the leave to
the exit on an idle-ish machine, up to 11 s on a loaded one).

`arm(...)` makes the interpreter's exit quick without losing anything the
script does after the training loop: the script's own code runs to its end as
usual; then, at the point where the interpreter would start tearing itself
down, the hook

1. joins the script's non-daemon threads (what the interpreter does next),
2. runs every `atexit` callback once, in the usual order (logging's flush and
   close is one of them),
3. flushes every open Python file object and the standard streams (an
   ordinary exit would flush them while collecting them),
4. and ends the process with `os._exit(code)`.

The exit code is the interpreter's own choice where it can be known: the
argument of `sys.exit(...)` (sys.exit is wrapped while armed), 1 after an
uncaught exception (its traceback is already printed), else 0. A script that
ends with a bare `raise SystemExit(n)` for a non-zero n after leaving the job
exits 0: use `sys.exit(n)` or `ElasticJob(..., fast_exit=False)`.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading

_armed = False
_exit_code: int | None = None  # what the script passed to sys.exit, once armed


def exit_code_of(code: object) -> int:
    """The process exit status Python gives `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: Python prints it to stderr and exits 1


def arm() -> None:
    """Make this process's interpreter exit quick (see the module docstring).
    Idempotent; only from the main thread of the main interpreter."""
    global _armed
    if _armed or threading.current_thread() is not threading.main_thread():
        return
    _armed = True
    real_exit = sys.exit

    def recording_exit(code: object = None) -> None:
        global _exit_code
        _exit_code = exit_code_of(code)  # Python still prints a message argument itself
        real_exit(code)

    sys.exit = recording_exit
    # threading's exit hooks run when the main thread's code has ended and
    # before any atexit callback, so every atexit callback (including ones
    # registered after this) still runs exactly once, from here.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_quick_exit)
    else:  # pragma: no cover - CPython has had it since 3.9
        atexit.register(_quick_exit)


def _quick_exit() -> None:
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t.is_alive():
            t.join()
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failing callback is reported by atexit itself; go on exiting
        pass
    code = _exit_code
    if code is None:
        code = 1 if getattr(sys, "last_value", None) is not None else 0
    flush_open_files()
    os._exit(code)


def flush_open_files() -> None:
    """Flush every open Python file object (as an ordinary exit does when it
    collects them), then the standard streams."""
    for obj in gc.get_objects():
        # The type, not isinstance: an ABC's isinstance reads `obj.__class__`, an attribute
        # access on every live object, and some objects warn on any (torch's deprecated
        # `torch.distributed.reduce_op` printed a FutureWarning in every worker's log at exit).
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken stream must not stop the exit
                pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass
