"""The host daemon: its pure decisions by tables, its GPU watch against the GPU
simulator, and scenarios with the real daemon, a real store, and the real example
training on a simulated two-GPU host (device cpu).

Scenario plans:
- owner yield: two slots train; a foreign process appears on GPU 1; that worker
  leaves in the planned way (not reported dead), the job trains at size 1, a
  yield event names the user and pid, slot 1 stays empty; the owner leaves and a
  new desired seq brings a new worker back (size 2); SIGTERM to the daemon makes
  both leave in the planned way and the daemon exit, pid files gone.
- crash and adoption: a worker SIGKILLed is reported dead at once (crash event,
  the survivor goes on at size 1) and not restarted; a second daemon refuses to
  run; the daemon SIGKILLed leaves the worker running and a new daemon adopts it
  (same pid, nothing started); stop: workers and daemon exit, pid files gone.
- store and driver trouble: nvidia-smi hangs (unhealthy, workers kept), the
  store goes away (daemon and workers keep running) and comes back (the daemon
  reconnects and reports again).
- a CPU-only host with a plain script as the command: a worker exiting with
  status 3 is reported once and not restarted; SIGTERM ends the rest.
- a command that cannot start is one crash, not a retry loop.
- a restarted daemon adopts workers by pid file and, for one whose pid file is
  lost, by its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from daemon_fixtures import SimHost, alive, job_pids

import eltctl_runtime as elt
from eltctl.sim.gpustate import ForeignProcess, GpuMode, GpuState, install_nvidia_smi
from eltctl_runtime.daemon import DaemonConfig, DaemonConfigError, worker_env
from eltctl_runtime.protocol import Desired
from eltctl_runtime.daemon.logic import (
    Decision, Exit, Foreign, Memory, Note, RecordYield, View, WorkerState, WorkerView, Yield, decide,
    exit_outcome, first_incarnation, incarnation_of,
)
from eltctl_runtime.daemon.procs import AlreadyRunning, PidLock
from eltctl_runtime.daemon.gpuwatch import (
    GpuApp, GpuInfo, Intruder, Ownership, SmiPoller, WatchHealth, classify_pid, descendants, gpu_states,
    intruders, parse_app_query, parse_gpu_query,
)

# ============================================================================ parsing


@pytest.mark.parametrize("text, expected", [
    ("0, GPU-a, 600, 40960, 3\n1, GPU-b, 0, 40960, 0\n",
     (GpuInfo(0, "GPU-a", 600, 40960, 3), GpuInfo(1, "GPU-b", 0, 40960, 0))),
    ("0, GPU-a, [N/A], 40960, [Not Supported]\n", (GpuInfo(0, "GPU-a", None, 40960, None),)),
    ("0, GPU-a, 12 MiB, 81920 MiB, 7 %\n", (GpuInfo(0, "GPU-a", 12, 81920, 7),)),  # units left on
    ("garbage\nx, GPU-a, 1, 2, 3\n\n2, GPU-c, 1, 2, 3\n", (GpuInfo(2, "GPU-c", 1, 2, 3),)),
    ("", ()),
])
def test_parse_gpu_query(text, expected):
    assert parse_gpu_query(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("GPU-a, 1234, 2000, python\n", (GpuApp("GPU-a", 1234, 2000, "python"),)),
    ("GPU-a, 1234, [N/A], /opt/my app, v2\n", (GpuApp("GPU-a", 1234, None, "/opt/my app, v2"),)),
    ("GPU-a, [N/A], 5, x\nGPU-b, 7\nshort\n", ()),
    ("GPU-a, 9, 5\n", (GpuApp("GPU-a", 9, 5, ""),)),
])
def test_parse_app_query(text, expected):
    assert parse_app_query(text) == expected


def test_descendants_close_over_the_parent_map():
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants([10], parents) == {10, 11, 12, 13}
    assert descendants([12, 20], parents) == {12, 20, 21}
    assert descendants([], parents) == frozenset()


@pytest.mark.parametrize("pid, visible, job_env, expected", [
    (100, True, None, Ownership.OURS),  # a worker or its child
    (500, True, "myjob", Ownership.OURS),  # carries our job's name (e.g. a worker of an earlier daemon)
    (500, True, "otherjob", Ownership.TAKEN),  # another eltctl job's worker: never an owner (issue 13)
    (500, True, None, Ownership.FOREIGN),  # another user's process: environ unreadable
    (500, False, None, Ownership.INVISIBLE),  # another pid namespace: cannot tell, never evict on it
])
def test_classify_pid(pid, visible, job_env, expected):
    assert classify_pid(pid, frozenset({100, 101}), visible, job_env, "myjob") is expected


@pytest.mark.parametrize("job_env, claimed, expected", [
    (None, True, Ownership.TAKEN),  # unreadable, and its user holds its GPU's claim for another job
    (None, False, Ownership.FOREIGN),  # unreadable, no claim of its user: an owner
    ("", True, Ownership.FOREIGN),  # readable without ELTCTL_JOB: a person's process, whatever the claim says
    ("myjob", True, Ownership.OURS),
])
def test_classify_pid_by_the_gpu_claim(job_env, claimed, expected):
    assert classify_pid(500, frozenset(), True, job_env, "myjob", claimed_by_its_user=claimed) is expected


GPUS = (GpuInfo(0, "GPU-a", 0, 100, 0), GpuInfo(1, "GPU-b", 0, 100, 0))


@pytest.mark.parametrize("apps, watched, owners, expected", [
    ((GpuApp("GPU-b", 7, 10, "x"),), {0, 1}, {7: Ownership.FOREIGN}, (Intruder(1, 7, "x"),)),
    ((GpuApp("GPU-b", 7, 10, "x"),), {0}, {7: Ownership.FOREIGN}, ()),  # GPU 1 not ours: none of our business
    ((GpuApp("GPU-b", 7, 10, "x"),), {1}, {7: Ownership.OURS}, ()),
    ((GpuApp("GPU-b", 7, 10, "x"),), {1}, {7: Ownership.INVISIBLE}, ()),
    ((GpuApp("GPU-z", 7, 10, "x"),), {0, 1}, {7: Ownership.FOREIGN}, ()),  # unknown uuid
    ((GpuApp("GPU-a", 9, 1, "b"), GpuApp("GPU-a", 8, 1, "a"), GpuApp("GPU-b", 3, 1, "c")), {0, 1},
     {9: Ownership.FOREIGN, 8: Ownership.FOREIGN, 3: Ownership.OURS}, (Intruder(0, 8, "a"), Intruder(0, 9, "b"))),
])
def test_intruders(apps, watched, owners, expected):
    assert intruders(GPUS, apps, watched, owners) == expected


GPUS4 = tuple(GpuInfo(i, f"GPU-{i}", 0, 100, 0) for i in range(4))


def test_gpu_states_name_who_holds_each_gpu():
    apps = (GpuApp("GPU-0", 7, 1, "x"), GpuApp("GPU-0", 5, 1, "y"), GpuApp("GPU-1", 8, 1, "w"),
            GpuApp("GPU-2", 9, 1, "t"), GpuApp("GPU-2", 6, 1, "u"), GpuApp("GPU-9", 4, 1, "z"))
    owners = {7: Ownership.FOREIGN, 5: Ownership.FOREIGN, 8: Ownership.OURS, 9: Ownership.TAKEN,
              6: Ownership.TAKEN, 4: Ownership.FOREIGN}
    states = gpu_states(GPUS4, apps, owners, ours={0: "h1/0/1", 1: "h1/1/2"}, claimed={},
                        other_job={9: "jobb"})
    assert states == {
        0: ("busy", "used by pid 5, 7"),  # a foreign process outranks our worker there
        1: ("ours", "worker h1/1/2"),
        2: ("taken", "taken by job jobb (pid 6, 9)"),  # its processes; 6's job unknown
        3: ("free", ""),  # GPU-9's process: an unknown uuid, on no GPU of ours
    }
    claimed = gpu_states(GPUS4, apps, owners, ours={}, claimed={2: "job c (user u, pid 1)", 3: "job d"},
                         other_job={})
    assert claimed[2] == ("taken", "taken by job c (user u, pid 1)")  # the claim outranks the processes
    assert claimed[3] == ("taken", "taken by job d") and claimed[1] == ("free", "")


# ============================================================================ decisions

H = "h1"


def view(desired=None, memory=Memory(), workers=(), foreign=None, now=100.0, **kw) -> View:
    return View(now=now, wall=1000.0, host=H, desired=desired, memory=memory, workers=tuple(workers),
                foreign=foreign or {}, valid_slots=frozenset({0, 1}), leave_timeout=60, stop_timeout=300, **kw)


def running(slot, inc, state=WorkerState.RUNNING, since=90.0) -> WorkerView:
    return WorkerView(slot, f"{H}/{slot}/{inc}", 1000 + slot, state, since)


def kinds(d: Decision) -> list[tuple]:
    out = []
    for a in d.actions:
        if isinstance(a, Note):
            continue
        if isinstance(a, RecordYield):
            out.append(("yield", a.record.slot, a.worker_id))
        elif isinstance(a, Exit):
            out.append(("exit",))
        else:
            out.append((type(a).__name__.lower(), a.slot, a.worker_id))
    return out


APPLIED = Memory(seq_applied=1, wanted=frozenset({0, 1}), next_incarnation=3)

DECIDE_CASES = [
    # (name, view, expected actions, checks on the new memory)
    ("a first desired seq starts one worker per slot",
     view(Desired(1, (0, 1))), [("start", 0, "h1/0/1"), ("start", 1, "h1/1/2")],
     dict(seq_applied=1, armed=frozenset(), next_incarnation=3)),
    ("the same seq again starts nothing, even for an empty slot (a crash is not restarted)",
     view(Desired(1, (0, 1)), APPLIED, [running(0, 1)]), [], dict(next_incarnation=3)),
    ("a new seq that drops a slot makes its worker leave",
     view(Desired(2, (0,)), APPLIED, [running(0, 1), running(1, 2)]), [("leave", 1, "h1/1/2")],
     dict(seq_applied=2, wanted=frozenset({0}), leaving=frozenset({"h1/1/2"}))),
    ("a new seq re-arms a slot whose worker crashed; the running one is kept",
     view(Desired(2, (0, 1)), APPLIED, [running(0, 1)]), [("start", 1, "h1/1/3")],
     dict(seq_applied=2, armed=frozenset(), next_incarnation=4)),
    ("a foreign process on a worker's GPU: yield and a planned leave",
     view(Desired(1, (0, 1)), APPLIED, [running(0, 1), running(1, 2)], {1: Foreign(77, "alice")}),
     [("yield", 1, "h1/1/2"), ("leave", 1, "h1/1/2")],
     dict(yielded=(Yield(1, 77, "alice", 1000.0),), leaving=frozenset({"h1/1/2"}), urgent=frozenset({"h1/1/2"}))),
    ("the owner seen after the controller dropped the slot: still a yield, and urgent",
     view(Desired(2, (0,)), Memory(seq_applied=2, wanted=frozenset({0}), leaving=frozenset({"h1/1/2"})),
          [running(0, 1), running(1, 2, WorkerState.LEAVING, since=99.0)], {1: Foreign(77, "alice")}),
     [("yield", 1, "h1/1/2")],
     dict(yielded=(Yield(1, 77, "alice", 1000.0),), urgent=frozenset({"h1/1/2"}))),
    ("a leaving worker's yield is recorded once",
     view(Desired(2, (0,)), Memory(seq_applied=2, wanted=frozenset({0}), yielded=(Yield(1, 77, "alice", 9.0),),
                                   urgent=frozenset({"h1/1/2"})),
          [running(1, 2, WorkerState.LEAVING, since=99.0)], {1: Foreign(77, "alice")}),
     [], dict(yielded=(Yield(1, 77, "alice", 9.0),))),
    ("a yielded slot is not restarted under the same seq, even once its worker is gone",
     view(Desired(1, (0, 1)), Memory(seq_applied=1, wanted=frozenset({0, 1}), next_incarnation=3,
                                     yielded=(Yield(1, 77, "alice", 1.0),)), [running(0, 1)]), [],
     dict(yielded=(Yield(1, 77, "alice", 1.0),))),
    ("a new seq listing the yielded slot clears the yield and starts a worker",
     view(Desired(2, (0, 1)), Memory(seq_applied=1, wanted=frozenset({0, 1}), next_incarnation=3,
                                     yielded=(Yield(1, 77, "alice", 1.0),)), [running(0, 1)]),
     [("start", 1, "h1/1/3")], dict(yielded=())),
    ("an armed slot whose GPU the owner holds gets no worker, and a yield record",
     view(Desired(2, (0, 1)), APPLIED, [running(0, 1)], {1: Foreign(77, "alice")}),
     [("yield", 1, None)], dict(armed=frozenset(), next_incarnation=3)),
    ("an armed slot whose old worker is still leaving waits for it",
     view(Desired(2, (0, 1)), APPLIED, [running(0, 1), running(1, 2, WorkerState.LEAVING, since=99.0)]),
     [], dict(armed=frozenset({1}))),
    ("slots the host does not have are ignored",
     view(Desired(1, (0, 5))), [("start", 0, "h1/0/1")], dict(wanted=frozenset({0}))),
    ("a lower seq (an old document written back) is never acted on: seqs only move forward",
     view(Desired(1, (), stop=True), Memory(seq_applied=9, wanted=frozenset({0, 1}), next_incarnation=5),
          [running(0, 3)]),
     [], dict(seq_applied=9, wanted=frozenset({0, 1}), next_incarnation=5)),
    ("stop: running workers are awaited, nothing is started, the daemon stays",
     view(Desired(2, (0, 1), stop=True), APPLIED, [running(0, 1)]), [("markstopping", 0, "h1/0/1")],
     dict(armed=frozenset())),
    ("stop with no worker left: exit",
     view(Desired(2, (), stop=True), APPLIED, []), [("exit",)], {}),
    ("SIGTERM: every running or stopping worker leaves in the planned way",
     view(Desired(1, (0, 1)), APPLIED, [running(0, 1), running(1, 2, WorkerState.STOPPING)], terminating=True),
     [("leave", 0, "h1/0/1"), ("leave", 1, "h1/1/2")], {}),
    ("SIGTERM with no worker: exit at once", view(Desired(1, (0, 1)), APPLIED, [], terminating=True),
     [("exit",)], {}),
    ("a leaving worker past the grace is killed",
     view(Desired(1, (0, 1)), APPLIED, [running(1, 2, WorkerState.LEAVING, since=30.0)]), [("kill", 1, "h1/1/2")],
     {}),
    ("a leaving worker within the grace is left alone",
     view(Desired(1, (0, 1)), APPLIED, [running(1, 2, WorkerState.LEAVING, since=50.0)]), [], {}),
    ("a stopping worker past the stop timeout is asked to leave",
     view(Desired(2, (), stop=True), APPLIED, [running(0, 1, WorkerState.STOPPING, since=-250.0)]),
     [("leave", 0, "h1/0/1")], {}),
    ("a worker that left for an owner and lingers past the evict grace is killed, as an eviction",
     view(Desired(1, (0, 1)), Memory(seq_applied=1, wanted=frozenset({0, 1}), urgent=frozenset({"h1/1/2"})),
          [running(1, 2, WorkerState.LEAVING, since=97.0)], departed=frozenset({"h1/1/2"})),
     [("kill", 1, "h1/1/2")], {}),
    ("a worker leaving for an owner that has not left the job yet is given its planned leave",
     view(Desired(1, (0, 1)), Memory(seq_applied=1, wanted=frozenset({0, 1}), urgent=frozenset({"h1/1/2"})),
          [running(1, 2, WorkerState.LEAVING, since=90.0)]), [], {}),
    ("a worker leaving for a scale-down may linger after leaving, up to the leave timeout",
     view(Desired(1, (0,)), Memory(seq_applied=1, wanted=frozenset({0})),
          [running(1, 2, WorkerState.LEAVING, since=90.0)], departed=frozenset({"h1/1/2"})), [], {}),
    ("no desired state yet: adopted workers are kept, nothing starts",
     view(None, Memory(), [running(0, 4)]), [], dict(seq_applied=None)),
]


@pytest.mark.parametrize("name, v, expected, memory", DECIDE_CASES, ids=[c[0] for c in DECIDE_CASES])
def test_decide(name, v, expected, memory):
    d = decide(v)
    assert kinds(d) == expected
    for key, value in memory.items():
        assert getattr(d.memory, key) == value, key


def test_decide_forgets_leavers_that_are_gone():
    m = Memory(seq_applied=1, wanted=frozenset({0}), leaving=frozenset({"h1/1/2", "h1/0/1"}))
    d = decide(view(Desired(1, (0,)), m, [running(0, 1, WorkerState.LEAVING, since=99.0)]))
    assert d.memory.leaving == {"h1/0/1"}


@pytest.mark.parametrize("rc, state, expected", [
    (0, WorkerState.RUNNING, (WorkerState.FINISHED, False, False)),
    (1, WorkerState.RUNNING, (WorkerState.CRASHED, True, True)),
    (-9, WorkerState.RUNNING, (WorkerState.CRASHED, True, True)),
    (None, WorkerState.RUNNING, (WorkerState.LOST, True, True)),  # adopted, unasked, status unknown
    (0, WorkerState.LEAVING, (WorkerState.LEFT, False, False)),
    (0, WorkerState.STOPPING, (WorkerState.LEFT, False, False)),
    (-15, WorkerState.LEAVING, (WorkerState.LEFT, True, False)),  # SIGTERM before the runtime's handler
    (None, WorkerState.LEAVING, (WorkerState.LEFT, False, False)),  # adopted, asked: left
    (3, WorkerState.LEAVING, (WorkerState.CRASHED, True, True)),
    (-9, WorkerState.KILLED, (WorkerState.CRASHED, True, True)),  # killed after the grace: a failure
    (-9, WorkerState.EVICTED, (WorkerState.LEFT, False, False)),  # it had left the job: not a failure
])
def test_exit_outcome(rc, state, expected):
    out = exit_outcome(rc, state)
    assert (out.state, out.report_dead, out.crash_event) == expected


@pytest.mark.parametrize("rc, state, left_job, job_done, expected", [
    (None, WorkerState.RUNNING, False, True, (WorkerState.FINISHED, False, False)),  # stop seen by the runtime first
    (None, WorkerState.RUNNING, True, False, (WorkerState.LEFT, False, False)),  # a plan lists it as left
    (None, WorkerState.STOPPING, False, True, (WorkerState.FINISHED, False, False)),
    (None, WorkerState.RUNNING, False, False, (WorkerState.LOST, True, True)),  # nothing known: lost
    (-9, WorkerState.RUNNING, False, True, (WorkerState.CRASHED, True, True)),  # a known status decides
    (3, WorkerState.RUNNING, True, False, (WorkerState.CRASHED, True, True)),
])
def test_exit_outcome_of_adopted_worker_uses_what_the_store_says(rc, state, left_job, job_done, expected):
    out = exit_outcome(rc, state, left_job=left_job, job_done=job_done)
    assert (out.state, out.report_dead, out.crash_event) == expected


@pytest.mark.parametrize("remembered, adopted, started, expected", [
    (1, 0, 1000.0, 1_000_000),                    # no memory: the start time in ms is the floor
    (1_000_007, 0, 1000.0, 1_000_007),            # memory of a daemon started in the same second
    (5, 2_000_000, 1000.0, 2_000_001),            # an adopted worker from a clock that went back
    (1_000_010, 0, 1000.5, 1_000_500),            # a later start is above any id the earlier one reached
])
def test_first_incarnation_never_goes_back(remembered, adopted, started, expected):
    assert first_incarnation(remembered, adopted, started) == expected


def test_memory_round_trips_through_json():
    m = Memory(seq_applied=4, wanted=frozenset({0, 2}), armed=frozenset({2}), yielded=(Yield(1, 5, "bob", 2.5),),
               next_incarnation=9, leaving=frozenset({"h1/0/3"}))
    assert Memory.from_json(m.to_json()) == m


@pytest.mark.parametrize("raw, ok", [
    ('{"seq": 3, "slots": [1, 0, 1], "stop": false}', True),
    ('{"seq": 3}', True),
    ('{"slots": [0]}', False),
    ('{"seq": 1, "slots": [-1]}', False),
    ('{"seq": 1, "slots": "0"}', False),
    ('[1]', False),
])
def test_desired_from_json(raw, ok):
    if ok:
        d = Desired.from_json(raw)
        assert d.slots == tuple(sorted(set(json.loads(raw).get("slots", []))))
    else:
        with pytest.raises(ValueError):
            Desired.from_json(raw)


# ============================================================================ configuration

BASE_CFG = {"job": "j", "host": "h1", "store": "127.0.0.1:29400", "job_dir": "/tmp/x", "code_dir": "/tmp/x/code",
            "command": ["python", "train.py"], "python": "/usr/bin/python3", "gpus": [0, 2], "device": "cpu",
            "env": {"A": "job", "ELTCTL_JOB": "spoof"}, "max_workers": 4, "checkpoint_dir": "/ck"}


def test_config_reads_the_documented_fields():
    cfg = DaemonConfig.from_json(json.dumps(BASE_CFG))
    assert cfg.argv == ("/usr/bin/python3", "train.py")
    assert cfg.valid_slots == {0, 2} and cfg.gpu_host
    assert cfg.watch_interval == 1.0 and cfg.nvidia_smi_timeout == 10.0
    cpu = DaemonConfig.from_json(json.dumps(dict(BASE_CFG, gpus=None, slots=3, command=["./run.sh"])))
    assert cpu.valid_slots == {0, 1, 2} and not cpu.gpu_host and cpu.argv == ("./run.sh",)


def test_restart_mode_runs_the_supervisor_with_time_to_save():
    cfg = DaemonConfig.from_json(json.dumps(dict(BASE_CFG, mode="restart", stop_grace=100, leave_timeout=30)))
    assert cfg.argv == ("/usr/bin/python3", "-m", "eltctl_runtime.restart", "--stop-grace", "100", "--script-dir",
                        f"{BASE_CFG['job_dir']}/script-checkpoints", "--max-restarts", "5", "--restart-window", "600",
                        "--", "/usr/bin/python3", "train.py")
    tuned = DaemonConfig.from_json(json.dumps(dict(BASE_CFG, mode="restart", progress="step-loss", max_restarts=0,
                                                   restart_window=60)))
    assert tuned.argv[-9:] == ("--max-restarts", "0", "--restart-window", "60", "--progress", "step-loss", "--",
                             "/usr/bin/python3", "train.py")
    assert cfg.leave_timeout == 160 and cfg.stop_timeout == 300
    assert DaemonConfig.from_json(json.dumps(BASE_CFG)).mode == "elastic"


@pytest.mark.parametrize("change, message", [
    ({"mode": "torchrun"}, "'mode' must be 'elastic' or 'restart'"),
    ({"job": None}, "'job' is required"),
    ({"store": "nohost"}, "host:port"),
    ({"device": "tpu"}, "'device'"),
    ({"gpus": [0, "1"]}, "'gpus'"),
    ({"command": []}, "'command'"),
    ({"watch_interval": 0}, "'watch_interval'"),
    ({"env": {"A": 1}}, "'env'"),
    ({"job": ".."}, "'job' is not a valid name"),
    ({"host": "-x"}, "'host' is not a valid name"),
    ({"host": "a/b"}, "'host' is not a valid name"),
    ({"config": 7}, "'config' must be a string"),
])
def test_config_errors_name_the_key(change, message):
    with pytest.raises(DaemonConfigError, match=message):
        DaemonConfig.from_json(json.dumps({**BASE_CFG, **change}))


def test_worker_env_follows_the_contract():
    cfg = DaemonConfig.from_json(json.dumps(BASE_CFG))
    env = worker_env(cfg, {"PATH": "/bin", "A": "inherited", "CUDA_VISIBLE_DEVICES": "0,1,2"}, 2, "h1/2/7")
    assert env["PATH"] == "/bin" and env["A"] == "job"  # inherited, then the job's env
    assert env["ELTCTL_JOB"] == "j"  # the contract wins over the job's env
    assert env["ELTCTL_WORKER_ID"] == "h1/2/7" and env["ELTCTL_STORE"] == "127.0.0.1:29400"
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["ELTCTL_LOCAL_GPU"] == "0"
    assert env["ELTCTL_MAX_WORKERS"] == "4" and env["ELTCTL_CHECKPOINT_DIR"] == "/ck"
    elt.RuntimeConfig.from_env(env)  # the runtime accepts it


def test_pid_lock_admits_one_daemon(tmp_path):
    first, second = PidLock(tmp_path / "daemon.pid"), PidLock(tmp_path / "daemon.pid")
    first.acquire()
    with pytest.raises(AlreadyRunning) as e:
        second.acquire()
    assert e.value.pid == os.getpid()
    first.release()
    assert not (tmp_path / "daemon.pid").exists()
    second.acquire()
    second.release()


# ============================================================================ the GPU watch, against the simulator


@pytest.fixture
def sim(tmp_path):
    bin_dir = tmp_path / "bin"
    smi = install_nvidia_smi(bin_dir)
    gpus = GpuState(tmp_path / "gpus.json", "w1")
    gpus.initialize(2)
    env = dict(os.environ, ELTSIM_STATE=str(gpus.path), ELTSIM_HOST="w1")
    procs: list[subprocess.Popen] = []
    yield smi, gpus, env, procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def poll_until(poller: SmiPoller, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = poller.poll(time.monotonic())
        if result is not None:
            return result
        time.sleep(0.02)
    raise AssertionError("the poller gave no result")


def test_watch_reads_gpus_and_a_foreign_process(sim):
    smi, gpus, env, procs = sim
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    procs.append(sleeper)
    gpus.add_process(ForeignProcess(pid=sleeper.pid, gpu=1, used_memory_mib="[N/A]"))
    poller = SmiPoller(str(smi), interval=0.1, timeout=20, env=env)
    try:
        r = poll_until(poller)
    finally:
        poller.close()
    assert r.health is WatchHealth.OK
    assert [g.index for g in r.gpus] == [0, 1]
    assert [(a.pid, a.used_memory_mib) for a in r.apps] == [(sleeper.pid, None)]
    assert r.apps[0].gpu_uuid == r.gpus[1].uuid


@pytest.mark.parametrize("mode, health", [(GpuMode.FAIL, WatchHealth.FAILED), (GpuMode.MISSING, WatchHealth.NONE),
                                          (GpuMode.HANG, WatchHealth.HUNG)])
def test_watch_reports_a_broken_driver(sim, mode, health):
    smi, gpus, env, _ = sim
    gpus.set_mode(mode)
    poller = SmiPoller(str(smi), interval=0.1, timeout=2, env=env)
    try:
        r = poll_until(poller)
    finally:
        poller.close()
    assert r.health is health, r
    assert (health is WatchHealth.NONE) == (not poller.enabled)


def test_watch_without_nvidia_smi_is_a_cpu_host(tmp_path):
    poller = SmiPoller(str(tmp_path / "nope" / "nvidia-smi"), interval=0.1, timeout=2, env=os.environ)
    assert poller.poll(time.monotonic()).health is WatchHealth.NONE
    assert not poller.enabled and poller.poll(time.monotonic() + 5) is None


# ============================================================================ scenarios with the real daemon


@pytest.fixture
def host(tmp_path):
    h = SimHost(tmp_path)
    try:
        yield h
    finally:
        h.close()


def wait_exit(p: subprocess.Popen, timeout: float = 120.0) -> int:
    return p.wait(timeout=timeout)


@pytest.mark.slow
def test_owner_yield_then_rejoin_then_sigterm(host):
    daemon = host.start_daemon()
    host.desire([0, 1])
    host.wait_world(2)
    first = host.live_workers()
    assert sorted(first) == [0, 1]

    # The owner of GPU 1 comes back.
    t0 = time.time()
    owner = host.start_foreign(1)
    host.wait_for(lambda: not alive(first[1]["pid"]), "the worker on GPU 1 to exit", timeout=60)
    t_gone = time.time() - t0
    host.wait_world(1)
    yields = host.wait_for(lambda: host.events("yield"), "a yield event")
    leave = [e for e in host.events("leave") if first[1]["worker_id"] in e.get("left", ())]
    print(f"\nowner yield: seen after {yields[0]['time'] - t0:.2f} s, worker out of the job after "
          f"{leave[0]['time'] - t0:.2f} s (the others paused {leave[0]['pause_s']} s), process gone after "
          f"{t_gone:.2f} s (target 5 s; watch interval 0.5 s)")
    assert yields[0]["workers"] == [first[1]["worker_id"]]
    assert f"pid {owner.pid}" in yields[0]["detail"] and yields[0]["host"] == "h1"
    state = host.wait_for(lambda: (s := host.state()) and any(w["slot"] == 1 and w["state"] == "left"
                                                              for w in s["workers"]) and s,
                          "worker 1 to have left")
    assert [y["pid"] for y in state["yielded"]] == [owner.pid]
    assert {g["index"]: g["state"] for g in state["gpus"]} == {0: "ours", 1: "busy"}
    assert not host.dead_reported(first[1]["worker_id"])  # a planned leave is not a death
    assert not alive(first[1]["pid"])
    # The slot stays empty under the same seq.
    time.sleep(3)
    assert sorted(host.live_workers()) == [0]
    assert host.status()["world_size"] == 1

    # The owner is gone; the controller wants the GPU again.
    owner.kill()
    owner.wait()
    host.desire([0, 1])
    host.wait_world(2)
    again = host.live_workers()
    assert again[0]["pid"] == first[0]["pid"]  # untouched
    assert again[1]["worker_id"] != first[1]["worker_id"]  # a new incarnation, never a reused id
    assert host.state()["yielded"] == []

    # SIGTERM to the daemon: both leave in the planned way, then it exits.
    daemon.send_signal(signal.SIGTERM)
    assert wait_exit(daemon) == 0
    for w in again.values():
        assert not alive(w["pid"])
        assert not host.dead_reported(w["worker_id"])
    assert not list((host.job_dir / "workers").glob("*.pid"))
    assert not (host.job_dir / "daemon.pid").exists()
    assert host.state()["phase"] == "stopped"
    assert job_pids(host.job) == []


@pytest.mark.slow
def test_crash_reported_at_once_then_daemon_killed_and_adopted_then_stop(host):
    daemon = host.start_daemon()
    host.desire([0, 1])
    host.wait_world(2)
    workers = host.live_workers()
    victim = workers[1]

    # A worker is SIGKILLed: reported dead at once, crash event, the survivor goes on.
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    host.wait_for(lambda: host.dead_reported(victim["worker_id"]), "the death report", timeout=30)
    crash = host.wait_for(lambda: host.events("crash"), "a crash event", timeout=30)
    assert crash[0]["workers"] == [victim["worker_id"]] and "SIGKILL" in crash[0]["detail"]
    host.wait_world(1)
    shrink = [e for e in host.events("crash") if victim["worker_id"] in e.get("lost", ())]
    print(f"\nworker SIGKILLed: reported dead by the daemon {crash[0]['time'] - t_kill:.2f} s after the kill; "
          f"the survivor paused {shrink[0]['pause_s'] if shrink else '?'} s")
    time.sleep(2)
    st = host.state()
    assert sorted(host.live_workers()) == [0]  # not restarted by the daemon
    assert st["crashes"] == 1
    assert [w["state"] for w in st["workers"] if w["slot"] == 1] == ["crashed"]

    # A second daemon for the same job and host refuses to run.
    second = host.start_daemon()
    assert wait_exit(second, 60) == 3
    assert "another daemon of job" in host.log()

    # The daemon is SIGKILLed: the worker keeps running; a new daemon adopts it.
    os.killpg(daemon.pid, signal.SIGKILL)
    daemon.wait()
    time.sleep(1)
    assert alive(workers[0]["pid"])
    before = host.status()["step"]
    started = host.start_detached()  # as the controller may start it over SSH
    assert started.returncode == 0 and started.stdout.startswith("ok "), started
    assert int(started.stdout.split()[1]) == host.daemon_pid()
    host.wait_for(lambda: (s := host.state()) and s["pid"] != st["pid"] and s, "the new daemon's state")
    adopted = host.wait_for(lambda: host.live_workers().get(0), "the adopted worker")
    assert adopted["pid"] == workers[0]["pid"] and adopted["adopted"]
    assert adopted["worker_id"] == workers[0]["worker_id"]
    host.wait_for(lambda: host.status()["step"] > before + 5, "training to go on")
    assert sorted(host.live_workers()) == [0]  # nothing started in slot 1
    assert sorted(job_pids(host.job, workers_only=True)) == [workers[0]["pid"]]

    # Stop (as `down` does it): the runtime's stop key and desired stop.
    elt.request_stop(host.store, host.job)
    host.desire([], stop=True)
    daemon_pid = host.state()["pid"]
    host.wait_for(lambda: not alive(daemon_pid), "the daemon to exit")
    assert not alive(workers[0]["pid"])
    assert not list((host.job_dir / "workers").glob("*.pid"))
    assert not (host.job_dir / "daemon.pid").exists()
    assert host.state()["phase"] == "stopped"
    # The usage ledger's how: `down` ended it, whether the worker or the daemon saw the stop first.
    assert [e["why"] for e in host.state()["history"] if e["worker_id"] == workers[0]["worker_id"]] == ["down"]
    assert not host.dead_reported(workers[0]["worker_id"])
    assert job_pids(host.job) == []


@pytest.mark.slow
def test_hung_driver_and_lost_store_never_cost_a_worker(host):
    daemon = host.start_daemon()
    host.desire([0])
    host.wait_world(1)
    worker = host.live_workers()[0]

    # nvidia-smi hangs: the host is unhealthy, the worker stays.
    host.gpu.set_mode(GpuMode.HANG)
    st = host.wait_for(lambda: (s := host.state()) and s["health"] == "unhealthy" and s, "an unhealthy watch")
    assert st["watch"]["health"] == "hung"
    assert host.live_workers()[0]["pid"] == worker["pid"] and alive(worker["pid"])
    host.gpu.set_mode(GpuMode.OK)
    host.wait_for(lambda: host.state()["health"] == "ok", "the watch to recover")

    # The store goes away: the daemon and the worker keep running.
    host.stop_store()
    time.sleep(4)
    assert daemon.poll() is None
    assert alive(worker["pid"])
    assert "lost the store" in host.log() or "unreachable" in host.log()

    # It comes back at the same address: the daemon reconnects and reports again.
    host.restart_store()
    st = host.wait_for(host.state, "the daemon to report to the new store", timeout=90)
    assert st["store"]["connected"] and st["store"]["reconnects"] >= 1 and st["store"]["last_error"]
    assert st["workers"][0]["pid"] == worker["pid"] and alive(worker["pid"])
    assert daemon.poll() is None


WORKER = """
import os, sys, time
slot = os.environ["ELTCTL_WORKER_ID"].split("/")[1]
if slot == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.slow
def test_cpu_host_crash_is_reported_once_and_sigterm_ends_everything(tmp_path):
    """A CPU-only host (no nvidia-smi), two CPU slots, a plain script as the
    command: slot 1 exits with status 3 (reported dead, a crash event, not
    restarted); SIGTERM to the daemon ends slot 0 and the daemon."""
    host = SimHost(tmp_path, nvidia_smi=False,
                   overrides={"gpus": None, "slots": 2, "command": ["python", "-c", WORKER]})
    try:
        daemon = host.start_daemon()
        host.desire([0, 1, 2])  # slot 2 does not exist here: ignored
        crash = host.wait_for(lambda: host.events("crash"), "a crash event", timeout=60)
        (crashed,) = crash[0]["workers"]
        assert crashed.startswith("h1/1/") and "status 3" in crash[0]["detail"]
        assert host.dead_reported(crashed)
        time.sleep(1.5)
        st = host.state()
        assert [(w["slot"], w["state"]) for w in st["workers"]] == [(0, "running"), (1, "crashed")]
        assert st["gpus"] == [] and st["watch"]["health"] == "none" and st["health"] == "ok"
        assert st["wanted"] == [0, 1] and "does not have" in host.log()
        assert st["slot_kind"] == "cpu" and st["valid_slots"] == [0, 1]  # what the controller compares
        env = procs_environ(st["workers"][0]["pid"])
        assert env["ELTCTL_WORKER_ID"].startswith("h1/0/") and env["ELTCTL_JOB"] == host.job
        # the data plane: the interface of the workers' address (the store's route: 127.0.0.1)
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo" and "interface lo" in host.log()
        assert incarnation_of(env["ELTCTL_WORKER_ID"]) + 1 == incarnation_of(crashed)  # slot 0 started first
        assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == os.environ.get(
            "CUDA_VISIBLE_DEVICES")
        daemon.send_signal(signal.SIGTERM)
        assert wait_exit(daemon, 60) == 0
        assert job_pids(host.job) == []
        assert host.state()["phase"] == "stopped"
    finally:
        host.close()


@pytest.mark.slow
def test_a_worker_that_cannot_start_is_a_crash_not_a_retry_loop(tmp_path):
    host = SimHost(tmp_path, overrides={"command": [str(tmp_path / "no-such-program")]})
    try:
        daemon = host.start_daemon()
        host.desire([0])
        crash = host.wait_for(lambda: host.events("crash"), "a crash event", timeout=60)
        assert "could not be started" in crash[0]["detail"]
        time.sleep(1.5)
        assert len(host.events("crash")) == 1
        assert host.state()["workers"][0]["state"] == "crashed"
        assert daemon.poll() is None
    finally:
        host.close()


def procs_environ(pid: int) -> dict:
    from eltctl_runtime.daemon.procs import environ_of

    return environ_of(pid) or {}


SLEEPER = "import time; time.sleep(600)"


@pytest.mark.slow
def test_restarted_daemon_adopts_by_pid_file_and_by_environment(tmp_path):
    """The daemon is SIGKILLed and the pid file of slot 1 is lost (as if the
    daemon died between starting the worker and writing it): the next daemon
    adopts slot 0 through its pid file and slot 1 through /proc, starts nothing."""
    host = SimHost(tmp_path, nvidia_smi=False,
                   overrides={"gpus": None, "slots": 2, "command": ["python", "-c", SLEEPER]})
    try:
        daemon = host.start_daemon()
        host.desire([0, 1])
        first = host.wait_for(lambda: len(w := host.live_workers()) == 2 and w, "two workers", timeout=60)
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
        (host.job_dir / "workers" / "1.pid").unlink()
        host.start_daemon()
        again = host.wait_for(lambda: (s := host.state()) and s["pid"] != daemon.pid and len(s["workers"]) == 2
                              and host.live_workers(), "the new daemon to adopt both", timeout=60)
        assert {s: (w["pid"], w["worker_id"], w["adopted"]) for s, w in again.items()} == \
            {s: (w["pid"], w["worker_id"], True) for s, w in first.items()}
        assert sorted(job_pids(host.job, workers_only=True)) == sorted(w["pid"] for w in first.values())
        assert int((host.job_dir / "workers" / "1.pid").read_text()) == first[1]["pid"]
        assert "found without a pid file" in host.log()
    finally:
        host.close()


@pytest.mark.slow
def test_restarted_daemon_never_repeats_a_worker_id(tmp_path):
    """A daemon stops cleanly (its memory file is removed) and a stale leave
    request for its worker stays in the store; a new daemon on the same host
    and job starts a training worker with a new id, which the stale key does
    not touch: it trains on."""
    host = SimHost(tmp_path)
    try:
        daemon = host.start_daemon()
        host.desire([0])
        host.wait_world(1)
        first = host.live_workers()[0]
        daemon.send_signal(signal.SIGTERM)
        assert wait_exit(daemon, 90) == 0
        assert not (host.job_dir / "daemon.memory.json").exists()
        elt.request_leave(host.store, host.job, first["worker_id"])  # stale, as a colleague saw
        second_daemon = host.start_daemon()
        host.desire([0])
        second = host.wait_for(lambda: (s := host.state()) and s["pid"] == second_daemon.pid
                               and host.live_workers().get(0), "a new worker on slot 0", timeout=60)
        assert second["worker_id"] != first["worker_id"]
        assert incarnation_of(second["worker_id"]) > incarnation_of(first["worker_id"])
        status = host.wait_for(lambda: (s := host.status()) and s["members"] == [second["worker_id"]] and s,
                               "the new worker to train", timeout=120)
        step = status["step"]
        host.wait_for(lambda: host.status()["step"] >= step + 5, "five more steps", timeout=60)
        assert host.live_workers()[0]["worker_id"] == second["worker_id"]  # it did not obey the stale key
        assert all(second["worker_id"] not in e.get("left", ()) for e in host.events("leave"))
    finally:
        host.close()


# ---- failed at start: the cause line --------------------------------------------

from eltctl_runtime.daemon.logic import CAUSE_MAX, cause_line  # noqa: E402

TRACEBACK = """\
some output of the job
Traceback (most recent call last):
  File "/x/code/train.py", line 3, in <module>
    import foo
    ^^^^^^^^^^
ModuleNotFoundError: No module named 'foo'
"""
CHAINED = """\
Traceback (most recent call last):
  File "t.py", line 2, in <module>
KeyError: 'a'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "t.py", line 4, in <module>
RuntimeError: boom
  second line of the message
"""


@pytest.mark.parametrize("output, expected", [
    ("python: can't open file '/h/code/trian.py': [Errno 2] No such file or directory\n",
     "python: can't open file '/h/code/trian.py': [Errno 2] No such file or directory"),
    (TRACEBACK, "ModuleNotFoundError: No module named 'foo'"),
    (CHAINED, "RuntimeError: boom"),
    ("line one\n\n  last words  \n\n", "last words"),
    ("/usr/bin/python3: No module named nosuch\n", "/usr/bin/python3: No module named nosuch"),
    ("", ""),
    ("\n \n", ""),
    ("x" * 1000, "x" * (CAUSE_MAX - 1) + "…"),
])
def test_cause_line(output, expected):
    assert cause_line(output) == expected


@pytest.mark.parametrize("rc, state, joined, at_start", [
    (1, WorkerState.RUNNING, False, True),  # never in a plan: failed at start
    (-9, WorkerState.RUNNING, False, True),
    (1, WorkerState.RUNNING, True, False),  # a member of a generation: a crash mid-training
    (0, WorkerState.RUNNING, False, False),  # exit 0: finished, not a failure
    (3, WorkerState.LEAVING, False, False),  # asked to go: not a start failure
    (-9, WorkerState.KILLED, False, False),
])
def test_exit_outcome_tells_a_failure_at_start(rc, state, joined, at_start):
    out = exit_outcome(rc, state, joined=joined)
    assert out.at_start is at_start
    if at_start:
        assert out.state is WorkerState.CRASHED and "failed at start" in out.detail


@pytest.mark.slow
@pytest.mark.parametrize("command, cause", [
    (["python", "trian.py"], "can't open file"),
    (["python", "-c", "import no_such_module_xyz"], "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
])
def test_a_worker_that_fails_at_start_reports_its_cause(tmp_path, command, cause):
    host = SimHost(tmp_path, nvidia_smi=False, overrides={"gpus": None, "slots": 1, "command": command,
                                                          "config": "feedbeefcafe0001"})
    try:
        daemon = host.start_daemon()
        host.desire([0])
        crash = host.wait_for(lambda: host.events("crash"), "a crash event", timeout=60)[0]
        assert cause in crash["cause"] and cause in crash["detail"], crash
        # the digest it was started with: the controller tells a failure from before a fix by it
        assert crash["config"] == "feedbeefcafe0001" and host.state()["config"] == "feedbeefcafe0001"
        assert crash["at_start"] is True and crash["exit_code"] not in (0, None) and crash["ran_s"] >= 0
        assert "failed at start" in crash["detail"]
        ended = host.wait_for(lambda: [w for w in host.state()["workers"] if w.get("cause")], "the state", 30)[0]
        assert ended["state"] == "crashed" and ended["at_start"] is True and cause in ended["cause"]
        assert daemon.poll() is None
    finally:
        host.close()
