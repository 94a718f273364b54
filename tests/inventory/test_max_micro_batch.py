"""`[[hosts]] max_micro_batch`: from hosts.toml through daemon.json to the
worker's environment, where the runtime reads it (ELTCTL_MAX_MICRO_BATCH)."""

from __future__ import annotations

import json

import pytest

from eltctl.errors import ConfigError
from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.inventory import parse_inventory
from eltctl_runtime import RuntimeConfig
from eltctl_runtime.daemon import DaemonConfig, DaemonConfigError, worker_env

JOB = '[job]\nname = "j"\ncommand = "python t.py"\n'


def test_a_hosts_limit_reaches_its_workers_environment(tmp_path):
    inv = parse_inventory(JOB + '[[hosts]]\nname = "a"\naddress = "a"\nmax_micro_batch = 16\n'
                                '[[hosts]]\nname = "b"\naddress = "b"\n', tmp_path / "hosts.toml")
    a, b = inv.hosts
    assert (a.max_micro_batch, b.max_micro_batch) == (16, None)
    for host, want in ((a, 16), (b, None)):
        doc = hostops.daemon_config(inv, host, HostPaths(home="/h", job="j", host=host.name), "10.0.0.5:1", None)
        cfg = DaemonConfig.from_json(json.dumps(doc))
        env = worker_env(cfg, {"ELTCTL_MAX_MICRO_BATCH": "3"}, 0, f"{host.name}/0/1")  # never inherited
        assert RuntimeConfig.from_env(env).max_micro_batch == want


def test_a_limit_below_one_names_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_inventory(JOB + '[[hosts]]\nname = "a"\naddress = "a"\nmax_micro_batch = 0\n', tmp_path / "hosts.toml")
    assert 'hosts[0].max_micro_batch (host "a"): must be >= 1' in str(info.value)
    assert "leave it out: no limit" in str(info.value)


@pytest.mark.parametrize("value", [0, -2, "8", True, 1.5])
def test_daemon_json_refuses_a_limit_that_is_not_a_positive_integer(value):
    base = {"job": "j", "host": "h", "store": "127.0.0.1:1", "job_dir": "/j", "code_dir": "/c", "command": ["x"]}
    with pytest.raises(DaemonConfigError, match="max_micro_batch"):
        DaemonConfig.from_json(json.dumps({**base, "max_micro_batch": value}))
