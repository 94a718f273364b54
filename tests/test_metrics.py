"""The Prometheus text (eltctl/metrics.py): it parses under the format's strict rules
(tests/testbed/promtext.py) and every value agrees with the status document and the
usage ledger it was made from; `eltctl metrics` prints it without a controller."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from eltctl.metrics import escape_label, render
from tests.test_statusview import CROWDED, TIMEOUT, cli_env, state_dir
from tests.testbed.promtext import parse, value

DOC = {
    **CROWDED,
    "mode": "elastic", "runtime_current": True,
    "resizes": {"count": 4, "pause_s": 3.25, "last_pause_s": 0.5},
    "forged": {"controller": {"gen/plan": 2}, "hosts": {"ws1": {"hb": 1}}, "rank0": {}, "total": 3,
               "events_skipped": 0},
    "keeper": {"pid": 1, "endpoint": "127.0.0.1:5", "restarts": 2, "problem": None},
    "notify": {"delivered": 5, "failed": 1, "dropped": 0, "pending": 0, "last": None, "last_failure": None},
}
FAIR = {"share": 3, "pool": 6, "cap": 3, "release": {"h1": 1}, "to": "bob/bert", "reason": "released 1 GPU",
        "jobs": [], "user": "alice", "priority": 1, "held": 4, "wanted": 2, "usage_gpu_h": 1.5, "min_workers": 1}
LEDGER = {"gpu_seconds": {"ws1": 7200.5, "cpu1": 60.0},
          "ends": {("ws1", "yield"): 3, ("ws1", "crash"): 1, ("cpu1", "quota"): 2, ("cpu1", "planned"): 4}}


def test_the_text_parses_strictly_and_agrees_with_the_document():
    fams = parse(render(DOC, LEDGER))
    job = {"job": "mnist"}
    assert value(fams, "eltctl_world_size", **job) == DOC["world_size"] == 3
    assert value(fams, "eltctl_step", **job) == DOC["step"]
    assert value(fams, "eltctl_generation", **job) == DOC["generation"]
    assert value(fams, "eltctl_samples_per_second", **job) == DOC["samples_per_s"]
    assert value(fams, "eltctl_loss", **job) == DOC["loss"]
    assert value(fams, "eltctl_checkpoint_step", **job) == DOC["checkpoint"]["step"]
    assert value(fams, "eltctl_info", state="training", phase="training", mode="elastic") == 1
    assert value(fams, "eltctl_resize_pauses_total") == 4 and value(fams, "eltctl_resize_pause_seconds_total") == 3.25
    assert value(fams, "eltctl_gpu_seconds_total", host="ws1") == 7200.5
    assert value(fams, "eltctl_yields_total", host="ws1", cause="yield") == 3
    assert value(fams, "eltctl_yields_total", host="cpu1", cause="quota") == 2
    assert value(fams, "eltctl_yields_total", host="ws1", cause="crash") is None  # a crash is no yield
    assert value(fams, "eltctl_worker_ends_total", host="ws1", how="crash") == 1
    assert value(fams, "eltctl_forged_values_total", reader="controller", family="gen/plan") == 2
    assert value(fams, "eltctl_forged_values_total", reader="host", host="ws1", family="hb") == 1
    assert sum(v for _, _, v in fams["eltctl_forged_values_total"]["samples"]) == DOC["forged"]["total"]
    assert value(fams, "eltctl_store_keeper_restarts_total") == 2
    assert value(fams, "eltctl_notifications_total", result="failed") == 1
    for h in DOC["hosts"]:
        assert value(fams, "eltctl_host_workers", host=h["name"]) == h["workers"]
    assert sum(v for _, _, v in fams["eltctl_hosts"]["samples"]) == len(DOC["hosts"])
    for name, fam in fams.items():
        assert name.startswith("eltctl_") and all(ls.get("job") == "mnist" for _, ls, _ in fam["samples"]), name
    assert "eltctl_restarts_total" not in fams  # elastic mode has no script restarts


def test_unknown_figures_are_left_out_not_zero_and_restart_mode_counts_restarts():
    doc = {"job": "j", "state": "starting", "phase": "probing", "mode": "restart", "restarts": 3, "step": None,
           "samples_per_s": None, "loss": None, "hosts": [], "controller": {"alive": False}}
    fams = parse(render(doc, None))
    assert "eltctl_step" not in fams and "eltctl_loss" not in fams and "eltctl_gpu_seconds_total" not in fams
    assert value(fams, "eltctl_restarts_total") == 3 and value(fams, "eltctl_controller_up") == 0


def test_label_values_are_escaped():
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    doc = {**DOC, "forged": {"controller": {'we"ird\\fam\nily': 1}, "total": 1}}
    fams = parse(render(doc, None))
    assert value(fams, "eltctl_forged_values_total", family='we"ird\\fam\nily') == 1


def test_fair_share_figures_agree_with_the_document():
    fams = parse(render({**DOC, "fairshare": FAIR}))
    assert value(fams, "eltctl_fairshare_share_gpus") == 3 and value(fams, "eltctl_fairshare_pool_gpus") == 6
    assert value(fams, "eltctl_fairshare_held_gpus") == 4 and value(fams, "eltctl_fairshare_wanted_gpus") == 2
    assert value(fams, "eltctl_fairshare_releasing_gpus") == 1 and value(fams, "eltctl_fairshare_priority") == 1
    assert value(fams, "eltctl_fairshare_usage_gpu_hours", user="alice") == 1.5
    alone = parse(render({**DOC, "fairshare": {**FAIR, "share": None, "release": {}}}))
    assert "eltctl_fairshare_share_gpus" not in alone and "eltctl_fairshare_pool_gpus" not in alone
    assert value(alone, "eltctl_fairshare_held_gpus") == 4
    assert not any(n.startswith("eltctl_fairshare") for n in parse(render(DOC)))  # an older document


def test_eltctl_metrics_prints_the_text_of_status_json(tmp_path):
    (tmp_path / "hosts.toml").write_text('[job]\nname = "mnist"\ncommand = "python t.py"\n'
                                         '[[hosts]]\nname = "ws1"\naddress = "local"\n')
    doc = {**DOC, "updated": time.time(), "fairshare": FAIR}
    (state_dir(tmp_path) / "status.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "eltctl", "metrics"], cwd=tmp_path, env=cli_env(tmp_path),
                       capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    fams = parse(r.stdout)
    assert value(fams, "eltctl_step") == doc["step"] and value(fams, "eltctl_controller_up") == 0  # from the file
    st = subprocess.run([sys.executable, "-m", "eltctl", "status", "--json"], cwd=tmp_path, env=cli_env(tmp_path),
                        capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    fair = json.loads(st.stdout)["fairshare"]  # the metrics agree with `status --json`
    assert (value(fams, "eltctl_fairshare_share_gpus"), value(fams, "eltctl_fairshare_held_gpus"),
            value(fams, "eltctl_fairshare_wanted_gpus"), value(fams, "eltctl_fairshare_priority"),
            value(fams, "eltctl_fairshare_usage_gpu_hours", user=fair["user"])) == \
        (fair["share"], fair["held"], fair["wanted"], fair["priority"], fair["usage_gpu_h"])
    assert "import torch" not in r.stderr


def test_the_ledgers_figures_count_gpu_seconds_and_how_workers_ended(tmp_path):
    from eltctl.ledger.db import open_writer
    from eltctl.metrics import ledger_figures

    conn = open_writer(tmp_path / "usage.db", "mnist")
    rows = [("ws1/0/0", "ws1", 0, 100.0, 160.0, "yield"), ("ws1/1/0", "ws1", 1, 100.0, 130.0, "crash"),
            ("cpu1/0/0", "cpu1", 0, 100.0, None, "")]
    for wid, host, slot, start, end, how in rows:
        conn.execute("INSERT INTO intervals (worker_id, job, host, slot, kind, start, end, last_seen, how, exact) "
                     "VALUES (?, 'mnist', ?, ?, ?, ?, ?, ?, ?, 1)",
                     (wid, host, slot, "cpu" if host == "cpu1" else "gpu", start, end, end or 150.0, how))
    figures = ledger_figures(conn, 200.0, live=True)
    assert figures == {"gpu_seconds": {"ws1": 90.0}, "ends": {("ws1", "yield"): 1, ("ws1", "crash"): 1}}
    fams = parse(render(DOC, figures))
    assert value(fams, "eltctl_gpu_seconds_total", host="ws1") == 90.0
    assert value(fams, "eltctl_yields_total", host="ws1", cause="yield") == 1


def test_where_the_training_ends_and_the_time_left_are_figures_too():
    fams = parse(render({**DOC, "total_steps": 5000, "eta_s": 812.5}, None))
    assert value(fams, "eltctl_total_steps", job="mnist") == 5000
    assert value(fams, "eltctl_eta_seconds", job="mnist") == 812.5
    unknown = parse(render({**DOC, "total_steps": None, "eta_s": None}, None))
    assert "eltctl_total_steps" not in unknown and "eltctl_eta_seconds" not in unknown
