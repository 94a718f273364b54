"""[notify] and [controller] metrics_file: read, defaults, exact messages, documented in the example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eltctl.errors import ConfigError
from eltctl.inventory import parse_inventory
from eltctl.inventory.notify import NOTIFY_EVENTS, NOTIFY_KEYS, NotifySettings

REPO = Path(__file__).resolve().parents[2]
BASE = '[job]\nname = "j"\ncommand = "python t.py"\n'
HOST = '[[hosts]]\nname = "a"\naddress = "a.lab"\n'


def test_defaults_send_nothing():
    inv = parse_inventory(BASE + HOST, "/lab/hosts.toml")
    assert inv.notify == NotifySettings() and not inv.notify.enabled
    assert inv.controller.metrics_file is None
    assert (inv.notify.timeout, inv.notify.retries, inv.notify.stall_after) == (10.0, 3, 1800.0)
    assert inv.notify.events == NOTIFY_EVENTS


def test_every_key_is_read():
    inv = parse_inventory(BASE + '[controller]\nmetrics_file = "m/bert.prom"\n[notify]\n'
                          'webhook = "https://ntfy.sh/lab"\nformat = "ntfy"\nheaders = { Authorization = "Bearer x" }\n'
                          'command = "notify-lab --json"\ntimeout = "3s"\nretries = 5\nstall_after = "1h"\n'
                          'events = ["failed", "finished", "failed"]\n' + HOST, "/lab/hosts.toml")
    n = inv.notify
    assert inv.controller.metrics_file == Path("/lab/m/bert.prom")  # relative to the inventory
    assert (n.webhook, n.format, n.headers, n.command) == ("https://ntfy.sh/lab", "ntfy",
                                                           (("Authorization", "Bearer x"),), ("notify-lab", "--json"))
    assert (n.timeout, n.retries, n.stall_after, n.events) == (3.0, 5, 3600.0, ("failed", "finished"))
    assert n.enabled and n.wants("failed") and not n.wants("paused") and n.wants("test")


@pytest.mark.parametrize("text, message", [
    ('webhook = "ntfy.sh/lab"', 'hosts.toml:5: notify.webhook: "ntfy.sh/lab" is not an http:// or https:// URL; '
                                'write e.g. webhook = "https://ntfy.sh/my-topic"'),
    ('format = "teams"', 'hosts.toml:5: notify.format: must be one of "json", "slack", "ntfy", got a string '
                         '("teams")'),
    ('events = ["done"]', 'hosts.toml:5: notify.events: names unknown event kind(s) "done"; choose from '
                          + ", ".join(f'"{e}"' for e in NOTIFY_EVENTS)),
    ("retries = -1", "hosts.toml:5: notify.retries: must be from 0 to 10 (attempts after the first), got -1"),
    ('timeout = "0s"', 'hosts.toml:5: notify.timeout: must be longer than 0 s, got "0s"'),
    ("command = []", "hosts.toml:5: notify.command: must be a string or a non-empty list of strings, got an array "
                     "([]); write command = [\"my-notifier\", \"--json\"] (run without a shell, the event on stdin)"),
    ('stall = "1m"', "hosts.toml:5: notify.stall: unknown key; did you mean stall_after?"),
])
def test_mistakes_name_the_file_the_key_and_the_fix(text, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(BASE + "[notify]\n" + text + "\n" + HOST, "hosts.toml")
    assert info.value.message == message


def test_the_example_documents_every_notify_key_and_metrics_file():
    text = (REPO / "hosts.example.toml").read_text(encoding="utf-8")
    section = text.split("[notify]", 1)[1].split("\n[[hosts]]\n", 1)[0]
    for key in NOTIFY_KEYS:
        m = re.search(rf"^(?:# )?{key} = ", section, re.M)
        assert m, f"notify.{key} missing from hosts.example.toml"
        assert section[: m.start()].rstrip("\n").splitlines()[-1].startswith("#"), f"notify.{key} has no comment"
    assert re.search(r"^# metrics_file = ", text.split("[controller]", 1)[1], re.M)
    inv = parse_inventory(text.replace("# webhook = ", "webhook = ").replace("# format = ", "format = "),
                          REPO / "hosts.example.toml")
    assert inv.notify.webhook == "https://ntfy.sh/my-lab-training"
