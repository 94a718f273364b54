"""The courtesy keys (eltctl/inventory/courtesy.py): [policy] defaults, per-host
overrides, daemon.json's "courtesy" object, and a bad value named by file and key."""

from __future__ import annotations

import pytest

from eltctl.errors import ConfigError
from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.inventory import parse_inventory
from eltctl.inventory.courtesy import Courtesy, for_host, parse_size_mib

HEAD = '[job]\nname = "j"\ncommand = "python t.py"\n'


def inv(policy: str = "", host: str = ""):
    return parse_inventory(f"{HEAD}[policy]\n{policy}\n[[hosts]]\naddress = \"h1\"\n{host}\n"
                           "[[hosts]]\naddress = \"h2\"\n", "/lab/hosts.toml")


def test_defaults_are_nice_10_best_effort_and_no_limits():
    i = inv()
    assert i.courtesy == Courtesy(nice=10, ionice="best-effort", cpu_threads=None, memory_limit_mib=None)
    assert for_host(i.courtesy, i.hosts[0].courtesy) == i.courtesy


def test_a_host_overrides_policy_key_by_key():
    i = inv('nice = 5\ncpu_threads = 8\nmemory_limit = "16GiB"', 'ionice = "idle"\ncpu_threads = 2\nnice = 19')
    h1, h2 = (for_host(i.courtesy, h.courtesy) for h in i.hosts)
    assert h1 == Courtesy(nice=19, ionice="idle", cpu_threads=2, memory_limit_mib=16384)
    assert h2 == Courtesy(nice=5, ionice="best-effort", cpu_threads=8, memory_limit_mib=16384)


def test_daemon_json_carries_the_hosts_courtesy():
    i = inv('memory_limit = 512', 'nice = 0\nionice = "none"')
    doc = hostops.daemon_config(i, i.hosts[0], HostPaths(home="/h", job="j", host="h1"), "10.0.0.5:1", None)
    assert doc["courtesy"] == {"nice": 0, "ionice": "none", "cpu_threads": None, "memory_limit_mib": 512}


@pytest.mark.parametrize("text, mib", [("16GiB", 16384), ("16G", 16384), ("512MiB", 512), ("512m", 512),
                                       ("1.5G", 1536), ("1T", 1048576), ("2048", 2048)])
def test_sizes(text, mib):
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("policy, host, says", [
    ("nice = 20", "", "policy.nice: must be from 0 to 19"),
    ("nice = -5", "", "policy.nice"),
    ('ionice = "realtime"', "", 'policy.ionice: must be one of "best-effort", "idle", "none"'),
    ("", 'ionice = "Idle"', 'hosts[0].ionice (host "h1"): must be one of'),
    ("cpu_threads = 0", "", "policy.cpu_threads: must be"),
    ('memory_limit = "lots"', "", 'policy.memory_limit: "lots" is not a size'),
    ("", "memory_limit = 0", 'hosts[0].memory_limit (host "h1"): must be at least 1 MiB'),
    ("", "memory_limit = true", "hosts[0].memory_limit"),
    ("", "nicee = 3", "did you mean nice?"),
])
def test_a_bad_value_names_the_file_and_key(policy, host, says):
    with pytest.raises(ConfigError) as err:
        inv(policy, host)
    text = str(err.value)
    assert "/lab/hosts.toml" in text and says in text, text
