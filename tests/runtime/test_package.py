"""`import eltctl_runtime` is light: the host daemon and the control plane's
helpers load without torch; the training machinery loads it on first use."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import eltctl_runtime as elt
import eltctl_runtime.daemon
assert "torch" not in sys.modules, "importing the package or the daemon imported torch"
assert callable(elt.report_dead) and elt.EventKind.YIELD.value == "yield"
from eltctl_runtime import report, checkpoint_saved
report(step=1, loss=0.5)  # outside eltctl: a no-op
checkpoint_saved("x")
assert "torch" not in sys.modules, "restart mode's report() imported torch"
job_class = elt.ElasticJob
assert "torch" in sys.modules and job_class.__module__ == "eltctl_runtime.train.job"
from eltctl_runtime import share_bounds, SamplerState, ExcludedFromJob, Commit
assert set(elt.__all__) <= set(dir(elt))
try:
    elt.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("an unknown attribute must raise AttributeError")
print("ok")
"""


def test_package_and_daemon_import_without_torch_and_job_loads_it_lazily():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
