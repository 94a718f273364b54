"""The controller's signed store client against a real TCPStore: what someone who
reaches the store's port writes (forged crash events, a raised or lowered events/seq, a forged
rank-0 status or daemon state) is never acted on, and is counted."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

import pytest

from eltctl.controller import store as kstore
from eltctl.controller.observe import Observer
from eltctl.controller.status import forged_summary
from eltctl_runtime.store import auth
from eltctl_runtime.protocol import EventKind, Keys, add_event, job_prefix, state_key

dist = pytest.importorskip("torch.distributed")

NOW = 50_000.0
SECRET = bytes(range(32))


class Bed:
    """A real TCPStore; the controller's signed client (JobStore), a legitimate writer
    holding the job's secret (a daemon, rank 0) and an attacker without it."""

    def __init__(self) -> None:
        self.job = f"sig-{uuid.uuid4().hex[:8]}"
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=10))
        self.client = kstore.connect_client(f"127.0.0.1:{self.master.port}", self.job, secret=SECRET)
        self.store = kstore.JobStore(self.client)
        self.owner = auth.signed(self.raw(), job_prefix(self.job), SECRET)
        self.attacker = self.raw()

    def raw(self):
        tcp = dist.TCPStore("127.0.0.1", self.master.port, is_master=False, timeout=timedelta(seconds=10))
        return Synced(dist.PrefixStore(job_prefix(self.job), tcp))

    def close(self) -> None:
        self.store.close()


class Synced:
    """A c10d store whose `set` returns once the server holds the value. c10d's SET has no
    reply, so a read on another connection (the controller's) could come first: on a loaded
    run the replayed daemon state once read as missing, not forged. A CHECK on the same
    connection is answered after the SET."""

    def __init__(self, store) -> None:
        self._store = store

    def set(self, key: str, value) -> None:
        self._store.set(key, value)
        self._store.check([key])

    def __getattr__(self, name: str):
        return getattr(self._store, name)


@pytest.fixture
def bed():
    b = Bed()
    try:
        yield b
    finally:
        b.close()


def crash(host: str, slot: int) -> dict:
    return {"kind": EventKind.CRASH.value, "host": host, "workers": [f"{host}/{slot}/0"], "detail": "exit 1"}


def test_what_the_controller_writes_is_signed(bed):
    asyncio.run(bed.store.set_json("daemon/a/desired", {"seq": 1, "slots": [0], "stop": False}))
    raw = bed.attacker.get("daemon/a/desired")
    assert raw.startswith(b"elt1.") and json.loads(bed.owner.get("daemon/a/desired"))["slots"] == [0]
    asyncio.run(bed.store.event({"kind": EventKind.JOIN.value, "host": "a", "detail": "x"}))
    assert bed.attacker.get(Keys.event(1)).startswith(b"elt1.")
    assert bed.store.forgeries is not None and bed.store.forgeries.total == 0


def test_forged_events_and_a_raised_counter_are_ignored_and_counted(bed):
    o = Observer()
    asyncio.run(o.read_store(bed.store, ["a", "b"], NOW))  # born: the log is empty
    add_event(bed.owner, crash("a", 0))  # a real crash of a/0
    n = bed.attacker.add(Keys.EVENTS_SEQ, 1)  # a fake crash that would bench b
    bed.attacker.set(Keys.event(n), json.dumps(crash("b", 1)))
    asyncio.run(o.read_store(bed.store, ["a", "b"], NOW + 1))
    assert o.crashed == {"a": {0}}
    assert bed.store.forgeries.counts() == {"events": 1}

    # events/seq raised to 10^9, before and after the next real events: the log is read
    # as a run of entries, the counter never: every real event is read, none skipped
    bed.attacker.add(Keys.EVENTS_SEQ, 10**9)
    add_event(bed.owner, crash("a", 1))  # takes number 2: the forgery's, replaced
    bed.attacker.add(Keys.EVENTS_SEQ, 10**9)
    add_event(bed.owner, crash("a", 2))
    bed.attacker.add(Keys.EVENTS_SEQ, -(3 * 10**9))  # and lowered below the log's end
    add_event(bed.owner, crash("a", 3))
    asyncio.run(o.read_store(bed.store, ["a", "b"], NOW + 2))
    assert o.events_read == 4 and o.events_skipped == 0
    assert o.crashed == {"a": {0, 1, 2, 3}}
    doc = forged_summary(bed.store.forgeries.counts(), o.seen, o.runtime_status, o.events_skipped)
    assert doc["total"] >= 1 and doc["events_skipped"] == 0


def test_a_forged_status_or_daemon_state_is_never_used(bed):
    o = Observer()
    good = {"generation": 2, "world_size": 2, "members": ["a/0/0", "b/0/0"], "step": 40, "time": 1.0}
    bed.owner.set(Keys.STATUS, json.dumps(good))
    bed.owner.set(state_key("a"), json.dumps({"phase": "running", "forged": {"leave": 2}}))
    asyncio.run(o.read_store(bed.store, ["a"], NOW))
    assert o.runtime_status["step"] == 40

    bed.attacker.set(Keys.STATUS, json.dumps(dict(good, step=10**12)))  # mirroring would stop
    bed.attacker.set(state_key("a"), json.dumps({"phase": "stopped"}))  # the host would look gone
    asyncio.run(o.read_store(bed.store, ["a"], NOW + 1))
    assert o.runtime_status["step"] == 40  # the last verified status
    assert o.seen["a"].state["phase"] == "running"
    assert bed.store.forgeries.counts() == {"status": 1, "daemon/state": 1}

    # a status never signed at all reads as missing, not as the forgery
    other = Bed()
    try:
        other.attacker.set(Keys.STATUS, json.dumps(dict(good, step=10**12)))
        fresh = Observer()
        asyncio.run(fresh.read_store(other.store, [], NOW))
        assert fresh.runtime_status is None
    finally:
        other.close()

    doc = forged_summary(bed.store.forgeries.counts(), o.seen, {"forged": {"leave": 1, "bad": "x"}})
    assert doc == {"controller": {"status": 1, "daemon/state": 1}, "hosts": {"a": {"leave": 2}},
                   "rank0": {"leave": 1}, "total": 5, "events_skipped": 0}


def test_a_reconnected_client_is_signed_and_counts_on(bed):
    """connect_client is the one place the client is built: a new connection (a new
    keeper, helper B's reconnect) is signed alike and adds to the same counts."""
    bed.attacker.set("leave/a/0/0", "1")
    again = kstore.JobStore(kstore.connect_client(f"127.0.0.1:{bed.master.port}", bed.job, secret=SECRET))
    try:
        assert asyncio.run(again.get_raw("leave/a/0/0")) is None
        assert asyncio.run(bed.store.get_raw("leave/a/0/0")) is None
        assert kstore.forgeries(bed.job).counts() == {"leave": 2}
    finally:
        again.close()


POLICY = __import__("eltctl.inventory", fromlist=["parse_inventory"]).parse_inventory(
    '[job]\nname = "j"\ncommand = "python t.py"\n[policy]\nwatch_interval = 0.5\n'
    '[[hosts]]\nname = "a"\naddress = "a.lab"\n', "hosts.toml").policy  # a daemon is fresh for 5 s


def test_a_deleted_daemon_state_is_not_silence_but_a_stopped_daemon_is(bed):
    """A daemon's state deleted right after each write: the controller watches the key
    for the daemon's next write (counted as deleted) and the daemon stays alive; once
    the daemon stops writing, it goes stale as before."""
    import threading
    import time

    stop, deleting, writing = threading.Event(), threading.Event(), threading.Event()
    writing.set()
    key = state_key("a")

    def daemon():  # writes its state about every 0.2 s, its own clock in it
        while not stop.is_set():
            if writing.is_set():
                bed.owner.set(key, json.dumps({"phase": "running", "time": time.time()}))
            time.sleep(0.2)

    def attacker():
        while not stop.is_set():
            if deleting.is_set() and bed.attacker.check([key]):
                bed.attacker.delete_key(key)
            time.sleep(0.001)

    threads = [threading.Thread(target=daemon, daemon=True), threading.Thread(target=attacker, daemon=True)]
    for t in threads:
        t.start()
    o = Observer()
    try:
        time.sleep(0.3)
        asyncio.run(o.read_store(bed.store, ["a"], NOW))
        assert o.daemon_alive("a", NOW, POLICY)
        deleting.set()
        time.sleep(0.3)
        # 4 passes, 3 s apart by the controller's clock: 12 s of deleted states, within the
        # 15 s (CONTESTED_LIMIT windows) a daemon may stay alive on rewrites alone, none read.
        # Each pass after a daemon's write in real time too: passes run back to back read
        # one write several times over (CI: the attacker slow to delete, 3 passes saw 1 write)
        for k in range(1, 5):
            time.sleep(0.3)
            asyncio.run(o.read_store(bed.store, ["a"], NOW + 3 * k))
            assert o.daemon_alive("a", NOW + 3 * k, POLICY), k
        assert bed.store.forgeries.counts().get("daemon/state deleted", 0) >= 1
        writing.clear()  # the daemon stops: its state stays missing
        time.sleep(0.3)
        for k in range(5, 7):
            asyncio.run(o.read_store(bed.store, ["a"], NOW + 3 * k))
        assert not o.daemon_alive("a", NOW + 18, POLICY)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)


def test_an_older_daemon_state_written_back_is_no_news(bed):
    o = Observer()
    bed.owner.set(state_key("a"), json.dumps({"phase": "running", "time": 100.0}))
    asyncio.run(o.read_store(bed.store, ["a"], NOW))
    old = bed.attacker.get(state_key("a"))
    bed.owner.set(state_key("a"), json.dumps({"phase": "running", "time": 101.0}))
    asyncio.run(o.read_store(bed.store, ["a"], NOW + 1))
    bed.attacker.set(state_key("a"), old)  # the daemon stopped; its older state written back
    asyncio.run(o.read_store(bed.store, ["a"], NOW + 4))
    assert o.seen["a"].changed == NOW + 1 and o.seen["a"].state["time"] == 101.0
    assert not o.daemon_alive("a", NOW + 7, POLICY)
    assert bed.store.forgeries.counts() == {"daemon/state replayed": 1}


def test_the_controller_signs_in_the_stores_run_and_refuses_an_earlier_runs_values(tmp_path, monkeypatch):
    """connect_client reads the state directory's run file at every (re)connect: what
    was signed in an earlier run (a crash event, a daemon's state) reads as forged."""
    from eltctl.controller.statedir import StateDir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    job = f"run-{uuid.uuid4().hex[:8]}"
    state = StateDir.for_job(job)
    state.path.mkdir(parents=True)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    raw = Synced(dist.PrefixStore(job_prefix(job), dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                                  timeout=timedelta(seconds=10))))
    run1 = auth.new_run_id()
    auth.write_run_file(kstore.run_file(state), run1)
    first = kstore.JobStore(kstore.connect_client(f"127.0.0.1:{master.port}", job, secret=SECRET))
    try:
        asyncio.run(first.event(crash("a", 0)))
        asyncio.run(first.set_json(state_key("a"), {"phase": "running", "time": 1.0}))
        assert asyncio.run(first.get_json(Keys.event(1)))["kind"] == "crash"
    finally:
        first.close()
    saved = {k: raw.get(k) for k in (Keys.event(1), state_key("a"))}
    # the store keeper is restarted: a new run id, an empty store where someone writes run 1's values back
    auth.write_run_file(kstore.run_file(state), auth.new_run_id())
    for k in saved:
        raw.delete_key(k)
    again = kstore.JobStore(kstore.connect_client(f"127.0.0.1:{master.port}", job, secret=SECRET))
    try:
        for k, v in saved.items():
            raw.set(k, v)
        o = Observer()
        o.store_restarted()
        asyncio.run(o.read_store(again, ["a"], NOW))
        assert o.crashed == {} and o.seen == {} and o.events_read == 0
        counts = again.forgeries.counts()
        assert counts.get("events", 0) >= 1 and counts.get("daemon/state", 0) >= 1, counts
    finally:
        again.close()
