"""Another account against gloo's listening sockets (the data plane; issue 21).

Plan: two real processes form a gloo group (GLOO_SOCKET_IFNAME=lo) and all-reduce
without pause, each checking every result against the honest sum (rank r contributes
r + 1 + i at iteration i). As another account (`nobody`), the attacker finds each
rank's TCP listeners from /proc/net/tcp by the ranks' pids and, against all of them at
once: connects and sends one byte, then stays silent; connects and stays silent; sends
64 MiB of garbage; sends a 64 MiB c10d store value; holding every connection open for
the whole attack. Meanwhile, and after it, the ranks form a new group (as a resize
does: a new gloo context) and all-reduce on it.

What must hold: the all-reduces go on during the attack (more iterations than before
it), every result is the honest sum, the new group forms and gives honest sums, and
neither rank fails. The figures (iterations during the attack, what each connection
saw) are printed: `pytest -s` shows them.

A second test races the listener of each NEW gloo group (a resize forms one): gloo's TCP
listener gives an incoming connection to the pair waiting for the sequence number the
connection names (0, 1, ...: predictable), with no authentication. As `nobody`, watching
/proc/net/tcp for new listeners on the ranks' address and connecting first, the attacker
took the pair in about half the rounds: the round's all-reduce timed out on both ranks
and the waiting rank sent the attacker its tensor. gloo (torch 2.13) cannot refuse it, so
the runtime checks every pair of a new group with a signed handshake before any collective
uses it (collectives.verify_pairs): the test forms its groups as the runtime does and
asserts that a hijacked group is dropped (counted) and the next one trains honestly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testbed import attacker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RANK = r'''
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

rank, world, init, out, cmd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
group = None  # the default group; "regroup" forms a new one
i, bad, groups = 0, 0, 1
CODES = {"run": 0, "regroup": 1, "stop": 2}
with open(out, "a", buffering=1) as f:
    while True:
        want = 0
        if rank == 0:
            try:
                want = CODES.get(open(cmd).read().strip(), 0)
            except OSError:
                pass
        flag = torch.tensor([float(want)])
        dist.all_reduce(flag, group=group)  # rank 0's command, agreed by both
        code = int(flag.item())
        if code == 2:
            break
        if code == 1 and groups == 1:
            group = dist.new_group(list(range(world)))
            groups += 1
            f.write(f"regrouped {i}\n")
        t = torch.full((65536,), float(rank + 1 + i))
        dist.all_reduce(t, group=group)
        honest = float(sum(r + 1 + i for r in range(world)))
        ok = bool((t == honest).all())
        bad += not ok
        f.write(f"{i} {groups} {int(ok)} {time.time():.3f}\n")
        i += 1
        time.sleep(0.005)
    f.write(f"done {i} {bad}\n")
dist.destroy_process_group()
'''


def iterations(path: Path) -> list[tuple[int, int, bool, float]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        f = line.split()
        if len(f) == 4 and f[0].isdigit():
            out.append((int(f[0]), int(f[1]), f[2] == "1", float(f[3])))
    return out


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_gloo_listeners_survive_one_byte_silence_and_floods_from_another_account(tmp_path):
    reason = attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    os.chmod(tmp_path, 0o700)  # the attacker reads nothing of the ranks'
    cmd = tmp_path / "cmd"
    cmd.write_text("run")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "init"), str(logs[r]),
                               str(cmd)], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"rank{r}.err", "w"),
                              start_new_session=True) for r in range(2)]
    try:
        wait_until(lambda: all(len(iterations(p)) >= 20 for p in logs), 90, "both ranks to all-reduce")
        sockets = [s for s in attacker.listening_sockets({p.pid: f"rank{r}" for r, p in enumerate(ranks)})
                   if s.kind == "tcp"]
        assert sockets, "no gloo listener found"
        before = [len(iterations(p)) for p in logs]
        wedge = attacker.Wedge(sockets, hold=8).start()
        time.sleep(3)  # the attack under way: form a new group while it holds its connections
        cmd.write_text("regroup")
        found = wedge.result()
        during = [len(iterations(p)) for p in logs]
        # after the attack: a few more honest iterations on the new group, then stop
        wait_until(lambda: all(len(iterations(p)) >= n + 20 for p, n in zip(logs, during)), 60,
                   "all-reduces after the attack")
        after = [s.key for s in attacker.listening_sockets({p.pid: f"rank{r}" for r, p in enumerate(ranks)})
                 if s.kind == "tcp"]
        cmd.write_text("stop")
        codes = [p.wait(timeout=60) for p in ranks]
        print(json.dumps({"listeners": [s.key for s in sockets], "listeners_with_the_new_group": after, "iterations_before": before,
                          "iterations_at_end_of_attack": during, "attack": found}, indent=1))
        errs = [(tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
        assert codes == [0, 0], errs
        for r, p in enumerate(logs):
            its = iterations(p)
            assert all(ok for _i, _g, ok, _t in its), f"rank {r} received a dishonest sum"
            assert any(g == 2 for _i, g, _ok, _t in its), f"rank {r} never all-reduced on the new group"
            assert "done" in p.read_text() and p.read_text().rstrip().endswith(" 0"), p.read_text()[-200:]
        for r in range(2):
            assert during[r] > before[r] + 10, (f"rank {r}: {before[r]} iterations before the attack, "
                                                f"{during[r]} at its end: the attack held the all-reduces")
        # the attacker did reach every listener (else the test proves nothing)
        for key, r in found.items():
            assert r.get("one_byte_connect") == "ok", (key, r)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


ROUNDS = r"""
import json, os, secrets, sys, threading, time
import torch
import torch.distributed as dist
from eltctl_runtime.store import auth
from eltctl_runtime.member import collectives
from eltctl_runtime.member.plan import job_store
from eltctl_runtime.store.pgstore import pg_store

# The back-off after failed handshakes in a row doubles up to 16 s (collectives.py, unit-tested
# there); here, where the attacker may win the race many times in a row, it stops at 2 s so the
# test's time stays bounded (160 s once at the real cap).
collectives.PAIR_BACKOFF_MAX_S = 2.0

rank, addr, storefile, out, rounds, skew, secret_file, check_s = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]), sys.argv[7],
    float(sys.argv[8]))
base = dist.FileStore(storefile, 2)
forgeries = auth.Forgeries()
js = job_store(base, "j", auth.read_secret(secret_file), forgeries)  # signed, as a job with a secret
raw = dist.PrefixStore("test", base)  # the test's own agreement (the job's is its signed abort key)
cpu = torch.device("cpu")


def watch(g, stop):
    # as the job's ControlThread: a rank that drops generation g sets its abort key
    ev = threading.Event()
    def loop():
        while not stop.is_set():
            if raw.check([f"abort/{g}"]):
                ev.set()
                return
            time.sleep(0.01)
    threading.Thread(target=loop, daemon=True).start()
    return ev


res, g = [], 0
for r in range(rounds):
    raw.add(f"arrived/{r}", 1)  # both ranks start the round together ...
    while int(raw.add(f"arrived/{r}", 0)) < 2:
        time.sleep(0.005)
    while True:  # ... and form generations until one passes its pair handshake
        if rank == 1:
            time.sleep(skew)  # rank 1 forms the group a moment later, as on another host
        stop = threading.Event()
        abort = watch(g, stop)
        store = pg_store(js, g)
        pg = None
        try:
            pg = collectives.run_abortable(lambda: collectives.make_group(store, rank, 2, cpu, addr), abort,
                                           f"group of generation {g}")
            collectives.verify_pairs(pg, js, g, collectives.group_id(f"round {r} generation {g}"), rank, 2, cpu,
                                     abort, timeout_s=check_s, peers=["rank0", "rank1"], listen=addr)
            raw.set(f"ok/{g}/{rank}", "1")
            while not raw.check([f"ok/{g}/{1 - rank}"]):
                if abort.is_set():
                    raise collectives.Aborted("the peer dropped the generation")
                time.sleep(0.005)
            t = torch.full((1024,), float(rank + 1 + 10 * r))
            collectives.allreduce(pg, t, abort)
            res.append({"round": r, "generation": g, "honest": bool((t == float(1 + 2 + 20 * r)).all()),
                        "got": t[0].item()})
            break
        except collectives.Aborted as e:
            raw.compare_set(f"abort/{g}", "", "1")
            res.append({"round": r, "generation": g, "dropped": str(e)[-200:]})
        finally:
            stop.set()
            collectives.bury(pg, store)
            g += 1
    with open(out, "w") as f:
        json.dump({"rounds": res, "forged": forgeries.counts()}, f)
# Ended as a worker ends (runtime/exiting.py: os._exit once the script is done), not by the
# interpreter's teardown: with the dropped groups still held by their daemon threads
# (collectives.bury), that teardown once aborted the process after every round had passed
# (a gloo timeout thrown while it tore down: SIGABRT, exit -6).
sys.stderr.flush()
os._exit(0)
"""

# What a hijacked pair carries at most: one handshake message (the group id sealed for
# one pair, useless anywhere else), never a tensor of the group's collectives.
HANDSHAKE_BYTES = 5 + 64 + 1 + 32


def test_a_new_gloo_group_is_not_hijacked_by_another_account_racing_its_listener(tmp_path):
    """As another account, watch for the listener of each new gloo group (a resize forms
    one) and connect to it first, naming pair sequence numbers 0..3. gloo gives it the
    pair (its limitation), so the runtime checks every pair right after the group forms
    (collectives.verify_pairs, signed with the job's secret): what must hold is that a
    hijacked group is detected there (counted) and dropped before any collective uses it,
    the ranks form the next generation on fresh listeners (raced again), every round ends
    with an all-reduce of the honest sum, no rank ever completes one with another value,
    and the attacker receives no tensor (at most a handshake message)."""
    reason = attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    import random

    from eltctl_runtime.store import auth

    address = f"127.{random.randint(20, 63)}.{random.randint(0, 255)}.1"  # its own, below test beds' 127.64+
    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS)
    os.chmod(tmp_path, 0o700)
    secret_file = tmp_path / "secret"
    auth.write_secret(secret_file, auth.new_secret())
    rounds = 5  # which rank of a pair waits (listens) follows the ports: about half the groups are open to it
    race = attacker.ListenerRace(address, seconds=150).start()
    time.sleep(0.5)  # the attacker is watching
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), address, str(tmp_path / "store"), str(outs[r]),
                               str(rounds), "0.3", str(secret_file), "3"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"rank{r}.err", "w"), start_new_session=True)
             for r in range(2)]
    try:
        codes = [p.wait(timeout=170) for p in ranks]
        seen = race.result(now=True)
    finally:
        race.stop()
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads(o.read_text()) if o.exists() else {"rounds": [], "forged": {}} for o in outs]
    stolen = [m for m in seen["received"] if m["opcode"] in (0, 1)]  # data, not the notifications
    for r, res in enumerate(results):
        print(f"rank {r}: forged {res['forged']}:", json.dumps(res["rounds"]))
    dropped = sorted({x["generation"] for res in results for x in res["rounds"] if "dropped" in x})
    print(f"as {attacker.ATTACKER}: {seen['listeners']} listeners raced, {len(seen['received'])} messages "
          f"received, with data: {json.dumps(stolen[:6])}; generations dropped by the handshake: {dropped}")
    assert codes == [0, 0], [(tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    for r, res in enumerate(results):
        done = [x for x in res["rounds"] if "honest" in x]
        assert [x["round"] for x in done] == list(range(rounds)), res  # every round trained, once
        assert all(x["honest"] for x in done), f"rank {r} completed an all-reduce with a dishonest sum: {done}"
    assert all(m["length"] <= HANDSHAKE_BYTES for m in stolen), f"another account received a tensor: {stolen[:4]}"
    if stolen:  # it held a pair: that group was dropped, and the handshake counted it
        assert dropped, "the attacker held a pair but no generation was dropped"
    counted = sum(n for res in results for fam, n in res["forged"].items() if fam.startswith("gen/pair"))
    assert counted >= (1 if dropped else 0), [res["forged"] for res in results]
    # each failed handshake is reported (issue 49): the pair, this rank's address, who is
    # connected to its listener and how many failed in a row (the back-off from the second)
    reports = [line for r in range(2) for line in (tmp_path / f"rank{r}.err").read_text().splitlines()
               if "failed in a row" in line]
    print("the ranks' reports:", *reports[:6], sep="\n  ")
    if dropped:
        assert reports and all(f"listening on {address}" in line for line in reports), reports
        assert any("another account" in line for line in reports), reports  # it names the racer's account
