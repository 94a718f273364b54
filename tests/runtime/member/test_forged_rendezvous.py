"""An attacker on the process groups' rendezvous (issue 21): a rewritten peer address
fails the generation's group, is counted, and never connects a rank to it.

gloo's full mesh writes each rank's address under `gen/<g>/pg/0/<rank>` and every rank
reads every other's (waiting for it if it is not there yet). The plan: one worker of a
job with a secret trains alone in generation g; an attacker who reaches the store's
port writes rank 1's address of generation g+1 before anyone does (a copy of rank 0's
signed address of generation g: a replay under another key). A joiner registers and is
stopped (SIGSTOP) before it can write its own address; the member admits it, forms
generation g+1, reads the forged address first, and the group fails (ForgedValue) rather
than connect. Once the member has aborted generation g+1 the joiner resumes; the roll
call forms generation g+2 on a fresh prefix, which trains with both, and a real stop
ends the job with identical states and every sample used exactly once (the all-reduce
carried the honest sum).
"""

from __future__ import annotations

import re
import secrets
import signal
import time
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.member.plan import job_store
from eltctl_runtime.store.pgstore import PgStore, pg_store
from eltctl_runtime.protocol import Keys, job_prefix
from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])
# Slow steps: the member admits a joiner only at a step boundary after it registered,
# so the joiner is stopped well before the plan that admits it exists.
SLOW = ["--steps", "100000", "--step-sleep", "0.4"]


def _key(g: int, rank: int) -> str:
    return f"{Keys.pg_prefix(g)}/0/{rank}"  # gloo's full mesh: context 0, one key per rank


@pytest.mark.slow
def test_a_forged_peer_address_aborts_the_generation_and_the_next_one_trains(cluster_factory):
    cluster = cluster_factory(secret=secrets.token_bytes(auth.SECRET_BYTES), hang_timeout=20.0)
    # Steps of 1.5 s: the member plans the joiner's generation only at its next step
    # boundary, so the joiner is stopped (polled every 5 ms) before it is admitted and
    # writes its own address (with 0.4 s steps a loaded machine lost that race in CI).
    slower = ["--steps", "100000", "--step-sleep", "1.5"]
    (member,) = cluster.start(1, slower)
    g = cluster.wait_world(1, steps_after=2)
    evil = dist.PrefixStore(job_prefix(cluster.job),
                            dist.TCPStore("127.0.0.1", cluster.store.port, is_master=False,
                                          timeout=timedelta(seconds=10)))
    evil.set(_key(g + 1, 1), evil.get(_key(g, 0)))  # signed, but for another key

    (joiner,) = cluster.start(1, slower)
    deadline = time.monotonic() + 90
    while "waiting to be admitted" not in joiner.log_text():
        assert time.monotonic() < deadline, f"the joiner did not register; logs:\n{cluster.dump_logs()}"
        time.sleep(0.005)
    cluster.kill(joiner, signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: cluster.js.check([Keys.abort(g + 1)]), what=f"generation {g + 1} to abort")
        # the joiner never wrote its address: the member read the forged one
        assert evil.get(_key(g + 1, 1)) == evil.get(_key(g, 0)), cluster.dump_logs()
    finally:
        cluster.kill(joiner, signal.SIGCONT)
    g2 = cluster.wait_world(2, min_gen=g + 2, steps_after=3)
    status = cluster.wait_for_status(lambda s: s["generation"] == g2 and "gen/pg" in s.get("forged", {}))
    assert status["members"] == [member.id, joiner.id], status
    logs = cluster.dump_logs()
    assert f"ignored a store value of {_key(g + 1, 1)}" in logs, logs
    assert re.search(rf"generation {g + 1} aborted while forming: .*{re.escape(_key(g + 1, 1))}", logs), logs

    cluster.stop()
    cluster.wait_exit([member, joiner])
    assert member.proc.returncode == 0 and joiner.proc.returncode == 0, cluster.dump_logs()
    results = [member.read_result(), joiner.read_result()]
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, results[0]["step"])


# -- the store itself, two ranks in threads ------------------------------------------------


def _group(store, rank: int, size: int):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=20)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield s


def _job(server, secret):
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    return job_store(tcp, "j", secret)


def test_groups_form_on_signed_values_and_a_forged_one_raises_naming_its_key(server):
    secret = secrets.token_bytes(auth.SECRET_BYTES)
    stores = [pg_store(_job(server, secret), 0) for _ in range(2)]
    assert all(isinstance(s, PgStore) for s in stores)
    out: dict = {}

    def rank(r: int) -> None:
        pg = _group(stores[r], r, 2)
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [3.0] * 3, 1: [3.0] * 3}
    raw = dist.PrefixStore(job_prefix("j"), server)
    assert raw.get(_key(0, 1)).startswith(b"elt1.")  # what gloo wrote went out signed

    # Generation 1: rank 1's address is there first, unsigned (or replayed): rank 0 refuses it.
    js = _job(server, secret)
    raw.set(_key(1, 1), raw.get(_key(0, 0)))
    with pytest.raises(Exception, match=re.escape(_key(1, 1))):
        _group(pg_store(js, 1), 0, 2)
    assert js.forgeries.counts() == {"gen/pg": 1}


def test_an_unsigned_job_keeps_plain_values(server):
    """No secret: the group forms on the plain prefix `gen/<g>/pg` (PlainPgStore: its waits
    in slices), its values unsigned."""
    from eltctl_runtime.store.pgstore import PlainPgStore

    store = pg_store(dist.PrefixStore(job_prefix("j"), server), 3)
    assert type(store) is PlainPgStore
    store.set("probe", b"plain")
    _group(store, 0, 1)
    plain = dist.PrefixStore(job_prefix("j"), server)
    assert plain.check([_key(3, 0)])
    assert plain.get(f"{Keys.pg_prefix(3)}/probe") == b"plain"


def test_the_signed_store_passes_counters_through_and_signs_the_rest(server):
    secret = secrets.token_bytes(auth.SECRET_BYTES)
    store = pg_store(_job(server, secret), 5)
    raw = dist.PrefixStore(f"{job_prefix('j')}/{Keys.pg_prefix(5)}", server)
    store.multi_set(["a", "b"], [b"1", b"2"])
    store.append("a", b"3")
    assert store.multi_get(["a", "b"]) == [b"13", b"2"]
    assert store.compare_set("c", "", b"x") == b"x"
    assert store.compare_set("c", b"x", b"y") == b"y"
    assert store.add("n", 2) == 2 and raw.add("n", 0) == 2
    assert store.check(["a", "c"]) and not store.check(["nope"])
    assert raw.get("a") != b"13" and raw.get("a").endswith(b"13")
    store.wait(["a"], timedelta(seconds=1))
    twin = store.clone()
    assert twin.get("b") == b"2"
