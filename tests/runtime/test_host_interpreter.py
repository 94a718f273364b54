"""Hosts have Python and torch only: the runtime must work there, and the test bed's
host interpreter must be such a one (or these tests would hide a numpy dependency)."""

from __future__ import annotations

import subprocess

from tests.testbed.hostpython import HOST_PYTHON, SETUP_HINT, host_env

STATE_ROUND_TRIP = """
import sys
import torch
import eltctl_runtime.train.state as st

model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 5)).sum().backward()
opt.step()
header, flat = st.pack(st.capture(model, opt, {"step": 3}))
# what a joiner does with what it received: the header came as a uint8 tensor
hbuf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
other_opt = torch.optim.Adam(other.parameters())
progress = st.apply(st.unpack(st.tensor_bytes(hbuf), flat.clone()), other, other_opt)
assert progress == {"step": 3}, progress
assert st.fingerprint(model, opt) == st.fingerprint(other, other_opt)
t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
assert st.tensor_bytes(t[:, 1::2]) == st.tensor_bytes(t[:, 1::2].contiguous())   # a strided view
assert st.tensor_bytes(t[2:]) == st.tensor_bytes(t)[2 * 6 * 4:]                # a view with an offset
assert st.tensor_bytes(torch.empty(0)) == b""
assert "numpy" not in sys.modules, "the runtime imported numpy"
print("ok")
"""


def run_on_host(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([HOST_PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                          env=host_env({"PATH": "/usr/bin:/bin"}))


def test_host_interpreter_has_torch_and_no_numpy():
    r = run_on_host("import torch, importlib.util as u; print(torch.__version__, u.find_spec('numpy') is None)")
    assert r.returncode == 0, f"{HOST_PYTHON}: {r.stderr.strip()}; {SETUP_HINT}"
    version, no_numpy = r.stdout.split()
    assert version.startswith("2.13.0")
    assert no_numpy == "True", f"numpy is importable by the host interpreter {HOST_PYTHON}; {SETUP_HINT}"


def test_state_round_trip_and_fingerprint_on_a_torch_only_host():
    r = run_on_host(STATE_ROUND_TRIP)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
