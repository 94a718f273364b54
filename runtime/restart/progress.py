"""Restart mode: what an unmodified (or barely modified) script tells eltctl.

Two calls a torchrun script may make; both are no-ops outside eltctl (when
`ELTCTL_PROGRESS` is not in the environment), need only the standard library
(`from eltctl_runtime import report` works on a host with torch only, or none)
and never raise::

    from eltctl_runtime import report, checkpoint_saved
    report(step=step, loss=loss, samples=samples_so_far)   # every step is fine
    checkpoint_saved(path)                                  # after a complete save

The contract with the supervisor (runtime/restart/supervisor.py): the supervisor sets
`ELTCTL_PROGRESS` in the script's environment to a file path; each call appends
one JSON line to it (open, append, close: a line is one write, so it is never
seen half written). Lines::

    {"t": <unix time>, "step": int|null, "loss": float|null, "samples": int|null, "metrics": {...}}
    {"t": <unix time>, "checkpoint": "<path>"}

`report` writes at most one line every REPORT_EVERY_S (the newest value of
each field: a field a call leaves out keeps the value an earlier call since the
last line gave it, so `report(step=s, samples=n)` at a step's end and
`report(step=s, loss=l)` when the script logs both reach the line, whichever
call writes it; the values in between are dropped, and `loss` is converted
with `float()` only when written, so a CUDA tensor costs no sync on the other
calls); a report still pending is written at exit. `checkpoint_saved` writes at
once. `samples` is the job's samples so far (all ranks together, like the
step); eltctl derives samples/s from it. `samples_per_s=` among the metrics is
taken as it is.

For scripts that must stay untouched, `[job] progress` names a regex (or one of
PATTERNS) matched against rank 0's output lines (`match_progress`).

The supervisor's side is `ProgressFile` (tails the file) and
`ProgressTracker` (the newest step, loss, samples/s of a script).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

ENV_PROGRESS = "ELTCTL_PROGRESS"
REPORT_EVERY_S = 1.0
ROTATE_BYTES = 1 << 20  # the supervisor starts a new file past this size


# ---- the script's side -----------------------------------------------------------


class _Reporter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._resolved = False
        self._last_write = 0.0
        self._pending: dict[str, Any] | None = None
        self._atexit = False

    def path(self) -> str | None:
        # Looked up on the first call, not at import: a warm interpreter imports
        # this before it receives the script's environment.
        if not self._resolved:
            self._path = os.environ.get(ENV_PROGRESS) or None
            self._resolved = True
        return self._path

    def report(self, step: Any, loss: Any, samples: Any, metrics: Mapping[str, Any]) -> None:
        path = self.path()
        if path is None:
            return
        now = time.monotonic()
        with self._lock:
            self._pending = _merged(self._pending, step, loss, samples, metrics)
            if now - self._last_write < REPORT_EVERY_S:
                if not self._atexit:
                    atexit.register(self.flush)
                    self._atexit = True
                return
            self._last_write = now
            pending, self._pending = self._pending, None
        _append(path, _report_line(pending))

    def flush(self) -> None:
        path = self.path()
        with self._lock:
            pending, self._pending = self._pending, None
        if path is not None and pending is not None:
            _append(path, _report_line(pending))

    def checkpoint_saved(self, target: Any) -> None:
        path = self.path()
        if path is None:
            return
        self.flush()  # the step this checkpoint belongs to, before it
        _append(path, {"t": time.time(), "checkpoint": os.path.abspath(os.fspath(target))})


def _merged(pending: dict[str, Any] | None, step: Any, loss: Any, samples: Any,
            metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The values not yet written, with one call's on top: a field that call leaves out keeps
    its value from an earlier call (a Trainer reports the step at a step's end and the loss
    when it logs, just after: the line must carry both, whichever call writes it)."""
    out = dict(pending) if pending else {"step": None, "loss": None, "samples": None, "metrics": {}}
    for key, value in (("step", step), ("loss", loss), ("samples", samples)):
        if value is not None:
            out[key] = value
    out["metrics"] = {**out["metrics"], **metrics}
    return out


_reporter = _Reporter()


def report(step: Any = None, loss: Any = None, samples: Any = None, **metrics: Any) -> None:
    """Tell eltctl the script's progress: its step, loss, the job's samples so far,
    any other number. A no-op outside eltctl; cheap enough for every step."""
    try:
        _reporter.report(step, loss, samples, metrics)
    except Exception:  # noqa: BLE001 - progress must never break training
        pass


def checkpoint_saved(path: Any) -> None:
    """Tell eltctl that a complete checkpoint (a file or a directory) is at
    `path`, inside ELTCTL_CHECKPOINT_DIR: it is mirrored without waiting for the
    directory to settle. A no-op outside eltctl."""
    try:
        _reporter.checkpoint_saved(path)
    except Exception:  # noqa: BLE001
        pass


def _number(value: Any, kind: type) -> Any:
    if value is None:
        return None
    try:
        if hasattr(value, "item"):  # a tensor or a numpy scalar
            value = value.item()
        value = kind(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _report_line(p: Mapping[str, Any]) -> dict[str, Any]:
    metrics = {}
    for k, v in p["metrics"].items():
        n = _number(v, float)
        if n is not None:
            metrics[str(k)] = n
    return {"t": time.time(), "step": _number(p["step"], int), "loss": _number(p["loss"], float),
            "samples": _number(p["samples"], int), "metrics": metrics}


def _append(path: str, line: Mapping[str, Any]) -> None:
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# ---- named output patterns ------------------------------------------------------------

# `[job] progress` is one of these names or a regex. A pattern is one or more
# regexes tried on every output line (split at \n and \r, so progress bars
# count); each match contributes its named groups:
#   step         the script's step (global)
#   epoch, batch, batches   step = epoch * batches + batch when there is no step
#   loss, samples (so far), samples_per_s, steps_per_s (it/s)
# Groups that are absent or do not parse as numbers are ignored.
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
PATTERNS: dict[str, tuple[str, ...]] = {
    # examples/ddp_restart.py and the like: "step 120 ... loss 0.1234"
    "step-loss": (rf"\bstep[ =:]+(?P<step>\d+)\b(?:.*?\bloss[ =:]+(?P<loss>{_NUM}))?",),
    # Hugging Face Trainer: its tqdm bar "  50%|#####     | 500/1000 [00:10<00:20, 49.50it/s]"
    # (the global step) and its log dicts "{'loss': 0.1234, 'grad_norm': ..., 'epoch': 0.5}".
    "hf-trainer": (
        rf"^\s*\d+%\|[^|]*\|\s*(?P<step>\d+)/\d+\s*\[(?:[^\]]*?,\s*(?P<steps_per_s>{_NUM})it/s)?",
        rf"^\{{.*'loss': '?(?P<loss>{_NUM})'?,.*'epoch': '?(?P<epoch_f>{_NUM})'?.*\}}\s*$",
    ),
    # Lightning's progress bar: "Epoch 3:  45%|####5     | 450/1000 [00:05<00:06, 85.20it/s, v_num=0, train_loss=0.123]"
    "lightning": (
        rf"^\s*Epoch (?P<epoch>\d+):\s*\d+%\|[^|]*\|\s*(?P<batch>\d+)/(?P<batches>\d+)\s*\["
        rf"(?:[^\]]*?,\s*(?P<steps_per_s>{_NUM})it/s)?(?:[^\]]*?\b(?:train_)?loss(?:_step)?=(?P<loss>{_NUM}))?",
    ),
}


class PatternError(ValueError):
    """`[job] progress` is neither a known name nor a valid regex."""


def compile_progress(spec: str) -> tuple[re.Pattern[str], ...]:
    """The regexes of `[job] progress`: a name in PATTERNS or one regex with named groups."""
    sources = PATTERNS.get(spec) or (spec,)
    out = []
    for src in sources:
        try:
            rx = re.compile(src)
        except re.error as e:
            raise PatternError(f"the progress pattern {spec!r} is not a valid regex: {e}; "
                               f"or name one of: {', '.join(PATTERNS)}") from None
        out.append(rx)
    if spec not in PATTERNS and not (set(out[0].groupindex) & {"step", "batch", "loss", "samples", "samples_per_s"}):
        raise PatternError(f"the progress pattern {spec!r} has no named group: give (?P<step>...) "
                           f"(and optionally loss, samples, samples_per_s), or name one of: {', '.join(PATTERNS)}")
    return tuple(out)


def match_progress(patterns: Iterable[re.Pattern[str]], line: str) -> dict[str, float] | None:
    """The numbers one output line gives (None: no pattern matched)."""
    found: dict[str, float] = {}
    hit = False
    for rx in patterns:
        m = rx.search(line)
        if m is None:
            continue
        hit = True
        for k, v in m.groupdict().items():
            if v is None:
                continue
            try:
                found[k] = float(v)
            except ValueError:
                pass
    if not hit:
        return None
    if "step" not in found and {"epoch", "batch", "batches"} <= set(found):
        found["step"] = found["epoch"] * found["batches"] + found["batch"]
    return found


# ---- the supervisor's side -------------------------------------------------------------


class ProgressFile:
    """Tails a script's ELTCTL_PROGRESS file. `poll()` returns the lines written
    since the last call; past ROTATE_BYTES the file is renamed aside and read to
    its end one poll later (a write that opened it just before the rename lands
    there), then removed."""

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._rest = b""
        self._aside: str | None = None

    def reset(self) -> None:
        """A new script: forget the old file."""
        for p in (self.path, self.path + ".1"):
            try:
                os.unlink(p)
            except OSError:
                pass
        self._offset, self._rest, self._aside = 0, b"", None

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._aside is not None:
            out += self._read(self._aside, self._aside_offset)[0]
            try:
                os.unlink(self._aside)
            except OSError:
                pass
            self._aside = None
        lines, self._offset = self._read(self.path, self._offset)
        out += lines
        if self._offset >= ROTATE_BYTES:
            aside = self.path + ".1"
            try:
                os.replace(self.path, aside)
                self._aside, self._aside_offset = aside, self._offset
                self._offset = 0
            except OSError:
                pass
        return out

    def _read(self, path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return [], offset
        data = self._rest + data
        offset += len(data) - len(self._rest)
        *lines, self._rest = data.split(b"\n")
        out = []
        for raw in lines:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out, offset


@dataclass
class ProgressTracker:
    """The newest progress of one script, from its reports and its output lines."""

    step: int | None = None
    loss: float | None = None
    samples: int | None = None
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    epoch: float | None = None
    updated: float | None = None  # unix time of the newest figure
    metrics: dict[str, float] = field(default_factory=dict)
    _rate_from: tuple[float, int] | None = None  # (time, samples) the rate is measured from

    def reset(self) -> None:
        """A new script: the step is kept (it resumes near it), the rates are not."""
        self.samples_per_s = self.steps_per_s = None
        self._rate_from = None

    def update(self, values: Mapping[str, Any], now: float | None = None) -> None:
        now = time.time() if now is None else now
        if values.get("step") is not None:
            self.step = int(values["step"])
        if values.get("loss") is not None:
            self.loss = float(values["loss"])
        epoch = values.get("epoch_f", values.get("epoch"))
        if epoch is not None:
            self.epoch = float(epoch)
        for k in ("samples_per_s", "steps_per_s"):
            if values.get(k) is not None:
                setattr(self, k, float(values[k]))
        metrics = values.get("metrics")
        if isinstance(metrics, Mapping):
            self.metrics.update({str(k): v for k, v in metrics.items() if isinstance(v, (int, float))})
            if isinstance(metrics.get("samples_per_s"), (int, float)):
                self.samples_per_s = float(metrics["samples_per_s"])
        if values.get("samples") is not None:
            samples = int(values["samples"])
            if self._rate_from is None or samples < self._rate_from[1]:
                self._rate_from = (now, samples)
            elif now - self._rate_from[0] >= 5.0:
                self.samples_per_s = (samples - self._rate_from[1]) / (now - self._rate_from[0])
                self._rate_from = (now, samples)
            self.samples = samples
        self.updated = now

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "samples": self.samples, "samples_per_s": self.samples_per_s,
                "steps_per_s": self.steps_per_s, "epoch": self.epoch, "time": self.updated}
