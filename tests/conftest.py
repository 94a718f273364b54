"""Shared fixtures and the markers' rules.

The tests mirror the source tree: the tests of `eltctl/hosts/ssh.py` are in
tests/hosts/test_ssh.py, those of `eltctl_runtime.daemon` (runtime/daemon/) in
tests/runtime/daemon/. A module's tests on real sshd hosts, when it also has
in-process ones, sit beside them as `test_<module>_sshd.py`. What a test needs is a
marker, not a folder:

- `sshd`: starts real sshd hosts (the `testbed` or `job_env` fixture, or tests.testbed
  directly). A test using `testbed` or `job_env` without it is a collection error.
- `slow`: a multi-process scenario that takes more than a few seconds.

`-m "not sshd"` and `-m "not slow"` leave them out. Fixtures: `testbed` (here) and
`job_env` (tests/testbed/jobenv.py, registered below as a plugin).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread for torch in the test processes, and the processes they start
# (the workers already run with one): on 2 shared cores torch's default pool of 2
# threads, under the load of the other tests, made an in-test reference run 16x slower
# (16 ms a step instead of 1 ms at load 8). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `tests` has no __init__.py; the repository root on sys.path makes the test bed
# importable under one name, `tests.testbed`, from any test (and from benchmarks).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.testbed import Testbed, make_testbed, sshd_missing_reason  # noqa: F401  (re-exported)

pytest_plugins = ["tests.testbed.jobenv"]

# The fixtures that start real sshd hosts: a test that uses one must be marked `sshd`.
SSHD_FIXTURES = ("testbed", "job_env")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_stamp_per_run(request, tmp_path_factory):
    """Under pytest-xdist, the workers make the test bed's torch stamp once between them
    (tests/testbed/torchstamp.py) in the run's temporary directory: the parent of each
    worker's own, which only this run uses (pytest keeps the last few runs' and removes
    older ones)."""
    if hasattr(request.config, "workerinput"):
        from tests.testbed.torchstamp import share_in

        share_in(tmp_path_factory.getbasetemp().parent)


@pytest.fixture
def testbed():
    """Simulated hosts on loopback. Starts nothing until `testbed.add_host()`;
    everything it started is torn down after the test, pass or fail."""
    reason = sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    bed = Testbed()
    try:
        yield bed
    finally:
        bed.close()


def _direct_params(item) -> set[str]:
    """Argument names a test gets from `@pytest.mark.parametrize` itself (not fixtures)."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        if mark.kwargs.get("indirect") is True:
            continue
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = [n.strip() for n in argnames.split(",")]
        indirect = mark.kwargs.get("indirect") or ()
        names.update(n for n in argnames if n not in indirect)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Keep the `sshd` marker true: every test that uses an sshd fixture carries it
    (checked before `-m`/`-k` deselect anything); under pytest-xdist, heavy modules first."""
    unmarked = []
    for item in items:
        uses = set(getattr(item, "fixturenames", ())) - _direct_params(item)
        needs = sorted(uses.intersection(SSHD_FIXTURES))
        if needs and item.get_closest_marker("sshd") is None:
            unmarked.append(f"{item.nodeid} (uses {', '.join(needs)})")
    if unmarked:
        raise pytest.UsageError("tests that start sshd hosts must be marked `sshd` "
                                "(e.g. `pytestmark = pytest.mark.sshd`):\n  " + "\n  ".join(unmarked))
    _heavy_modules_first(config, items)


def _weight(module_items) -> int:
    """0 for a module with a `slow` test, 1 for one with an `sshd` test, 2 for the rest."""
    marks = {m.name for item in module_items for m in item.iter_markers() if m.name in ("slow", "sshd")}
    return 0 if "slow" in marks else 1 if "sshd" in marks else 2


def _heavy_modules_first(config, items) -> None:
    """Under pytest-xdist (scripts/test.sh runs `-n 2 --dist worksteal`), the heavy modules first.

    worksteal gives each worker a contiguous part of this list and lets an idle one take the
    tail of a busy one's queue: with the long multi-process modules first, what is left to
    share at the end is short tests, not a several-minute scenario that one worker runs while
    the other waits. A module's tests stay together and in their order (a module-scoped bed is
    built once per worker that runs any of them). Every worker sorts the same collection the
    same way, as xdist requires. Without xdist the order is left as collected.
    """
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(modules.values(), key=_weight)  # stable: collection order within a weight
    items[:] = [item for group in ordered for item in group]
