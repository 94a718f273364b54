"""The store's limits on connections, answers, MULTI_SET and counters
(eltctl_runtime.store.server), with an in-process server and the plain client (no torch):

- the connection limit below the open-file limit (`connection_cap`: a table);
- a connection that sends nothing is closed (counted, not as a refusal); one idle between
  requests is closed with a CLOSED frame, and the client sends its next request again
  on a new connection without the caller seeing it;
- at the connection limit a silent connection makes room for a new one (counted);
- an answer over `max_response` is refused (counted), the connection goes on;
- a MULTI_SET is checked as a whole against the keys and bytes limits;
- a counter (a key ADD wrote) stays an integer whatever op writes it; a spoiled
  counter does not stop the event log (`protocol.add_event` finds its number anyway).
The real keeper process under attack: tests/security/test_store_limits.py."""

from __future__ import annotations

import socket
import time

import pytest

from eltctl_runtime.protocol import Keys, add_event, scope
from eltctl_runtime.store.server import FD_RESERVE, Limits, StoreServer, connection_cap, encode, Op, Status, decode
from eltctl_runtime.store.client import PlainSocketStore, StoreRefused


def _serve(tmp_path, **limits) -> StoreServer:
    srv = StoreServer(Limits(**limits))
    srv.listen_unix(tmp_path / "run" / "store.sock")
    srv.start()
    return srv


@pytest.fixture
def server(tmp_path):
    srv = _serve(tmp_path, max_keys=20, max_total=64 << 10, max_value=16 << 10, max_response=40 << 10,
                 max_connections=8, silent_timeout_s=0.3, idle_timeout_s=0.6)
    yield srv
    srv.stop()


def _client(srv) -> PlainSocketStore:
    return PlainSocketStore(f"unix:{srv.unix_path}", 5.0)


def _until(predicate, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("nofile, wanted, per_client, cap", [
    (1 << 20, 4096, 1, 4096),  # plenty: the wanted limit
    (1 << 20, 4096, 2, 4096),
    (1024, 4096, 1, 1024 - FD_RESERVE),  # the usual soft limit of 1024: below it, with the reserve
    (1024, 4096, 2, (1024 - FD_RESERVE) // 2),  # forwarded clients hold two descriptors each
    (FD_RESERVE, 4096, 1, 1),  # never 0: the job's own client still gets in
])
def test_the_connection_limit_stays_below_the_open_file_limit(nofile, wanted, per_client, cap):
    assert connection_cap(nofile, wanted, per_client) == cap


def test_a_silent_connection_is_closed_and_counted_apart(server):
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(server.unix_path)
    raw.settimeout(10)
    data = b""
    while chunk := raw.recv(4096):
        data += chunk
    raw.close()
    assert decode(data[4:])[0] == Status.CLOSED
    assert server.stats()["silent_closed"] == 1 and server.stats()["refused"] == 0


def test_an_idle_connection_is_closed_and_the_client_sends_again(server):
    c = _client(server)
    c.set("k", "v")
    _until(lambda: server.stats()["idle_closed"] == 1)
    assert server.stats()["idle_closed"] == 1 and server.stats()["connections"] == 0
    assert c.get("k") == b"v" and c.add("n", 1) == 1  # on a new connection, each sent once
    assert c.add("n", 1) == 2 and server.stats()["refused"] == 0  # an idle close is no refusal


def test_at_the_limit_a_silent_connection_makes_room(server):
    silent = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX)
        s.connect(server.unix_path)
        silent.append(s)
    _until(lambda: server.stats()["connections"] == 8)
    c = _client(server)
    c.ping()
    assert server.stats()["refused_by_reason"].get("evicted") == 1
    for s in silent:
        s.close()


def test_an_answer_over_the_limit_is_refused_and_the_connection_goes_on(server):
    c = _client(server)
    c.set("v", b"x" * (15 << 10))
    with pytest.raises(StoreRefused, match="per answer"):
        c.peek_many(["v"] * 3)
    with pytest.raises(StoreRefused, match="per answer"):
        c.multi_get(["v"] * 3)
    assert c.multi_get(["v", "v"]) == [b"x" * (15 << 10)] * 2
    assert server.stats()["refused_by_reason"] == {"response_size": 2}


def test_a_multi_set_is_checked_as_a_whole(server):
    c = _client(server)
    c.multi_set([f"a{i}" for i in range(15)], ["v"] * 15)
    with pytest.raises(StoreRefused, match="refused as a whole"):  # 15 + 10 new keys > 20
        c.multi_set([f"b{i}" for i in range(10)], ["v"] * 10)
    assert c.num_keys() == 15 and not c.check(["b0"])
    c.multi_set([f"a{i}" for i in range(15)] + ["b0"] * 5, ["w"] * 20)  # rewrites and one new key: fits
    with pytest.raises(StoreRefused, match="bytes: refused as a whole"):  # 5 x 15 KiB > 64 KiB
        c.multi_set([f"a{i}" for i in range(5)], [b"x" * (15 << 10)] * 5)
    assert c.get("a0") == b"w" and server.stats()["refused_by_reason"] == {"keys": 1, "total": 1}


def test_a_counter_stays_an_integer(server):
    c = _client(server)
    assert c.add("seq", 5) == 5
    for write in (lambda: c.set("seq", "x"), lambda: c.compare_set("seq", "5", "x"),
                  lambda: c.append("seq", "x"), lambda: c.multi_set(["other", "seq"], ["1", "x"])):
        with pytest.raises(StoreRefused, match="is a counter"):
            write()
    c.set("seq", "7")  # an integer is fine
    assert c.add("seq", 1) == 8 and not c.check(["other"])
    assert c.delete_key("seq")
    c.set("seq", "free again")  # deleted: no longer a counter
    with pytest.raises(StoreRefused, match="not an integer: ADD refused"):
        c.add("seq", 1)
    assert c.get("seq") == b"free again"  # the same connection
    assert server.stats()["refused_by_reason"] == {"counter": 5}


def test_a_spoiled_event_counter_does_not_stop_the_event_log(tmp_path):
    srv = _serve(tmp_path)
    try:
        raw = _client(srv)
        js = scope(raw, "job")
        js.set(Keys.EVENTS_SEQ, "not a number")  # before any ADD: accepted, then ADD refuses it
        assert add_event(js, {"kind": "start", "step": 1}) == 1
        assert add_event(js, {"kind": "start", "step": 2}) == 2
        assert js.check([Keys.event(1), Keys.event(2)])
    finally:
        srv.stop()


def test_a_pipelined_batch_after_an_idle_close_is_sent_again_whole(server):
    c = _client(server)
    c.set("a", "1")
    _until(lambda: server.stats()["idle_closed"] == 1)
    assert c.set_and_peek([("b", b"2")], ["a", "b"]) == [b"1", b"2"]
    raw = socket.socket(socket.AF_UNIX)  # the frame the server says it with
    raw.connect(server.unix_path)
    raw.sendall(encode(Op.PING))
    raw.settimeout(10)
    assert decode(raw.recv(64)[4:])[0] == Status.OK
    raw.close()


def test_answers_nobody_reads_are_bounded_in_all(tmp_path):
    """Clients that ask for big values and never read them: past `max_unread` bytes
    buffered for them in all, a big answer is refused (counted "unread")."""
    srv = _serve(tmp_path, max_value=2 << 20, max_unread=2 << 20)
    try:
        c = _client(srv)
        c.set("v", b"x" * (3 << 19))  # 1.5 MiB
        get = encode(Op.GET, [b"v", b"1000"])
        first = socket.socket(socket.AF_UNIX)
        first.connect(srv.unix_path)
        first.sendall(get)  # its answer is not read: most of it stays in the server
        _until(lambda: srv._unread() > (1 << 20))
        second = socket.socket(socket.AF_UNIX)
        second.connect(srv.unix_path)
        second.settimeout(10)
        second.sendall(get)
        head = second.recv(4)
        status, items = decode(second.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))
        assert status == Status.REFUSED and b"not read" in items[0], items
        assert srv.stats()["refused_by_reason"] == {"unread": 1}
        first.close()
        second.close()
    finally:
        srv.stop()


def test_after_an_idle_close_the_client_sends_again_only_to_the_same_server(tmp_path):
    """A keeper restarted at the same address while a client sat idle: the client's next
    call is a lost store (StoreClosed, what the callers recover from), not a quiet
    reconnect to a new store whose run id it does not know."""
    from eltctl_runtime.store.server import StoreClosed

    srv = _serve(tmp_path, idle_timeout_s=0.2)
    c = _client(srv)
    c.set("k", "v")
    _until(lambda: srv.stats()["idle_closed"] == 1)
    srv.stop()
    successor = _serve(tmp_path)  # the same socket path
    try:
        with pytest.raises(StoreClosed, match="replaced"):
            c.get("k")
    finally:
        successor.stop()
