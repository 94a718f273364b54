"""The store's last limits against a real store keeper process (issue 49, point 4).

In the default "ssh" store mode the store is reached by the job's own account only (a
Unix socket in a 0700 directory), so these attacks come from that account: the tests
run a real `python -m eltctl.storekeeper` serving its socket, as the controller starts
it, with its open-file limit lowered to 700 descriptors (its connection limit is then
set below that: sockstore.connection_cap), and speak the wire protocol at it. Each one
reads the keeper's own counters (storestats.json, what `eltctl status` reports as a
possible attack) and, for memory, the keeper's peak RSS from /proc.

- idle-connection exhaustion: 800 connections that never send a byte, more than the
  keeper's descriptors; a legitimate client's PING still answers (the silent
  connections make room), `accept` never fails for want of a descriptor, and the
  refusals are counted;
- an amplified PEEK (a 1.5 KB request naming a 1 MiB value 300 times): refused with an
  error, counted, and the keeper's peak memory grows by far less than the answer;
- an oversized MULTI_SET (more new keys in one request than the store may hold):
  refused as a whole, nothing of it stored;
- a counter overwritten with a value that is not an integer: refused; ADD on a key
  that holds a non-integer: a clean error, and the same connection still works.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eltctl_runtime.store.server import Op, Status, decode, encode
from eltctl_runtime.store.client import PlainSocketStore, StoreRefused

NOFILE = 700  # the keeper's open-file limit (soft and hard) in these tests


def _nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def keeper(tmp_path_factory):
    """A store keeper process on a Unix socket (the "ssh" mode), as the controller runs it."""
    d = tmp_path_factory.mktemp("keeper")
    run = d / "run"
    run.mkdir(mode=0o700)
    info, stats, log = d / "storekeeper.json", d / "storestats.json", d / "storekeeper.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "eltctl.storekeeper", "--socket", str(run / "store.sock"),
                                 "--info", str(info), "--stats", str(stats), "--run-file", str(d / "runid")],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=_nofile, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not info.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert info.exists(), f"the keeper did not start: {log.read_text()}"
        yield {"proc": proc, "spec": f"unix:{run / 'store.sock'}", "stats": stats, "log": log}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _stats(keeper, until=lambda s: True, wait_s: float = 30.0) -> dict:
    """The keeper's counters (written every 2 s), once `until` holds of them or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            doc = json.loads(keeper["stats"].read_text())
        except (OSError, ValueError):
            doc = {}
        if (doc and until(doc)) or time.monotonic() > deadline:
            return doc
        time.sleep(0.2)


def _refused(doc: dict, reason: str) -> int:
    return int((doc.get("refused_by_reason") or {}).get(reason, 0))


def _raw(keeper) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(keeper["spec"][len("unix:"):])
    return s


def _ask(sock: socket.socket, op: Op, items: list[bytes]) -> tuple[int, list[bytes]]:
    """One request on a raw connection and its answer."""
    sock.sendall(encode(op, items))
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "the keeper closed the connection"
        head += chunk
    size = int.from_bytes(head, "big")
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(min(size - len(body), 1 << 20))
        assert chunk, "the keeper closed the connection"
        body += chunk
    return decode(bytes(body))


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


def test_idle_connections_cannot_lock_the_job_out_of_its_store(keeper):
    before = _stats(keeper, lambda s: "refused" in s)
    idle = []
    try:
        for _ in range(800):  # more than the keeper has descriptors: each sends nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            idle.append(s)
            s.settimeout(5)
            try:
                s.connect(keeper["spec"][len("unix:"):])
            except OSError:
                pass  # the backlog full: the attack goes on with the others
        legit = PlainSocketStore(keeper["spec"], 20.0)
        legit.ping()  # answered although hundreds of idle connections came first
        legit.set("k", "v")
        assert legit.get("k") == b"v"
        legit.close()
    finally:
        for s in idle:
            s.close()
    doc = _stats(keeper, lambda s: _refused(s, "evicted") > _refused(before, "evicted"))
    assert _refused(doc, "evicted") > _refused(before, "evicted"), doc
    assert doc["refused"] > before.get("refused", 0)
    log = keeper["log"].read_text()
    assert "Too many open files" not in log and "out of system resource" not in log, log


def test_an_amplified_peek_is_refused_and_memory_stays_bounded(keeper):
    pid = keeper["proc"].pid
    s = _raw(keeper)
    assert _ask(s, Op.SET, [b"b", b"x" * (1 << 20)])[0] == Status.OK
    before = _stats(keeper, lambda d: "refused" in d)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
    base = _peak_rss(pid)
    request = [b"b"] * 300  # 1.5 KB asking for 300 MiB
    assert len(encode(Op.PEEK, request)) < 2000
    for _ in range(3):
        status, items = _ask(s, Op.PEEK, request)
        assert status == Status.REFUSED and b"per answer" in items[0], items
    assert _ask(s, Op.PING, [])[0] == Status.OK  # the connection goes on
    s.close()
    grew = _peak_rss(pid) - base
    assert grew < 64 << 20, f"the keeper's peak memory grew by {grew >> 20} MiB for a refused PEEK"
    doc = _stats(keeper, lambda d: _refused(d, "response_size") >= _refused(before, "response_size") + 3)
    assert _refused(doc, "response_size") == _refused(before, "response_size") + 3, doc


def test_an_oversized_multi_set_is_refused_as_a_whole(keeper):
    client = PlainSocketStore(keeper["spec"], 60.0)
    try:
        held = client.num_keys()
        n = 200_001 - held + 10  # the keeper's limit is 200,000 keys: one request past it
        with pytest.raises(StoreRefused, match="refused as a whole"):
            client.multi_set([f"m/{i:06d}" for i in range(n)], [b"1"] * n)
        assert client.num_keys() == held and not client.check(["m/000000"])
    finally:
        client.close()
    doc = _stats(keeper, lambda d: _refused(d, "keys") >= 1)
    assert _refused(doc, "keys") >= 1, doc


def test_a_counter_stays_an_integer_and_add_errs_cleanly(keeper):
    s = _raw(keeper)
    try:
        assert _ask(s, Op.ADD, [b"job/join/seq", b"1"]) == (Status.OK, [b"1"])
        status, items = _ask(s, Op.SET, [b"job/join/seq", b"x"])  # would stop every joiner
        assert status == Status.REFUSED and b"counter" in items[0], items
        assert _ask(s, Op.ADD, [b"job/join/seq", b"1"]) == (Status.OK, [b"2"])
        # a key someone wrote a non-integer to before any ADD: ADD errs, the connection stays
        assert _ask(s, Op.SET, [b"job/events/seq", b"x"])[0] == Status.OK
        status, items = _ask(s, Op.ADD, [b"job/events/seq", b"1"])
        assert status == Status.REFUSED and b"not an integer" in items[0], items
        assert _ask(s, Op.ADD, [b"job/join/seq", b"1"]) == (Status.OK, [b"3"])  # same connection
    finally:
        s.close()
    doc = _stats(keeper, lambda d: _refused(d, "counter") >= 2)
    assert _refused(doc, "counter") == 2, doc
