"""A host's logs of the job: the daemon's and each worker's, read over the host's transport.

On each host the job's files sit in `~/.eltctl/jobs/<job>/<host>/` (`eltctl.hosts.layout`):
`daemon.log` and `workers/<slot>.log`. One shell command (`read_command`) reports,
for every log there, its new size and the bytes since the offset we already have
(base64, so any byte survives the trip and chunk boundaries are exact); the first
call takes only the last N lines of each. `LogReader` keeps the offsets and the
unfinished last line of each file and turns chunks into whole lines prefixed with
their source, so `--follow` is the same call repeated.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from eltctl.errors import EltctlError, HostError
from eltctl.hosts import layout
from eltctl.hosts.transport import ErrorKind, Transport

MARK = "@@eltctl-log"
NO_DIR = "@@eltctl-nodir"
FOLLOW_INTERVAL_S = 1.0
_WORKER_LOG = re.compile(re.escape(layout.WORKERS_DIR) + r"/(\d+)\.log")


def job_dir(job: str, host: str) -> str:
    """The job's directory on the host, as the host's shell writes it."""
    return layout.shell_job_dir(job, host)


def log_files(slots: Iterable[int] | None = None) -> str:
    """The logs to read, as shell words relative to the job's directory: every log
    (the daemon's and each worker's), or only the workers' of `slots`."""
    if slots is None:
        return f"{layout.DAEMON_LOG} {layout.worker_log('*')}"
    return " ".join(layout.worker_log(int(s)) for s in slots)


def read_command(job: str, host: str, offsets: Mapping[str, int], *, last_lines: int | None,
                 slots: Iterable[int] | None = None) -> str:
    """The shell command that reads what is new in every log of `job` on `host`
    (only the logs of the workers of `slots` when that is given).

    A log in `offsets` is read from that byte offset (from 0 if it shrank: rotated or
    rewritten). Another log is read whole, or only its last `last_lines` lines when
    that is set (the first read). Sizes are taken first and reads stop there, so a
    line written meanwhile is read next time, not twice.
    """
    cases = "".join(f"    {shlex.quote(path)}) off={int(off)};;\n" for path, off in offsets.items())
    new = f"head -c \"$size\" \"$f\" | tail -n {int(last_lines)}" if last_lines is not None else \
        "head -c \"$size\" \"$f\""
    return f"""\
d={job_dir(job, host)}
[ -d "$d" ] || {{ echo {NO_DIR}; exit 0; }}
cd "$d" || exit 1
for f in {log_files(slots)}; do
  [ -f "$f" ] || continue
  size=$(wc -c < "$f" | tr -d ' ')
  off=-1
  case "$f" in
{cases}    *) ;;
  esac
  if [ "$off" -gt "$size" ]; then off=0; fi
  if [ "$off" -lt 0 ]; then
    data=$({new} | base64 | tr -d '\\n')
  else
    data=$(tail -c +$((off + 1)) "$f" | head -c $((size - off)) | base64 | tr -d '\\n')
  fi
  echo "{MARK} $f $size $data"
done
"""


@dataclass(frozen=True)
class Chunk:
    """New bytes of one log file, and the file's size once they are read."""

    path: str  # relative to the job directory: daemon.log, workers/0.log
    size: int
    data: bytes


def parse_read_output(stdout: str) -> list[Chunk] | None:
    """The chunks of one `read_command` run; None when the job directory does not exist."""
    chunks = []
    for line in stdout.splitlines():
        if line.strip() == NO_DIR:
            return None
        if not line.startswith(MARK + " "):
            continue
        parts = line.split(" ", 3)
        if len(parts) < 3 or not parts[2].isdigit():
            continue
        raw = parts[3] if len(parts) == 4 else ""
        chunks.append(Chunk(parts[1], int(parts[2]), base64.b64decode(raw) if raw else b""))
    return chunks


def source_name(path: str) -> str:
    """How a line's source is shown: `daemon`, `worker 0`."""
    if path == layout.DAEMON_LOG:
        return "daemon"
    m = _WORKER_LOG.fullmatch(path)
    return f"worker {m.group(1)}" if m else path


def _order(path: str) -> tuple[int, int, str]:
    m = _WORKER_LOG.fullmatch(path)
    return (0, 0, path) if path == layout.DAEMON_LOG else (1, int(m.group(1)), path) if m else (2, 0, path)


@dataclass
class LogReader:
    """Offsets and unfinished lines of one host's logs; `feed` turns chunks into lines.

    A line is shown once it is complete; `flush` shows the unfinished ones (at the
    end of a one-shot read, where nothing more will come).
    """

    offsets: dict[str, int] = field(default_factory=dict)
    partial: dict[str, bytes] = field(default_factory=dict)

    def feed(self, chunks: list[Chunk]) -> list[str]:
        out: list[str] = []
        for chunk in sorted(chunks, key=lambda c: _order(c.path)):
            previous = self.offsets.get(chunk.path)
            if previous is not None and chunk.size < previous:
                self.partial.pop(chunk.path, None)  # the file was rewritten from the start
            self.offsets[chunk.path] = chunk.size
            data = self.partial.pop(chunk.path, b"") + chunk.data
            *lines, rest = data.split(b"\n")
            if rest:
                self.partial[chunk.path] = rest
            prefix = f"[{source_name(chunk.path)}] "
            out.extend(prefix + line.decode("utf-8", "replace").rstrip("\r") for line in lines)
        return out

    def flush(self) -> list[str]:
        out = [f"[{source_name(path)}] " + self.partial[path].decode("utf-8", "replace")
               for path in sorted(self.partial, key=_order)]
        self.partial.clear()
        return out


class NoLogsError(EltctlError):
    """The host has no directory of this job: the job never ran there."""


async def read_new(transport: Transport, job: str, host: str, reader: LogReader, *,
                   last_lines: int | None, slots: Iterable[int] | None = None) -> list[str] | None:
    """One read of everything new (of the workers of `slots` only, when given); None
    when the host has no directory of the job."""
    result = await transport.run(read_command(job, host, reader.offsets, last_lines=last_lines,
                                              slots=slots))
    if not result.ok:
        raise HostError(host, f"reading the logs failed (exit {result.exit_status}): "
                              f"{result.stderr.strip()[:300]}", kind=ErrorKind.COMMAND)
    chunks = parse_read_output(result.stdout)
    return None if chunks is None else reader.feed(chunks)


async def show_logs(transport: Transport, job: str, host: str, *, lines: int, follow: bool,
                    emit: Callable[[str], None], interval: float = FOLLOW_INTERVAL_S,
                    stop: asyncio.Event | None = None, slots: Iterable[int] | None = None) -> list[str]:
    """Emit the last `lines` lines of every log (of the workers of `slots` only, when
    given: e.g. those that failed); with `follow`, then every new line until cancelled
    (Ctrl-C) or until `stop` is set. Returns the logs read (`daemon.log`, `workers/0.log`)."""
    slots = None if slots is None else sorted(set(slots))
    reader = LogReader()
    first = await read_new(transport, job, host, reader, last_lines=lines, slots=slots)
    if first is None and not follow:
        raise NoLogsError(f"host {host} has no logs of job {job!r} (no {job_dir(job, host)})",
                          hint="the job has not run on this host; `eltctl status` shows where it runs")
    for line in first or []:
        emit(line)
    if not follow:
        for line in reader.flush():
            emit(line)
        return sorted(reader.offsets, key=_order)
    seen_dir = first is not None
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
            break
        except asyncio.TimeoutError:
            pass
        # Files that appear while following are new workers: shown from their start.
        new = await read_new(transport, job, host, reader, last_lines=None if seen_dir else lines,
                             slots=slots)
        if new is None:
            continue
        seen_dir = True
        for line in new:
            emit(line)
    return sorted(reader.offsets, key=_order)
