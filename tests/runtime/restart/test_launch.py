"""Restart mode's warm interpreters forked from the supervisor's fork server
(runtime/restart/launch.py's Warm and Launcher, daemon/zygote.py): each generation's
script gets what its Popen made (its own process group, its stdout and stderr apart
through the supervisor's pipes, the descriptors it is handed at their numbers, the
generation's environment) without an import of torch per generation, and it dies with
the fork server, which dies with the supervisor.

Real processes: the host interpreter (torch, no numpy) as the fork server, real forks and
pipes; every process is ended by the pid or group the test holds, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from eltctl_runtime.daemon.forkserver import ForkServer, Forked
from eltctl_runtime.restart.launch import Launcher, Warm
from eltctl_runtime.restart.watch import OutputPump
from tests.testbed.hostpython import HOST_PYTHON, host_env
from tests.testbed.jobenv import wait_for
from tests.testbed.procs import kill_pids

SCRIPT = r'''
import json, os, sys, time
me = {"argv": sys.argv, "group_leader": os.getpgid(0) == os.getpid(), "session_leader": os.getsid(0) == os.getpid(),
      "rank": os.environ.get("RANK"), "main": __name__, "torch": "torch" in sys.modules,
      "stdin": os.readlink("/proc/self/fd/0")}
print("OUT " + json.dumps(me), flush=True)
print("ERR on stderr", file=sys.stderr, flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
'''


def _env(**extra: str) -> dict[str, str]:
    return host_env({"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", "/"),
                     "ELTCTL_JOB": f"launch-{os.getpid()}", **extra})


def _until(what, timeout: float = 60.0):
    return wait_for(what, timeout, "the fork's answer", interval=0.05)


def _line(pump: OutputPump, prefix: str) -> str:
    return _until(lambda: next((x for x in pump.last_lines() if x.startswith(prefix)), None))


def test_each_generations_warm_interpreter_is_a_fork_of_one_fork_server(tmp_path: Path, monkeypatch):
    (tmp_path / "t.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    server = ForkServer("h1", f"launch-{os.getpid()}")
    started: list[int] = []
    try:
        # the first generation's: the fork server starts (torch's import, once) and forks it
        pump = OutputPump()
        warm = Warm.start(HOST_PYTHON, _env(), pump, server, wait=True)
        assert isinstance(warm.proc, Forked)
        started.append(warm.proc.pid)
        assert warm.wait_ready(60)
        zygote = server._proc.pid  # noqa: SLF001 - the test kills it below
        child = warm.hand(["t.py", "0", "3"], False, _env(RANK="1"))
        assert child is not None
        me = json.loads(_line(pump, "OUT ")[4:])
        assert me["argv"] == ["t.py", "0", "3"] and me["rank"] == "1" and me["main"] == "__main__"
        assert me["group_leader"] and not me["session_leader"]  # its own group, in the supervisor's session
        assert me["torch"] and me["stdin"] == "/dev/null"  # torch came with the fork
        _until(lambda: child.poll() is not None)
        assert child.poll() == 3
        pump.join()
        assert "ERR on stderr" in pump.last_lines()
        assert not any("RuntimeWarning" in x for x in pump.last_lines())  # nothing of the fork server's own

        # the next generation's is a fork of the same server, without waiting for it
        pump2 = OutputPump()
        warm2 = Warm.start(HOST_PYTHON, _env(), pump2, server, wait=False)
        assert isinstance(warm2.proc, Forked) and server._proc.pid == zygote  # noqa: SLF001
        started.append(warm2.proc.pid)
        assert warm2.wait_ready(60)
        child2 = warm2.hand(["t.py", "60", "0"], False, _env(RANK="0"))
        assert child2 is not None
        _line(pump2, "OUT ")

        # the fork server dies (as it does when the supervisor dies): the script dies with it
        os.kill(zygote, signal.SIGKILL)
        _until(lambda: child2.poll() is not None, 10)
        assert child2.poll() == -signal.SIGKILL
        assert _until(lambda: not Path(f"/proc/{child2.proc.pid}").exists()
                      or "Z" in Path(f"/proc/{child2.proc.pid}/stat").read_text().split(")")[-1][:3], 10)
        assert child2.stop(1.0) == -signal.SIGKILL  # no status will come: stop does not wait for one

        # with no server up and no wait, the warm interpreter starts the plain way
        fresh = ForkServer("h1")
        plain = Warm.start(HOST_PYTHON, _env(), OutputPump(), fresh, wait=False)
        started.append(plain.proc.pid)
        assert not isinstance(plain.proc, Forked) and fresh._proc is None  # noqa: SLF001
        plain.discard()
    finally:
        kill_pids(started)
        server.close()


def test_the_launcher_hands_each_start_to_a_warm_interpreter(tmp_path: Path, monkeypatch):
    (tmp_path / "t.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    launch = Launcher([HOST_PYTHON, "t.py", "0", "0"], True, "h1", f"launch-{os.getpid()}", "h1/0/1")
    try:
        pids = []
        for gen in range(2):
            launch.prewarm(_env(), OutputPump(), wait=gen == 0)
            assert launch.warm is not None and isinstance(launch.warm.proc, Forked)
            assert launch.warm.wait_ready(60)
            pump = OutputPump()
            child = launch.start(_env(RANK=str(gen)), pump)
            assert launch.last_warm and launch.warm is None
            pids.append(child.proc.pid)
            _until(lambda: child.poll() is not None)
            assert child.poll() == 0
        assert pids[0] != pids[1]
        # without a warm interpreter (none asked for), the start is cold
        cold = Launcher([HOST_PYTHON, "t.py", "0", "4"], False, "h1", "j", "h1/0/1")
        child = cold.start(_env(RANK="0"), OutputPump())
        assert not cold.last_warm and not isinstance(child.proc, Forked)
        assert child.proc.wait(60) == 4
        cold.close()
    finally:
        launch.close()
