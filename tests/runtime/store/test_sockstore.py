"""The job's store server (eltctl_runtime.store.server) and its client (storeclient.SocketStore):
every op with c10d's meaning, the limits and their messages, a silent client that
delays nobody, the socket's modes, long paths, and gloo's rendezvous through it."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.store.server import Limits, StoreServer, parse_spec
from eltctl_runtime.store.client import SocketStore, StoreClosed, StoreRefused, StoreTimeout, connect


@pytest.fixture
def server(tmp_path):
    srv = StoreServer(Limits(max_value=1 << 20, max_keys=50, max_total=4 << 20, max_connections=16,
                             frame_timeout_s=0.5))
    srv.listen_unix(tmp_path / "run" / "store.sock")
    srv.start()
    yield srv
    srv.stop()


def client(srv, timeout=5.0) -> SocketStore:
    return SocketStore(f"unix:{srv.unix_path}", timeout)


def test_every_op_has_c10d_meaning(server):
    c = client(server)
    c.set("a", "1")
    c.set("b", b"\x00\xff")
    assert c.get("a") == b"1" and c.get("b") == b"\x00\xff"
    assert c.add("n", 3) == 3 and c.add("n", -1) == 2 and c.get("n") == b"2"
    assert c.check(["a", "b"]) and not c.check(["a", "nope"])
    c.wait(["a", "b"])
    assert c.compare_set("x", "", "first") == b"first"  # empty expected: set if absent
    assert c.compare_set("x", "", "second") == b"first"  # present: the current value, unchanged
    assert c.compare_set("x", "first", "third") == b"third"
    assert c.compare_set("y", "something", "z") == b"something" and not c.check(["y"])
    c.append("log", "ab")
    c.append("log", "cd")
    assert c.get("log") == b"abcd"
    c.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert c.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert sorted(c.list_keys()) == ["a", "b", "log", "m1", "m2", "n", "x"]
    assert c.num_keys() == 7
    assert c.delete_key("a") and not c.delete_key("a") and c.num_keys() == 6
    assert c.has_extended_api()
    other = c.clone()
    assert other is not c and other.get("x") == b"third"


def test_get_waits_for_the_key_and_times_out(server):
    c = client(server, timeout=0.3)
    with pytest.raises(StoreTimeout, match="did not appear"):
        c.get("later")
    with pytest.raises(StoreTimeout):
        c.wait(["later"], timedelta(seconds=0.2))
    writer = client(server)
    threading.Timer(0.1, writer.set, ("later", "here")).start()
    c.set_timeout(timedelta(seconds=5))
    assert c.get("later") == b"here"  # the same connection still works after a timeout


def test_limits_are_refused_with_their_numbers(server):
    c = client(server)
    with pytest.raises(StoreRefused, match=r"value of 1048577 bytes is over the store's limit of 1048576"):
        c.set("big", b"x" * ((1 << 20) + 1))
    with pytest.raises(StoreRefused, match="per key"):
        c.set("k" * 5000, "v")
    for i in range(50 - c.num_keys()):
        c.set(f"k{i}", "v")
    with pytest.raises(StoreRefused, match="50 keys, its limit"):
        c.set("one-more", "v")
    c.set("k0", "overwriting an existing key is fine")
    stats = server.stats()
    assert stats["refused"] == 3 and stats["refused_by_reason"] == {"value_size": 1, "key_size": 1, "keys": 1}
    assert c.get("k1") == b"v"  # the connection survives its refusals


def test_a_64_mib_value_is_refused_and_the_client_goes_on(server):
    c = client(server, timeout=30)
    with pytest.raises(StoreRefused, match="per request"):
        c.set("huge", b"\x00" * (64 << 20))
    c.set("small", "ok")
    assert c.get("small") == b"ok" and server.stats()["refused_by_reason"] == {"frame_size": 1}


def test_a_silent_partial_frame_delays_no_other_client(tmp_path):
    srv = StoreServer(Limits(frame_timeout_s=60.0))  # the silent one outlives the others' timeout
    srv.listen_unix(tmp_path / "s.sock")
    with srv:
        c = client(srv, timeout=3.0)  # a served-in-turn store would time this client out
        c.set("k", "v")
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(srv.unix_path)
        raw.sendall(b"\x00")  # one byte of a length, then silence
        for _ in range(20):
            assert c.get("k") == b"v"
        raw.close()


def test_a_silent_partial_frame_is_dropped(server):
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(server.unix_path)
    raw.sendall(b"\x00\x00\x00\x10\x02")  # a frame begun, never finished
    raw.settimeout(10)
    assert raw.recv(10) == b""  # dropped after the frame timeout (0.5 s here)
    raw.close()
    assert server.stats()["refused_by_reason"] == {"slow_frame": 1}


def test_too_many_busy_connections_are_refused(tmp_path):
    srv = StoreServer(Limits(max_connections=16, evict_idle_s=3600.0))  # none idle long enough to make room
    srv.listen_unix(tmp_path / "run" / "store.sock")
    with srv:
        _too_many_connections_are_refused(srv)


def _too_many_connections_are_refused(server):
    held = [client(server) for _ in range(16)]
    for c in held:
        c.ping()  # spoken: not evicted as a silent connection
    with pytest.raises(StoreRefused, match="16 open"):
        client(server).get("x")
    held.pop().close()
    deadline = time.monotonic() + 5
    while server.stats()["connections"] >= 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    client(server).set("x", "1")


def test_a_lost_server_raises_closed_on_every_call(tmp_path):
    srv = StoreServer()
    srv.listen_unix(tmp_path / "s.sock")
    srv.start()
    c = client(srv)
    c.set("a", "1")
    srv.stop()
    with pytest.raises(StoreClosed):
        c.get("a")
    with pytest.raises(StoreClosed):
        c.set("a", "2")


def test_the_socket_is_0600_in_a_0700_directory(server):
    path = server.unix_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_a_loose_directory_is_tightened_and_a_foreign_one_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    srv = StoreServer()
    srv.listen_unix(loose / "store.sock")
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    srv.stop()
    if os.getuid() != 0:
        return
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(PermissionError, match="account's own"):
        StoreServer().listen_unix(foreign / "store.sock")


def test_a_path_longer_than_sun_path_works(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    srv = StoreServer()
    srv.listen_unix(deep / "store.sock")
    assert len(str(deep / "store.sock")) > 108
    with srv:
        c = connect(f"unix:{srv.unix_path}", 5)
        c.set("k", "v")
        assert c.get("k") == b"v"


def test_tcp_listener_for_the_direct_mode(tmp_path):
    srv = StoreServer()
    port = srv.listen_tcp("127.0.0.1", 0)
    with srv:
        c = connect(f"tcp:127.0.0.1:{port}", 5)
        c.set("k", "v")
        assert c.get("k") == b"v" and srv.specs == [f"tcp:127.0.0.1:{port}"]


def test_nobody_connects_between_bind_and_start(tmp_path):
    # the store keeper writes its run id after binding and before start(): a client that
    # connected in between would sign with the last run's id (a CI flake, stop 31)
    srv = StoreServer()
    path = srv.listen_unix(tmp_path / "s.sock")
    port = srv.listen_tcp("127.0.0.1", 0)
    for family, addr in ((socket.AF_UNIX, path), (socket.AF_INET, ("127.0.0.1", port))):
        with socket.socket(family, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
            s.connect(addr)
    with srv:
        for spec in (f"unix:{path}", f"tcp:127.0.0.1:{port}"):
            c = connect(spec, 5)
            c.set("k", spec)
            assert c.get("k") == spec.encode()


def test_specs_parse():
    assert parse_spec("unix:/a/b.sock").path == "/a/b.sock"
    assert (parse_spec("tcp:10.0.0.5:29400").kind, parse_spec("10.0.0.5:29400").kind) == ("tcp", "c10d")
    assert str(parse_spec("tcp:[::1]:5")) == "tcp:[::1]:5"
    for bad in ("unix:relative", "nohost", "h:port", "tcp:h:0"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_gloo_rendezvous_through_a_prefix_store(server):
    results = {}

    def rank(r: int) -> None:
        store = client(server, timeout=30)  # referenced here for the group's life
        prefixed = dist.PrefixStore("job/pg/1", store)
        pg = dist.ProcessGroupGloo(prefixed, r, 2, timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        results[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: [3.0] * 4, 1: [3.0] * 4}


def test_a_client_that_leaves_during_a_get_frees_its_connection(server):
    c = client(server, timeout=600)
    waiting = threading.Thread(target=lambda: pytest.raises(Exception, c.get, "never"), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while server.stats()["connections"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    c._sock.shutdown(socket.SHUT_RDWR)  # gone while its GET waits (600 s)
    while server.stats()["connections"] > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats()["connections"] == 0
    waiting.join(10)


def test_requests_after_a_get_on_the_same_connection_stay_in_step(server):
    c = client(server)
    threading.Timer(0.2, client(server).set, ("late", "v")).start()
    assert c.get("late") == b"v"  # answered while the server watched the connection
    for i in range(50):
        c.set(f"s{i % 5}", str(i))
        assert c.get(f"s{i % 5}") == str(i).encode()
    with pytest.raises(StoreTimeout):
        c.wait(["nope"], timedelta(seconds=0.1))
    assert c.add("n", 1) == 1


def test_peek_reads_several_keys_without_waiting_and_pipelined_requests_stay_in_order(server):
    c = client(server)
    c.set("a", b"")
    c.set("b", b"\x00value")
    assert c.peek_many(["a", "missing", "b"]) == [b"", None, b"\x00value"]
    # a poll: a write and the reads in one round trip, answered in order
    assert c.set_and_peek([("hb", b"7")], ["hb", "a", "gone"]) == [b"7", b"", None]
    assert server.stats()["requests_by_op"]["PEEK"] == 2
    with pytest.raises(StoreRefused, match="per key"):  # a refused request in a pipeline: the others answered
        c.set_and_peek([("k" * 5000, b"v")], ["a"])
    assert c.get("hb") == b"7"  # the connection is still in step


def test_a_signed_poll_verifies_every_value_and_counts_forgeries(server):
    from eltctl_runtime.store import auth
    from eltctl_runtime.member.plan import job_store
    from eltctl_runtime.protocol import Keys, job_prefix, scan

    secret = auth.new_secret()
    js = job_store(client(server), "j", secret)
    evil = client(server)  # the socket without the secret
    js.set(Keys.STOP, "now")
    evil.set(f"{job_prefix('j')}/{Keys.leave('w')}", "forged")
    assert js.set_and_peek([(Keys.heartbeat("w"), "3")], [Keys.STOP, Keys.leave("w"), Keys.heartbeat("w")]) == \
        [b"now", None, b"3"]
    assert js.forgeries.counts() == {"leave": 1}
    assert js.peek_many([Keys.leave("w")]) == [None] and js.forgeries.counts() == {"leave": 2}  # every read counted
    # the join queue read in chunks: the same entries, and no number read past where the scan ends
    for n in (1, 2, 4):
        js.set(Keys.join(n), f"w{n}")
    evil.set(f"{job_prefix('j')}/{Keys.join(3)}", "forged")
    for n in range(13, 20):  # past 8 misses in a row (5..12): never read
        evil.set(f"{job_prefix('j')}/{Keys.join(n)}", "forged")
    assert scan(js, Keys.join, 0) == ([(1, b"w1"), (2, b"w2"), (4, b"w4")], 4)
    assert js.forgeries.counts()["join"] == 1


def test_the_plain_client_speaks_the_same_store_without_torch(server):
    """connect(..., plain=True) (the controller's and the daemons' client): no dist.Store,
    the same requests; its prefix store and torch's PrefixStore see the same keys."""
    from eltctl_runtime.store.client import PlainPrefixStore, PlainSocketStore, prefix_store

    spec = f"unix:{server.unix_path}"
    plain = connect(spec, 5.0, plain=True)
    assert isinstance(plain, PlainSocketStore) and not isinstance(plain, dist.Store)
    p = prefix_store("job/x", plain)
    assert isinstance(p, PlainPrefixStore)
    p.set("a", "1")
    assert p.add("n", 2) == 2 and p.compare_set("c", "", "v") == b"v" and p.check(["a", "n"])
    p.multi_set(["m1", "m2"], ["v1", "v2"])
    assert p.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert p.peek_many(["a", "missing"]) == [b"1", None]
    assert p.set_and_peek([("s", b"w")], ["s", "a"]) == [b"w", b"1"]
    torch_side = prefix_store("job/x", client(server))
    assert torch_side.get("a") == b"1" and torch_side.get("s") == b"w"
    assert p.delete_key("a") and not p.check(["a"])
    assert plain.clone().get("job/x/n") == b"2"


def test_a_rendezvous_wait_brings_the_value_and_its_get_still_verifies_it(server):
    """gloo waits for each peer's key, then gets it: PgStore fetches the value with the wait
    (one round trip: WAIT and PEEK pipelined) and its get checks it as before; a forged
    value fetched so is refused and counted all the same."""
    from eltctl_runtime.store import auth
    from eltctl_runtime.member.plan import job_store
    from eltctl_runtime.store.pgstore import pg_store
    from eltctl_runtime.protocol import Keys, job_prefix

    js = job_store(client(server), "j", auth.new_secret())
    ps = pg_store(js, 4)
    evil = client(server)
    ps.set("0/0", b"rank 0's address")
    evil.set(f"{job_prefix('j')}/{Keys.pg_prefix(4)}/0/1", b"an attacker's address")
    before = server.stats()["requests"]
    ps.wait(["0/0", "0/1"])
    assert server.stats()["requests"] - before == 2  # WAIT and PEEK, sent at once
    assert ps.get("0/0") == b"rank 0's address"
    with pytest.raises(auth.ForgedValue, match="0/1"):
        ps.get("0/1")
    assert server.stats()["requests"] - before == 2  # both read with the wait
    assert js.forgeries.counts() == {"gen/pg": 1}
    with pytest.raises(auth.ForgedValue):  # read again (no fetched bytes left): still refused
        ps.get("0/1")
    with pytest.raises(StoreTimeout):
        ps.wait(["0/2"], timedelta(seconds=0.2))
    assert ps.get("0/0") == b"rank 0's address"  # the connection stays in step


@pytest.mark.parametrize("kind,signed", [("keeper", True), ("keeper", False), ("tcpstore", True),
                                         ("tcpstore", False)])
def test_an_abandoned_group_construction_keeps_no_request_of_the_same_client_waiting(server, kind, signed):
    """A group's construction waits for its peers' addresses (gloo: up to its timeout, 300 s
    in the job); abandoned on an abort, it goes on waiting in its helper thread while the
    roll call writes and reads on the same client. Before, one long WAIT held the client's
    lock (c10d's TCPStore holds it too) and the roll call could not write a word until the
    wait ran out (a hand-over aborted on one survivor stalled the job 300 s). Now every wait
    of the rendezvous goes in slices: the roll call's requests pass while it still waits."""
    from eltctl_runtime.store import auth
    from eltctl_runtime.member.plan import job_store
    from eltctl_runtime.store.pgstore import pg_store

    if kind == "keeper":
        base = client(server, timeout=60)
    else:
        host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=60))
    js = job_store(base, "j", auth.new_secret() if signed else None)
    formed = {}

    def form(rank: int) -> None:
        ps = pg_store(js, 7)
        formed[rank] = dist.ProcessGroupGloo(ps, rank, 2, timedelta(seconds=40))
        formed[f"store{rank}"] = ps

    first = threading.Thread(target=form, args=(0,), daemon=True)
    first.start()
    time.sleep(0.5)  # rank 0 waits for rank 1's address, which nobody writes yet
    said = threading.Thread(target=lambda: formed.setdefault("said", js.compare_set("gen/7/abort", "", "x")),
                            daemon=True)
    said.start()
    said.join(20)
    assert formed.get("said") == b"x" and first.is_alive(), formed
    form(1)  # rank 1 comes after all: the waiting construction completes
    first.join(30)
    assert 0 in formed and 1 in formed
