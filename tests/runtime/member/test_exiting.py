"""A worker that is out of the job (finished or left) ends at once, and the
script's own code after the loop still runs: its files are flushed, its atexit
callbacks run once, and the process keeps the exit status the script asked for.
The interpreter's slow teardown (torch, gloo, the garbage collector) is skipped:
a C exit handler that only teardown would run (here: one that aborts) does not run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

import eltctl_runtime as elt
from eltctl_runtime.member.exiting import exit_code_of

SCRIPT = textwrap.dedent("""
    import atexit, ctypes, sys, torch
    import eltctl_runtime as elt

    # Only an ordinary interpreter teardown runs C exit handlers (os._exit skips them):
    # this one aborts the process. (A __del__ of a global is no marker: with torch
    # imported the teardown never calls it.)
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    job = elt.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=4,
                         max_steps=3)
    with job:
        for x, y in job:
            job.step(((model(x) - y) ** 2).mean())
    out = open(sys.argv[1], "w")          # never closed, never flushed by the script
    out.write(f"steps={job.step_count}")
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "a").write("once\\n"))
    if sys.argv[2] == "raise":
        raise ValueError("after the loop")
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield s


def run_script(store, tmp_path, how: str) -> tuple[subprocess.CompletedProcess, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    job = f"x{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, ELTCTL_STORE=f"127.0.0.1:{store.port}", ELTCTL_JOB=job,
               ELTCTL_WORKER_ID=f"h/0/{uuid.uuid4().hex[:6]}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(out), how], env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert (elt.read_status(store, job) or {}).get("step") == 3, proc.stderr
    return proc, str(out)


@pytest.mark.parametrize("code", [0, 3])
def test_finished_worker_keeps_its_code_after_the_loop_and_exit_status(store, tmp_path, code):
    proc, out = run_script(store, tmp_path, str(code))
    assert proc.returncode != -signal.SIGABRT, "the interpreter's teardown ran: the exit was not shortened"
    assert proc.returncode == code, proc.stderr
    assert open(out).read() == "steps=3"
    assert open(out + ".atexit").read() == "once\n"


def test_uncaught_error_after_the_loop_still_exits_with_status_1(store, tmp_path):
    proc, out = run_script(store, tmp_path, "raise")
    assert proc.returncode == 1
    assert "ValueError: after the loop" in proc.stderr
    assert open(out).read() == "steps=3"
    assert open(out + ".atexit").read() == "once\n"


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (3, 3), (True, 1), (256, 0), ("bye", 1)])
def test_exit_status_is_what_python_gives_system_exit(code, status):
    assert exit_code_of(code) == status


def test_flushing_at_exit_touches_no_attribute_of_other_objects():
    # Every worker's log ended with torch's "`torch.distributed.reduce_op` is deprecated"
    # FutureWarning: the exit's flush ran isinstance(obj, io.IOBase) on every live object,
    # which reads obj.__class__, and torch's deprecated object warns on any attribute read.
    import warnings

    from eltctl_runtime.member.exiting import flush_open_files

    assert dist.reduce_op is not None  # the deprecated object lives (read once here, before recording)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flush_open_files()
    assert [str(w.message) for w in caught if "reduce_op" in str(w.message)] == []
