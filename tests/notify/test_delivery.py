"""Delivering notifications (notify/delivery.py, bodies.py) to a real HTTP server on
127.0.0.1 and to a real command: the documented bodies arrive; a failing endpoint is
retried and recorded; an endpoint that accepts and never answers holds the notifier's
thread only, never its caller (`submit` returns while the thread waits on it)."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eltctl.inventory.notify import NotifySettings
from eltctl.notify import Notifier, notification
from eltctl.notify import delivery

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(delivery, "BACKOFF_S", 0.01)


class Endpoint:
    """An HTTP server on 127.0.0.1 (port 0) that records each POST; `answers` says what
    each request gets: an HTTP status, or "hang" (accept, read, never answer until released)."""

    def __init__(self, answers=()):
        self.received: list[tuple[str, dict, dict]] = []  # (path, headers, JSON body)
        self.answers = list(answers)
        self.got = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.received.append((self.path, dict(self.headers), body))
                outer.got.set()
                answer = outer.answers.pop(0) if outer.answers else 200
                if answer == "hang":
                    outer.release.wait(30)
                    return
                self.send_response(answer)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @contextmanager
    def running(self):
        t = threading.Thread(target=self.server.serve_forever, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self.release.set()
            self.server.shutdown()
            self.server.server_close()
            t.join(10)


def wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


FINISHED = notification("finished", "bert", T0, "the training finished at step 1200", state="training", step=1200)
FAILED = notification("failed", "bert", T0 + 5, "the job stopped on its restart limit: ValueError: bad batch",
                      cause="ValueError: bad batch", host=None, state="failed", step=1200)


def test_a_finished_and_a_failed_webhook_arrive_with_the_documented_body(tmp_path):
    with Endpoint().running() as ep:
        n = Notifier(NotifySettings(webhook=ep.url + "/hook", headers=(("X-Token", "s3cret"),)),
                     tmp_path / "notify.json").start()
        try:
            assert n.submit(FINISHED) and n.submit(FAILED)
            wait(lambda: n.status()["delivered"] == 2)
        finally:
            n.stop()
    (path1, headers1, finished), (_, _, failed) = ep.received
    assert path1 == "/hook" and headers1["Content-Type"] == "application/json" and headers1["X-Token"] == "s3cret"
    # "json": the event's fields and a text line that Slack shows
    assert finished == {"text": "eltctl job bert: finished: the training finished at step 1200", "kind": "finished",
                        "job": "bert", "time": T0, "detail": "the training finished at step 1200",
                        "state": "training", "step": 1200}
    assert failed["kind"] == "failed" and failed["cause"] == "ValueError: bad batch"
    assert failed["text"] == "eltctl job bert: FAILED: the job stopped on its restart limit: ValueError: bad batch"
    record = json.loads((tmp_path / "notify.json").read_text())
    assert record["delivered"] == 2 and record["failed"] == 0 and record["last_failure"] is None
    assert record["last"]["ok"] and record["last"]["kind"] == "failed"


def test_slack_and_ntfy_bodies(tmp_path):
    with Endpoint().running() as ep:
        for fmt, url in (("slack", ep.url + "/services/T0/B0/XYZ"), ("ntfy", ep.url + "/lab-jobs")):
            results = Notifier(NotifySettings(webhook=url, format=fmt)).deliver(FAILED)
            assert [r["ok"] for r in results] == [True]
    (slack_path, _, slack), (ntfy_path, _, ntfy) = ep.received
    assert slack_path == "/services/T0/B0/XYZ"
    assert slack == {"text": "eltctl job bert: FAILED: the job stopped on its restart limit: ValueError: bad batch"}
    assert ntfy_path == "/"  # ntfy's JSON publishing: the server's root, the topic in the body
    assert ntfy == {"topic": "lab-jobs", "title": "eltctl bert: FAILED",
                    "message": "the job stopped on its restart limit: ValueError: bad batch", "tags": ["x"],
                    "priority": 5}


def test_a_failing_endpoint_is_retried_then_recorded_and_the_url_path_is_not(tmp_path):
    with Endpoint(answers=[500, 500, 500, 500]).running() as ep:
        n = Notifier(NotifySettings(webhook=ep.url + "/secret-topic", retries=3), tmp_path / "notify.json")
        [result] = n.deliver(FINISHED)
    assert len(ep.received) == 4  # the first attempt and 3 retries
    assert not result["ok"] and result["attempts"] == 4 and "HTTP 500" in result["error"]
    record = json.loads((tmp_path / "notify.json").read_text())
    assert record["failed"] == 1 and record["last_failure"]["kind"] == "finished"
    assert record["last_failure"]["target"] == f"webhook http://127.0.0.1:{ep.url.rsplit(':', 1)[1]}/… (json)"
    assert "secret-topic" not in (tmp_path / "notify.json").read_text()
    # a 500 then a 200: delivered at the second attempt
    with Endpoint(answers=[500]).running() as ep:
        [result] = Notifier(NotifySettings(webhook=ep.url)).deliver(FINISHED)
    assert result["ok"] and result["attempts"] == 2


def test_an_endpoint_that_never_answers_holds_only_the_notifiers_thread(tmp_path):
    with Endpoint(answers=["hang"] * 10).running() as ep:
        n = Notifier(NotifySettings(webhook=ep.url, timeout=0.5, retries=1), tmp_path / "notify.json").start()
        try:
            n.submit(FINISHED)
            assert ep.got.wait(20)  # the thread is inside the request now, and blocked there
            for _ in range(50):  # the loop's calls go on while it is: each one only queues
                assert n.submit(FAILED)
            assert n.status()["pending"] >= 50
            wait(lambda: n.status()["failed"] >= 1)  # the timeout ends the attempt; it is recorded
            assert "timed out" in n.status()["last_failure"]["error"]
        finally:
            ep.release.set()
            n.stop(timeout=0.1)


def test_the_queue_is_bounded_the_oldest_dropped(tmp_path):
    n = Notifier(NotifySettings(webhook="http://127.0.0.1:9/"))  # never started: nothing is sent
    for i in range(delivery.MAX_PENDING + 3):
        n.submit(notification("stalled", "bert", T0 + i, f"n{i}"))
    assert n.status()["pending"] == delivery.MAX_PENDING and n.status()["dropped"] == 3


def test_kinds_not_asked_for_and_no_target_send_nothing():
    assert not Notifier(NotifySettings()).submit(FINISHED)
    only_failed = Notifier(NotifySettings(webhook="http://127.0.0.1:9/", events=("failed",)))
    assert not only_failed.submit(FINISHED) and only_failed.submit(FAILED)


def test_a_command_gets_the_event_on_stdin_and_its_failure_is_recorded(tmp_path):
    out = tmp_path / "got.json"
    script = ("import json, os, sys; d = json.load(sys.stdin); d['env'] = os.environ['ELTCTL_NOTIFY_KIND']; "
              f"open({str(out)!r}, 'w').write(json.dumps(d))")
    [r] = Notifier(NotifySettings(command=(sys.executable, "-c", script))).deliver(FAILED)
    assert r["ok"] and r["target"] == f"command {sys.executable}"
    got = json.loads(out.read_text())
    assert got["kind"] == got["env"] == "failed" and got["cause"] == "ValueError: bad batch" and "text" in got
    bad = (sys.executable, "-c", "import sys; print('no route to the pager', file=sys.stderr); sys.exit(3)")
    [r] = Notifier(NotifySettings(command=bad, retries=1)).deliver(FAILED)
    assert not r["ok"] and r["attempts"] == 2 and r["error"] == "exited with status 3: no route to the pager"
    slow = (sys.executable, "-c", "import time; time.sleep(30)")
    [r] = Notifier(NotifySettings(command=slow, retries=0, timeout=0.5)).deliver(FAILED)
    assert not r["ok"] and "killed" in r["error"]


def test_eltctl_notify_test_sends_one_and_says_how_it_went(tmp_path):
    import os
    import subprocess

    def run(url: str) -> subprocess.CompletedProcess:
        (tmp_path / "hosts.toml").write_text('[job]\nname = "bert"\ncommand = "python t.py"\n'
                                             f'[notify]\nwebhook = "{url}"\nretries = 1\ntimeout = "2s"\n'
                                             '[[hosts]]\nname = "a"\naddress = "local"\n')
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "XDG_STATE_HOME": str(tmp_path / "state")}
        return subprocess.run([sys.executable, "-m", "eltctl", "notify", "test", "--kind", "failed"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    with Endpoint(answers=[200, 503, 503]).running() as ep:
        ok = run(ep.url + "/topic")
        bad = run(ep.url + "/topic")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"sent to webhook http://127.0.0.1:{ep.url.rsplit(':', 1)[1]}/… (json) (1 attempt(s))"
    assert ep.received[0][2]["kind"] == "failed" and ep.received[0][2]["test"] is True
    assert bad.returncode == 1 and "failed to webhook" in bad.stdout and "HTTP 503" in bad.stdout, bad.stdout
    assert not (tmp_path / "state").exists()  # the controller's record is not touched


def test_notify_test_without_a_target_says_how_to_configure_one_and_exits_1(tmp_path, monkeypatch, capsys):
    # Nothing configured is not a command-line mistake (it exited 2): nothing was sent (1),
    # and the message says what to add where.
    from eltctl.cli import main

    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[job]\nname = "bert"\ncommand = "python t.py"\n[[hosts]]\nname = "a"\naddress = "local"\n')
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["-i", str(inventory), "notify", "test"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (1, "")
    assert captured.err == (
        f"error: no notifications are configured: {inventory} has no [notify] webhook or command, so there is "
        "nothing to test\n"
        '  hint: add a [notify] section to it with webhook = "https://..." (ntfy, Slack, a generic JSON POST) '
        'and/or command = ["/path/to/program"]; docs/notifications.md\n')
