"""One side of a short throughput test between two hosts over the data plane
(`eltctl probe`, `doctor`, `up`; eltctl/linkspeed.py plans and judges it).

    python -c <this> recv ADDRESS ACCEPT_S SECONDS      (token on stdin's first line)
    python -c <this> send ADDRESS PORT SECONDS MAX_BYTES (token on stdin's first line)

`recv` listens on ADDRESS only (the host's data-plane address, where gloo listens), on
an ephemeral port, prints `port N` at once, and waits ACCEPT_S seconds for the one
sender whose first bytes are the token (stdin, never the command line, which other
accounts can read): a connection that does not send it within 2 s is closed and
counted as `rejected`, its bytes never counted. After the token it times PINGS
one-byte round trips (it sends a byte, the sender echoes it; `rtt_ms` is the
smallest, null if the echoes failed). From the first byte after them it counts what
arrives for at most SECONDS, closes, and prints one JSON line
{"bytes", "seconds", "rejected", "rtt_ms"} (the first chunk starts the clock and is
not counted), or {"error", "rejected"}. It exits then, in any case within
ACCEPT_S + SECONDS + 2 s (+ the round trips).

`send` connects, sends the token, echoes the receiver's PINGS bytes, then zeros in 64 KiB
writes until SECONDS pass, MAX_BYTES are sent or the receiver closes, and prints {"sent"}
(or {"error"}).
Standard library only, Python 3.8+.
"""

import hmac
import json
import socket
import sys
import time

CHUNK = 64 * 1024  # small writes: at 1 Mbit/s one takes half a second, so SECONDS holds
TOKEN_WAIT_S = 2.0
PINGS = 5  # one-byte round trips before the transfer: the link's latency, the smallest of them


def _token():
    return sys.stdin.readline().strip().encode("ascii")


def _read_exactly(conn, n):
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            break
        got += part
    return got


def _family(address):
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def recv(address, accept_s, seconds):
    token = _token()
    srv = socket.socket(_family(address), socket.SOCK_STREAM)
    srv.bind((address, 0))
    srv.listen(4)
    print("port %d" % srv.getsockname()[1], flush=True)
    deadline = time.monotonic() + accept_s
    rejected = 0
    conn = None
    while conn is None:
        left = deadline - time.monotonic()
        if left <= 0:
            print(json.dumps({"error": "no sender connected within %g s" % accept_s, "rejected": rejected}))
            return
        srv.settimeout(left)
        try:
            c, _peer = srv.accept()
        except socket.timeout:
            continue
        c.settimeout(TOKEN_WAIT_S)
        try:
            ok = bool(token) and hmac.compare_digest(_read_exactly(c, len(token)), token)
        except OSError:
            ok = False
        if ok:
            conn = c
        else:
            rejected += 1
            c.close()
    srv.close()
    conn.settimeout(seconds + 2)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    trips = []
    try:
        for _ in range(PINGS):
            t = time.monotonic()
            conn.sendall(b"p")
            if _read_exactly(conn, 1) != b"p":
                raise OSError("no echo")
            trips.append(time.monotonic() - t)
    except OSError:
        trips = []
    rtt = min(trips) if trips else None
    buf = bytearray(1 << 20)
    counted, first, last = 0, None, None
    try:
        while True:
            k = conn.recv_into(buf)
            if not k:
                break
            now = time.monotonic()
            if first is None:
                first = now  # the clock starts with the first chunk, which is not counted
            else:
                counted += k
                last = now
            if now - first >= seconds:
                break
    except OSError:
        pass
    conn.close()
    spent = (last - first) if last is not None else 0.0
    print(json.dumps({"bytes": counted, "seconds": spent, "rejected": rejected,
                      "rtt_ms": None if rtt is None else round(rtt * 1000, 3)}))


def send(address, port, seconds, max_bytes):
    token = _token()
    try:
        s = socket.create_connection((address, port), timeout=5)
    except OSError as exc:
        print(json.dumps({"error": "cannot connect to %s port %d: %s" % (address, port, exc)}))
        return
    zeros = bytes(CHUNK)
    sent = 0
    end = time.monotonic() + seconds + 1.0  # past the receiver's own end: it decides
    s.settimeout(seconds + 2)
    try:
        s.sendall(token)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(PINGS):
            s.sendall(_read_exactly(s, 1))
        while sent < max_bytes and time.monotonic() < end:
            n = min(CHUNK, max_bytes - sent)
            s.sendall(zeros[:n])
            sent += n
    except OSError:
        pass  # the receiver closed: its time was up
    s.close()
    print(json.dumps({"sent": sent}))


def main(argv):
    if argv[:1] == ["recv"] and len(argv) == 4:
        recv(argv[1], float(argv[2]), float(argv[3]))
    elif argv[:1] == ["send"] and len(argv) == 5:
        send(argv[1], int(argv[2]), float(argv[3]), int(argv[4]))
    else:
        print("usage: recv ADDRESS ACCEPT_S SECONDS | send ADDRESS PORT SECONDS MAX_BYTES", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
