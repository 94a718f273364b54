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
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

from eltctl.errors import EltctlError, HostError
from eltctl.hosts import layout
from eltctl.hosts.transport import ErrorKind, Transport
from eltctl.inventory import Host

MARK = "@@eltctl-log"
NO_DIR = "@@eltctl-nodir"
FOLLOW_INTERVAL_S = 1.0
CONTROLLER_LOG = "controller.log"  # in the job's state directory on this machine (controller/statedir.py)
LOCAL_TAIL_BYTES = 1 << 20  # the first read of the controller's log looks this far back for its last lines
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
    """How a line's source is shown: `daemon`, `worker 0`, `controller`."""
    if path == layout.DAEMON_LOG:
        return "daemon"
    if path == CONTROLLER_LOG:
        return "controller"
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
    seen: set[str] = field(default_factory=set)  # the logs that exist: a chunk of each came

    def feed(self, chunks: list[Chunk]) -> list[str]:
        out: list[str] = []
        for chunk in sorted(chunks, key=lambda c: _order(c.path)):
            self.seen.add(chunk.path)
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


def last_per_source(lines: list[str], n: int, sources: Iterable[str]) -> list[str]:
    """`lines` (each prefixed with its source, `[worker 0] `) with only the last `n` of
    each of `sources`; the other sources' lines untouched."""
    prefixes = {f"[{source_name(p)}] " for p in sources}
    kept: dict[str, int] = {}
    for line in reversed(lines):
        prefix = next((p for p in prefixes if line.startswith(p)), None)
        if prefix is not None:
            kept[prefix] = kept.get(prefix, 0) + 1
    out, seen = [], dict.fromkeys(prefixes, 0)
    for line in lines:
        prefix = next((p for p in prefixes if line.startswith(p)), None)
        if prefix is None:
            out.append(line)
            continue
        seen[prefix] += 1
        if seen[prefix] > kept[prefix] - n:
            out.append(line)
    return out


def failed_log_starts(doc: Mapping, host: str, failed_states: Iterable[str]) -> dict[int, int]:
    """{slot: byte offset} where each failed worker's own output begins in its slot's log,
    from the host daemon's worker states in the status document (`log_offset`: the log's
    size when the daemon started that worker). A slot's log holds every worker that ran
    on it; `--failed` shows the failed one's lines, not those of the healthy ones before."""
    states = set(failed_states)
    hosts = doc.get("hosts") if isinstance(doc.get("hosts"), list) else []
    entry = next((h for h in hosts if isinstance(h, dict) and h.get("name") == host), {})
    daemon = entry.get("daemon") if isinstance(entry.get("daemon"), dict) else {}
    out = {}
    for w in daemon.get("workers") or []:
        if (isinstance(w, dict) and w.get("state") in states and isinstance(w.get("slot"), int)
                and isinstance(w.get("log_offset"), int) and w["log_offset"] >= 0):
            out[w["slot"]] = w["log_offset"]
    return out


async def show_logs(transport: Transport, job: str, host: str, *, lines: int, follow: bool,
                    emit: Callable[[str], None], interval: float = FOLLOW_INTERVAL_S,
                    stop: asyncio.Event | None = None, slots: Iterable[int] | None = None,
                    starts: Mapping[int, int] | None = None) -> list[str]:
    """Emit the last `lines` lines of every log (of the workers of `slots` only, when
    given: e.g. those that failed); with `follow`, then every new line until cancelled
    (Ctrl-C) or until `stop` is set. Returns the logs read (`daemon.log`, `workers/0.log`).

    `starts` ({slot: byte offset}): a worker's log is read from there only (the output of
    the slot's last worker, not of those before it: `failed_log_starts`)."""
    slots = None if slots is None else sorted(set(slots))
    begin = {layout.worker_log(s): int(off) for s, off in (starts or {}).items()
             if slots is None or s in slots}
    reader = LogReader(offsets=dict(begin))
    first = await read_new(transport, job, host, reader, last_lines=lines, slots=slots)
    if first is None and not follow:
        raise NoLogsError(f"host {host} has no logs of job {job!r} (no {job_dir(job, host)})",
                          hint="the job has not run on this host; `eltctl status` shows where it runs")
    shown = (first or []) + (reader.flush() if not follow else [])
    if begin:  # read from each such worker's start to the end: only its last `lines` lines are shown
        shown = last_per_source(shown, lines, begin)
    for line in shown:
        emit(line)
    if not follow:
        return sorted(reader.seen, key=_order)
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
    return sorted(reader.seen, key=_order)


# --------------------------------------------------------------------------- every host at once

@dataclass(frozen=True)
class HostLogs:
    """One host's outcome of `show_hosts_logs`: the logs read, or why none were."""

    host: str
    read: tuple[str, ...] = ()
    error: EltctlError | None = None  # a HostError (not reached), NoLogsError (the job never ran there)


async def show_hosts_logs(open_transport: Callable[[Host], Awaitable[Transport]], hosts: Sequence[Host], job: str,
                          *, lines: int, follow: bool, emit: Callable[[str], None],
                          slots: Mapping[str, Iterable[int]] | None = None,
                          starts: Mapping[str, Mapping[int, int]] | None = None,
                          interval: float = FOLLOW_INTERVAL_S, stop: asyncio.Event | None = None) -> list[HostLogs]:
    """`show_logs` on every host at once, each line prefixed with its host's name (padded,
    so the sources line up). One host's failure is that host's outcome, never the batch's
    end. Without `follow` the hosts' lines come host after host, in `hosts`' order; with
    it, as they arrive. `slots` / `starts`: per host, as `show_logs` takes them (a host
    missing from `slots` is skipped when `slots` is given)."""
    width = max((len(h.name) for h in hosts), default=0)
    held: dict[str, list[str]] = {h.name: [] for h in hosts}

    async def one(host: Host) -> HostLogs:
        prefix = host.name.ljust(width) + " "
        out = (lambda line: emit(prefix + line)) if follow else (lambda line: held[host.name].append(prefix + line))
        try:
            transport = await open_transport(host)
            read = await show_logs(transport, job, host.name, lines=lines, follow=follow, emit=out,
                                   interval=interval, stop=stop,
                                   slots=None if slots is None else slots.get(host.name, ()),
                                   starts=(starts or {}).get(host.name))
        except EltctlError as exc:
            return HostLogs(host.name, error=exc)
        return HostLogs(host.name, tuple(read))

    chosen = [h for h in hosts if slots is None or slots.get(h.name)]
    results = await asyncio.gather(*(one(h) for h in chosen))
    for host in chosen:
        for line in held[host.name]:
            emit(line)
    return list(results)


# --------------------------------------------------------------------------- the controller's log (this machine)

def read_local(path: Path, reader: LogReader, *, last_lines: int | None) -> list[str] | None:
    """What is new in a log on this machine, as `read_new` reads a host's: from the
    reader's offset, or (the first read) the last `last_lines` lines. None: no such file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            off = reader.offsets.get(CONTROLLER_LOG)
            if off is None or off > size:
                start = 0 if off is not None else max(0, size - LOCAL_TAIL_BYTES)
            else:
                start = off
            f.seek(start)
            data = f.read(size - start)
    except FileNotFoundError:
        return None
    if off is None and last_lines is not None:
        tail = data.split(b"\n")
        unfinished = tail.pop()
        data = b"".join(ln + b"\n" for ln in tail[-last_lines:] if last_lines) + unfinished
    return reader.feed([Chunk(CONTROLLER_LOG, size, data)])


def show_local_log(path: Path, *, lines: int, follow: bool, emit: Callable[[str], None],
                   interval: float = FOLLOW_INTERVAL_S, stop: Callable[[], bool] = lambda: False) -> None:
    """The last `lines` lines of the controller's log on this machine, prefixed
    `[controller] `; with `follow`, then every new line until Ctrl-C (or `stop()`)."""
    import time

    reader = LogReader()
    first = read_local(path, reader, last_lines=lines)
    if first is None and not follow:
        raise NoLogsError(f"no controller log on this machine ({path})",
                          hint="the job's controller has not run here; `eltctl up` starts it")
    for line in (first or []) + ([] if follow else reader.flush()):
        emit(line)
    seen = first is not None
    while follow and not stop():
        time.sleep(interval)
        new = read_local(path, reader, last_lines=None if seen else lines)
        seen = seen or new is not None
        for line in new or []:
            emit(line)
