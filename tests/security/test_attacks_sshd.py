"""Another unix account against a training job on the real-sshd test bed (issue 21).

One job trains on two simulated hosts (one GPU each: world size 2) with a checkpoint
mirror, for the whole module; h2's sshd has `GatewayPorts yes` (a remote TCP forward
there listens on every interface); every test attacks it as `nobody` (tests/testbed/
attacker.py) and checks what must hold. The job's processes are found from /proc: the
controller and the store keeper (controller.json), every process whose environment
names the job (the daemons, the workers), and the hosts' SSH connections (their sshd
processes hold the remote forwards). Their sockets: every TCP listener and every named
Unix listener they hold (/proc/net/{tcp,tcp6,unix}, joined through /proc/<pid>/fd). The
test bed's own private directories are made traversable (0711), so only the job's
directories and sockets can keep the other account out; the first test says which one does.

- `test_no_socket_of_the_control_plane_is_reachable_by_another_account`: as `nobody`, on
  the control machine and on a host (connections from h1's address): no TCP listener
  belongs to the control plane (the controller, the keeper, the daemons, the hosts' SSH
  connections: the store and its forwards), and every Unix listener of the job refuses
  the other account (EACCES or ENOENT; an abstract socket has no permissions: it fails).
  The workers' TCP listeners are gloo's (the data plane): expected, printed, attacked
  by the next test.
- `test_one_byte_silence_and_floods_on_every_socket_do_not_stop_training`: against
  every socket at once, for 15 s: one byte then silence, a silent connection, 64 MiB of
  garbage, a 64 MiB store value. Training goes on: the workers commit steps during the
  attack at world size 2, status.json follows, and every rank's fingerprint (of
  parameters and optimizer state, logged every 5 steps by the job's script) is
  identical at every step.
- `test_down_mirrors_a_verified_final_checkpoint`: `down` mirrors the final
  checkpoint, verified and signed, and the ranks ended with identical state.

`pytest -s` prints what the other account could do on each socket.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.testbed import attacker, make_testbed, sshd_missing_reason
from tests.testbed.jobenv import job_env_on, wait_for

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]

HOLD = 15  # seconds every attack connection is held open
FP_EVERY = 5

# The job's script: the example (examples/train.py, kept as example_train.py), with each
# rank's committed step, generation, world size and fingerprint appended every FP_EVERY
# steps to FPDIR/<worker id>; not by a joiner still catching up (runtime/train/catchup.py:
# it commits steps with an empty share before its state arrives, so it holds none yet).
WRAPPER = '''\
import os, runpy, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eltctl_runtime as elt

FPDIR = {fpdir!r}
_step = elt.ElasticJob.step


def step(self, *args, **kwargs):
    loss = _step(self, *args, **kwargs)
    c = self.last_commit
    if loss is not None and c is not None and c.step % {every} == 0 and self._agreement.has_state:
        name = os.path.join(FPDIR, self.config.worker_id.replace("/", "_"))
        with open(name, "a") as f:
            f.write(f"{{c.step}} {{c.generation}} {{c.world_size}} {{time.time():.3f}} {{self.fingerprint()}}\\n")
    return loss


elt.ElasticJob.step = step
sys.argv[0] = str(Path(__file__).with_name("example_train.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
'''


class Attacked:
    def __init__(self, je, mirror: Path, fpdir: Path) -> None:
        self.je = je
        self.mirror = mirror
        self.fpdir = fpdir

    def fingerprints(self) -> dict[str, list[tuple[int, int, int, float, str]]]:
        """worker -> [(step, generation, world size, time, fingerprint)] as logged."""
        out = {}
        for f in sorted(self.fpdir.iterdir()):
            rows = []
            for line in f.read_text().splitlines():
                p = line.split()
                if len(p) == 5:
                    rows.append((int(p[0]), int(p[1]), int(p[2]), float(p[3]), p[4]))
            out[f.name] = rows
        return out

    def assert_identical_fingerprints(self) -> int:
        """Every step logged by more than one rank has one fingerprint; returns how many steps were compared."""
        by_step: dict[int, dict[str, str]] = {}
        for worker, rows in self.fingerprints().items():
            for step, _gen, _ws, _t, fp in rows:
                by_step.setdefault(step, {})[worker] = fp
        shared = {s: fps for s, fps in by_step.items() if len(fps) > 1}
        differ = {s: fps for s, fps in shared.items() if len(set(fps.values())) > 1}
        assert not differ, f"the ranks' states differ at steps {sorted(differ)[:10]}: {list(differ.items())[:3]}"
        return len(shared)

    def sockets(self) -> list[attacker.Socket]:
        return attacker.listening_sockets(attacker.job_processes(self.je))


@pytest.fixture(scope="module")
def attacked():
    reason = sshd_missing_reason() or attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    with make_testbed() as bed:
        hosts = bed.add_hosts(2, gpus=1)
        # h2's sshd lets remote forwards listen on every interface (finding 7): what the
        # job forwards there must still be out of the LAN's and other accounts' reach
        hosts[1].set_sshd_option("GatewayPorts", "yes")
        mirror = Path(tempfile.mkdtemp(prefix="eltc-mirror-"))
        gen = job_env_on(bed, hosts, extra=f'\n[storage]\nmirror = "{mirror}"\n')
        je = next(gen)
        try:
            # Only the job's own directories may keep the other account out: the test
            # bed's (private temporary directories) are made traversable, as a home
            # directory and /tmp are on a lab machine.
            for d in [bed.dir, *(p for h in hosts for p in (h.dir, h.home)), je.workdir.parent,
                      je.state_home]:
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o711)
            fpdir = je.workdir.parent / "fp"
            fpdir.mkdir()
            # a busy machine must not make a worker look hung: a resize would blur what the attack did
            je.inventory.write_text(je.inventory.read_text().replace('hang_timeout = "4s"', 'hang_timeout = "30s"'))
            (je.workdir / "train.py").rename(je.workdir / "example_train.py")
            (je.workdir / "train.py").write_text(WRAPPER.format(fpdir=str(fpdir), every=FP_EVERY))
            je.eltctl("up")
            je.training_at(2)
            yield Attacked(je, mirror, fpdir)
        finally:
            next(gen, None)
            shutil.rmtree(mirror, ignore_errors=True)


REFUSED = {"EACCES", "ENOENT", "EPERM"}


def test_no_socket_of_the_control_plane_is_reachable_by_another_account(attacked):
    je = attacked.je
    processes = attacker.job_processes(je)
    roles = sorted(processes.values())
    assert roles.count("worker") == 2 and "controller" in roles, roles
    sockets = attacked.sockets()
    control_tcp = [s for s in sockets if s.kind == "tcp" and s.role != "worker"]
    data_tcp = [s for s in sockets if s.kind == "tcp" and s.role == "worker"]
    unix = [s for s in sockets if s.kind == "unix"]
    h1 = je.hosts[0]
    seen = {"control machine": attacker.probe(control_tcp + unix),
            f"host {h1.name} ({h1.address})": attacker.probe(control_tcp + unix, source=h1.address)}
    print("the job's processes:", json.dumps({str(p): r for p, r in sorted(processes.items())}))
    print("gloo's listeners (the data plane; attacked by the next test):", [s.key for s in data_tcp])
    for where, found in seen.items():
        print(f"as {attacker.ATTACKER} on the {where}:")
        for s in control_tcp + unix:
            print(f"  {s.key} ({s.role} {s.pid}): {json.dumps(found[s.key])}")

    problems = []
    bed_dirs = {str(d) for d in [je.bed.dir, *(p for h in je.hosts for p in (h.dir, h.home)), je.workdir.parent,
                                 je.state_home]}
    for s in unix:
        guard = attacker.refusing_directory(s.address)
        print(f"  {s.key}: the first directory refusing {attacker.ATTACKER}: {guard}")
        if guard is not None and any(b == guard or b.startswith(guard.rstrip("/") + "/") for b in bed_dirs):
            problems.append(f"{s.key}: the test bed's directory {guard}, not the job's own, keeps "
                            f"{attacker.ATTACKER} out (the test proves nothing about it)")
    for where, found in seen.items():
        for s in control_tcp:
            wide = " on every interface (the LAN reaches it)" if s.address in ("0.0.0.0", "::") else ""
            problems.append(f"{where}: {s.key} of the {s.role} (pid {s.pid}) is a TCP listener of the control "
                            f"plane{wide}; {attacker.ATTACKER}: {found[s.key]}")
        for s in unix:
            got = found[s.key].get("connect")
            if got not in REFUSED:
                problems.append(f"{where}: {s.key} of the {s.role} (pid {s.pid}) lets {attacker.ATTACKER} in "
                                f"(connect: {got}; {found[s.key]})")
    assert not problems, "another account reaches the job's control plane:\n" + "\n".join(problems)


def test_one_byte_silence_and_floods_on_every_socket_do_not_stop_training(attacked):
    je = attacked.je
    before = je.training_at(2)
    sockets = attacked.sockets()
    assert sockets, "no socket of the job found: nothing to attack"
    start = time.time()
    wedge = attacker.Wedge(sockets, hold=HOLD, source=je.hosts[1].address).start()
    samples = []
    try:
        while time.time() < start + HOLD:
            st = je.status()
            samples.append((time.time(), st.get("state"), st.get("world_size"), st.get("step") or 0))
            time.sleep(0.5)
        found = wedge.result()
    finally:
        wedge.stop()
    end = time.time()
    fps = attacked.fingerprints()
    during = {w: [r for r in rows if start + 1 <= r[3] <= end] for w, rows in fps.items()}
    print(f"as {attacker.ATTACKER} from {je.hosts[1].address}, against every socket for {HOLD} s:")
    for s in sockets:
        print(f"  {s.key} ({s.role} {s.pid}): {json.dumps(found.get(s.key))}")
    print("  status.json during it (s, state, world size, step):",
          [(round(t - start, 1), state, ws, step) for t, state, ws, step in samples])
    print("  steps the workers committed during it (fingerprint log):",
          {w: [r[0] for r in rows] for w, rows in during.items()})
    assert set(found) == {s.key for s in sockets}, found  # every socket was tried

    problems = []
    for w, rows in during.items():
        steps = [r[0] for r in rows]
        if len(steps) < 2:
            problems.append(f"{w} committed {FP_EVERY * max(0, len(steps))} steps or fewer in the {HOLD} s "
                            f"of the attack (logged: {steps})")
        wrong = [r for r in rows if r[2] != 2]
        if wrong:
            problems.append(f"{w} trained at another world size during the attack: {wrong[:3]}")
    statuses = [s for s in samples if s[0] >= start + 2]
    if statuses and statuses[-1][3] <= statuses[0][3]:
        problems.append(f"status.json showed no progress during the attack: step {statuses[0][3]} at "
                        f"{statuses[0][0] - start:.1f} s, {statuses[-1][3]} at {statuses[-1][0] - start:.1f} s")
    off = [s for s in statuses if s[2] != 2]
    if off:
        problems.append(f"status.json showed world size other than 2: {off[:3]}")
    assert not problems, (f"the attack stopped training (step {before['step']} when it began):\n"
                          + "\n".join(problems) + f"\nas {attacker.ATTACKER}: {json.dumps(found)}"
                          + f"\ncontroller.log:\n{je.controller_log()}")

    # training goes on after it, and every rank held the same state at every step
    je.training_at(2, after_step=max(s[3] for s in samples) + FP_EVERY * 2)
    assert attacked.assert_identical_fingerprints() > 0, fps


def test_down_mirrors_a_verified_final_checkpoint(attacked):
    je = attacked.je
    je.training_at(2)
    down = je.eltctl("down", timeout=240)
    assert "mirrored and verified" in down.stdout, down.stdout
    final = json.loads((je.state_dir / "status.json").read_text())["mirror"]["step"]
    assert final is not None
    assert (attacked.mirror / je.job / f"step-{final:08d}" / "manifest.mac").is_file()
    wait_for(lambda: attacked.assert_identical_fingerprints() > 0, 10, "fingerprints to compare")
