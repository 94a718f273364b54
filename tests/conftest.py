"""Shared fixtures: the multi-host test bed (tests/testbed).

Helpers add their own fixtures in conftest files of their subdirectories; this
file only registers the test bed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `tests` has no __init__.py; the repository root on sys.path makes the test bed
# importable under one name, `tests.testbed`, from any test (and from benchmarks).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.testbed import Testbed, make_testbed, sshd_missing_reason  # noqa: F401  (re-exported)


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
