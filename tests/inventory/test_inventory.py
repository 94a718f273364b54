"""The inventory parser: hosts.toml text in, frozen values or one precise ConfigError out.

Cases are tables: a small TOML document and the exact message a user reads
(`path:line: key path: what is wrong and what to write`).
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from eltctl.durations import format_duration, parse_duration
from eltctl.errors import ConfigError
from eltctl.inventory import (
    HOST_KEYS,
    JOB_KEYS,
    POLICY_KEYS,
    SSH_KEYS,
    STORAGE_KEYS,
    DeviceKind,
    load_inventory,
    parse_inventory,
)
from eltctl.inventory.tables import KeyLines

REPO = Path(__file__).resolve().parents[2]

JOB = '[job]\nname = "t"\ncommand = ["python", "train.py"]\n'
HOST = '[[hosts]]\nname = "h1"\naddress = "10.0.0.1"\n'


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own directory and names its file relative to it, as users do."""
    monkeypatch.chdir(tmp_path)


def parse(text: str, where: str = "hosts.toml"):
    return parse_inventory(textwrap.dedent(text), Path(where))


def error_of(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value


# ---------------------------------------------------------------- valid documents


def test_minimal_inventory_takes_documented_defaults(tmp_path):
    inv = parse(JOB + '[[hosts]]\naddress = "gpu1.lab"\n')
    assert inv.path == tmp_path / "hosts.toml"
    assert inv.job.name == "t"
    assert inv.job.command == ("python", "train.py")
    assert inv.job.workdir == tmp_path  # the file's directory
    assert (inv.job.min_workers, inv.job.max_workers, inv.job.device) == (1, None, DeviceKind.AUTO)
    assert inv.ssh.port == 22 and inv.ssh.user is None and inv.ssh.connect_timeout == 10.0
    assert inv.policy.idle_for == 600.0 and inv.policy.memory_threshold_mib == 500
    assert inv.storage.mirror is None and inv.storage.keep == 3
    (host,) = inv.hosts
    assert host.name == "gpu1.lab"  # a host without a name is called by its address
    assert (host.port, host.user, host.python, host.gpus, host.slots) == (22, None, "python3", None, 1)
    assert not host.is_local


def test_every_key_is_read_into_its_field(tmp_path):
    inv = parse(
        """\
        [job]
        name = "resnet-1"
        command = "torchrun --standalone 'my script.py' --lr 0.1"
        workdir = "code"
        min_workers = 2
        max_workers = 6
        device = "cpu"
        env = { OMP_NUM_THREADS = "2", A_B = "x y" }

        [ssh]
        user = "alice"
        port = 2200
        identity_file = "keys/id_ed25519"
        known_hosts = "/etc/eltctl/known_hosts"
        connect_timeout = "1500ms"
        command_timeout = 45
        max_parallel = 8

        [policy]
        idle_for = "1h30m"
        memory_threshold_mib = 0
        utilization_threshold = 100
        cooldown = 0
        probe_interval = 2.5
        nvidia_smi_timeout = "3s"

        [storage]
        mirror = "ssh://bob@store:2222/ckpt"
        keep = 1

        [[hosts]]
        name = "ws"
        address = "ws.lab"
        [[hosts]]
        name = "srv"
        address = "10.0.0.12"
        port = 2222
        user = "train"
        python = "/opt/conda/bin/python"
        gpus = [3, 1]
        env = { NCCL_SOCKET_IFNAME = "eth0" }
        [[hosts]]
        name = "here"
        address = "local"
        slots = 4
        """,
    )
    assert inv.job == inv.job.__class__(
        name="resnet-1",
        command=("torchrun", "--standalone", "my script.py", "--lr", "0.1"),
        workdir=tmp_path / "code",
        min_workers=2,
        max_workers=6,
        device=DeviceKind.CPU,
        env=(("OMP_NUM_THREADS", "2"), ("A_B", "x y")),
    )
    assert inv.ssh.identity_file == tmp_path / "keys" / "id_ed25519"
    assert inv.ssh.known_hosts == Path("/etc/eltctl/known_hosts")
    assert (inv.ssh.user, inv.ssh.port, inv.ssh.max_parallel) == ("alice", 2200, 8)
    assert (inv.ssh.connect_timeout, inv.ssh.command_timeout) == (1.5, 45.0)
    assert dataclasses.astuple(inv.policy) == (5400.0, 0, 100, 0.0, 2.5, 3.0, 1.0, 3, 10.0, 0.0,
                                              86400.0, 0, 600.0)
    assert (inv.storage.mirror, inv.storage.keep) == ("ssh://bob@store:2222/ckpt", 1)
    ws, srv, here = inv.hosts
    assert (ws.port, ws.user, ws.gpus) == (2200, "alice", None)  # [ssh] defaults
    assert (srv.port, srv.user, srv.python, srv.gpus) == (2222, "train", "/opt/conda/bin/python", (3, 1))
    assert srv.env == (("NCCL_SOCKET_IFNAME", "eth0"),)
    assert here.is_local and here.slots == 4
    assert inv.host("srv") is srv


def test_home_and_relative_paths_resolve_against_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    inv = parse(
        JOB.replace('[job]\n', '[job]\nworkdir = "../src"\n')
        + '[ssh]\nidentity_file = "~/.ssh/k"\n[storage]\nmirror = "mirror"\n' + HOST,
        "conf/hosts.toml",
    )
    assert inv.job.workdir == tmp_path / "conf" / ".." / "src"
    assert inv.ssh.identity_file == tmp_path / "home" / ".ssh" / "k"
    assert inv.storage.mirror == str(tmp_path / "conf" / "mirror")


def test_values_are_frozen():
    inv = parse(JOB + HOST)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inv.hosts[0].port = 23  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        inv.policy.idle_for = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "gpus, expected",
    [('"all"', None), ("[0]", (0,)), ("[0, 1]", (0, 1)), ("[7, 2]", (7, 2))],
)
def test_gpus_all_or_indices(gpus, expected):
    inv = parse(JOB + HOST + f"gpus = {gpus}\n")
    assert inv.hosts[0].gpus == expected


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
def test_device_kinds(device):
    assert parse(JOB + f'device = "{device}"\n' + HOST).job.device == DeviceKind(device)


# ---------------------------------------------------------------- one mistake, one exact message

ERRORS = [
    # (what, document, the exact message)
    ("toml syntax: missing =", JOB + "[[hosts]]\nname \"h\"\n",
     "hosts.toml:5: invalid TOML: Expected '=' after a key in a key/value pair (column 6)"),
    ("toml syntax: unterminated string", '[job]\nname = "t\n',
     "hosts.toml:2: invalid TOML: Illegal character '\\n' (column 10)"),
    ("toml syntax: table declared twice", JOB + "[job]\n",
     "hosts.toml:4: invalid TOML: Cannot declare ('job',) twice (column 5)"),
    ("unknown key with a suggestion", JOB + '[policy]\nidel_for = "10m"\n' + HOST,
     "hosts.toml:5: policy.idel_for: unknown key; did you mean idle_for?"),
    ("unknown host key with a suggestion", JOB + HOST + "adress = \"x\"\n",
     'hosts.toml:7: hosts[0].adress (host "h1"): unknown key; did you mean address?'),
    ("unknown key without a near name", JOB + "colour = 1\n" + HOST,
     "hosts.toml:4: job.colour: unknown key; [job] accepts: name, command, workdir, "
     "min_workers, max_workers, device, env, shared_filesystem, mode, stop_grace, progress, max_restarts, "
     "restart_window, priority, exclude, include"),
    ("unknown section", JOB + "[host]\nname = 'a'\n" + HOST,
     "hosts.toml:4: host: unknown section; did you mean hosts?"),
    ("missing job section", HOST,
     'hosts.toml: job: missing the [job] section; add [job] with name = "..." and command = "..."'),
    ("missing job name", '[job]\ncommand = "x"\n' + HOST,
     'hosts.toml:1: job.name: missing; add name = "my-job"'),
    ("missing address names the host", JOB + HOST + '[[hosts]]\nname = "gpu4"\nport = 22\n',
     'hosts.toml:7: hosts[1].address (host "gpu4"): missing; add address = "hostname or IP" '
     '(or "local" for this machine)'),
    ("no hosts", JOB,
     "hosts.toml: hosts: no hosts; add at least one [[hosts]] section with name and address"),
    ("an empty hosts array", "hosts = []\n" + JOB,
     "hosts.toml:1: hosts: no hosts; add at least one [[hosts]] section with name and address"),
    ("hosts written as one table", JOB + '[hosts]\nname = "a"\n',
     "hosts.toml:4: hosts: must be an array of tables: write [[hosts]] (two brackets) before each host"),
    ("port as a string", JOB + HOST + 'port = "22"\n',
     'hosts.toml:7: hosts[0].port (host "h1"): must be an integer from 1 to 65535, '
     'got a string ("22"); remove the quotes: port = 22'),
    ("port out of range", JOB + HOST + "port = 70000\n",
     'hosts.toml:7: hosts[0].port (host "h1"): must be from 1 to 65535, got 70000'),
    ("boolean is not an integer", JOB + "min_workers = true\n" + HOST,
     "hosts.toml:4: job.min_workers: must be an integer >= 1, got a boolean (true)"),
    ("min_workers below 1", JOB + "min_workers = 0\n" + HOST,
     "hosts.toml:4: job.min_workers: must be >= 1, got 0"),
    ("max below min", JOB + "min_workers = 4\nmax_workers = 2\n" + HOST,
     "hosts.toml:5: job.max_workers: must be >= job.min_workers (4), got 2; raise it or lower min_workers"),
    ("float for an integer", JOB + "[ssh]\nmax_parallel = 8.0\n" + HOST,
     "hosts.toml:5: ssh.max_parallel: must be an integer >= 1, got a float (8.0); write max_parallel = 8"),
    ("command of the wrong type", '[job]\nname = "t"\ncommand = 5\n' + HOST,
     'hosts.toml:3: job.command: must be a string or a list of strings, got an integer (5); '
     'write command = ["python", "train.py"]'),
    ("command list with a number", '[job]\nname = "t"\ncommand = ["python", 3]\n' + HOST,
     "hosts.toml:3: job.command[1]: must be a string, got an integer (3); quote it"),
    ("command with an open quote", '[job]\nname = "t"\ncommand = "python \'a.py"\n' + HOST,
     "hosts.toml:3: job.command: cannot be split into arguments (No closing quotation); "
     "check its quotes, or write it as a list"),
    ("device typo", JOB + 'device = "gpu"\n' + HOST,
     'hosts.toml:4: job.device: must be one of "auto", "cuda", "cpu", got a string ("gpu"); '
     'did you mean "cuda"?'),
    ("bad duration", JOB + '[policy]\nidle_for = "10 mins"\n' + HOST,
     'hosts.toml:5: policy.idle_for: "10 mins" is not a duration: write it like '
     '"90s", "10m", "1h30m", "500ms" or a number of seconds'),
    ("zero timeout", JOB + "[ssh]\nconnect_timeout = 0\n" + HOST,
     "hosts.toml:5: ssh.connect_timeout: must be longer than 0 s, got 0"),
    ("negative duration", JOB + "[policy]\ncooldown = -5\n" + HOST,
     "hosts.toml:5: policy.cooldown: a duration must be a finite number of seconds >= 0, got -5"),
    ("utilisation over 100", JOB + "[policy]\nutilization_threshold = 150\n" + HOST,
     "hosts.toml:5: policy.utilization_threshold: must be from 0 to 100 (percent), got 150"),
    ("host name with a slash", JOB + '[[hosts]]\nname = "a/b"\naddress = "x"\n',
     'hosts.toml:5: hosts[0].name (host "a/b"): "a/b" is not usable as a host name: use letters, '
     "digits, '.', '_' and '-' only, starting with a letter, digit or '_' (it names files)"),
    ("host name ..", JOB + '[[hosts]]\nname = ".."\naddress = "x"\n',
     'hosts.toml:5: hosts[0].name (host ".."): ".." is not usable as a host name: use letters, '
     "digits, '.', '_' and '-' only, starting with a letter, digit or '_' (it names files)"),
    ("host name like an option", JOB + '[[hosts]]\nname = "-rf"\naddress = "x"\n',
     'hosts.toml:5: hosts[0].name (host "-rf"): "-rf" is not usable as a host name: use letters, '
     "digits, '.', '_' and '-' only, starting with a letter, digit or '_' (it names files)"),
    ("job name .", '[job]\nname = "."\ncommand = ["python", "t.py"]\n' + HOST,
     'hosts.toml:2: job.name: "." is not a valid job name: use letters, digits, \'.\', \'_\' and \'-\' '
     "only, starting with a letter, digit or '_' (it names files and directories)"),
    ("address unusable as a name", JOB + '[[hosts]]\naddress = "fe80::1"\n',
     'hosts.toml:4: hosts[0].name (host "fe80::1"): missing, and the address "fe80::1" is not usable '
     "as a host name; add name = \"...\" (letters, digits, '.', '_' and '-' only, starting with a letter, "
     "digit or '_')"),
    ("gpus as a count", JOB + HOST + "gpus = 2\n",
     'hosts.toml:7: hosts[0].gpus (host "h1"): must be "all" or a list of GPU indices, got an '
     'integer (2); write gpus = "all" or a list of indices such as gpus = [0, 1]'),
    ("negative gpu index", JOB + HOST + "gpus = [0, -1]\n",
     'hosts.toml:7: hosts[0].gpus[1] (host "h1"): must be a GPU index (an integer >= 0), got -1'),
    ("gpu listed twice", JOB + HOST + "gpus = [1, 1]\n",
     'hosts.toml:7: hosts[0].gpus (host "h1"): lists GPU 1 more than once'),
    ("slots zero", JOB + HOST + "slots = 0\n",
     'hosts.toml:7: hosts[0].slots (host "h1"): must be >= 1 (CPU workers on this host), got 0'),
    ("env value not a string", JOB + "env = { N = 4 }\n" + HOST,
     'hosts.toml:4: job.env.N: must be a string, got an integer (4); environment values are text: '
     'write N = "4"'),
    ("env overriding the GPU choice", JOB + HOST + 'env = { CUDA_VISIBLE_DEVICES = "1" }\n',
     'hosts.toml:7: hosts[0].env.CUDA_VISIBLE_DEVICES (host "h1"): is set by eltctl for each worker '
     "and cannot be overridden; choose GPUs with gpus = [...] in [[hosts]]"),
    ("env overriding eltctl's own", JOB + 'env = { ELTCTL_JOB = "x" }\n' + HOST,
     "hosts.toml:4: job.env.ELTCTL_JOB: is set by eltctl for each worker and cannot be overridden"),
    ("mirror of an unknown scheme", JOB + '[storage]\nmirror = "s3://b/c"\n' + HOST,
     'hosts.toml:5: storage.mirror: "s3://b/c": only a directory or ssh://[user@]host[:port]/path '
     "is supported"),
    ("duplicate host names", JOB + HOST + '\n[[hosts]]\nname = "h1"\naddress = "10.0.0.2"\n',
     'hosts.toml:9: hosts[1].name (host "h1"): duplicate host name "h1" (also hosts[0], line 5); '
     "give each host a unique name"),
    ("duplicate default names", JOB + '[[hosts]]\naddress = "a"\n[[hosts]]\naddress = "a"\n',
     'hosts.toml:6: hosts[1] (host "a"): duplicate host name "a" (also hosts[0], line 5); '
     'give each host a unique name with name = "..."'),
    ("ssh table of the wrong type", 'ssh = 3\n' + JOB + HOST,
     "hosts.toml:1: ssh: must be a table, got an integer (3); write it as a [ssh] section"),
]


def test_the_fork_server_switch_is_the_one_eltctl_variable_a_job_may_set():
    """`ELTCTL_FORK_SERVER = "0"` starts each worker as its own process (runtime/daemon/forkserver.py)."""
    from eltctl.inventory.tables import FORK_SERVER_ENV
    from eltctl_runtime.daemon.forkserver import ENV_SWITCH
    assert FORK_SERVER_ENV == ENV_SWITCH
    inv = parse(JOB + 'env = { ELTCTL_FORK_SERVER = "0" }\n' + HOST)
    assert ("ELTCTL_FORK_SERVER", "0") in inv.job.env


@pytest.mark.parametrize("what, text, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_each_mistake_has_an_exact_message(what, text, message):
    err = error_of(text)
    assert err.message == message
    assert err.exit_code == 2


def test_all_problems_are_reported_at_once_in_file_order():
    err = error_of(
        """\
        [[hosts]]
        name = "a"
        address = "x"
        port = 0
        [[hosts]]
        name = "a"
        address = "y"
        [job]
        name = "j"
        command = []
        min_workers = 0
        """,
    )
    assert [(p.line, p.key) for p in err.problems] == [
        (4, 'hosts[0].port (host "a")'),
        (6, 'hosts[1].name (host "a")'),
        (10, "job.command"),
        (11, "job.min_workers"),
    ]
    lines = err.message.splitlines()
    assert lines[0] == "hosts.toml: 4 problems"
    assert lines[1:] == [f"  {p.message}" for p in err.problems]
    assert (err.line, err.key) == (4, 'hosts[0].port (host "a")')  # the first one


def test_a_host_with_a_problem_still_counts_for_duplicates():
    err = error_of(JOB + HOST + "slots = 0\n" + HOST)
    assert [p.key for p in err.problems] == ['hosts[0].slots (host "h1")', 'hosts[1].name (host "h1")']


# ---------------------------------------------------------------- the file


def test_missing_file_says_which_and_suggests_init():
    with pytest.raises(ConfigError) as info:
        load_inventory(Path("hosts.toml"))
    assert info.value.message == "hosts.toml: no such inventory file"
    assert info.value.hint == ("write a commented starter with `eltctl init` and edit it, or choose "
                               "another file with `eltctl -i PATH ...` or ELTCTL_INVENTORY=PATH")
    with pytest.raises(ConfigError) as info:
        load_inventory(Path("conf/lab hosts.toml"), origin="$ELTCTL_INVENTORY")
    assert info.value.message == "conf/lab hosts.toml: no such inventory file (named by $ELTCTL_INVENTORY)"
    assert "`eltctl init 'conf/lab hosts.toml'`" in info.value.hint


def test_directory_and_non_utf8_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not an inventory file"):
        load_inventory(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(JOB.encode() + b'# caf\xe9\n')
    with pytest.raises(ConfigError) as info:
        load_inventory(bad)
    assert info.value.message == f"{bad}:4: not UTF-8 text (TOML files must be UTF-8)"


def test_load_reads_the_file(tmp_path):
    f = tmp_path / "lab.toml"
    f.write_text(JOB + HOST)
    assert load_inventory(f).hosts[0].address == "10.0.0.1"


# ---------------------------------------------------------------- the example and the starter


def test_example_parses_with_the_four_kinds_of_host():
    inv = load_inventory(REPO / "hosts.example.toml")
    kinds = {h.name: h for h in inv.hosts}
    assert any(h.gpus is None and not h.is_local for h in inv.hosts)  # a workstation, all GPUs
    assert any(h.gpus == (0, 1) for h in inv.hosts)  # a server with some GPUs
    assert any(h.slots > 1 for h in inv.hosts)  # a CPU-only box
    assert any(h.is_local for h in inv.hosts)
    assert len(kinds) == len(inv.hosts)


def test_starter_is_the_example():
    from eltctl.commands.init import STARTER

    assert (REPO / "hosts.example.toml").read_text(encoding="utf-8") == STARTER


@pytest.mark.parametrize(
    "table, keys",
    [("job", JOB_KEYS), ("ssh", SSH_KEYS), ("policy", POLICY_KEYS), ("storage", STORAGE_KEYS),
     ("hosts", HOST_KEYS)],
)
def test_example_documents_every_key_with_a_comment(table, keys):
    text = (REPO / "hosts.example.toml").read_text(encoding="utf-8")
    section = text.split(f"[{table}]", 1)[1] if table != "hosts" else text.split("\n[[hosts]]\n", 1)[0]
    for key in keys:
        if table == "hosts":
            # [[hosts]] keys are documented once, as a list before the first host
            assert re.search(rf"^#\s+{key}\s+\S", section, re.M), f"hosts.{key} undocumented"
            continue
        m = re.search(rf"^(?:# )?{key} = ", section, re.M)
        assert m, f"{table}.{key} missing from hosts.example.toml"
        before = section[: m.start()].rstrip("\n").splitlines()[-1]
        assert before.startswith("#"), f"{table}.{key} has no comment above it"


# ---------------------------------------------------------------- durations and key lines

DURATIONS = [
    ("90s", 90.0), ("10m", 600.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0),
    ("2d", 172800.0), ("45", 45.0), (45, 45.0), (2.5, 2.5), ("0", 0.0), (" 10M ", 600.0),
]


@pytest.mark.parametrize("value, seconds", DURATIONS)
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "10 mins", "m", "1x", "-5", -1, True, [1], "1h-5m", "nan", float("inf")])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.5, "500ms"), (90, "1m30s"), (5400, "1h30m"),
                                           (600, "10m"), (2.5, "2.5s")])
def test_format_duration_reads_back(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


def test_key_lines_places_keys_tables_and_array_elements():
    text = textwrap.dedent(
        '''\
        title = """
        name = "not a key"
        """
        [job]
        name = "j"
        env.A = "1"
        [[hosts]]
        address = "a"
        [[hosts]]
          "port" = 22
        [hosts.env]
        X = "1"
        '''
    )
    lines = KeyLines.scan(text)
    assert lines.line_of("title") == 1
    assert lines.line_of("job") == 4
    assert lines.line_of("job.name") == 5
    assert lines.line_of("job.env.A") == 6
    assert lines.line_of("hosts[0].address") == 8
    assert lines.line_of("hosts[1].port") == 10
    assert lines.line_of("hosts[1].env.X") == 12
    assert lines.line_of("hosts[1].address") == 9  # not written: its table's line
    assert lines.line_of("policy.idle_for") is None


def test_fair_share_keys(tmp_path):
    inv = parse("""
        [job]
        name = "a"
        command = "python t.py"
        priority = 2
        [policy]
        usage_half_life = "2h"
        fairshare_slack = 1
        fairshare_hold = "30s"
        [[hosts]]
        name = "h"
        address = "local"
        """)
    assert inv.job.priority == 2
    assert (inv.policy.usage_half_life, inv.policy.fairshare_slack, inv.policy.fairshare_hold) == (7200.0, 1, 30.0)
