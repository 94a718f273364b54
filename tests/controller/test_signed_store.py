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
from eltctl_runtime import auth
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
        self.client = kstore.connect_client("127.0.0.1", self.master.port, self.job, secret=SECRET)
        self.store = kstore.JobStore(self.client)
        self.owner = auth.signed(self.raw(), job_prefix(self.job), SECRET)
        self.attacker = self.raw()

    def raw(self):
        tcp = dist.TCPStore("127.0.0.1", self.master.port, is_master=False, timeout=timedelta(seconds=10))
        return dist.PrefixStore(job_prefix(self.job), tcp)

    def close(self) -> None:
        self.store.close()


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
    again = kstore.JobStore(kstore.connect_client("127.0.0.1", bed.master.port, bed.job, secret=SECRET))
    try:
        assert asyncio.run(again.get_raw("leave/a/0/0")) is None
        assert asyncio.run(bed.store.get_raw("leave/a/0/0")) is None
        assert kstore.forgeries(bed.job).counts() == {"leave": 2}
    finally:
        again.close()
