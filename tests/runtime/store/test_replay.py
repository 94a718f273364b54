"""Replays and unsigned counters (issue 21, part C), on a real c10d TCPStore:

- a value signed in an earlier run of the store (a plan, `done`, `stop`, an event, a
  desired document) read in the next run is refused like a forgery and counted: the
  run id is in the signed scope (auth.py), and the run file is read at every connect;
- desired documents only move forward: `{seq: 40, stop: true}` written back after
  seq 41 is ignored and counted (daemon/link.py), also by a restarted daemon;
- a joiner hidden by a join counter raised again and again still joins, and a raised
  or lowered dead/seq hides no death report (membership.scan_joiners, control.py);
- a heartbeat deleted right after each write does not make its (healthy) writer look
  silent, and a worker that stopped is still found silent (control.py).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.member.config import RuntimeConfig
from eltctl_runtime.member.control import ControlThread
from eltctl_runtime.daemon.link import StoreLink
from eltctl_runtime.member.plan import Plan, await_admission, decide, job_store, scan_joiners
from eltctl_runtime.protocol import EventKind, Keys, add_event, get_events, job_prefix

SECRET = bytes(range(32))


@pytest.fixture(scope="module")
def tcp():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def client(tcp):
    return dist.TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=timedelta(seconds=10))


def attacker(tcp, job):
    return dist.PrefixStore(job_prefix(job), client(tcp))


def wait_until(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------- the run id


def test_a_value_signed_in_an_earlier_run_is_refused_and_counted(tcp):
    job = "runs"
    run1 = job_store(tcp, job, SECRET, run=auth.new_run_id())
    plan1 = Plan(0, ("h1/0/1",), join_upto=1)
    run1.set(Keys.plan(0), plan1.to_json())
    run1.set(Keys.DONE, json.dumps({"step": 9, "reason": "finished"}))
    run1.set(Keys.STOP, "1")
    run1.set(Keys.desired("h1"), json.dumps({"seq": 10**6, "slots": [], "stop": True}))
    add_event(run1, {"kind": "crash", "host": "h1", "workers": ["h1/0/1"]})
    # someone who reaches the store keeps them: run 2's store holds the very same bytes
    raw = attacker(tcp, job)
    saved = {k: raw.get(k) for k in (Keys.plan(0), Keys.DONE, Keys.STOP, Keys.desired("h1"), Keys.event(1))}

    run2 = job_store(tcp, job, SECRET, run=auth.new_run_id())
    for k, v in saved.items():
        raw.set(k, v)
    for k in saved:
        assert not run2.check([k]), k
    assert get_events(run2) == []
    counts = run2.forgeries.counts()
    assert counts["gen/plan"] == counts["done"] == counts["stop"] == counts["daemon/desired"] == 1, counts
    assert counts["events"] >= 1, counts
    mine = Plan(0, ("h2/0/1",), join_upto=0)
    assert decide(run2, mine) == mine  # run 1's plan is replaced, never adopted
    # the run that signed them still reads them
    assert run1.check([Keys.DONE]) and json.loads(run1.get(Keys.DONE))["step"] == 9


def test_the_run_file_is_read_at_every_connect(tmp_path):
    path = tmp_path / auth.RUN_FILE_NAME
    cfg = RuntimeConfig.from_env({"ELTCTL_STORE": "127.0.0.1:1", "ELTCTL_JOB": "j", "ELTCTL_WORKER_ID": "h/0/1",
                                  auth.ENV_RUN_FILE: str(path)})
    assert cfg.run_id() == ""  # none yet (a setup without run ids): run id ""
    auth.write_run_file(path, "ab12")
    assert cfg.run_id() == "ab12" and path.stat().st_mode & 0o777 == 0o600
    auth.write_run_file(path, "cd34")  # a new store keeper
    assert cfg.run_id() == "cd34"
    path.chmod(0o666)
    with pytest.raises(auth.SecretError, match="0600"):
        cfg.run_id()
    with pytest.raises(auth.SecretError):
        auth.write_run_file(path, "not hex")


# ----------------------------------------------------------------- desired documents move forward


def test_an_older_desired_document_is_ignored_and_counted(tcp, tmp_path):
    job = "fwd"
    run = auth.new_run_id()
    auth.write_run_file(tmp_path / "run", run)
    ctl = job_store(client(tcp), job, SECRET, run=run)
    ctl.set(Keys.desired("h1"), json.dumps({"seq": 40, "slots": [0], "stop": True}))
    old = attacker(tcp, job).get(Keys.desired("h1"))  # a validly signed seq 40, kept
    ctl.set(Keys.desired("h1"), json.dumps({"seq": 41, "slots": [0, 1], "stop": False}))

    forgeries = auth.Forgeries()
    link = StoreLink(f"127.0.0.1:{tcp.port}", job, "h1", poll_s=0.02, secret=SECRET, forgeries=forgeries,
                     run_file=tmp_path / "run")
    link.start()
    try:
        wait_until(lambda: link.desired() and link.desired().seq == 41, "seq 41")
        attacker(tcp, job).set(Keys.desired("h1"), old)  # seq 40, stop: written back
        wait_until(lambda: forgeries.counts().get("daemon/desired replayed"), "the replay counted")
        assert link.desired().seq == 41 and not link.desired().stop
    finally:
        link.close(flush_s=0)

    # A daemon restarted with its memory (seq 41 applied) meets seq 40 first: never handed on.
    again = StoreLink(f"127.0.0.1:{tcp.port}", job, "h1", poll_s=0.02, secret=SECRET, forgeries=forgeries,
                      run_file=tmp_path / "run")
    again.floor(41)
    again.start()
    try:
        wait_until(lambda: forgeries.counts().get("daemon/desired replayed", 0) >= 2, "the replay counted again")
        assert again.desired() is None
    finally:
        again.close(flush_s=0)


def test_the_daemon_acts_on_no_older_seq():
    from eltctl_runtime.daemon.logic import Memory, View, WorkerState, WorkerView, decide as daemon_decide
    from eltctl_runtime.protocol import Desired

    m = Memory(seq_applied=41, wanted=frozenset({0}), armed=frozenset())
    running = (WorkerView(0, "h1/0/1", 123, WorkerState.RUNNING, 0.0),)
    view = View(now=10.0, wall=10.0, host="h1", desired=Desired(40, (), stop=True), memory=m, workers=running)
    decision = daemon_decide(view)
    assert decision.memory == m and decision.actions == ()
    # the newer seq is obeyed
    newer = daemon_decide(View(now=10.0, wall=10.0, host="h1", desired=Desired(42, (), stop=True), memory=m,
                               workers=running))
    assert newer.memory.seq_applied == 42 and newer.actions


# ----------------------------------------------------------------- unsigned counters


def test_a_joiner_hidden_by_a_raised_join_counter_still_joins(tcp):
    job = "hidden"
    js = job_store(client(tcp), job, SECRET)
    plan = decide(js, Plan(0, ("h1/0/1",), join_upto=0))
    member = ControlThread(lambda: job_store(client(tcp), job, SECRET), "h1/0/1", hang_timeout_s=30.0,
                           max_workers=None)
    member.start()
    member.watch(plan)
    joiner_ctl = ControlThread(lambda: job_store(client(tcp), job, SECRET), "h2/0/1", hang_timeout_s=30.0,
                               max_workers=None)
    joiner_ctl.start()
    stop = threading.Event()
    evil = attacker(tcp, job)

    def raise_counter():  # the counter raised by 10^6, again and again, all along
        while not stop.is_set():
            evil.add(Keys.JOIN_SEQ, 10**6)
            evil.add(Keys.DEAD_SEQ, -1)
            time.sleep(0.005)

    box: dict = {}
    bumper = threading.Thread(target=raise_counter, daemon=True)
    joiner = threading.Thread(target=lambda: box.setdefault("plan", await_admission(
        job_store(client(tcp), job, SECRET), "h2/0/1", joiner_ctl, min_workers=1, max_workers=None,
        hang_timeout_s=30.0)), daemon=True)
    try:
        bumper.start()
        joiner.start()
        # the member sees a live joiner (read from the queue, not through the counter) ...
        wait_until(lambda: member.requests.join, "the member to see the joiner", timeout=20)
        queue, upto = scan_joiners(js, plan.join_upto)
        assert [w for _, w in queue] == ["h2/0/1"] and upto < 10**6
        decide(js, Plan(1, ("h1/0/1", "h2/0/1"), join_upto=upto, joined=("h2/0/1",), kind=EventKind.JOIN))
        # ... and the joiner is admitted
        joiner.join(timeout=20)
        assert box["plan"].generation == 1
        # a death report is read whatever dead/seq says (lowered all along)
        member.watch(box["plan"])
        js.set(Keys.dead("h2/0/1"), "1")
        wait_until(lambda: member.is_dead("h2/0/1"), "the death report", timeout=20)
    finally:
        stop.set()
        js.set(Keys.DONE, "{}")  # ends a waiter left behind by a failure
        member.close()
        joiner_ctl.close()


# ----------------------------------------------------------------- deleted keys


def test_a_deleted_heartbeat_is_not_silence_but_a_stopped_writer_is(tcp):
    job = "deleted"
    hang = 1.5
    plan = Plan(0, ("h1/0/1", "h2/0/1"))
    a = ControlThread(lambda: job_store(client(tcp), job, SECRET), "h1/0/1", hang_timeout_s=hang, max_workers=None)
    b = ControlThread(lambda: job_store(client(tcp), job, SECRET), "h2/0/1", hang_timeout_s=hang, max_workers=None)
    a.start()
    b.start()
    abort_a = a.watch(plan)
    b.watch(plan)
    stop = threading.Event()
    evil = attacker(tcp, job)
    deletions = [0]

    def delete_beats():  # b's heartbeat deleted right after each write
        while not stop.is_set():
            if evil.check([Keys.heartbeat("h2/0/1")]):
                evil.delete_key(Keys.heartbeat("h2/0/1"))
                deletions[0] += 1
            time.sleep(0.001)

    deleter = threading.Thread(target=delete_beats, daemon=True)
    try:
        wait_until(lambda: a.silence("h2/0/1") < 0.5 and job_store(client(tcp), job, SECRET).check(
            [Keys.heartbeat("h2/0/1")]), "b's first heartbeat read")
        time.sleep(0.3)
        deleter.start()
        time.sleep(3 * hang)  # twice the hang timeout: b keeps writing, its key keeps vanishing
        assert deletions[0] > 20
        assert not abort_a.is_set(), a.abort_reason()
        # b stops (hung or killed): its key stays missing, and a finds it silent in time
        b.close()
        wait_until(abort_a.is_set, "a to abort the generation", timeout=4 * hang + 5)
        assert json.loads(a.abort_reason())["reason"] == "hang"
    finally:
        stop.set()
        a.close()
        b.close()


def test_the_daemon_names_the_job_directorys_run_file_to_its_workers(tmp_path):
    from eltctl_runtime.daemon import DaemonConfig, worker_env

    auth.write_secret(tmp_path / "secret", SECRET)
    base = {"job": "j", "host": "h1", "store": "127.0.0.1:29400", "job_dir": str(tmp_path),
            "code_dir": str(tmp_path / "c"), "command": ["python", "train.py"], "device": "cpu"}
    cfg = DaemonConfig.from_json(json.dumps(dict(base, secret_file=str(tmp_path / "secret"))))
    assert cfg.run_file == tmp_path / auth.RUN_FILE_NAME
    env = worker_env(cfg, {}, 0, "h1/0/1")
    assert env[auth.ENV_RUN_FILE] == str(tmp_path / auth.RUN_FILE_NAME)
    auth.write_run_file(cfg.run_file, "abc")
    assert RuntimeConfig.from_env(env).run_id() == "abc"
    unsigned = DaemonConfig.from_json(json.dumps(base))
    assert auth.ENV_RUN_FILE not in worker_env(unsigned, {auth.ENV_RUN_FILE: "/elsewhere"}, 0, "h1/0/1")
