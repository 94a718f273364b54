"""The runtime's side of the signed store, on a real c10d TCPStore: the join queue and
the event log are read as runs of entries, never through their unsigned counters
(protocol.claim and scan), forged and missing entries are
skipped, a joiner whose number a plan consumed registers again, and the secret comes
to the runtime (ELTCTL_SECRET_FILE) and the daemon (daemon.json's secret_file) once,
with errors that name the file and the fix."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.member.config import ConfigError, RuntimeConfig
from eltctl_runtime.member.control import ControlThread
from eltctl_runtime.daemon import DaemonConfig, DaemonConfigError, worker_env
from eltctl_runtime.member.plan import Plan, _register, await_admission, decide, job_store, scan_joiners
from eltctl_runtime.protocol import EventKind, Keys, add_event, get_events, job_prefix


@pytest.fixture(scope="module")
def tcp():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def stores(tcp, job):
    """The job's signed store (as the runtime builds it) and an attacker's plain one."""
    secret = auth.new_secret()
    return job_store(tcp, job, secret), dist.PrefixStore(job_prefix(job), tcp), secret


def test_a_raised_event_counter_hides_no_event_and_forgeries_are_skipped(tcp):
    js, evil, _ = stores(tcp, "ev")
    assert add_event(js, {"kind": "add", "host": "h1"}) == 1
    evil.add(Keys.EVENTS_SEQ, 10**9)
    n = add_event(js, {"kind": "stop", "step": 3})
    assert n == 2  # the first free number of the log, not the raised counter's
    evil.add(Keys.EVENTS_SEQ, 10**9)  # raised again after the write: readers never look at it
    evil.set(Keys.event(3), json.dumps({"kind": "crash", "host": "h1"}))  # forged, past the end
    assert [e["kind"] for e in get_events(js)] == ["add", "stop"]
    assert js.forgeries.counts() == {"events": 1}
    assert add_event(js, {"kind": "add", "host": "h2"}) == 3  # the forgery's number is taken over
    assert [e["kind"] for e in get_events(js, start=2)] == ["stop", "add"]


def test_join_scan_skips_forged_and_missing_entries_and_ignores_the_counter(tcp):
    js, evil, _ = stores(tcp, "join")
    js.set(Keys.join(1), "h1/0/1")
    evil.set(Keys.join(2), "evil/0/1")  # forged entry
    js.set(Keys.join(6), "h2/0/1")  # numbers 3-5 missing (deleted): within the gap a reader looks past
    assert scan_joiners(js, 0) == ([(1, "h1/0/1"), (6, "h2/0/1")], 6)
    evil.set(Keys.dead("h2/0/1"), "1")  # a forged death report does not take a joiner out
    assert scan_joiners(js, 1) == ([(6, "h2/0/1")], 6)

    evil.add(Keys.JOIN_SEQ, 10**9)
    seq = _register(js, "h3/0/1", 6)
    assert seq == 7 and scan_joiners(js, 6) == ([(7, "h3/0/1")], 7)  # the counter is only a guess
    evil.add(Keys.JOIN_SEQ, 10**6)  # raised again after it registered: it stays visible
    assert scan_joiners(js, 6) == ([(7, "h3/0/1")], 7)
    assert js.forgeries.counts() == {"join": 2, "dead": 1}


def test_a_forged_plan_is_replaced_by_the_first_real_proposal(tcp):
    js, evil, _ = stores(tcp, "plan")
    evil.set(Keys.plan(0), Plan(0, ("evil/0/1",)).to_json())
    assert not js.check([Keys.plan(0)])
    mine = Plan(0, ("h1/0/1", "h2/0/1"), join_upto=2)
    assert decide(js, mine) == mine
    assert decide(js, Plan(0, ("h9/0/1",))) == mine  # the first real proposal wins, as before


def test_a_joiner_whose_number_a_plan_consumed_registers_again(tcp):
    js, _, secret = stores(tcp, "again")
    control = ControlThread(lambda: job_store(tcp, "again", secret), "h2/0/1", hang_timeout_s=30.0,
                            max_workers=None)
    control.start()
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.setdefault("plan", await_admission(
        js, "h2/0/1", control, min_workers=5, max_workers=None, hang_timeout_s=30.0)), daemon=True)
    try:
        waiter.start()
        deadline = time.monotonic() + 10
        while not js.check([Keys.join(1)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        # A plan consumed number 1 without admitting it (as when its id came after the scan).
        decide(js, Plan(0, ("h1/0/1",), join_upto=1))
        deadline = time.monotonic() + 30  # a loaded machine: the joiner takes its number, then writes it
        while not js.check([Keys.join(2)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert js.get(Keys.join(2)) == b"h2/0/1"
        decide(js, Plan(1, ("h1/0/1", "h2/0/1"), join_upto=2, joined=("h2/0/1",), kind=EventKind.JOIN))
        waiter.join(timeout=10)
        assert box["plan"].generation == 1
    finally:
        js.set(Keys.DONE, "{}")  # ends a waiter left behind by a failure
        control.close()


ENV = {"ELTCTL_STORE": "127.0.0.1:29400", "ELTCTL_JOB": "j", "ELTCTL_WORKER_ID": "h/gpu0/1"}


def test_the_runtime_reads_the_secret_once_and_names_a_bad_file(tmp_path):
    path = tmp_path / "secret"
    secret = auth.new_secret()
    auth.write_secret(path, secret)
    cfg = RuntimeConfig.from_env({**ENV, auth.ENV_SECRET_FILE: str(path)})
    assert cfg.secret == secret and secret.hex() not in repr(cfg)
    assert RuntimeConfig.from_env(ENV).secret is None
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=f"{auth.ENV_SECRET_FILE}={path}.*chmod 600"):
        RuntimeConfig.from_env({**ENV, auth.ENV_SECRET_FILE: str(path)})
    with pytest.raises(ConfigError, match="does not exist.*eltctl up"):
        RuntimeConfig.from_env({**ENV, auth.ENV_SECRET_FILE: str(tmp_path / "none")})


DAEMON_CFG = {"job": "j", "host": "h1", "store": "127.0.0.1:29400", "job_dir": "/tmp/x", "code_dir": "/tmp/x/c",
              "command": ["python", "train.py"], "device": "cpu"}


def test_the_daemon_reads_its_secret_file_and_hands_it_to_its_workers(tmp_path):
    secret = auth.new_secret()
    auth.write_secret(tmp_path / "secret", secret)
    conf = tmp_path / "daemon.json"
    conf.write_text(json.dumps(dict(DAEMON_CFG, secret_file=str(tmp_path / "secret"))))
    cfg = DaemonConfig.load(conf)
    assert cfg.secret == secret and secret.hex() not in repr(cfg)
    env = worker_env(cfg, {auth.ENV_SECRET_FILE: "/elsewhere"}, 0, "h1/0/1")
    assert env[auth.ENV_SECRET_FILE] == str(tmp_path / "secret")
    assert RuntimeConfig.from_env(env).secret == secret
    unsigned = DaemonConfig.from_json(json.dumps(DAEMON_CFG))
    assert unsigned.secret_file is None and auth.ENV_SECRET_FILE not in worker_env(
        unsigned, {auth.ENV_SECRET_FILE: "/elsewhere"}, 0, "h1/0/1")
    with pytest.raises(DaemonConfigError, match="'secret_file' must be null or an absolute path"):
        DaemonConfig.from_json(json.dumps(dict(DAEMON_CFG, secret_file="secret")))
    os.chmod(tmp_path / "secret", 0o640)
    with pytest.raises(DaemonConfigError, match="'secret_file'.*0600"):
        DaemonConfig.load(conf)
