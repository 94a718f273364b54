"""The daemon's fork server (runtime/daemon/forkserver.py, zygote.py): a forked worker is
what `procs.start_worker` would have started, seen from inside and from /proc, and the
daemon falls back to a plain start whenever the zygote cannot serve.

Real processes: the host interpreter (torch, no numpy) as the zygote, real forks, real
exit statuses; every process is ended by the pid the test holds, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from eltctl_runtime.daemon import forkserver, procs
from eltctl_runtime.daemon.courtesy import Courtesy
from eltctl_runtime.daemon.forkserver import ForkServer, Forked, forkable
from tests.testbed.hostpython import HOST_PYTHON, host_env

# What a worker sees of itself: the same script started both ways must print the same.
PROBE = r'''
import json, os, sys, time
import torch
torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)  # an optimizer: torch._dynamo's lazy import
me = {
    "argv": sys.argv, "cwd": os.getcwd(), "session_leader": os.getsid(0) == os.getpid(),
    "fds": sorted(int(n) for n in os.listdir("/proc/self/fd") if int(n) > 2 and os.path.exists(f"/proc/self/fd/{n}")
                  and not os.readlink(f"/proc/self/fd/{n}").startswith("/proc")),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "worker": os.environ.get("ELTCTL_WORKER_ID"), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "pad": any(k.startswith("ELTCTL_ZYGOTE") for k in os.environ), "main": __name__, "path0": sys.path[0],
    "stdin": os.readlink("/proc/self/fd/0"),
}
print("PROBE " + json.dumps(me), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
'''


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def _env(job: str, wid: str, gpu: str, **extra: str) -> dict[str, str]:
    return host_env({"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", "/"),
                     "ELTCTL_JOB": job, "ELTCTL_WORKER_ID": wid, "CUDA_VISIBLE_DEVICES": gpu, **extra})


def _probe(log: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if line.startswith("PROBE "):
                return json.loads(line[6:])
        time.sleep(0.05)
    raise AssertionError(f"no PROBE line in {log}: {log.read_text(errors='replace') if log.exists() else ''}")


def _wait(proc, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            return rc
        time.sleep(0.05)
    raise AssertionError(f"pid {proc.pid} did not end in {timeout} s")


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("argv, ok", [
    (["python", "train.py", "--x"], True),
    (["/opt/venv/bin/python3", "-m", "pkg.train"], True),
    (["python3.11", "t.py"], True),
    (["python", "-u", "t.py"], False),  # an interpreter option: the zygote was not started with it
    (["python", "-c", "print(1)"], False),
    (["python", "-m"], False),
    (["torchrun", "t.py"], False),
    (["python"], False),
])
def test_only_a_plain_python_script_or_module_is_forked(argv, ok):
    assert forkable(argv) is ok


def test_a_forked_worker_is_what_a_plain_start_makes(workdir, tmp_path):
    """Same script, same environment: forked and started with procs.start_worker, each
    worker sees the same argv, directory, session, descriptors, nice level and
    environment, /proc shows its own environment and command line, and each exit
    status comes back (a code, then a SIGKILL)."""
    job = f"fs-{os.getpid()}"
    claim_r, claim_w = os.pipe()  # stands in for the GPU claim's descriptor: inherited, nothing else
    server = ForkServer("h1", job)
    argv = [HOST_PYTHON, "probe.py", "30", "3"]
    started = []
    try:
        courtesy = Courtesy(nice=3)
        forked = server.spawn(argv, _env(job, "h1/0/1", "0"), workdir, tmp_path / "f.log", courtesy, "cpu",
                              pass_fds=(claim_w,))
        assert forked is not None, (tmp_path / "f.log").read_text() if (tmp_path / "f.log").exists() else ""
        started.append(forked.pid)
        plain = procs.start_worker(argv, _env(job, "h1/1/2", "1"), workdir,
                                   tmp_path / "p.log", courtesy, "cpu", pass_fds=(claim_w,))
        started.append(plain.pid)
        a, b = _probe(tmp_path / "f.log"), _probe(tmp_path / "p.log")
        assert (a["worker"], a["gpu"], b["worker"], b["gpu"]) == ("h1/0/1", "0", "h1/1/2", "1")
        for key in ("argv", "cwd", "session_leader", "nice", "pad", "main", "path0", "stdin"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert a["session_leader"] and a["nice"] == 3 and not a["pad"] and a["main"] == "__main__"
        # the claim at the daemon's number for it, as pass_fds leaves it, and no descriptor of the zygote's
        assert a["fds"] == b["fds"] == [claim_w], (a["fds"], b["fds"], claim_w)
        env = procs.environ_of(forked.pid)
        assert env is not None and env.get("ELTCTL_WORKER_ID") == "h1/0/1" and env.get("CUDA_VISIBLE_DEVICES") == "0"
        assert forkserver.PAD_VAR not in env
        assert procs.worker_identity(forked.pid, job) == "h1/0/1"
        zygote = procs.environ_of(server._proc.pid)  # noqa: SLF001 - the zygote: the job's, and no worker
        assert zygote is not None and zygote.get("ELTCTL_JOB") == job and "ELTCTL_WORKER_ID" not in zygote
        cmdline = Path(f"/proc/{forked.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmdline[1:] == [b"probe.py", b"30", b"3"], cmdline

        # a second fork is quick and equally its own; SIGKILL comes back as Popen says it (-9)
        second = server.spawn(argv, _env(job, "h1/0/3", "0"), workdir, tmp_path / "g.log")
        assert second is not None
        started.append(second.pid)
        assert _probe(tmp_path / "g.log")["worker"] == "h1/0/3"
        os.killpg(second.pid, signal.SIGKILL)
        assert _wait(second) == -signal.SIGKILL
        os.killpg(plain.pid, signal.SIGKILL)
        assert _wait(plain) == -signal.SIGKILL
    finally:
        _kill(started)
        server.close()
        os.close(claim_r)
        os.close(claim_w)


def test_an_exit_code_the_zygote_dying_and_a_changed_environment(workdir, tmp_path):
    job = f"fs2-{os.getpid()}"
    server = ForkServer("h1", job)
    started = []
    try:
        quick = server.spawn([HOST_PYTHON, "probe.py", "0.2", "3"], _env(job, "h1/0/1", "0"), workdir, tmp_path / "a.log")
        assert quick is not None
        started.append(quick.pid)
        assert _wait(quick) == 3
        zygote = server._proc.pid  # noqa: SLF001 - the test kills it to see the daemon's side cope

        # the zygote dies under a running worker: the worker runs on, watched as an adopted one
        argv = [HOST_PYTHON, "probe.py", "30", "0"]
        long = server.spawn(argv, _env(job, "h1/0/2", "0"), workdir, tmp_path / "b.log")
        assert server._proc.pid == zygote  # noqa: SLF001 - another command line, the same zygote
        assert long is not None
        started.append(long.pid)
        _probe(tmp_path / "b.log")
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not long.orphaned and time.monotonic() < deadline:
            time.sleep(0.05)
        assert long.orphaned and long.poll() is None
        assert procs.worker_identity(long.pid, job) == "h1/0/2"  # alive, and still itself

        # the next worker brings a new zygote; a changed environment another one
        again = server.spawn(argv, _env(job, "h1/1/3", "1"), workdir, tmp_path / "c.log")
        assert again is not None and server._proc.pid != zygote  # noqa: SLF001
        started.append(again.pid)
        # the old zygote's worker stays orphaned under the new one (by which zygote forked it, not
        # by its pid, which a later fork may reuse); the new one's is not
        assert long.orphaned and not again.orphaned and again.poll() is None
        second_zygote = server._proc.pid  # noqa: SLF001
        changed = server.spawn(argv, _env(job, "h1/1/4", "1", OMP_NUM_THREADS="1"), workdir, tmp_path / "d.log")
        assert changed is not None and server._proc.pid != second_zygote  # noqa: SLF001
        started.append(changed.pid)
        assert _probe(tmp_path / "d.log")["worker"] == "h1/1/4"
    finally:
        _kill(started)
        server.close()


def test_what_the_zygote_cannot_serve_is_started_the_plain_way(workdir, tmp_path):
    server = ForkServer("h1")
    assert server.spawn([HOST_PYTHON, "-c", "pass"], {}, workdir, tmp_path / "x.log") is None
    env = _env("j", "h1/0/1", "0", ELTCTL_FORK_SERVER="0")  # the job's own switch
    assert server.spawn([HOST_PYTHON, "probe.py"], env, workdir, tmp_path / "y.log") is None
    assert server._proc is None  # noqa: SLF001 - nothing was started for them
    # an interpreter without the runtime on its path: no zygote, no worker lost (the daemon starts it)
    bare = {"PATH": os.environ.get("PATH", os.defpath)}
    assert server.spawn([HOST_PYTHON, "probe.py"], bare, workdir, tmp_path / "z.log") is None
    assert server.spawn([HOST_PYTHON, "probe.py"], bare, workdir, tmp_path / "z.log") is None  # no second try
    server.close()


def test_a_missing_script_fails_as_python_says_it(tmp_path):
    server = ForkServer("h1")
    try:
        w = server.spawn([HOST_PYTHON, "trian.py"], _env("j3", "h1/0/1", "0"), tmp_path, tmp_path / "m.log")
        assert w is not None
        assert _wait(w) == 2
        assert "can't open file" in (tmp_path / "m.log").read_text()
    finally:
        server.close()


def test_an_idle_zygote_ends(workdir, tmp_path, monkeypatch):
    server = ForkServer("h1")
    try:
        w = server.spawn([HOST_PYTHON, "probe.py", "0", "0"], _env("j4", "h1/0/1", "0"), workdir, tmp_path / "i.log")
        assert w is not None and _wait(w) == 0
        zygote = server._proc  # noqa: SLF001
        server.tick(time.monotonic())
        assert zygote.poll() is None  # idle only just now
        server.tick(time.monotonic() + forkserver.IDLE_S + 1)
        assert zygote.poll() is not None  # ended and reaped
    finally:
        server.close()


def test_the_zygote_leaves_with_the_daemon_and_its_workers_stay(workdir, tmp_path):
    """The daemon killed with SIGKILL: the zygote sees its socket close and exits; the
    worker it forked runs on in its own session (the next daemon adopts it)."""
    job = f"fs5-{os.getpid()}"
    driver = subprocess.Popen(
        [HOST_PYTHON, "-c", (
            "import sys, time; from pathlib import Path; from eltctl_runtime.daemon.forkserver import ForkServer\n"
            f"s = ForkServer('h1', {job!r})\n"
            f"w = s.spawn([{HOST_PYTHON!r}, 'probe.py', '30', '0'], {_env(job, 'h1/0/1', '0')!r}, "
            f"Path({str(workdir)!r}), Path({str(tmp_path / 'w.log')!r}))\n"
            "print(w.pid, s._proc.pid, flush=True); time.sleep(60)")],
        env=host_env({"PATH": os.environ.get("PATH", os.defpath)}), stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    worker = zygote = None
    try:
        worker, zygote = (int(x) for x in driver.stdout.readline().split())
        _probe(tmp_path / "w.log")
        os.kill(driver.pid, signal.SIGKILL)  # the daemon alone (its process group would take the zygote too)
        driver.wait()
        def state() -> str:  # "" once gone
            try:
                return Path(f"/proc/{zygote}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return ""

        deadline = time.monotonic() + 20
        while state() not in ("", "Z", "X") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state() in ("", "Z", "X"), Path(f"/proc/{zygote}/stat").read_text()
        assert procs.worker_identity(worker, job) == "h1/0/1"
    finally:
        _kill([p for p in (worker,) if p])
        if zygote:
            try:
                os.kill(zygote, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def test_an_exit_status_polled_from_two_threads_is_kept():
    """The server hands a status out once; a poll that got None while another thread's got
    the status must not write None over it (the runtime tests' launcher polls from its
    watch thread and from the test's)."""
    inside, done = threading.Event(), threading.Event()

    class Server:
        calls = 0

        def exit_code(self, pid: int, zygote: int):
            self.calls += 1
            if self.calls == 1:  # the second thread, held inside its call until the first has its status
                inside.set()
                done.wait(5)
                return None
            return 3

    w = Forked(Server(), 1234, 1)
    late = threading.Thread(target=w.poll)
    late.start()
    assert inside.wait(5)
    assert w.poll() == 3  # the first thread's poll gets the status...
    done.set()
    late.join(5)
    assert w.returncode == 3 and w.poll() == 3  # ...and the other thread's None does not erase it
