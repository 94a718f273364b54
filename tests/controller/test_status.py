"""The controller's phase after a pass, and the shape of the status document, as tables."""

from __future__ import annotations

import pytest

from eltctl.controller.observe import DaemonSeen
from eltctl.controller.policy import Decision, GpuUse, HostRecord, HostView, Reach, SlotView
from eltctl.controller.status import Phase, job_state, next_phase, status_document
from eltctl.inventory import parse_inventory

NOW = 10_000.0
INV = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = 1\nmax_workers = 4\n'
                      '[policy]\nhang_timeout = 10\n'
                      '[[hosts]]\nname = "a"\naddress = "a.lab"\n[[hosts]]\nname = "b"\naddress = "b.lab"\n',
                      "hosts.toml")


def decision(waiting=False, message="") -> Decision:
    return Decision(actions=(), desired={}, usable=0, waiting=waiting, message=message)


RUNNING = {"a": HostView("a", Reach.OK, daemon_alive=True, workers=(0,), worker_ids=("a/0/1",)),
           "b": HostView("b", Reach.OK)}
IDLE = {"a": HostView("a", Reach.OK), "b": HostView("b", Reach.OK)}
# rank 0's clock is never read
TRAINING_STATUS = {"seen": NOW - 1, "time": NOW - 3600, "world_size": 1, "members": ["a/0/1"], "step": 7}
# The script crashed; the daemon started a new worker in the slot (a new id): the old status names no one running.
RESTARTED = {"a": HostView("a", Reach.OK, daemon_alive=True, workers=(0,), worker_ids=("a/0/2",)),
             "b": HostView("b", Reach.OK)}
WANTED = {"a": HostRecord(desired=(0,))}

# (case, phase before, runtime status, views, records, decision, daemons starting, phase and message after)
PHASES = [
    ("rank 0 reports a world and workers run: training", Phase.STARTING, TRAINING_STATUS, RUNNING, WANTED,
     decision(), False, (Phase.TRAINING, "")),
    ("a stale rank 0 status is not training", Phase.TRAINING,
     {"seen": NOW - 31, "time": NOW, "world_size": 1, "members": ["a/0/1"]}, RUNNING, WANTED,
     decision(), False, (Phase.STARTING, "waiting for the first step")),
    ("a fresh status of a crashed run, its worker replaced: not training (up must not print its step)",
     Phase.TRAINING, TRAINING_STATUS, RESTARTED, WANTED, decision(), False,
     (Phase.STARTING, "waiting for the first step")),
    ("a fresh status whose members all ended (both hosts cooling down): not training", Phase.TRAINING,
     TRAINING_STATUS, IDLE, {}, decision(waiting=True), False,
     (Phase.WAITING, "no slot free; min_workers is 1")),
    ("too few GPUs and nothing runs: waiting, with what it waits for counted", Phase.PROBING, None, IDLE, {},
     decision(waiting=True, message="1 usable slot(s), min_workers is 2"), False,
     (Phase.WAITING, "no slot free; min_workers is 1")),
    ("nothing wanted yet, the policy says why: starting with its reason", Phase.PROBING, None, IDLE, {},
     decision(message="GPU 0 of a free for 3 s of idle_for 10 s"), False,
     (Phase.STARTING, "GPU 0 of a free for 3 s of idle_for 10 s")),
    ("daemons being started from probing: shipping", Phase.PROBING, None, IDLE, WANTED, decision(), True,
     (Phase.SHIPPING, "old")),
    ("daemons being started later: the phase stays", Phase.STARTING, None, IDLE, WANTED, decision(), True,
     (Phase.STARTING, "old")),
    ("daemons being started after waiting: starting, not still waiting", Phase.WAITING, None, IDLE, WANTED,
     decision(), True, (Phase.STARTING, "starting the hosts' daemons")),
    ("slots wanted, no worker yet: starting workers", Phase.SHIPPING, None, IDLE, WANTED, decision(), False,
     (Phase.STARTING, "starting workers")),
    ("nothing wanted and nothing to say: unchanged", Phase.PROBING, None, IDLE, {}, decision(), False,
     (Phase.PROBING, "old")),
]


@pytest.mark.parametrize("case, phase, rs, views, records, dec, starting, expected", PHASES,
                         ids=[c[0] for c in PHASES])
def test_next_phase(case, phase, rs, views, records, dec, starting, expected):
    assert next_phase(phase, "old", now=NOW, inventory=INV, runtime_status=rs, views=views, records=records,
                      decision=dec, starting_daemons=starting) == expected


@pytest.mark.parametrize("phase, state", [(Phase.TRAINING, "training"), (Phase.WAITING, "waiting"),
                                          (Phase.STOPPING, "stopping"), (Phase.STOPPED, "stopped"),
                                          (Phase.CONNECTING, "starting"), (Phase.SHIPPING, "starting")])
def test_job_state(phase, state):
    assert job_state(phase) == state


def test_status_document_shape():
    views = {"a": HostView("a", Reach.OK, slots=(SlotView(0, GpuUse.FREE), SlotView(1, GpuUse.BUSY, "pid 9")),
                           daemon_alive=True, workers=(0,)),
             "b": HostView("b", Reach.UNREACHABLE, reason="timeout")}
    records = {"a": HostRecord(desired=(0,), cooldown_until=NOW + 5, benched_until=NOW - 1)}
    rs = {"seen": NOW - 2, "time": NOW - 60 - 2, "generation": 3, "world_size": 1, "members": ["a/0/0"], "step": 12, "epoch": 0,
          "samples_per_s": 99.0, "loss": 0.5, "checkpoint": {"step": 10, "time": NOW - 60 - 4, "path": "/c"}}
    events = [{"kind": "join", "time": float(i)} for i in range(25)]
    doc = status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=rs,
                          views=views, records=records, seen={"a": DaemonSeen(b"{}", NOW - 0.5, {})},
                          events=events, store_endpoint="127.0.0.1:29500", mirror=None)
    assert list(doc) == ["job", "state", "phase", "message", "updated", "generation", "world_size", "members",
                         "runtime_current", "min_workers", "max_workers", "step", "epoch", "samples_per_s", "loss", "network",
                         "checkpoint", "runtime_status_age_s", "controller", "store", "hosts", "events", "mirror",
                         "start_failed", "mode", "restarts", "forged", "starts_at", "total_steps", "steps_per_s",
                         "eta_s"]
    assert (doc["mode"], doc["restarts"]) == ("elastic", None)
    assert doc["forged"] == {"controller": {}, "hosts": {}, "rank0": {}, "total": 0, "events_skipped": 0}
    assert (doc["job"], doc["state"], doc["world_size"], doc["min_workers"], doc["max_workers"]) == ("j", "training", 1,
                                                                                                    1, 4)
    # rank 0's clock a minute behind: the age is still the controller's 4 s
    assert doc["checkpoint"] == {"step": 10, "time": NOW - 64, "path": "/c", "host": None, "age_s": 4.0}
    assert doc["runtime_status_age_s"] == 2.0
    assert doc["events"] == events[-20:]
    a, b = doc["hosts"]
    assert a == {"name": "a", "state": "running", "reason": "1 worker(s)", "workers": 1, "device": "gpu",
                 "heartbeat_age_s": 0.5,
                 "benched_until": None, "cooldown_until": NOW + 5, "failures": 0, "desired": [0],
                 "gpus": [{"index": 0, "state": "ours", "reason": ""}, {"index": 1, "state": "busy", "reason": "pid 9"}],
                 "last_problem": "", "start_failure": None, "daemon": {}, "usable_at": None, "signal": None,
                 "refused": None, "waiting": {"kind": "cooldown", "detail": "cooling down after a failure; 5 s more", "until": NOW + 5}}
    assert doc["start_failed"] is None
    assert (b["state"], b["reason"], b["heartbeat_age_s"], b["gpus"]) == ("unreachable", "timeout", None, [])


# ----------------------------------------------------------------------- what a waiting job waits for

from dataclasses import replace  # noqa: E402

from eltctl.controller.status import fix_hint, start_failures, waiting_message  # noqa: E402

CANT_OPEN = "worker on slot 0 failed at start: python: can't open file '/h/code/trian.py': [Errno 2] No such file"
FREE1 = (SlotView(0, GpuUse.FREE),)
FREE2 = (SlotView(0, GpuUse.FREE), SlotView(1, GpuUse.FREE))
BUSY2 = (SlotView(0, GpuUse.BUSY, "pid 7"), SlotView(1, GpuUse.BUSY, "pid 8"))
FAILED = HostRecord(cooldown_until=NOW + 118, failures=1, last_problem=CANT_OPEN, start_failure=CANT_OPEN)


def inv(min_workers=1, hosts=("a", "b")):
    text = f'[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = {min_workers}\n[policy]\nidle_for = 10\n'
    for h in hosts:
        text += f'[[hosts]]\nname = "{h}"\naddress = "{h}.lab"\n'
    return parse_inventory(text, "hosts.toml")


# (case, min_workers, views, records, message)
WAITING = [
    ("a slot held back by a failure's cooldown: counted with its cause, never '0 free'", 1,
     {"a": HostView("a", Reach.OK, slots=FREE1), "b": HostView("b", Reach.UNREACHABLE, reason="timed out")},
     {"a": FAILED},
     f"1 slot cooling down after a failure ({CANT_OPEN}; 118 s more; `eltctl logs a --failed` shows its output; "
     "after a fix `eltctl up` retries at once), 1 host unreachable (b: timed out); "
     "min_workers is 1"),
    ("busy GPUs are their owners'", 3,
     {"a": HostView("a", Reach.OK, slots=FREE1), "b": HostView("b", Reach.OK, slots=BUSY2)}, {},
     "1 slot free, 2 GPUs busy (their owners' processes); min_workers is 3"),
    ("one busy GPU, an owner's cooldown", 2,
     {"a": HostView("a", Reach.OK, slots=FREE2), "b": HostView("b", Reach.OK, slots=BUSY2[:1])},
     {"a": HostRecord(owner_until=NOW + 5, owner_note="its owner took GPU 1")},
     "2 slots cooling down after an owner came back, 1 GPU busy (its owner's process); min_workers is 2"),
    ("benched, unhealthy", 1,
     {"a": HostView("a", Reach.OK, slots=FREE2), "b": HostView("b", Reach.UNHEALTHY, reason="nvidia-smi hangs")},
     {"a": HostRecord(benched_until=NOW + 60, last_problem="benched after 3 failures in a row")},
     "2 slots on a benched host (benched after 3 failures in a row; 60 s more; `eltctl logs a` shows the host's "
     "log; after a fix `eltctl up` retries at once), "
     "1 host unhealthy (b: nvidia-smi hangs); min_workers is 1"),
    ("not probed yet, removed", 1, {"a": HostView("a")}, {"b": HostRecord(removed=True)},
     "1 host not probed yet, 1 host removed (`eltctl scale --add` brings it back); min_workers is 1"),
    ("scale --add waives the cooldown: free", 2, {"a": HostView("a", Reach.OK, slots=FREE1), "b": HostView("b")},
     {"a": replace(FAILED, join_now=True)}, "1 slot free, 1 host not probed yet; min_workers is 2"),
    ("nothing at all", 1, {"a": HostView("a", Reach.OK), "b": HostView("b", Reach.OK)}, {},
     "no slot free; min_workers is 1"),
]


@pytest.mark.parametrize("case, min_workers, views, records, message", WAITING, ids=[c[0] for c in WAITING])
def test_waiting_message(case, min_workers, views, records, message):
    assert waiting_message(now=NOW, inventory=inv(min_workers), views=views, records=records) == message


A_FREE = HostView("a", Reach.OK, slots=FREE1)
B_FREE = HostView("b", Reach.OK, slots=FREE1)

# (case, views, records, hosts whose failure `up` reports)
START_FAILED = [
    ("every host given slots failed at start", {"a": A_FREE, "b": HostView("b", Reach.UNREACHABLE)},
     {"a": FAILED}, {"a": CANT_OPEN}),
    ("both hosts failed", {"a": A_FREE, "b": B_FREE}, {"a": FAILED, "b": FAILED}, {"a": CANT_OPEN, "b": CANT_OPEN}),
    ("tried again after the cooldown: still failed until a step", {"a": A_FREE, "b": B_FREE},
     {"a": replace(FAILED, desired=(0,), cooldown_until=0.0), "b": FAILED}, {"a": CANT_OPEN, "b": CANT_OPEN}),
    ("another host still starts workers", {"a": A_FREE, "b": B_FREE},
     {"a": FAILED, "b": HostRecord(desired=(0,))}, {}),
    ("another host runs workers", {"a": A_FREE, "b": HostView("b", Reach.OK, slots=FREE1, workers=(0,))},
     {"a": FAILED}, {}),
    ("another host's free slot is about to be used", {"a": A_FREE, "b": B_FREE},
     {"a": FAILED, "b": HostRecord(free_since=((0, NOW - 5),))}, {}),
    ("a host reached a step", {"a": replace(A_FREE, in_job=True), "b": HostView("b", Reach.UNREACHABLE)},
     {"a": FAILED}, {}),
    ("no failure at start", {"a": A_FREE, "b": HostView("b", Reach.UNREACHABLE)},
     {"a": replace(FAILED, start_failure="")}, {}),
]


@pytest.mark.parametrize("case, views, records, expected", START_FAILED, ids=[c[0] for c in START_FAILED])
def test_start_failures(case, views, records, expected):
    assert start_failures(now=NOW, inventory=inv(), views=views, records=records) == expected


@pytest.mark.parametrize("cause, word", [
    ("python: can't open file '/x/trian.py': [Errno 2] No such file or directory", "[job] command"),
    ("ModuleNotFoundError: No module named 'foo'", "install the module"),
    ("RuntimeError: boom", "eltctl logs HOST"),
])
def test_fix_hint(cause, word):
    assert word in fix_hint(cause)


def test_status_document_names_the_failure_at_start():
    views = {"a": A_FREE, "b": HostView("b", Reach.UNREACHABLE, reason="timeout")}
    doc = status_document(now=NOW, inventory=INV, phase=Phase.WAITING, message="m", runtime_status=None,
                          views=views, records={"a": FAILED}, seen={}, events=[], store_endpoint="", mirror=None)
    assert doc["start_failed"] == {"a": CANT_OPEN}
    a = doc["hosts"][0]
    assert (a["state"], a["last_problem"], a["start_failure"]) == ("cooldown", CANT_OPEN, CANT_OPEN)
    assert a["reason"] == (f"{CANT_OPEN} (usable again in 118 s; `eltctl logs a --failed` shows its output; after "
                           "a fix `eltctl up` retries at once)")


def test_a_hosts_entry_carries_its_daemons_phase_health_and_workers():
    state = {"pid": 7, "phase": "running", "health": "ok", "time": 1.0, "gpus": [],
             "workers": [{"slot": 0, "worker_id": "a/0/1", "pid": 9, "state": "crashed", "cause": "boom"}]}
    from eltctl.controller.status import daemon_summary

    assert daemon_summary(state) == {"pid": 7, "phase": "running", "health": "ok", "workers": state["workers"]}
    assert daemon_summary({}) == {}


def test_when_every_host_failed_at_start_the_phase_says_so_in_the_same_pass():
    """status.json's `start_failed` and its message come from one pass: a job whose workers
    all failed at start is waiting, and the message names the failure (seen in CI: the old
    phase, "waiting for the first step", was kept beside `start_failed`)."""
    from eltctl.controller.policy import Decision

    views = {"a": HostView("a", Reach.OK, slots=FREE1, daemon_alive=True),
             "b": HostView("b", Reach.OK, slots=FREE1, daemon_alive=True)}
    records = {"a": FAILED, "b": FAILED}
    assert start_failures(now=NOW, inventory=inv(), views=views, records=records)
    phase, message = next_phase(Phase.STARTING, "waiting for the first step", now=NOW, inventory=inv(),
                                runtime_status=None, views=views, records=records, decision=Decision((), {}, 0, waiting=False),
                                starting_daemons=False)
    assert phase == Phase.WAITING and "cooling down after a failure" in message and CANT_OPEN in message


def test_the_owner_signal_shown_is_the_daemons_else_the_probes_with_its_name():
    """Seen in CI: the daemon's state briefly had no signal while the probe held the host;
    status showed the probe's signal without its name. The probe's answer carries it."""
    from eltctl.controller.status import owner_signal

    login = {"name": "login", "detail": "alice logged in on pts/3", "since": 5.0}
    busy = (SlotView(0, GpuUse.BUSY, "owner: alice logged in on pts/3"),)
    daemon = DaemonSeen(b"", NOW, {"signal": {"name": "keyboard", "detail": "typing", "since": 6.0}})
    silent = DaemonSeen(b"", NOW, {"signal": None})
    assert owner_signal(HostView("a", Reach.OK, slots=busy, daemon_alive=True, owner=login), daemon)["name"] == "keyboard"
    assert owner_signal(HostView("a", Reach.OK, slots=busy, daemon_alive=True, owner=login), silent) == login
    assert owner_signal(HostView("a", Reach.OK, slots=busy, owner=login), None) == login
    assert owner_signal(HostView("a", Reach.OK, slots=busy), None) == {
        "name": None, "detail": "alice logged in on pts/3", "since": None}
    assert owner_signal(HostView("a", Reach.OK, slots=(SlotView(0, GpuUse.FREE),)), silent) is None


def test_each_hosts_store_forward_rides_in_its_entry_and_a_down_one_is_a_note():
    """The "ssh" store mode: the keeper's forwards (status.json `keeper.forwards`) are also
    each host's `forward`, and the hosts table notes one that is down, with its error."""
    from eltctl.statusview.formatting import ViewOptions
    from eltctl.statusview.hosts import host_notes

    keeper = {"pid": 5, "endpoint": "127.0.0.1:1", "restarts": 0, "problem": None,
              "forwards": {"a": {"socket": "/h/a/store.sock", "up": True, "error": "", "since": 1.0},
                           "b": {"socket": None, "up": False, "error": "refused: AllowStreamLocalForwarding",
                                 "since": 2.0}}}
    doc = status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=None,
                          views=IDLE, records={}, seen={}, events=[], store_endpoint="127.0.0.1:1", mirror=None,
                          keeper=keeper)
    a, b = doc["hosts"]
    assert a["forward"] == {"socket": "/h/a/store.sock", "up": True, "error": None}
    assert b["forward"] == {"socket": None, "up": False, "error": "refused: AllowStreamLocalForwarding"}
    opts = ViewOptions(now=NOW)
    assert not [n for n in host_notes(a, opts) if "forward" in n]
    assert "store forward down: refused: AllowStreamLocalForwarding" in host_notes(b, opts)
    assert "store forward down" in host_notes(b, opts, brief=True)
    plain = status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=None,
                            views=IDLE, records={}, seen={}, events=[], store_endpoint="127.0.0.1:1", mirror=None)
    assert all("forward" not in h for h in plain["hosts"])


# ----------------------------------------------------------------------- the document tells what holds now

LAST_CK = {"step": 800, "time": NOW - 100, "path": "/h/.eltctl/jobs/j/a/checkpoints/step-800", "host": "a",
           "age_s": 30.0, "seen": NOW - 10}
RS2 = {"seen": NOW - 1, "time": NOW - 1, "generation": 2, "world_size": 2, "members": ["a/0/1", "b/0/1"],
       "step": 872, "epoch": 1, "samples_per_s": 1486.0, "loss": 0.3, "checkpoint": None,
       "workers": {"a/0/1": {"share": 0.5, "samples_per_s": 743.0}, "b/0/1": {"share": 0.5, "samples_per_s": 743.0}}}


def _doc(views, rs=RS2, checkpoint=None, records=None):
    return status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=rs,
                           views=views, records=records or {}, seen={}, events=[], store_endpoint="x", mirror=None,
                           checkpoint=checkpoint)


def test_after_a_resize_the_checkpoint_is_the_last_one_not_none_yet():
    views = {"a": HostView("a", Reach.CPU_ONLY, daemon_alive=True, worker_ids=("a/0/1",), workers=(0,)),
             "b": HostView("b", Reach.CPU_ONLY, daemon_alive=True, worker_ids=("b/0/1",), workers=(0,))}
    doc = _doc(views, checkpoint=LAST_CK)  # the new rank 0 has saved nothing yet
    assert doc["checkpoint"] == {"step": 800, "time": NOW - 100, "path": LAST_CK["path"], "host": "a",
                                 "age_s": 40.0}
    assert (doc["world_size"], doc["members"], doc["runtime_current"]) == (2, ["a/0/1", "b/0/1"], True)
    assert [w["worker"] for w in doc["workers"]] == ["a/0/1", "b/0/1"]


def test_after_a_crash_no_stale_worker_is_shown():
    cooling = HostRecord(cooldown_until=NOW + 100, failures=1, last_problem="worker crashed")
    views = {"a": HostView("a", Reach.CPU_ONLY, daemon_alive=True), "b": HostView("b", Reach.CPU_ONLY, daemon_alive=True)}
    doc = _doc(views, checkpoint=LAST_CK, records={"a": cooling, "b": cooling})
    assert (doc["world_size"], doc["members"], doc["runtime_current"]) == (0, [], False)
    assert "workers" not in doc and doc["samples_per_s"] is None
    assert (doc["step"], doc["checkpoint"]["step"]) == (872, 800)  # where it stopped, and what it resumes from


def test_a_member_that_died_is_left_out_of_the_members_and_the_workers():
    views = {"a": HostView("a", Reach.CPU_ONLY, daemon_alive=True, worker_ids=("a/0/1",), workers=(0,)),
             "b": HostView("b", Reach.CPU_ONLY, daemon_alive=True)}
    doc = _doc(views)
    assert (doc["world_size"], doc["members"]) == (1, ["a/0/1"])
    assert [w["worker"] for w in doc["workers"]] == ["a/0/1"]


def test_waiting_for_cpu_slots_names_slots_never_gpus():
    cpu_busy = (SlotView(0, GpuUse.BUSY, "owner: login alice"),)
    cpu_taken = (SlotView(0, GpuUse.TAKEN, "taken by job other"),)
    views = {"a": HostView("a", Reach.CPU_ONLY, slots=cpu_busy), "b": HostView("b", Reach.CPU_ONLY, slots=cpu_taken)}
    msg = waiting_message(now=NOW, inventory=inv(2), views=views, records={})
    assert msg == ("1 CPU slot held by its owner (an owner signal), 1 CPU slot taken by another eltctl job; "
                   "min_workers is 2")
    assert "GPU" not in msg


# ----------------------------------------------------------------------- issue 50: every wait says why, no phantoms

from eltctl.controller.policy import HostPhase, Limit  # noqa: E402
from eltctl.controller.status import host_wait, progress_fields  # noqa: E402

CPU2 = (SlotView(0, GpuUse.FREE, "CPU slot"), SlotView(1, GpuUse.FREE, "CPU slot"))
# fair share's plan (status.json `fairshare`): this job j holds 1 of a pool of 2, job b of bob wants more
FAIR = {"share": 1, "pool": 2, "cap": 1, "release": {}, "to": "", "reason": "",
        "jobs": [{"user": "alice", "job": "j", "held": 1, "wanted": 0, "share": 1},
                 {"user": "bob", "job": "b", "held": 1, "wanted": 2, "share": 1}]}
ADDED = HostRecord(join_now=True)  # `scale --add`: idle_for, cooldown and benching waived once
OFF = Limit(0, HostPhase.OFF_HOURS, "outside its working hours (Mon-Fri 09:00-18:00); usable again at Sat 00:00",
            NOW + 3600, "Sat 00:00")
QUOTA = Limit(0, HostPhase.QUOTA, "gpu_hours_per_day 4 reached (4.0 h used today); usable again at 00:00", NOW + 60)
RELEASED = Limit(0, None, "released 1 GPU (1 on a) to job b (fair share 1 of 2)")


def inv_max(max_workers=None):
    extra = f"max_workers = {max_workers}\n" if max_workers is not None else ""
    return parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = 1\n' + extra +
                           '[policy]\nidle_for = 10\n[[hosts]]\nname = "a"\naddress = "a.lab"\n', "hosts.toml")


# (case, view, record, limit, the job's slots in all, max_workers, fair share's plan, kind, words in its detail)
WAITS = [
    ("a GPU host added while fair share caps the job: fair share, and which job waits",
     HostView("a", Reach.OK, slots=FREE1), ADDED, Limit(), 1, None, FAIR, "fair share",
     ["1 GPU", "share 1 of 2", "job b (bob: holds 1, share 1)"]),
    ("a CPU host added while fair share caps the job's GPUs: fair share counts no CPU slot, they join",
     HostView("a", Reach.CPU_ONLY, slots=CPU2), ADDED, Limit(), 1, None, FAIR, "joining", ["next pass"]),
    ("fair share released this host's GPU to another job", HostView("a", Reach.OK, slots=FREE1), ADDED, RELEASED, 1,
     None, FAIR, "fair share", ["released 1 GPU", "job b"]),
    ("a cooldown after a failure, with its cause", HostView("a", Reach.OK, slots=FREE1), FAILED, Limit(), 0, None,
     None, "cooldown", [CANT_OPEN, "118 s more"]),
    ("an owner's cooldown", HostView("a", Reach.OK, slots=FREE1),
     HostRecord(owner_until=NOW + 30, owner_note="its owner took GPU 0"), Limit(), 0, None, None, "cooldown",
     ["its owner took GPU 0", "30 s more"]),
    ("outside working hours", HostView("a", Reach.OK, slots=FREE1), HostRecord(), OFF, 0, None, None, "off-hours",
     ["usable again at Sat 00:00"]),
    ("a gpu-hours quota", HostView("a", Reach.OK, slots=FREE1), HostRecord(), QUOTA, 0, None, None, "quota",
     ["gpu_hours_per_day 4 reached"]),
    ("the owner's process", HostView("a", Reach.OK, slots=BUSY2[:1]), HostRecord(), Limit(), 0, None, None, "owner",
     ["GPU 0: pid 7"]),
    ("another eltctl job's claim", HostView("a", Reach.OK, slots=(SlotView(0, GpuUse.TAKEN, "taken by job b"),)),
     HostRecord(), Limit(), 0, None, None, "taken", ["GPU 0: taken by job b"]),
    ("free, not for idle_for yet", HostView("a", Reach.OK, slots=FREE1), HostRecord(free_since=((0, NOW - 4),)),
     Limit(), 0, None, None, "idle_for", ["idle_for (10 s)", "in 6 s", "scale --add a"]),
    ("max_workers reached", HostView("a", Reach.OK, slots=FREE1), ADDED, Limit(), 2, 2, None, "max_workers",
     ["max_workers (2)"]),
    ("usable and nothing holds it: the next pass", HostView("a", Reach.OK, slots=FREE1), ADDED, Limit(), 1, None,
     None, "joining", ["next pass"]),
]


@pytest.mark.parametrize("case, view, record, limit, total, max_workers, fair, kind, words", WAITS,
                         ids=[c[0] for c in WAITS])
def test_a_host_that_does_not_join_says_what_holds_it(case, view, record, limit, total, max_workers, fair, kind,
                                                      words):
    wait = host_wait(view, record, limit, now=NOW, inventory=inv_max(max_workers), total=total, fair=fair)
    assert wait is not None and wait["kind"] == kind
    for w in words:
        assert w in wait["detail"]


@pytest.mark.parametrize("case, view, record", [
    ("every slot runs", HostView("a", Reach.OK, slots=FREE1, workers=(0,)), HostRecord(desired=(0,))),
    ("every slot asked for", HostView("a", Reach.OK, slots=FREE1), HostRecord(desired=(0,))),
    ("removed: its state says so", HostView("a", Reach.OK, slots=FREE1), HostRecord(removed=True)),
    ("unreachable: its state says so", HostView("a", Reach.UNREACHABLE, reason="timeout"), HostRecord()),
])
def test_nothing_waits_on_a_host_whose_slots_are_used_or_that_is_out(case, view, record):
    assert host_wait(view, record, Limit(), now=NOW, inventory=inv_max(), total=1, fair=FAIR) is None


def test_the_document_carries_each_hosts_wait_and_fair_shares_unit():
    """Issue 50: a CPU host added while fair share capped the job showed no reason. Fair
    share counts GPUs only (its `unit`): a CPU host's slots are never held back by it."""
    views = {"a": HostView("a", Reach.CPU_ONLY, slots=CPU2[:1], daemon_alive=True, workers=(0,),
                           worker_ids=("a/0/1",)),
             "b": HostView("b", Reach.CPU_ONLY, slots=CPU2)}
    records = {"a": HostRecord(desired=(0,)), "b": ADDED}
    doc = status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=None,
                          views=views, records=records, seen={}, events=[], store_endpoint="x", mirror=None,
                          fairshare=FAIR)
    a, b = doc["hosts"]
    assert a["waiting"] is None
    assert b["waiting"]["kind"] == "joining"
    assert doc["fairshare"]["unit"] == "GPU" and doc["fairshare"]["share"] == 1


def test_a_paused_job_shows_no_worker_of_its_last_status():
    """Issue 50: `paused` with "workers 1" and a worker row while no worker ran. The last
    members wrote `paused` as they all left; a silent daemon does not bring them back."""
    rs = {**TRAINING_STATUS, "paused": True, "samples_per_s": 300.0,
          "workers": {"a/0/1": {"share": 64, "samples_per_s": 300.0}}}
    views = {"a": HostView("a", Reach.OK, slots=FREE1), "b": HostView("b", Reach.OK)}  # daemon silent
    doc = status_document(now=NOW, inventory=INV, phase=Phase.PAUSED, message="outside working hours",
                          runtime_status=rs, views=views, records={}, seen={}, events=[], store_endpoint="x",
                          mirror=None)
    assert (doc["state"], doc["world_size"], doc["members"], doc["samples_per_s"]) == ("paused", 0, [], None)
    assert "workers" not in doc and doc["step"] == 7


def test_a_finished_job_holds_nothing_in_fair_share_and_waits_for_nothing():
    """Issue 50: "holding 2" after the job finished (fair share's last plan, from before)."""
    views = {"a": HostView("a", Reach.OK, slots=FREE1), "b": HostView("b", Reach.OK, slots=FREE1)}
    held = {**FAIR, "held": 2, "wanted": 0, "user": "alice"}
    doc = status_document(now=NOW, inventory=INV, phase=Phase.FINISHED, message="the training finished",
                          runtime_status=TRAINING_STATUS, views=views, records={"a": HostRecord(desired=(0,))},
                          seen={}, events=[], store_endpoint="x", mirror=None, fairshare=held)
    assert doc["fairshare"] is None and doc["world_size"] == 0
    assert [h["waiting"] for h in doc["hosts"]] == [None, None]


# (case, rank 0's status, a worker runs, total_steps, steps/s, eta_s)
PROGRESS = [
    ("step N of M and the time left at the recent rate", {"step": 400, "total_steps": 1000, "steps_per_s": 2.0},
     True, 1000, 2.0, 300.0),
    ("no bound on the steps: no time left", {"step": 400, "steps_per_s": 2.0}, True, None, 2.0, None),
    ("no worker runs: the last status is history, no rate", {"step": 400, "total_steps": 1000, "steps_per_s": 2.0},
     False, 1000, None, None),
    ("restart mode: the script's own steps/s", {"step": 10, "total_steps": 20, "script": {"steps_per_s": 0.5}},
     True, 20, 0.5, 20.0),
]


@pytest.mark.parametrize("case, rs, live, total, sps, eta", PROGRESS, ids=[c[0] for c in PROGRESS])
def test_progress_fields(case, rs, live, total, sps, eta):
    got = progress_fields(rs, live, restart="script" in rs)
    assert (got["total_steps"], got["steps_per_s"], got["eta_s"]) == (total, sps, eta)
