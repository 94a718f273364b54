"""Reading `nvidia-smi --query-gpu` and `--query-compute-apps` output.

The one parser of nvidia-smi's CSV (`--format=csv,noheader,nounits`) for the
host daemon's GPU watch (daemon/gpuwatch.py) and the controller's probe
(eltctl/probe.py). Stdlib only, pure, tested by tables.

A query names its fields; a line is read against that list (`GPU_FIELDS` and
`APP_FIELDS` are the fields eltctl knows, and a query may ask for fewer, in
the same order). The free-text fields (`name`, `process_name`) may themselves
hold commas: they take what is left over. A trailing free-text field may be
missing altogether (it reads as ""). Numbers are read by `parse_number`:
`[N/A]`, `[Not Supported]` and friends read as None, units left on (`MiB`,
`%`) are ignored. A line that does not fit (too few fields, an index or pid
that is not a number: "No devices were found", a warning) is skipped, so a
partial answer still tells about the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")
TEXT_FIELDS = frozenset({"name", "process_name"})  # free text: may hold commas
FORMAT = "--format=csv,noheader,nounits"
MISSING_VALUES = frozenset({"[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]",
                            "[gpu is lost]", "[unknown]", ""})


def query_gpus(fields: Sequence[str] = GPU_FIELDS) -> list[str]:
    """nvidia-smi's arguments for a GPU query of `fields`."""
    return [f"--query-gpu={','.join(fields)}", FORMAT]


def query_apps(fields: Sequence[str] = APP_FIELDS) -> list[str]:
    """nvidia-smi's arguments for a compute-process query of `fields`."""
    return [f"--query-compute-apps={','.join(fields)}", FORMAT]


@dataclass(frozen=True)
class GpuInfo:
    """One line of `--query-gpu`."""

    index: int
    uuid: str
    memory_used_mib: int | None  # None: the driver said [N/A] / [Not Supported]
    memory_total_mib: int | None
    utilization: int | None  # percent
    name: str = ""  # "" when the query did not ask for it


@dataclass(frozen=True)
class GpuApp:
    """One line of `--query-compute-apps`: a process using a GPU."""

    gpu_uuid: str
    pid: int
    used_memory_mib: int | None
    name: str  # its process name (a path, often); "" when not given


def parse_number(text: str) -> int | None:
    """An nvidia-smi number, or None for [N/A], [Not Supported] and friends."""
    text = text.strip()
    if text.lower() in MISSING_VALUES:
        return None
    for suffix in (" MiB", " %", "MiB", "%"):
        if text.endswith(suffix):
            text = text[: -len(suffix)].strip()
    try:
        return int(round(float(text)))
    except ValueError:
        return None


def split_line(line: str, fields: Sequence[str]) -> dict[str, str] | None:
    """{field: stripped text} for one CSV line of a query of `fields`, or None
    when the line has too few values. The first free-text field takes the
    values beyond the count (a name with commas); without one, extra values
    are ignored."""
    raw = line.split(",")
    n = len(fields)
    if len(raw) < n:
        if len(raw) == n - 1 and fields[-1] in TEXT_FIELDS:
            raw.append("")
        else:
            return None
    extra = len(raw) - n
    text_at = next((i for i, f in enumerate(fields) if f in TEXT_FIELDS), None)
    if extra and text_at is not None:
        raw = raw[:text_at] + [",".join(raw[text_at:text_at + extra + 1])] + raw[text_at + extra + 1:]
    return {f: raw[i].strip() for i, f in enumerate(fields)}


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def parse_gpu_line(line: str, fields: Sequence[str] = GPU_FIELDS) -> GpuInfo | None:
    """One `--query-gpu` line of `fields` (which must include index and uuid)."""
    row = split_line(line, fields)
    index = _int(row.get("index")) if row else None
    if row is None or index is None:
        return None
    return GpuInfo(index=index, uuid=row.get("uuid", ""), memory_used_mib=parse_number(row.get("memory.used", "")),
                   memory_total_mib=parse_number(row.get("memory.total", "")),
                   utilization=parse_number(row.get("utilization.gpu", "")), name=row.get("name", ""))


def parse_app_line(line: str, fields: Sequence[str] = APP_FIELDS) -> GpuApp | None:
    """One `--query-compute-apps` line of `fields` (which must include pid)."""
    row = split_line(line, fields)
    pid = _int(row.get("pid")) if row else None
    if row is None or pid is None:
        return None
    return GpuApp(gpu_uuid=row.get("gpu_uuid", ""), pid=pid, used_memory_mib=parse_number(row.get("used_memory", "")),
                  name=row.get("process_name", ""))


def parse_gpus(text: str, fields: Sequence[str] = GPU_FIELDS) -> tuple[GpuInfo, ...]:
    """Every GPU in a `--query-gpu` answer; lines that do not fit are skipped."""
    return tuple(g for g in (parse_gpu_line(line, fields) for line in text.splitlines()) if g is not None)


def parse_apps(text: str, fields: Sequence[str] = APP_FIELDS) -> tuple[GpuApp, ...]:
    """Every process in a `--query-compute-apps` answer; lines that do not fit are skipped."""
    return tuple(a for a in (parse_app_line(line, fields) for line in text.splitlines()) if a is not None)
