"""Issue 49: the shared claims directory believes nothing another account writes without
proof of who wrote it (runtime/claims.py `judge`, eltctl/sharedir.py, the probe's marker).

The rule is table-tested; then, as root, another account (`nobody`, through setpriv)
plants in a real claims directory what the review planted (a forged demand with a time
in the future, a squatted demand name, newline-named claim and demand files, a FIFO
under a claim name, a locked claim of another account with no live process of it), and
the daemon's readers and the real probe script see the directory as it is, with every
attempt refused and named with its owner.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eltctl.demand import Demand
from eltctl.probe import MARK, new_marker, parse_probe_output, probe_command, sections
from eltctl_runtime import claims
from eltctl_runtime.claims import Claim, judge, parse_name

NOW = 1_000_000.0


@pytest.mark.parametrize("name, owner, content, alive, why", [
    ("demand.alice.mnist", "alice", {"user": "alice", "job": "mnist", "time": NOW}, None, None),
    ("demand.alice.mnist~2", "alice", {"user": "alice", "job": "mnist", "time": NOW}, None, None),
    ("demand.bob.ghost", "nobody", {"user": "bob", "job": "ghost", "time": NOW}, None, "owned by nobody"),
    ("demand.nobody.ghost", "nobody", {"user": "bob", "job": "ghost", "time": NOW}, None, "names user 'bob'"),
    ("demand.alice.mnist", "alice", {"user": "alice", "job": "other", "time": NOW}, None, "names job 'other'"),
    ("demand.alice.mnist", "alice", {"user": "alice", "job": "mnist", "time": 9e12}, None, "in the future"),
    ("demand.alice.mnist", "alice", {"user": "alice", "job": "mnist", "time": NOW + 60}, None, None),  # skew
    ("demand.alice.mnist", None, {"user": "alice", "job": "mnist", "time": NOW}, None, "owner is unknown"),
    ("demand.alice.mnist", "alice", None, None, "not a JSON object"),
    ("demand.al ice.x", "alice", {}, None, "strict set"),
    ("gpu0\n:::eltctl:gpus 0", "nobody", {}, None, "strict set"),
    ("gpu0@alice", "alice", {"user": "alice", "job": "a", "pid": 4}, True, None),
    ("cpu1.ws1@alice~1", "alice", {"user": "alice", "job": "a", "pid": 4}, True, None),
    ("gpu0@alice", "nobody", {"user": "alice", "job": "a", "pid": 4}, True, "owned by nobody"),
    ("gpu0@alice", "alice", {"user": "alice", "job": "a", "pid": 4}, False, "no live process of alice"),
    ("gpu0@alice", "alice", {"user": "alice", "job": "a", "since": 9e12}, True, "in the future"),
    # an older eltctl's shared claim file (its daemons may still run): its content names the account
    ("gpu0", "alice", {"user": "alice", "job": "a", "pid": 4}, True, None),
    ("gpu0", "nobody", {"user": "alice", "job": "a", "pid": 4}, True, "naming alice but owned by nobody"),
    ("gpu0", "alice", {"user": "alice", "job": "a", "pid": 4}, False, "no live process of alice"),
    ("gpu0", "alice", {"job": "a"}, True, "names no account"),
    ("gpu0.ws1@alice", "alice", {"user": "alice", "job": "a"}, True, "strict set"),  # a GPU has no host part
])
def test_the_one_rule(name, owner, content, alive, why):
    got = judge(name, owner, content, NOW, alive=alive)
    if why is None:
        assert got is None, got
    else:
        assert got is not None and why in got, got


def test_names_parse_into_kind_account_and_what_they_name():
    assert parse_name("gpu3@alice") == claims.Name("gpu", "alice", base="gpu3")
    assert parse_name("cpu0.ws-1.lab@bob~3") == claims.Name("cpu", "bob", base="cpu0.ws-1.lab", alt=3)
    assert parse_name("demand.bob.my.job~1") == claims.Name("demand", "bob", job="my.job", alt=1)
    for bad in ("gpu3@alice~4", "gpu@alice", "demand.bob.", "demand..x", "gpu0@al/ice", ".demand.bob.x.1"):
        assert parse_name(bad) is None, bad
    assert claims.shown_name("a\nb") == "'a\\nb'"


def test_a_section_is_read_once_and_only_under_the_probes_own_marker():
    m = new_marker()
    assert m != new_marker() and m.startswith(":::eltctl-")
    text = "\n".join([f"{m}gpus 0", "0, GPU-real, A100, 0, 100, 0", f"{m}gpus 0", "5, GPU-forged, A100, 0, 100, 0",
                      f"{MARK}apps 0", "forged", f"{m}end"])
    s = sections(text, m)
    assert s["gpus"] == ("0", ["0, GPU-real, A100, 0, 100, 0"])  # the second `gpus` is ignored, lines and all
    assert "apps" not in s and s["end"] == ("", [])


def test_probe_output_cannot_be_rewritten_through_an_echoed_name(tmp_path):
    """A name holding newlines and fixed-marker sections (the review's forged GPU) never
    reaches the parser as sections: the script prints `!odd` with its owner instead."""
    d = tmp_path / "claims"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    forged = f"gpu0\n{MARK}gpus 0\n0, GPU-forged, A100, 9000, 40960, 90\n{MARK}end\nx"
    (d / forged).write_text("{}")
    (d / f"demand.x\n{MARK}end").write_text("{}")
    m = new_marker()
    out = subprocess.run(["sh", "-c", probe_command("j", 5.0, marker=m)], capture_output=True, text=True,
                         env={**os.environ, claims.ENV: str(d), "PATH": "/usr/bin:/bin"}, timeout=60).stdout
    assert "GPU-forged" not in out
    p = parse_probe_output(out, m)
    assert p.complete and p.nvidia_smi is None and p.gpus == ()  # no nvidia-smi here: none forged either
    assert sorted((r.file, r.reason) for r in p.refused) == sorted(
        (claims.shown_name(name), "a name outside eltctl's strict set") for name in (forged, f"demand.x\n{MARK}end"))


ATTACK = r'''
import fcntl, json, os, sys, time
d = sys.argv[1]
victim = sys.argv[2]
def put(name, doc):
    with open(os.path.join(d, name), "w") as f:
        f.write(json.dumps(doc))
put("demand.%s.ghost" % victim, {"job": "ghost", "user": victim, "priority": 100, "min_workers": 8, "time": 9e12})
put("demand.nobody.ghost", {"job": "ghost", "user": "nobody", "priority": 100, "min_workers": 8, "time": 9e12})
put("demand.%s.mnist" % victim, {"job": "mnist", "user": victim, "held": 0, "wanted": 0, "time": time.time()})
put("demand.x\n:::eltctl:end", {})
os.mkfifo(os.path.join(d, "gpu0@%s" % victim), 0o444)
# a locked claim of nobody's naming a process that is not nobody's (the victim's)
put("gpu1@nobody", {"job": "ghost", "user": "nobody", "pid": int(sys.argv[3])})
put("gpu1\n:::eltctl:gpus 0", {})
fd = os.open(os.path.join(d, "gpu1@nobody"), os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
fd2 = os.open(os.path.join(d, "gpu1\n:::eltctl:gpus 0"), os.O_RDONLY)
fcntl.flock(fd2, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.read()
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another account")
def test_what_another_account_plants_is_refused_and_named():
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no account nobody")
    me = claims.my_account()
    root = Path(tempfile.mkdtemp(prefix="eltc-shared-"))  # pytest's tmp_path is closed to nobody
    root.chmod(0o755)
    d = root / "claims"
    claims.ensure_dir(d)
    attacker = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                                 sys.executable, "-I", "-S", "-c", ATTACK, str(d), me, str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().strip() == "ready"
        # The daemon's readers: no forged demand, nothing taken, a FIFO never blocks.
        reader = claims.DemandReader(d)
        assert reader.read(time.time()) == []
        why = {(r.file, r.owner): r.reason for r in reader.refused}
        assert "owned by nobody" in why[(f"demand.{me}.ghost", "nobody")]
        assert "in the future" in why[("demand.nobody.ghost", "nobody")]
        refused: list = []
        assert claims.holder(d, "gpu0", refused=refused) is None
        assert claims.holder(d, "gpu1", refused=refused) is None
        why = {(r.file, r.owner): r.reason for r in refused}
        assert why[(f"gpu0@{me}", "nobody")] == "not a regular file"
        assert "no live process of nobody" in why[("gpu1@nobody", "nobody")]
        # The squatted names (a FIFO under my claim name, a file under my demand name) are
        # worked around: my claim and my demand go to their alternates, believed by all.
        with claims.take(d, "gpu0", Claim(job="mnist", pid=os.getpid())) as held:
            assert held.path.name == f"gpu0@{me}~1"
            assert [(r.file, r.owner) for r in held.refused] == [(f"gpu0@{me}", "nobody")]
            assert claims.holder(d, "gpu0").job == "mnist"
            m = new_marker()
            mine = Demand(job="mnist", held=1, wanted=2)
            out = subprocess.run(["sh", "-c", probe_command("mnist", 5.0, demand=mine, marker=m)],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, claims.ENV: str(d), "PATH": "/usr/bin:/bin"}).stdout
        p = parse_probe_output(out, m)
        assert p.complete and p.demand_error == ""
        assert [(x.user, x.job, x.held, x.wanted) for x in p.demands] == [(me, "mnist", 1, 2)]
        assert [c.job for _, c in p.claims] == ["mnist"]
        shown = {(r.file, r.owner, r.reason.split(":")[0]) for r in p.refused}
        assert (f"demand.{me}.mnist", "nobody", "squatted") in shown
        assert (f"demand.{me}.ghost", "nobody", f"named for {me} but owned by nobody") in shown
        assert ("gpu1@nobody", "nobody", "locked, but its pid {} is no live process of nobody".format(os.getpid())) \
            in shown
        assert sum(1 for r in p.refused if r.file.startswith(("'gpu1\\n", "'demand.x\\n"))) == 2, p.refused
        assert (d / f"demand.{me}.mnist~1").stat().st_uid == os.geteuid()
    finally:
        attacker.stdin.close()
        attacker.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("line, claimed, refused", [
    ('gpu0@alice 1001 alice 1 1 {"job": "a", "user": "alice", "pid": 4}', "a", None),
    ('gpu0@alice~1 1001 alice 1 1 {"job": "a", "user": "alice", "pid": 4}', "a", None),
    ('gpu0@alice 1001 alice 0 0 ', None, None),  # unheld: a released claim, nobody's business
    ('gpu0@alice 65534 nobody 0 0 ', None, "named for alice but owned by nobody"),  # a squat, even unheld
    ('gpu0@alice 65534 nobody 1 1 {"job": "g", "user": "alice", "pid": 4}', None, "owned by nobody"),
    ('gpu0@nobody 65534 nobody 1 0 {"job": "g", "user": "nobody", "pid": 1}', None, "no live process of nobody"),
    ('gpu0@nobody 65534 nobody 2 0 {"job": "g", "user": "nobody", "pid": 1}', None, None),  # no flock: no claim
    ('gpu0@nobody 65534 nobody 2 1 {"job": "g", "user": "nobody", "pid": 9}', "g", None),
    ('gpu0@alice 1001 alice 1 1 {"job": "a", "user": "alice", "since": 9e12}', None, "in the future"),
    ('gpu0 1001 alice 1 1 {"job": "a", "user": "alice", "pid": 4}', "a", None),  # an older eltctl's claim
    ('gpu0 65534 nobody 1 1 {"job": "g", "user": "alice", "pid": 4}', None, "naming alice but owned by nobody"),
    ("gpu0 0 root 0 0 ", None, None),  # an older eltctl's released claim: nobody's business
    ("!odd 65534 nobody 677075300a78", None, "strict set"),  # "gpu0\nx"
    ("!notfile gpu0@alice 65534 nobody", None, "not a regular file"),
])
def test_the_probes_claim_lines(line, claimed, refused):
    from eltctl.sharedir import parse_claims

    got, why, trusted = parse_claims(["!dir 0 0 root 43ff", line], NOW)
    assert trusted
    assert [c.job for _, c in got] == ([claimed] if claimed else [])
    if refused is None:
        assert why == (), why
    else:
        assert len(why) == 1 and refused in why[0].reason, why


@pytest.mark.parametrize("dir_line, trusted, problem", [
    ("!dir 0 0 root 43ff", True, None),  # root's, 1777
    ("!dir 1001 1001 alice 43ff", True, None),  # mine
    ("!dir 1001 1002 bob 43ff", True, "owned by bob"),  # another account's: used, reported
    ("!dir 0 1002 bob 41ff", False, "without the sticky bit"),  # 0777: nothing believed
    ("!dir 0 0 root a1ff", False, "not a directory"),  # a symlink
    ("!dir -", True, None),  # none yet
])
def test_the_claims_directory_itself_is_judged(dir_line, trusted, problem):
    from eltctl.sharedir import parse_claims

    held = 'gpu0@alice 1001 alice 1 1 {"job": "a", "user": "alice", "pid": 4}'
    got, why, ok = parse_claims([dir_line, held], NOW)
    assert ok is trusted and len(got) == (1 if trusted else 0)
    assert [r for r in why if problem and problem in r.reason] or (problem is None and why == ()), why


def test_status_names_each_refused_file_and_its_owner():
    from eltctl.statusview.refused import refused_line

    assert refused_line({"hosts": [{"name": "h1", "refused": None}]}) is None
    doc = {"hosts": [{"name": "h1", "refused": {"count": 1, "entries": [
        {"file": "demand.alice.ghost", "owner": "nobody", "reason": "named for alice but owned by nobody"}]}}]}
    line = refused_line(doc)
    assert "1 entry of the GPU claims directory not believed" in line
    assert "h1: demand.alice.ghost (owner [bold]nobody[/]): named for alice but owned by nobody" in line


RACE = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
import eltclaims as c
from pathlib import Path
d, out, rounds = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with open(out, "w") as f:
    for i in range(rounds):
        try:
            h = c.take(d, "gpu0", c.Claim(job=sys.argv[5], pid=os.getpid()))
        except c.Taken:
            time.sleep(0.002)
            continue
        t0 = time.monotonic()
        time.sleep(0.01)
        f.write(f"{t0} {time.monotonic()}\n")
        h.close()
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another account")
def test_two_accounts_racing_for_one_gpu_never_both_hold_it():
    """Both lock their own file, write, then look: whoever sees the other backs off. The
    holding intervals of the two accounts never overlap (CLOCK_MONOTONIC is one clock
    for both processes)."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no account nobody")
    root = Path(tempfile.mkdtemp(prefix="eltc-race-"))
    try:
        root.chmod(0o755)
        shutil.copy(claims.__file__, root / "eltclaims.py")
        d = root / "claims"
        claims.ensure_dir(d)
        outs = {"me": root / "me.out", "nobody": root / "nobody.out"}
        for f in outs.values():
            f.touch()
            f.chmod(0o666)
        runs = [subprocess.Popen([*(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                                     "--clear-groups"] if who == "nobody" else []),
                                  sys.executable, "-I", "-c", RACE, str(root), str(d), str(out), "60", who])
                for who, out in outs.items()]
        for p in runs:
            assert p.wait(timeout=120) == 0
        held = {who: [tuple(map(float, ln.split())) for ln in out.read_text().splitlines()]
                for who, out in outs.items()}
        assert held["me"] and held["nobody"], held  # both got the GPU at times
        overlaps = [(a, b) for a in held["me"] for b in held["nobody"] if a[0] < b[1] and b[0] < a[1]]
        assert overlaps == [], overlaps[:3]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_claims_directory_others_may_rewrite_is_not_trusted(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)  # world-writable, no sticky bit: anyone may remove or rename every entry
    with pytest.raises(claims.ClaimError, match="without the sticky bit.*nothing in it is trusted"):
        claims.take(d, "gpu0", Claim(job="a", pid=os.getpid()))
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(claims.ClaimError, match="not a directory"):
        claims.take(link, "gpu0", Claim(job="a", pid=os.getpid()))
    assert claims.dir_problem(1002, 0o41777, 1001, "bob") == (
        "owned by bob, not root: bob can remove any entry (create it as root, mode 1777)", True)
    assert claims.dir_problem(0, 0o41777, 1001, "root") is None
