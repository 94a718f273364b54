"""The inventory keys the control plane added: [job] shared_filesystem, [policy]
watch_interval / bench_after / hang_timeout, [controller] address and store; and the
one rule for a list of names ([policy] and a host's owner_signals, [notify] events)."""

from __future__ import annotations

import pytest

from eltctl.errors import ConfigError
from eltctl.inventory import parse_inventory

BASE = '[job]\nname = "j"\ncommand = "python t.py"\n'
HOST = '[[hosts]]\nname = "a"\naddress = "a.lab"\n'


def test_defaults():
    inv = parse_inventory(BASE + HOST, "hosts.toml")
    assert inv.job.shared_filesystem is False
    assert (inv.policy.watch_interval, inv.policy.bench_after, inv.policy.hang_timeout) == (1.0, 3, 10.0)
    assert inv.controller.address is None
    assert inv.controller.store == "ssh"  # the store on loopback, forwarded over SSH


def test_every_new_key_is_read():
    inv = parse_inventory(BASE + 'shared_filesystem = true\n[policy]\nwatch_interval = "500ms"\nbench_after = 5\n'
                          'hang_timeout = "20s"\n[controller]\naddress = "10.0.0.5"\n' + HOST, "hosts.toml")
    assert inv.job.shared_filesystem is True
    assert (inv.policy.watch_interval, inv.policy.bench_after, inv.policy.hang_timeout) == (0.5, 5, 20.0)
    assert inv.controller.address == "10.0.0.5"
    inv = parse_inventory(BASE + '[controller]\nstore = "direct"\n' + HOST, "hosts.toml")
    assert inv.controller.store == "direct"


@pytest.mark.parametrize("text, message", [
    (BASE + 'shared_filesystem = "true"\n' + HOST,
     "hosts.toml:4: job.shared_filesystem: must be true or false, got a string (\"true\"); remove the quotes: "
     "shared_filesystem = true"),
    (BASE + '[policy]\nhang_timeout = "1m"\n' + HOST, "hosts.toml:5: policy.hang_timeout: must be at most 30s, got \"1m\""),
    (BASE + '[policy]\nbench_after = 0\n' + HOST,
     "hosts.toml:5: policy.bench_after: must be >= 1 (failures in a row before a host is benched), got 0"),
    (BASE + '[controller]\naddress = "10.0.0.5 10.0.0.6"\n' + HOST,
     "hosts.toml:5: controller.address: \"10.0.0.5 10.0.0.6\" contains whitespace; write one IP address of this "
     "machine that every host can reach"),
    (BASE + '[controller]\nstore = "lan"\n' + HOST,
     'hosts.toml:5: controller.store: must be one of "ssh", "direct", got a string ("lan")'),
    (BASE + '[controller]\nadress = "10.0.0.5"\n' + HOST, "hosts.toml:5: controller.adress: unknown key; did you mean address?"),
])
def test_mistakes_have_exact_messages(text, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(text, "hosts.toml")
    assert info.value.message == message


def test_job_mode_and_stop_grace():
    inv = parse_inventory(BASE + HOST, "hosts.toml")
    assert (inv.job.mode.value, inv.job.stop_grace) == ("elastic", 30.0)
    inv = parse_inventory(BASE + 'mode = "restart"\nstop_grace = "45s"\n' + HOST, "hosts.toml")
    assert (inv.job.mode.value, inv.job.stop_grace) == ("restart", 45.0)
    assert (inv.job.progress, inv.job.max_restarts, inv.job.restart_window) == (None, 5, 600.0)
    inv = parse_inventory(BASE + 'mode = "restart"\nprogress = "hf-trainer"\nmax_restarts = 3\n'
                          'restart_window = "5m"\n' + HOST, "hosts.toml")
    assert (inv.job.progress, inv.job.max_restarts, inv.job.restart_window) == ("hf-trainer", 3, 300.0)


@pytest.mark.parametrize("text, message", [
    (BASE + 'mode = "restrat"\n' + HOST,
     'hosts.toml:4: job.mode: must be one of "elastic", "restart", got a string ("restrat"); did you mean "restart"?'),
    (BASE + 'stop_grace = "0s"\n' + HOST, 'hosts.toml:4: job.stop_grace: must be longer than 0 s, got "0s"'),
    (BASE + 'progress = "step \\\\d+"\n' + HOST,
     "hosts.toml:4: job.progress: the progress pattern 'step \\\\d+' has no named group: give (?P<step>...) "
     "(and optionally loss, samples, samples_per_s), or name one of: step-loss, hf-trainer, lightning"),
    (BASE + 'max_restarts = -1\n' + HOST, "hosts.toml:4: job.max_restarts: must be >= 0 (0: never stop), got -1"),
])
def test_job_mode_mistakes_have_exact_messages(text, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(text, "hosts.toml")
    assert info.value.message == message


SIGNALS = '"login", "keyboard", "load", "memory"'


def test_owner_signals_and_notify_events_read_a_list_of_names_in_order_without_repeats():
    inv = parse_inventory(BASE + '[policy]\nowner_signals = ["load", "login", "load"]\n[notify]\nevents = []\n'
                          + HOST + 'owner_signals = []\n', "hosts.toml")
    assert inv.owner.signals == ("load", "login") and inv.notify.events == ()
    assert inv.owner_policy(inv.hosts[0]).signals == ()  # the host's own [] over [policy]'s


@pytest.mark.parametrize("text, message", [
    # one rule (inventory/tables.py Table.names) for [policy] owner_signals, a host's and [notify] events
    (BASE + '[policy]\nowner_signals = "login"\n' + HOST,
     f'hosts.toml:5: policy.owner_signals: must be a list of owner signals ({SIGNALS}; [] for none), got a string '
     '("login"); write owner_signals = ["login"]'),
    (BASE + '[policy]\nowner_signals = ["login", "mouse", 3]\n' + HOST,
     f'hosts.toml:5: policy.owner_signals: must be a list of owner signals ({SIGNALS}; [] for none), got an array '
     "(['login', 'mouse', 3])"),
    (BASE + HOST + 'owner_signals = ["login", "mouse"]\n',
     f'hosts.toml:7: hosts[0].owner_signals (host "a"): names unknown owner signal(s) "mouse"; choose from {SIGNALS}'),
    (BASE + '[notify]\nevents = "failed"\n' + HOST,
     'hosts.toml:5: notify.events: must be a list of event kinds ("finished", "failed", "paused", "resumed", '
     '"stalled", "benched", "quota", "forged"; [] for none), got a string ("failed"); write events = ["failed"]'),
])
def test_a_list_of_names_names_the_key_the_choices_and_the_fix(text, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(text, "hosts.toml")
    assert info.value.message == message
