"""The store keeper dies mid-training, end to end on real sshd hosts.

Plan: two simulated GPU hosts (1 GPU each: two CPU workers) with a checkpoint
mirror train at world size 2. The controller is stopped (SIGSTOP) so that nothing
restarts the keeper at once, and the keeper is SIGKILLed: the workers train on
with no store (rank 0's checkpoints keep coming at higher steps). The controller
goes on (SIGCONT): it starts a new keeper at the SAME address (controller.json names
its pid, status.json counts one restart, a `store` event says so), no host is
benched, and training shows again in status.json. Then another user's process
takes h2's GPU: h2's worker leaves in the planned way (no crash, nobody lost);
it ends and h2's worker rejoins. `down` ends with the final checkpoint mirrored
and verified, and no process of the job left.

In the direct mode, a port another process took while the keeper was away moves the
store to a new port, and the daemons and workers already running follow it there
(the address file beside the run id, read at their reconnect).
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.testbed.jobenv import job_env_on, wait_for, worker_pids
from tests.testbed.squatter import PortSquatter

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(400)]


def _keeper(je) -> dict:
    return json.loads((je.state_dir / "controller.json").read_text()).get("store") or {}


def _newest_checkpoint(je) -> int:
    """The highest committed checkpoint step on any host (read from the hosts' disks)."""
    steps = [int(m.group(1)) for p in je.bed.dir.glob(f"*/home/.eltctl/jobs/{je.job}/**/step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name))]
    return max(steps, default=0)


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def test_a_killed_keeper_is_restarted_on_its_port_and_the_job_trains_through(testbed, tmp_path):
    hosts = testbed.add_hosts(2, gpus=1)
    mirror = tmp_path / "mirror"
    gen = job_env_on(testbed, hosts, extra=f'\n[storage]\nmirror = "{mirror}"\n')
    je = next(gen)
    ctl = None
    try:
        je.eltctl("up")
        st = je.training_at(2)
        before = _keeper(je)
        ctl = je.controller_pid()

        # 1. The keeper dies while nothing can restart it: training goes on without a store.
        os.kill(ctl, signal.SIGSTOP)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: _dead(before["pid"]), 30, "the keeper to die")
        ckpt = _newest_checkpoint(je)
        wait_for(lambda: _newest_checkpoint(je) >= ckpt + 50, 90,
                 "rank 0 to commit 50 more steps with the keeper dead", interval=0.2)
        assert worker_pids(je.job).keys() == {w for w in st["members"]}

        # 2. The controller restarts the keeper on the same address and port.
        os.kill(ctl, signal.SIGCONT)
        ctl_running = ctl
        ctl = None
        after = wait_for(lambda: (k := _keeper(je)).get("pid") not in (None, before["pid"]) and k, 60,
                         "a new keeper in controller.json")
        assert (after["address"], after["port"], after["socket"]) == (before["address"], before["port"],
                                                                     before["socket"])
        st = je.training_at(2, after_step=st["step"], timeout=90)
        assert (st.get("keeper") or {}).get("restarts") == 1, st.get("keeper")
        assert je.controller_pid() == ctl_running
        stored = wait_for(lambda: [e for e in je.status().get("events") or () if e["kind"] == "store"], 30,
                          "the controller's store event")
        assert "restarted" in stored[0]["detail"]
        assert not [h for h in st["hosts"] if h.get("benched_until")], st["hosts"]

        # 3. A planned leave after the restart (another user takes h2's GPU), then a rejoin.
        h2 = je.bed.host("h2")
        victim = next(w for w in worker_pids(je.job) if w.startswith("h2/"))
        owner = h2.start_foreign_process(0, memory_mib=8000, utilization=90)
        st = je.training_at(1, after_step=st["step"], timeout=90)
        events = je.status()["events"]
        leaves = [e for e in events if e["kind"] == "leave" and victim in (e.get("left") or [])]
        assert leaves and not leaves[-1].get("lost"), events
        assert not [e for e in events if e["kind"] in ("crash", "hang", "bench")], \
            f"{json.dumps(events, indent=1)}\n{je.host_logs(60)}\n{je.controller_log(60)}"
        h2.stop_foreign_process(owner)
        st = je.training_at(2, after_step=st["step"], timeout=120)

        # 4. `down`: the final checkpoint is taken and mirrored; nothing is left.
        out = je.eltctl("down", timeout=300).stdout
        assert re.search(r"final checkpoint step \d+ mirrored and verified", out), out
        assert "no process of job" in out, out
        final = json.loads((je.state_dir / "status.json").read_text())
        assert final["mirror"]["ok"] and final["mirror"]["step"] == final["step"] >= st["step"], final["mirror"]
        assert not worker_pids(je.job)
    finally:
        if ctl is not None:
            os.kill(ctl, signal.SIGCONT)
        next(gen, None)


def test_keeper_and_controller_both_killed_the_next_up_serves_the_old_port(testbed):
    """Plan: one host (2 GPUs) trains at 2; the controller and the keeper are SIGKILLed
    together; the workers train on. `eltctl up` starts a controller whose keeper takes
    the old port (the daemon and the workers know only that one): the same workers
    train on at 2, with no crash; `down` leaves nothing."""
    gen = job_env_on(testbed, testbed.add_hosts(1, gpus=2))
    je = next(gen)
    try:
        je.eltctl("up")
        st = je.training_at(2)
        before = _keeper(je)
        workers = worker_pids(je.job)
        ctl = je.controller_pid()
        os.kill(ctl, signal.SIGKILL)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: _dead(ctl) and _dead(before["pid"]), 30, "the controller and the keeper to die")
        ckpt = _newest_checkpoint(je)
        wait_for(lambda: _newest_checkpoint(je) >= ckpt + 25, 90, "steps with neither running", interval=0.2)

        je.eltctl("up")
        after = wait_for(lambda: (k := _keeper(je)).get("pid") not in (None, before["pid"]) and k, 60,
                         "a new keeper in controller.json")
        assert (after["address"], after["port"], after["socket"]) == (before["address"], before["port"],
                                                                     before["socket"])
        st = je.training_at(2, after_step=st["step"], timeout=90)
        assert worker_pids(je.job) == workers  # the same workers rode through
        events = je.status().get("events") or []
        assert not [e for e in events if e["kind"] in ("crash", "hang", "bench")], \
            f"{json.dumps(events, indent=1)}\n{je.host_logs(40)}\n{je.controller_log(40)}"
        out = je.eltctl("down", timeout=300).stdout
        assert "no process of job" in out, out
    finally:
        next(gen, None)


def test_a_direct_mode_keeper_whose_port_was_taken_moves_and_the_running_hosts_follow(testbed):
    """Plan (issue 49): two hosts (1 GPU each) train at 2 with `store = "direct"`. With
    the controller stopped, the keeper is SIGKILLed and another process takes its port
    (it accepts connections and hangs up: no store). The controller goes on: the new
    keeper serves on a new port and writes it beside the run id on each host; the
    daemons and workers already running (they know only the old port) reconnect there,
    and the same workers train on at 2, their steps seen again through the new store."""
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts, extra='\n[controller]\nstore = "direct"\n')
    je = next(gen)
    ctl = None
    squatter = None
    try:
        je.eltctl("up")
        st = je.training_at(2)
        before = _keeper(je)
        workers = worker_pids(je.job)
        ctl = je.controller_pid()

        os.kill(ctl, signal.SIGSTOP)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: _dead(before["pid"]), 30, "the keeper to die")
        # another program on the old port: it speaks no store protocol
        squatter = PortSquatter(before["address"], before["port"])
        # the dead keeper's closing connections hold the port a moment (FIN-WAIT)
        wait_for(squatter.try_bind, 60, "the keeper's port to be free for another process", interval=0.1)
        squatter.start()
        # steps past any the stopped controller saw (checkpoints every 25): a status past this
        # one can only come through the new store, from workers that found it
        ckpt = _newest_checkpoint(je)
        past = wait_for(lambda: (c := _newest_checkpoint(je)) >= ckpt + 75 and c, 90,
                        "rank 0 to commit 75 more steps with the keeper dead", interval=0.2)
        os.kill(ctl, signal.SIGCONT)
        ctl = None
        after = wait_for(lambda: (k := _keeper(je)).get("pid") not in (None, before["pid"]) and k, 60,
                         "a new keeper in controller.json")
        assert after["address"] == before["address"] and after["port"] != before["port"], (before, after)
        endpoint = f"tcp:{after['address']}:{after['port']}"
        for h in hosts:
            address = h.home / ".eltctl" / "jobs" / je.job / h.name / "store.address"
            wait_for(lambda: address.exists() and address.read_text().strip() == endpoint, 60,
                     f"{h.name}'s store address")
        st = je.training_at(2, after_step=past, timeout=120)
        assert worker_pids(je.job) == workers  # the same workers: none restarted to learn the port
        events = je.status().get("events") or []
        assert not [e for e in events if e["kind"] in ("crash", "hang", "bench")], \
            f"{json.dumps(events, indent=1)}\n{je.host_logs(40)}\n{je.controller_log(40)}"
    finally:
        if ctl is not None:
            os.kill(ctl, signal.SIGCONT)
        if squatter is not None:
            squatter.close()
        next(gen, None)
