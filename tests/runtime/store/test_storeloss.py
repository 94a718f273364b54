"""The pure parts of riding through a lost store (runtime/storeloss.py), and the
plan-following of a restarted store (protocol.first_generation, membership.await_admission)."""

from __future__ import annotations

import json
import os
import time

import pytest

from dictstore import DictStore
from eltctl_runtime.member.plan import Plan, await_admission
from eltctl_runtime.protocol import EventKind, Keys, first_generation
from eltctl_runtime.store.loss import STORE_ADDRESS_FILE, StoreAddress, StoreHealth, StoreLost, flush_held, read_store_address, republish, restarted_store_waits, wait_until_back
from tests.testbed.squatter import PortSquatter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


PLAN = Plan(generation=7, members=("h1/0/1", "h2/0/2"), join_upto=3, joined=("h2/0/2",), kind=EventKind.JOIN,
            created=5.0)


def test_health_counts_failures_and_expires_after_the_timeout():
    clock = Clock()
    h = StoreHealth("w", timeout_s=120, clock=clock)
    assert not h.lost and h.lost_for() == 0 and not h.expired()
    h.failed("status", RuntimeError("Connection reset by peer"))
    clock.t += 60
    h.failed("control channel", RuntimeError("Broken pipe"))
    assert h.lost and h.lost_for() == 60 and not h.expired() and h.failures == 2
    clock.t += 60
    assert h.expired()
    h.back()
    assert not h.lost and h.reconnects == 1 and not h.expired()


def test_a_client_older_than_the_last_reconnect_failing_does_not_mark_the_store_away():
    h = StoreHealth("w", clock=Clock())
    h.failed("control channel", "gone")
    h.back()
    h.failed("status", "old client", epoch=0)  # opened before the reconnect
    assert not h.lost and h.failures == 2
    h.failed("status", "new client", epoch=1)
    assert h.lost


def test_waiting_for_the_store_raises_store_lost_past_the_timeout():
    clock = Clock()
    h = StoreHealth("w", timeout_s=5, clock=clock)
    wait_until_back(h)  # not away: returns at once
    h.failed("status", "gone")
    clock.t += 5
    with pytest.raises(StoreLost, match="store_loss_timeout 5 s"):
        wait_until_back(h)


def test_republish_writes_the_plan_first_generation_and_moves_the_join_queue():
    js = DictStore()
    assert first_generation(js) == 0
    js.set(Keys.STORE_RESTARTED, "1")
    assert restarted_store_waits(js)
    # A joiner registered in the empty store before the members came back: number 1.
    js.set(Keys.join(js.add(Keys.JOIN_SEQ, 1)), "h3/0/9")
    assert republish(js, PLAN, "h1/0/1")
    assert Plan.from_json(js.get(Keys.plan(7))) == PLAN
    assert first_generation(js) == 7 and not restarted_store_waits(js)
    # The early joiner is queued again just past join_upto (3); the counter (a guess) too.
    assert js.get(Keys.join(4)) == b"h3/0/9" and js.add(Keys.JOIN_SEQ, 0) == 5
    # Idempotent: the plan is there now; another member finds nothing to do.
    assert not republish(js, PLAN, "h2/0/2")
    assert js.add(Keys.JOIN_SEQ, 0) == 5


def test_only_one_member_republishes():
    js = DictStore()
    js.set(Keys.FIRST_GEN, json.dumps({"generation": 7, "by": "h2/0/2"}))  # h2 is at it
    assert not republish(js, PLAN, "h1/0/1")
    assert not js.check([Keys.plan(7)])


def test_events_held_while_away_are_appended_when_back():
    h = StoreHealth("w", clock=Clock())
    h.hold({"kind": "leave", "generation": 8})
    js = DictStore()
    flush_held(js, h)
    assert json.loads(js.get(Keys.event(1)))["kind"] == "leave" and h.take_held() == []


class Control:
    def watch(self, plan, others=()):
        pass

    def silence(self, worker):
        return 0.0


def test_a_joiner_in_a_restarted_store_is_admitted_by_the_republished_plan_not_a_new_generation_0():
    js = DictStore()
    js.set(Keys.STORE_RESTARTED, "1")
    joined = PLAN.__class__(generation=8, members=PLAN.members + ("h3/0/9",), join_upto=4, joined=("h3/0/9",),
                            kind=EventKind.JOIN)
    republish(js, PLAN, "h1/0/1")
    js.set(Keys.plan(8), joined.to_json())  # the members admit the joiner (join #4)
    got = await_admission(js, "h3/0/9", Control(), min_workers=1, max_workers=None, hang_timeout_s=4,
                          restarted_wait_s=0.2)
    assert got == joined and not js.check([Keys.plan(0)])


def test_a_joiner_in_a_restarted_store_nobody_republishes_to_starts_the_job_after_the_wait():
    js = DictStore()
    js.set(Keys.STORE_RESTARTED, "1")
    got = await_admission(js, "h3/0/9", Control(), min_workers=1, max_workers=None, hang_timeout_s=4,
                          restarted_wait_s=0.2)
    assert got.generation == 0 and got.members == ("h3/0/9",)


def test_a_daemons_link_follows_a_restarted_stores_plans_from_the_republished_one():
    from eltctl_runtime.daemon.link import StoreLink

    link = StoreLink("127.0.0.1:1", "job", "h2")  # never started: _follow_plans is fed a store by hand
    old = DictStore()
    for g, members, left in ((0, ("h1/0/1", "h2/0/2"), ()), (1, ("h1/0/1", "h2/0/3"), ("h2/0/2",))):
        old.set(Keys.plan(g), Plan(generation=g, members=members, left=left, kind=EventKind.LEAVE).to_json())
    link._follow_plans(old)
    assert link.departed() == {"h2/0/2"} and link.joined() == {"h2/0/2", "h2/0/3"}

    new = DictStore()  # the restarted keeper's store: empty until rank 0 re-publishes generation 9
    link._generation = -1  # what a reconnect does
    link._follow_plans(new)
    assert link._generation == -1
    republish(new, Plan(generation=9, members=("h1/0/1", "h2/0/4"), kind=EventKind.JOIN), "h1/0/1")
    link._follow_plans(new)
    assert link._generation == 9 and "h2/0/4" in link.joined() and link.departed() == {"h2/0/2"}


# --------------------------------------------------------------------------- a direct-mode store that moved

def _address_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / STORE_ADDRESS_FILE
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_reconnect_goes_where_the_direct_mode_keeper_moved_and_only_then(tmp_path):
    addr = StoreAddress("tcp:127.0.0.1:4000", tmp_path / "run")
    assert addr.follow() == "tcp:127.0.0.1:4000"  # no file: the address given
    _address_file(tmp_path, "tcp:127.0.0.1:4711\n")
    assert addr.spec == "tcp:127.0.0.1:4000"  # nothing is read before a reconnect asks
    assert addr.follow() == "tcp:127.0.0.1:4711" and addr.spec == "tcp:127.0.0.1:4711"
    # the ssh mode's socket (and a job without run ids) never moves: the file is not read
    assert StoreAddress("unix:/home/u/.eltctl/jobs/j/h1/store.sock", tmp_path / "run").follow() == \
        "unix:/home/u/.eltctl/jobs/j/h1/store.sock"
    assert StoreAddress("tcp:127.0.0.1:4000", None).follow() == "tcp:127.0.0.1:4000"


@pytest.mark.parametrize("case", ["another-owner", "group-writable", "other-writable", "symlink", "unix", "garbage",
                                  "directory"])
def test_a_store_address_file_others_could_write_or_that_names_no_tcp_store_is_not_believed(tmp_path, case):
    if case == "another-owner":
        if os.getuid() != 0:
            pytest.skip("giving a file to another account needs root")
        os.chown(_address_file(tmp_path, "tcp:10.0.0.66:4711\n"), 65534, -1)
    elif case in ("group-writable", "other-writable"):
        _address_file(tmp_path, "tcp:10.0.0.66:4711\n", 0o620 if case == "group-writable" else 0o602)
    elif case == "symlink":
        real = tmp_path / "elsewhere"
        real.write_text("tcp:10.0.0.66:4711\n")
        os.chmod(real, 0o600)
        (tmp_path / STORE_ADDRESS_FILE).symlink_to(real)
    elif case == "unix":
        _address_file(tmp_path, "unix:/tmp/theirs.sock\n")
    elif case == "garbage":
        _address_file(tmp_path, "tcp:10.0.0.66:notaport\n")
    else:
        (tmp_path / STORE_ADDRESS_FILE).mkdir()
    assert read_store_address(tmp_path / STORE_ADDRESS_FILE) is None
    assert StoreAddress("tcp:127.0.0.1:4000", tmp_path / "run").follow() == "tcp:127.0.0.1:4000"


def test_a_daemons_link_reconnects_to_the_keepers_new_port_when_another_process_holds_the_old_one(tmp_path):
    """Plan: the daemon's link reads its desired document from a store on port A; that
    store dies and another process takes A (it accepts and hangs up); a new store serves
    on port B and the keeper's address file names it: the link reconnects to B (the old
    code retried A for ever)."""
    from eltctl_runtime.daemon.link import StoreLink
    from eltctl_runtime.member.plan import job_store
    from eltctl_runtime.protocol import Desired, put_desired
    from eltctl_runtime.store.server import StoreServer
    from eltctl_runtime.store.client import connect

    first = StoreServer()
    port_a = first.listen_tcp("127.0.0.1", 0)
    first.start()
    put_desired(job_store(connect(f"tcp:127.0.0.1:{port_a}", 5, plain=True), "j"), "h1", Desired(1, (0,)))
    link = StoreLink(f"tcp:127.0.0.1:{port_a}", "j", "h1", poll_s=0.02, connect_timeout_s=1.0,
                     run_file=tmp_path / "run")
    second = squatter = None
    link.start()
    try:
        wait(lambda: link.desired() and link.desired().seq == 1, "the first store's document")
        first.stop()
        squatter = PortSquatter("127.0.0.1", port_a)  # another program on the port: no store protocol
        squatter.bind()
        squatter.start(backlog=16)
        second = StoreServer()
        port_b = second.listen_tcp("127.0.0.1", 0)
        second.start()
        put_desired(job_store(connect(f"tcp:127.0.0.1:{port_b}", 5, plain=True), "j"), "h1", Desired(2, (0, 1)))
        wait(lambda: not link.connected, "the link to notice the loss")
        _address_file(tmp_path, f"tcp:127.0.0.1:{port_b}\n")
        wait(lambda: link.desired().seq == 2, "the link to read the moved store's document", timeout=60)
        assert link.connected and link.address == f"tcp:127.0.0.1:{port_b}"
    finally:
        link.close(flush_s=0)
        for srv in (first, second):
            if srv is not None:
                srv.stop()
        if squatter is not None:
            squatter.close()


def wait(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
