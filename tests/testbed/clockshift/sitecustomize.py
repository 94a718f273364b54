"""A simulated host's wall clock set off (tests/testbed: `clock_offset_env`).

On the host's PYTHONPATH, so every Python process of its sessions (the daemon, the
workers, the host programs) reads `time.time()` shifted by ELTSIM_CLOCK_OFFSET seconds,
as on a machine whose clock is wrong. The monotonic clocks are left alone, as a wrong
wall clock leaves them. (libfaketime would shift every program, but its 0.9.10 breaks
Python's sleeps and timed waits.)
"""

import os
import time

_offset = float(os.environ.get("ELTSIM_CLOCK_OFFSET") or 0)
if _offset:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset
    time.time_ns = lambda: _time_ns() + int(_offset * 1e9)
