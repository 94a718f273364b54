"""Restart mode with real processes: supervisors (`python -m eltctl_runtime.restart`)
under the host interpreter, each running the unmodified DDP script
examples/ddp_restart.py, on a store hosted by the test (runtime_cluster.py).

The plan: 3 supervisors start the script at world size 3; rank 0's supervisor
gets SIGTERM (a planned leave: it hands the script's checkpoint over) and the
other two restart at 2, resuming from the step the script saved; a fourth
supervisor joins and the job restarts at 3; one supervisor is SIGKILLed and the
survivors restart at 2 from the script's last save; a stop ends the job. Every
supervisor and every script is gone at the end.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime import read_status
from eltctl_runtime.daemon.procs import environ_of as procs_environ
from eltctl_runtime.protocol import Keys, job_prefix
from eltctl_runtime.checkpoint.store import CheckpointStore
from eltctl_runtime.restart.supervisor import ScriptStore, expand_command, pack_dir, torchrun_env, unpack_dir, warm_form
from runtime_cluster import PYTHON, ROOT, Cluster, Worker
from tests.testbed.hostpython import host_env

SCRIPT = ROOT / "examples" / "ddp_restart.py"
SCRIPT_ARGS = ["--steps", "100000", "--save-every", "5", "--step-sleep", "0.05", "--samples", "512",
               "--batch", "8", "--hidden", "16"]
STEP = re.compile(r"^step (\d+) world (\d+) restart (\d+)", re.M)
RESUMED = re.compile(r"^resumed at step (\d+) world (\d+) restart (\d+)", re.M)
STARTED = re.compile(r"started the script \(pid (\d+), (?:warm|cold)\)")


# -- the pure parts -----------------------------------------------------------------


@pytest.mark.parametrize("members, me, expect", [
    (("a/0/1",), "a/0/1", dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                                GROUP_WORLD_SIZE="1")),
    (("a/1/1", "b/0/1", "a/0/1"), "a/0/1", dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                                                 GROUP_RANK="0", GROUP_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="1,0")),
    (("a/1/1", "b/0/1", "a/0/1"), "b/0/1", dict(RANK="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
                                                 CUDA_VISIBLE_DEVICES="0")),
])
def test_torchrun_env_ranks_members_by_plan_and_host(members, me, expect):
    env = torchrun_env(members, me, "10.0.0.1", 29500, 2, "job", gpus=True)
    assert {k: env[k] for k in expect} == expect
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_RUN_ID"] == "job"
    assert "CUDA_VISIBLE_DEVICES" not in torchrun_env(members, me, "x", 1, 0, "j", gpus=False)


def _listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _remote, state = line.split()[1:4]
        addr, _, p = local.partition(":")
        if state == "0A" and int(p, 16) == port:
            out.append(addr)
    return out


def test_the_scripts_store_listens_on_the_data_plane_address_before_its_port_is_published():
    """Rank 0's supervisor hosts the scripts' env:// store: bound to the address the
    members reach it at (never 0.0.0.0), listening from open() on (nobody can take the
    port first), and the script's env:// init connects to it as a client."""
    store = ScriptStore("127.0.0.2").open()
    try:
        assert _listeners(store.port) == ["0200007F"]  # 127.0.0.2, and nothing on other addresses
        env = host_env(dict(os.environ))
        env.update(torchrun_env(["h/0/1"], "h/0/1", store.addr, store.port, 0, "job", gpus=False))
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        code = ("import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
                "t = torch.ones(2); dist.all_reduce(t); print(dist.get_world_size(), t.tolist()); "
                "dist.destroy_process_group()")
        out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "1 [1.0, 1.0]" in out.stdout, out.stderr[-2000:]
    finally:
        store.close()
    assert _listeners(store.port) == []


def test_checkpoint_dir_placeholder_is_expanded():
    assert expand_command(["python", "t.py", "--ckpt={checkpoint_dir}/x"], Path("/d")) == [
        "python", "t.py", "--ckpt=/d/x"]


def test_directory_snapshot_round_trips_and_replaces(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.pt").write_bytes(b"\x00\x01" * 1000)
    (src / "sub" / "b.txt").write_text("hi")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale").write_text("old")
    unpack_dir(pack_dir(src), dst)
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["a.pt", "sub", "sub/b.txt"]
    assert (dst / "a.pt").read_bytes() == b"\x00\x01" * 1000
    unpack_dir(b"", dst)
    assert list(dst.iterdir()) == []


SUPERVISOR_EXIT = """
import ctypes, sys
from eltctl_runtime.restart import supervisor as restart

# What a gloo group's destructor did to a supervisor: abort the process from the
# interpreter's teardown (C exit handlers run there; os._exit skips them).
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)

class Ended:  # a supervisor whose job has ended: run() returns its exit status
    def __init__(self, *args, **kwargs):
        pass

    def run(self):
        return 4

restart.Supervisor = Ended
status = restart.main(["--script-dir", sys.argv[1], "--", "python", "train.py"])
sys.exit(status)  # as restart.py's __main__ does
"""


def test_a_supervisor_ends_without_the_interpreters_teardown_and_keeps_its_status(tmp_path):
    """The teardown runs the destructors of the gloo groups the supervisor held, which abort
    the process (-6) when a peer closes its side meanwhile (seen in CI after a clean end)."""
    env = host_env({**{k: v for k, v in os.environ.items() if not k.startswith("ELTCTL_")},
                    "ELTCTL_STORE": "127.0.0.1:9", "ELTCTL_JOB": "j", "ELTCTL_WORKER_ID": "h/0/a"})
    proc = subprocess.run([PYTHON, "-c", SUPERVISOR_EXIT, str(tmp_path / "scripts")], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode != -signal.SIGABRT, "the interpreter's teardown ran (its exit handlers aborted it)"
    assert proc.returncode == 4, proc.stderr


# -- real supervisors ------------------------------------------------------------------


class RestartCluster(Cluster):
    """Cluster whose workers are restart-mode supervisors of the DDP script."""

    def start(self, n: int = 1, extra: list[str] | None = None, supervisor: list[str] | None = None,
              script: list[str] | None = None) -> list[Worker]:
        new = []
        for _ in range(n):
            i = self._n
            self._n += 1
            wid = f"host{i}/0/{os.getpid()}"
            log = self.tmp / f"w{i}.log"
            w = Worker(wid, None, log, self.tmp / f"w{i}.result.json", self.tmp / f"w{i}.progress")  # type: ignore[arg-type]
            cmd = [PYTHON, "-m", "eltctl_runtime.restart", "--stop-grace", "15", "--script-dir",
                   str(self.tmp / f"s{i}"), *(supervisor or []), "--",
                   *(script or [PYTHON, str(SCRIPT), *SCRIPT_ARGS, *(extra or [])])]
            env = self.env(wid)
            env.pop("ELTCTL_AUDIT")
            w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log.open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            new.append(w)
        self.workers += new
        return new

    def logs(self) -> str:
        return "\n".join(w.log_text() for w in self.workers)

    def steps(self) -> list[tuple[int, int, int]]:
        """(step, world, restart) of every step line of any rank 0."""
        return [tuple(map(int, m)) for m in STEP.findall(self.logs())]

    def resumed(self) -> dict[int, int]:
        """restart count -> the step the script resumed at."""
        return {int(r): int(s) for s, _w, r in RESUMED.findall(self.logs())}

    def wait_world(self, world: int, min_restart: int = 0, steps_after: int = 3, timeout: float = 120.0) -> int:
        """Wait for `steps_after` steps at `world` in a restart >= min_restart; returns that restart."""
        def ok() -> bool:
            got = [(s, r) for s, w, r in self.steps() if w == world and r >= min_restart]
            return len(got) >= steps_after

        self.wait_for(ok, timeout, f"{steps_after} steps at world size {world} (restart >= {min_restart})")
        return max(r for _s, w, r in self.steps() if w == world and r >= min_restart)

    def script_pids(self) -> list[int]:
        return [int(p) for p in STARTED.findall(self.logs())]


def check_resume(cluster: RestartCluster, restart: int, planned: bool) -> None:
    """The restart `restart` resumed at the step the script saved: after a planned
    change, the last step of the generation before (nothing redone); after a crash,
    the script's last save that survived (rank 0's directory if its host lives, else
    the snapshot handed over at the previous restart). Its first step is the next one."""
    steps = cluster.steps()
    before = max(s for s, _w, r in steps if r < restart)
    resumed = cluster.resumed()[restart]
    first = min(s for s, _w, r in steps if r == restart)
    assert first == resumed + 1, (restart, resumed, first)
    if planned:
        assert resumed == before, (restart, resumed, before, cluster.logs()[-4000:])
    else:  # no further back than the snapshot the previous generation started from
        assert cluster.resumed()[restart - 1] <= resumed <= before, (restart, resumed, before)


@pytest.mark.slow
def test_script_restarts_through_leave_join_and_kill(tmp_path):
    cluster = RestartCluster(tmp_path, hang_timeout=10.0, min_workers=3)
    try:
        a, b, c = cluster.start(3)
        r = cluster.wait_world(3, steps_after=6)
        cluster.kill(a, signal.SIGTERM)  # rank 0's supervisor leaves: it hands the directory over
        r = cluster.wait_world(2, min_restart=r + 1)
        check_resume(cluster, r, planned=True)
        cluster.wait_exit([a])
        assert a.proc.returncode == 0, cluster.dump_logs()
        (d,) = cluster.start(1)
        r = cluster.wait_world(3, min_restart=r + 1)
        check_resume(cluster, r, planned=True)
        cluster.kill(c, signal.SIGKILL)  # reported dead by the launcher, as a host daemon does
        r = cluster.wait_world(2, min_restart=r + 1)
        check_resume(cluster, r, planned=False)
        cluster.stop()
        cluster.wait_exit([b, d])
        assert b.proc.returncode == 0 and d.proc.returncode == 0, cluster.dump_logs()

        status = read_status(cluster.store, cluster.job)
        assert status["mode"] == "restart" and status["restarts"] == r and status["world_size"] == 2, status
        events = [e for e in cluster.events() if e.get("mode") == "restart"]
        kinds = [e["kind"] for e in events]
        assert kinds[:4] == ["start", "leave", "join", "crash"] and kinds[-1] == "stop", kinds  # the first start too
        assert all(e["pause_s"] is not None and e["pause_s"] < 60 for e in events[1:4]), events
        done = json.loads(cluster.store.get(f"eltctl/{cluster.job}/done"))
        assert done["reason"] == "stop"
        # The script's directory is saved as an ordinary eltctl checkpoint.
        info, state = CheckpointStore(cluster.ckpt).latest_valid()
        assert info.step == done["step"] and state["format"] == "eltctl-restart-snapshot"
        for pid in cluster.script_pids():
            assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"script pid {pid} still runs"
    finally:
        cluster.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("argv, form", [
    (["python3", "t.py", "--x"], ("python3", ["t.py", "--x"], False)),
    (["/usr/bin/python3.11", "-m", "pkg.train", "-a"], ("/usr/bin/python3.11", ["pkg.train", "-a"], True)),
    (["python", "-u", "t.py"], None),
    (["bash", "run.sh"], None),
    (["python", "-m"], None),
])
def test_warm_interpreter_runs_plain_python_commands_only(argv, form):
    assert warm_form(argv) == form


@pytest.mark.slow
def test_status_shows_the_scripts_step_and_its_checkpoints_are_snapshotted_while_it_runs(tmp_path):
    """One supervisor, the unmodified DDP script, `--progress step-loss`: the status
    carries the script's step (it grows) and the scripts count as running; each save
    of the script (every 30 steps, with rename) becomes an eltctl checkpoint while the
    script runs, labelled with the script's step."""
    cluster = RestartCluster(tmp_path, hang_timeout=10.0, min_workers=1)
    try:
        (a,) = cluster.start(1, supervisor=["--progress", "step-loss", "--checkpoint-poll", "0.3"],
                             extra=["--save-every", "30"])  # a save every ~1.5 s
        first = cluster.wait_for_status(lambda s: (s.get("step") or 0) >= 5 and s["script"]["running"], 120)
        assert first["mode"] == "restart" and first["script"]["step_from"] == "output", first
        assert first["loss"] is not None and first["snapshot"] >= 0
        later = cluster.wait_for_status(lambda s: (s.get("step") or 0) > first["step"] + 5
                                        and (s.get("checkpoint") or {}).get("script_step"), 60)
        ck = later["checkpoint"]
        assert ck["snapshot"] == ck["step"] >= 1 and 0 < ck["script_step"] <= later["step"], later
        assert a.proc.poll() is None and cluster.events() == [] or all(
            e.get("kind") not in ("crash", "leave", "join") for e in cluster.events())  # no restart was needed
        info, state = CheckpointStore(cluster.ckpt).latest_valid()
        assert state["format"] == "eltctl-restart-snapshot" and int(state["script_step"]) > 0
        cluster.stop()
        cluster.wait_exit([a])
        assert a.proc.returncode == 0, cluster.dump_logs()
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_script_saving_several_times_a_second_is_snapshotted_while_it_runs(tmp_path):
    """The unmodified DDP script saving every 2 steps (about every 0.1 s, with rename):
    its directory is never quiet, yet rank 0's supervisor turns its saves into eltctl
    checkpoints while it runs, newer ones as it goes, each holding a whole ckpt.pt."""
    cluster = RestartCluster(tmp_path, hang_timeout=10.0, min_workers=1)
    try:
        (a,) = cluster.start(1, supervisor=["--progress", "step-loss", "--checkpoint-poll", "0.5"],
                             extra=["--save-every", "2"])
        first = cluster.wait_for_status(lambda s: ((s.get("checkpoint") or {}).get("script_step") or 0) > 0, 120)
        later = cluster.wait_for_status(
            lambda s: ((s.get("checkpoint") or {}).get("script_step") or 0) > first["checkpoint"]["script_step"], 60)
        assert later["checkpoint"]["step"] > first["checkpoint"]["step"], (first, later)
        assert a.proc.poll() is None and all(e.get("kind") not in ("crash", "leave", "join")
                                             for e in cluster.events())  # taken while the script ran
        _info, state = CheckpointStore(cluster.ckpt).latest_valid()
        out = tmp_path / "unpacked"
        unpack_dir(bytes(state["tar"].numpy()), out)
        saved = torch.load(out / "ckpt.pt", weights_only=True)  # whole: it loads
        assert saved["step"] > 0 and sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]
        cluster.stop()
        cluster.wait_exit([a])
        assert a.proc.returncode == 0, cluster.dump_logs()
    finally:
        cluster.close()


FAILING = "import time, sys; print('starting', flush=True); time.sleep(2); raise RuntimeError('no data in /nowhere')"


@pytest.mark.slow
def test_a_script_that_fails_at_every_start_stops_the_job_at_max_restarts(tmp_path):
    cluster = RestartCluster(tmp_path, hang_timeout=10.0, min_workers=1)
    try:
        (a,) = cluster.start(1, supervisor=["--max-restarts", "3", "--restart-window", "120"],
                             script=[PYTHON, "-c", FAILING])
        cluster.wait_exit([a], timeout=120)
        assert a.proc.returncode == 0, cluster.dump_logs()
        done = json.loads(cluster.store.get(f"eltctl/{cluster.job}/done"))
        assert done["reason"] == "failed", done
        assert done["failed"] == ("the script exited 3 times in 2 min; last line: "
                                  "RuntimeError: no data in /nowhere"), done
        status = read_status(cluster.store, cluster.job)
        assert status["failed"] == done["failed"] and not status["script"]["running"], status
        log = a.log_text()
        # a first failure restarts at once, the second after 1 s; the third stops the job
        assert log.count("starting") == 3 and log.count("waiting 1 s before it starts again") == 1
        assert "waiting 2 s" not in log
    finally:
        cluster.close()


@pytest.mark.slow
def test_the_scripts_rendezvous_at_rank_0s_store_whatever_gen_master_says(tmp_path):
    """Someone who reaches the job's store rewrites every generation's `gen/<g>/master`
    (unsigned, pointing elsewhere) all the time: the scripts of a job with a secret still
    rendezvous at the store rank 0's supervisor holds on its data-plane address (their
    MASTER_ADDR), as clients of it, and train; no generation is aborted for it."""
    cluster = RestartCluster(tmp_path, hang_timeout=10.0, min_workers=2,
                             secret=secrets.token_bytes(auth.SECRET_BYTES))
    evil = dist.PrefixStore(job_prefix(cluster.job), dist.TCPStore(
        "127.0.0.1", cluster.store.port, is_master=False, timeout=timedelta(seconds=10)))
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            for g in range(4):
                evil.set(Keys.master(g), "127.0.0.9:1")
            stop.wait(0.002)

    attacker = threading.Thread(target=rewrite, daemon=True)
    attacker.start()
    try:
        a, b = cluster.start(2, supervisor=["--no-warm"])  # cold: /proc/<pid>/environ is the script's
        cluster.wait_world(2, steps_after=3)
        pids = cluster.script_pids()
        assert len(pids) == 2, cluster.logs()
        for pid in pids:
            env = procs_environ(pid)
            assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True", env
        assert not [e for e in cluster.events() if e["kind"] in ("crash", "hang")], cluster.events()
        stop.set()
        attacker.join()
        cluster.stop()
        cluster.wait_exit([a, b])
        assert a.proc.returncode == 0 and b.proc.returncode == 0, cluster.dump_logs()
    finally:
        stop.set()
        cluster.close()
