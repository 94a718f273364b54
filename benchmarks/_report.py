"""How a benchmark reports (benchmarks/heterogeneous.py, input_pipeline.py, resize.py):
progress lines on stderr; the result's `machine` (what it ran on, under what load);
the result on stdout as its table or (`--json`) one JSON object, and with `--save
FILE` that object in a file too."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable


def say(msg: str) -> None:
    """A progress line: on stderr, so that stdout holds only the result."""
    print(msg, file=sys.stderr, flush=True)


def machine(load_before: tuple[float, ...], started: float | None = None) -> dict:
    """CPUs, Python's and torch's versions, the load average before (`load_before`,
    os.getloadavg()) and now; with `started` (time.time()) the start and duration."""
    import torch

    out = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
           "loadavg_before": [round(x, 2) for x in load_before],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    if started is not None:
        out["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
        out["duration_s"] = round(time.time() - started, 1)
    return out


def emit(res: dict, *, as_json: bool, save: Path | None, render: Callable[[dict], str]) -> int:
    """Write `res` to `save` when given, print it (JSON or `render`'s table); the exit status, 0."""
    if save is not None:
        save.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1) if as_json else render(res))
    return 0
