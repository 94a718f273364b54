"""Another unix account against a restart-mode job (issue 21, finding 8).

Plan: examples/ddp_restart.py (an unmodified torchrun script: env:// rendezvous) under
`mode = "restart"` on two simulated hosts (one GPU each: world size 2). Once it trains,
every TCP listener of the job's processes is found from /proc (tests/testbed/attacker.py)
and, as `nobody`, probed: connect, write a c10d store key.

What must hold: no process of the job listens on a wildcard address (0.0.0.0 or ::: the
LAN would reach it), and the script's rendezvous store (MASTER_ADDR:MASTER_PORT, as each
supervisor's log gives it for the script it started) is held by a process of the job bound
to MASTER_ADDR alone. The script's store itself is the data plane's (torchrun's,
unauthenticated, reachable on the peers' address): what `nobody` can do there is printed,
not asserted.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.testbed import attacker
from tests.testbed.jobenv import POLICY, REPO, job_env_on, wait_for
from tests.testbed.scriptlog import ScriptLog

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(400)]

WILDCARD = ("0.0.0.0", "::")
# the supervisor's line for each script it starts (runtime/restart.py)
STARTED = re.compile(r"started the script \(pid (\d+), (?:warm|cold)\).*its store \(MASTER_ADDR:MASTER_PORT\) (\S+):(\d+)$",
                     re.M)


def scripts_stores(bed_dir, job: str, processes: dict[int, str]) -> set[tuple[str, str]]:
    """MASTER_ADDR:MASTER_PORT of each running script, from the supervisors' logs (a warm
    interpreter takes the script's environment after its start, so /proc/<pid>/environ
    holds it only for a script started cold): the newest start of each worker log, if that
    script still runs."""
    out = set()
    for f in sorted(Path(bed_dir).glob(f"*/home/.eltctl/jobs/{job}/*/workers/*.log")):
        try:
            starts = STARTED.findall(f.read_text(errors="replace"))
        except OSError:
            continue
        if starts and int(starts[-1][0]) in processes:
            out.add((starts[-1][1], starts[-1][2]))
    return out


def test_restart_mode_listens_on_no_wildcard_address_and_holds_the_scripts_store(testbed):
    reason = attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts)
    je = next(gen)
    try:
        shutil.copy(REPO / "examples" / "ddp_restart.py", je.workdir / "ddp_restart.py")
        # a busy machine must not make the scripts look hung (each restart frees and takes the port anew)
        policy = POLICY.replace('hang_timeout = "4s"', 'hang_timeout = "30s"')
        testbed.write_inventory(je.inventory, hosts=hosts, extra=policy, job={
            "name": je.job, "workdir": str(je.workdir), "device": "cpu", "min_workers": 1, "mode": "restart",
            "command": ["python", "ddp_restart.py", "--steps", "1000000", "--save-every", "10", "--step-sleep",
                        "0.1", "--samples", "512", "--batch", "8", "--hidden", "16",
                        "--checkpoint-dir", "{checkpoint_dir}"],
            "env": {"OMP_NUM_THREADS": "1"}})
        je.eltctl("up")
        ScriptLog(testbed.dir, je.job).at(2, after_restart=-1, steps=3)

        def snapshot():
            processes = attacker.job_processes(je)
            sockets = [s for s in attacker.listening_sockets(processes) if s.kind == "tcp"]
            masters = scripts_stores(testbed.dir, je.job, processes)
            return processes, sockets, masters

        def settled():  # the scripts run (a busy machine may restart them: wait for one generation)
            got = snapshot()
            ports = {str(s.port) for s in got[1]}
            return got if len(got[2]) == 1 and next(iter(got[2]))[1] in ports else None

        try:
            processes, sockets, masters = wait_for(settled, 120, "the scripts of one generation and their store")
        except AssertionError:
            processes, sockets, masters = snapshot()  # what is there: the assertions below say what is wrong
        found = attacker.probe(sockets)
        print("the job's processes:", json.dumps({str(p): r for p, r in sorted(processes.items())}))
        print("the scripts' MASTER_ADDR:MASTER_PORT:", sorted(masters))
        print(f"as {attacker.ATTACKER} on the control machine:")
        for s in sockets:
            print(f"  {s.key} ({s.role} {s.pid}): {json.dumps(found[s.key])}")

        problems = []
        for s in sockets:
            if s.address in WILDCARD:
                problems.append(f"{s.key} of the {s.role} (pid {s.pid}) listens on every interface; "
                                f"{attacker.ATTACKER}: {found[s.key]}")
        assert len(masters) == 1, (f"one MASTER_ADDR:MASTER_PORT expected: {masters}; processes: {processes}\n"
                                   f"{je.controller_log()}\n{je.host_logs()}")
        addr, port = next(iter(masters))
        holders = [s for s in sockets if s.port == int(port)]
        if not holders:
            problems.append(f"nothing of the job listens on MASTER_PORT {port}: another account may take it first")
        for s in holders:
            if s.address != addr:
                problems.append(f"the scripts' store {addr}:{port} is served on {s.key} by the {s.role} "
                                f"(pid {s.pid}), wider than MASTER_ADDR")
        assert not problems, "restart mode exposes more than the peers need:\n" + "\n".join(problems)
    finally:
        next(gen, None)
