"""The signed pair handshake on a new group (collectives.verify_pairs; issue 21, data
plane): two gloo ranks in threads form a group on a plain store, then check every pair
with the job's secret. A correct group passes; a peer that signs with another secret
fails on both sides (counted as gen/pair); a peer that never answers fails within the
timeout (counted as gen/pair missing); a job without a secret skips the check."""

from __future__ import annotations

import os
import secrets
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.member import collectives
from eltctl_runtime.protocol import Keys, job_prefix

CPU = torch.device("cpu")


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _signed(secret: bytes):
    """A job's signed store (only its signer and forgeries are used: the group forms elsewhere)."""
    return auth.SignedStore(None, auth.Signer(secret, job_prefix("j")))


def _handshake(server, prefix: str, stores: list, *, gid: str = "g1", answer=(True, True), timeout_s: float = 5.0,
               extra=({}, {})):
    """Form a 2-rank gloo group on `prefix` and run verify_pairs on the ranks that
    `answer`; {rank: "ok" or the Aborted message}."""
    out: dict[int, str] = {}
    done = threading.Event()

    def rank(r: int) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=20)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), r, 2, opts)
        if not answer[r]:
            out[r] = "silent"
            # the silent rank keeps its group (its pairs open) until the other has failed
            done.wait(30)
            collectives.bury(pg)
            return
        try:
            collectives.verify_pairs(pg, stores[r], 7, gid, r, 2, CPU, threading.Event(), timeout_s, **extra[r])
            out[r] = "ok"
        except collectives.Aborted as e:
            out[r] = str(e)
        done.set()
        collectives.bury(pg)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_group_whose_ranks_share_the_secret_passes(server):
    secret = secrets.token_bytes(auth.SECRET_BYTES)
    stores = [_signed(secret), _signed(secret)]
    assert _handshake(server, "ok", stores) == {0: "ok", 1: "ok"}
    assert [s.forgeries.counts() for s in stores] == [{}, {}]


def test_a_peer_with_another_secret_fails_the_handshake_on_both_sides(server):
    stores = [_signed(secrets.token_bytes(auth.SECRET_BYTES)) for _ in range(2)]
    out = _handshake(server, "bad", stores)
    assert "the message of rank(s) [1] to rank 0 is not signed" in out[0], out
    assert "the message of rank(s) [0] to rank 1 is not signed" in out[1], out
    assert [s.forgeries.counts() for s in stores] == [{"gen/pair": 1}, {"gen/pair": 1}]


def test_a_silent_peer_fails_the_handshake_within_its_timeout(server):
    secret = secrets.token_bytes(auth.SECRET_BYTES)
    stores = [_signed(secret), _signed(secret)]
    out = _handshake(server, "silent", stores, answer=(True, False), timeout_s=1.0)
    assert "no message from some peer of rank 0 within 1 s" in out[0], out
    assert stores[0].forgeries.counts() == {"gen/pair missing": 1}


def test_a_job_without_a_secret_skips_the_handshake(server):
    plain = dist.PrefixStore("plain", server)  # no signer: nothing to sign with, nothing sent
    assert _handshake(server, "plain", [plain, plain]) == {0: "ok", 1: "ok"}


def test_a_message_verifies_only_for_its_pair_generation_group_and_run():
    secret = secrets.token_bytes(auth.SECRET_BYTES)
    signer = auth.Signer(secret, job_prefix("j"), run="ab")
    sent = collectives.pair_messages(signer, 3, "g", 0, 2)  # rank 0's messages, one per receiver
    assert len({len(m) for m in sent}) == 1
    got = [sent[1], b""]  # what rank 1 receives (its own entry is never checked)
    assert collectives.check_pair_messages(signer, 3, "g", 1, got) == []
    assert collectives.check_pair_messages(signer, 4, "g", 1, got) == [0]  # another generation
    assert collectives.check_pair_messages(signer, 3, "h", 1, got) == [0]  # another group
    assert collectives.check_pair_messages(auth.Signer(secret, job_prefix("j"), run="cd"), 3, "g", 1, got) == [0]
    assert collectives.check_pair_messages(signer, 3, "g", 1, [sent[0], b""]) == [0]  # rank 0's to itself
    # rank 1's own message to rank 0, reflected back to rank 1 as if from rank 0: refused
    back = collectives.pair_messages(signer, 3, "g", 1, 2)
    assert collectives.check_pair_messages(signer, 3, "g", 1, [back[0], back[1]]) == [0]
    assert auth.family(Keys.pair(3, 0, 1)) == "gen/pair"


def test_the_group_id_is_the_plan_s():
    assert collectives.group_id('{"generation": 1}') == collectives.group_id(b'{"generation": 1}')
    assert collectives.group_id('{"generation": 1}') != collectives.group_id('{"generation": 2}')
    assert len(collectives.group_id("x")) == 32


@pytest.mark.parametrize("failures, wait", [(0, 0.0), (1, 0.0), (2, 1.0), (3, 2.0), (4, 4.0), (6, 16.0), (40, 16.0)])
def test_the_back_off_starts_at_the_second_failure_in_a_row_and_doubles_to_its_cap(failures, wait):
    assert collectives.pair_backoff_s(failures) == wait


def test_a_handshake_that_keeps_failing_backs_off_and_names_the_pair_and_the_count(server, caplog):
    """A peer that keeps failing the handshake (here: it signs with another secret, as a
    racer holding the pair would) makes each rank wait longer before the next group (1 s,
    then 2 s: recorded, not slept), and each failure's log line names the pair (rank and
    worker), this rank's address, who is connected to its listener, and the count; a
    handshake that passes clears the count."""
    mine, theirs = (secrets.token_bytes(auth.SECRET_BYTES) for _ in range(2))
    failures = [collectives.PairFailures(), collectives.PairFailures()]
    slept: list[list[float]] = [[], []]
    extra = [dict(peers=["h1/0/1", "h2/0/1"], listen="127.0.0.1", failures=failures[r], sleep=slept[r].append)
             for r in range(2)]
    caplog.set_level("WARNING", logger="eltctl_runtime")
    for i in range(3):
        out = _handshake(server, f"race{i}", [_signed(mine), _signed(theirs)], extra=extra)
        assert all("not signed" in out[r] for r in range(2)), out
    assert slept == [[1.0, 2.0], [1.0, 2.0]]
    assert [f.in_a_row for f in failures] == [3, 3]
    lines = [r.getMessage() for r in caplog.records if "failed in a row" in r.getMessage()]
    last = [line for line in lines if "for rank 0" in line][-1]
    assert "3 failed in a row" in last and "rank 1 (h2/0/1) (3x)" in last and "listening on 127.0.0.1" in last
    assert "connected to this rank's data-plane listener: " in last and "a 2 s back-off" in last
    assert _handshake(server, "honest", [_signed(mine), _signed(mine)], extra=extra) == {0: "ok", 1: "ok"}
    assert [f.in_a_row for f in failures] == [0, 0] and slept == [[1.0, 2.0], [1.0, 2.0]]


def test_the_report_names_another_account_connected_to_the_listener():
    f = collectives.PairFailures()
    f.failed(["rank 1 (h2/0/1)"])
    other = os.getuid() + 1
    line = f.report(4, 0, "10.0.0.5", "a message missing", 0.0,
                    [("10.0.0.6", 41000, None), ("10.0.0.5", 52000, other), ("10.0.0.5", 52001, other)])
    assert f"listener: 10.0.0.5 (2 connections, uid {other}, another account)." in line
    assert "10.0.0.6" not in line  # the other account's connections are the ones shown
    assert "1 failed in a row" in line and "back-off" not in line
