"""Where the status comes from: the live controller's answer on its socket, else status.json.

Every string in it is made `printable` (eltctl/text.py) as it is read: much of it came
from the hosts and the job's store."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eltctl.controller.statedir import SOCKET_NAME
from eltctl.errors import EltctlError
from eltctl.text import printable_tree


STATUS_FILE = "status.json"
SOCKET_FILE = SOCKET_NAME
SOCKET_TIMEOUT_S = 3.0  # the controller answers from memory; longer means it is wedged

CONTROLLER_DOWN = "controller not running: `eltctl up` restarts it, workers keep training"
# The job ended, and its controller with it: nothing trains on (status.json's last state).
CONTROLLER_ENDED = {"finished": "controller ended with the job: the training finished, nothing runs on the hosts",
                    "stopped": "controller ended with the job (`eltctl down`): nothing runs on the hosts"}


def controller_down(doc) -> str:
    """The `controller` row of a status document no live controller answered."""
    return CONTROLLER_ENDED.get(str(doc.get("state")), CONTROLLER_DOWN)


class Source(str, enum.Enum):
    """Where a snapshot's document came from."""

    CONTROLLER = "controller"  # answered by the live controller on control.sock
    FILE = "file"  # status.json: the controller is not answering, the document may be old


@dataclass(frozen=True)
class Snapshot:
    """One status document, where it came from and when it was read."""

    document: Mapping[str, Any]
    source: Source
    read_at: float  # time.time() when it was read
    why_file: str = ""  # why the controller was not asked or did not answer

    @property
    def controller_alive(self) -> bool:
        return self.source is Source.CONTROLLER

    def as_json(self) -> dict[str, Any]:
        """The document as `--json` prints it: the controller's own fields, with
        `controller.alive` saying what was observed now (a stale file says `true`)."""
        doc = dict(self.document)
        controller = dict(doc.get("controller") or {})
        controller["alive"] = self.controller_alive
        doc["controller"] = controller
        return doc


class NoJobError(EltctlError):
    """No status of this job exists on this machine (never started here, or `down` cleaned up)."""

    exit_code = 1


# --------------------------------------------------------------------------- where it comes from


def job_state_dir(job: str, environ: Mapping[str, str]) -> Path:
    """`${XDG_STATE_HOME:-~/.local/state}/eltctl/<job>/`: the controller's directory."""
    from eltctl.controller.statedir import StateDir  # light: the commands use it too

    return StateDir.for_job(job, environ).path


def read_status_file(state_dir: Path) -> dict[str, Any] | None:
    """status.json, or None when there is none (or it is not a JSON object)."""
    try:
        with open(state_dir / STATUS_FILE, encoding="utf-8") as f:
            doc = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return None  # written atomically, so unreadable means not ours or not yet
    return doc if isinstance(doc, dict) else None


def read_snapshot(job: str, state_dir: Path, *, clock=time.time,
                  timeout: float = SOCKET_TIMEOUT_S) -> Snapshot:
    """The freshest status of `job`: the live controller's answer, else status.json.

    Raises NoJobError when neither exists.
    """
    why = "no control.sock"
    if (state_dir / SOCKET_FILE).exists():
        try:
            from eltctl.controller.socket import request

            answer = request(state_dir / SOCKET_FILE, {"op": "status"}, timeout=timeout)
        except (OSError, ValueError) as exc:
            why = f"control.sock: {exc}"
        else:
            if answer.get("ok", True) is not False and "job" in answer:
                return Snapshot(printable_tree(answer), Source.CONTROLLER, clock())
            why = f"control.sock answered {json.dumps(answer)[:200]}"
    doc = read_status_file(state_dir)
    if doc is None:
        raise NoJobError(
            f"no status of job {job!r} on this machine (nothing in {state_dir})",
            hint="`eltctl up` starts the job; status reads the state the controller keeps here")
    return Snapshot(printable_tree(doc), Source.FILE, clock(), why_file=why)
