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
and the waiting rank sent the attacker its tensor. That is gloo's (torch 2.13's), not
eltctl's, so the test is an xfail that says so.
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


ROUNDS = r'''
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

rank, addr, storefile, out, rounds, skew = (int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                            int(sys.argv[5]), float(sys.argv[6]))
base = dist.FileStore(storefile, 2)
res = []
for r in range(rounds):
    store = dist.PrefixStore(f"round{r}", base)
    store.add("arrived", 1)  # both ranks start the round together ...
    while int(store.add("arrived", 0)) < 2:
        time.sleep(0.005)
    if rank == 1:
        time.sleep(skew)  # ... and rank 1 forms the group a moment later, as on another host
    opts = dist.ProcessGroupGloo._Options()  # as eltctl_runtime.collectives.make_group does
    opts._timeout = timedelta(seconds=2)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    try:
        pg = dist.ProcessGroupGloo(store, rank, 2, opts)
        t = torch.full((1024,), float(rank + 1 + 10 * r))
        pg.allreduce([t]).wait()
        honest = float(1 + 2 + 20 * r)
        res.append({"round": r, "honest": bool((t == honest).all()), "got": t[0].item()})
    except Exception as e:  # noqa: BLE001
        res.append({"round": r, "error": str(e)[-160:]})
    pg = None
    with open(out, "w") as f:
        json.dump(res, f)
'''


@pytest.mark.xfail(strict=False, reason=(
    "torch 2.13's gloo TCP transport (third_party/gloo/gloo/transport/tcp/listener.cc) hands an incoming "
    "connection to whichever pair waits for the sequence number it names, with no authentication, and the "
    "numbers are small and predictable (0, 1, ... per device): another account on the host that connects "
    "to a new group's listener first takes that pair (the rank sends it its tensors, the collective times "
    "out). A limitation of gloo, not fixable in eltctl short of an authenticated transport or a network "
    "namespace per job; docs should name it as what the data plane exposes."))
def test_a_new_gloo_group_is_not_hijacked_by_another_account_racing_its_listener(tmp_path):
    """As another account, watch for the listener of each new gloo group (a resize forms
    one) and connect to it first, naming pair sequence numbers 0..3; what must hold: every
    round's group forms, all-reduces the honest sum, and the attacker receives nothing."""
    reason = attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    import random

    address = f"127.{random.randint(20, 250)}.{random.randint(0, 255)}.1"  # this test's own: only its ranks listen there
    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS)
    os.chmod(tmp_path, 0o700)
    rounds = 5  # which rank of a pair waits (listens) follows the ports: about half the rounds are open to it
    race = attacker.ListenerRace(address, seconds=60).start()
    time.sleep(0.5)  # the attacker is watching
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), address, str(tmp_path / "store"), str(outs[r]),
                               str(rounds), "0.3"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"rank{r}.err", "w"), start_new_session=True)
             for r in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in ranks]
        seen = race.result(now=True)
    finally:
        race.stop()
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads(o.read_text()) if o.exists() else [] for o in outs]
    stolen = [m for m in seen["received"] if m["opcode"] in (0, 1)]  # data, not the notifications
    for r, rows in enumerate(results):
        print(f"rank {r}:", json.dumps(rows))
    print(f"as {attacker.ATTACKER}: {seen['listeners']} listeners raced, {len(seen['received'])} messages "
          f"received, with data: {json.dumps(stolen[:6])}")
    assert codes == [0, 0], [(tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    assert all(len(r) == rounds for r in results), results
    assert not stolen, f"another account received the ranks' tensors: {stolen[:4]}"
    failed = [x for r in results for x in r if not x.get("honest")]
    assert not failed, f"rounds that failed or returned a dishonest sum: {failed}"
