"""The hosts table, wide (every GPU with its full reason) or compact (one line per GPU, nothing wrapped)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from eltctl.statusview.formatting import GPU_STATE_STYLE, HOST_STATE_STYLE, ViewOptions, format_age, format_clock, num


def slot_word(host: Mapping[str, Any]) -> str:
    """What each of a host's `gpus` is called: "slot" on a host of CPU slots, else "GPU"."""
    return "slot" if host.get("device") == "cpu" else "GPU"


def slots_header(hosts: Any) -> str:
    """The hosts table's column of GPUs and CPU slots, named for what it holds."""
    words = {slot_word(h) for h in hosts or [] if isinstance(h, dict) and h.get("gpus")}
    return {frozenset({"slot"}): "slots", frozenset({"slot", "GPU"}): "GPUs/slots"}.get(frozenset(words), "GPUs")


def _reason(host: Mapping[str, Any], gpu: Mapping[str, Any]) -> str:
    reason = str(gpu.get("reason") or "")
    return "" if host.get("device") == "cpu" and reason == "CPU slot" else reason  # "slot 0 free CPU slot"


def _gpu_lines(host: Mapping[str, Any]) -> str:
    from rich.markup import escape

    lines = []
    for gpu in host.get("gpus") or []:
        state = str(gpu.get("state", "?"))
        text = f"{slot_word(host)} {gpu.get('index', '?')} [{GPU_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]"
        if _reason(host, gpu):
            text += f" [dim]{escape(_reason(host, gpu))}[/]"
        lines.append(text)
    return "\n".join(lines) or "[dim]no GPUs (CPU slots)[/]"


_WORKER_ID = re.compile(r"\S+/\d+/(\d+)")
_PROCESS_USER = re.compile(r"pid \d+(?: [^()]*?)? \(([^()]+)\)")  # probe: "pid 999 python (alice)"
_USER_PID = re.compile(r"^([\w.@-]+) \(pid \d+\)")  # "alice (pid 999): ..."
_OURS_PID = re.compile(r"\bpid (\d+)")
_MIB_USED = re.compile(r"^(\d+)(?: of \d+)? MiB used")  # probe: busy by memory, no process listed
_UTIL = re.compile(r"^(\d+)% utilisation")
_TAKEN_BY = re.compile(r"^taken by job ([\w.-]+)")  # daemon or probe: "taken by job B (user bob, pid 42)"


def gpu_brief(gpu: Mapping[str, Any], word: str = "GPU") -> str:
    """A GPU (or, `word` "slot", a CPU slot) in a few words, for the compact layout:
    `GPU 0 ours w3`, `GPU 1 busy alice`, `slot 2 free`.

    Who holds it, shortened: our worker's incarnation (`w<n>` of `<host>/<slot>/<n>`), a
    busy GPU's owners (the users the probe names), else the reason's first words (the
    full reason is in `eltctl status HOST`)."""
    state = str(gpu.get("state", "?"))
    reason = str(gpu.get("reason") or "")
    who = ""
    if state == "ours":
        m = _WORKER_ID.search(reason)
        pid = _OURS_PID.search(reason)
        who = f"w{m.group(1)}" if m else f"pid {pid.group(1)}" if pid else ""
    elif state == "busy":
        users = list(dict.fromkeys(_PROCESS_USER.findall(reason)))
        m = _USER_PID.match(reason)
        mem, util = _MIB_USED.search(reason), _UTIL.search(reason)
        who = (", ".join(users) if users else m.group(1) if m else f"{mem.group(1)} MiB" if mem
               else f"{util.group(1)}%" if util else reason)
    elif state == "taken":  # `taken by job B (user bob, pid 42)`: the job's name
        m = _TAKEN_BY.match(reason)
        who = m.group(1) if m else reason
    elif state != "free" and not (word == "slot" and reason == "CPU slot"):
        who = reason
    return " ".join(f"{word} {gpu.get('index', '?')} {state} {who}".split())  # one line, whatever the reason holds


def host_notes(host: Mapping[str, Any], options: ViewOptions, *, brief: bool = False) -> list[str]:
    """Why a host is as it is: its reason, benching or cooldown, failures in a row.
    `brief`: few words each (the compact layout), plain text."""
    notes = []
    wait = wait_note(host, brief=brief)
    if host.get("reason") and not (wait is not None and host.get("state") == "idle"):
        notes.append(str(host["reason"]))  # an idle host's "usable, not used" is what the wait explains
    if wait is not None:
        notes.append(wait)
    forward = host.get("forward")
    if isinstance(forward, dict) and not forward.get("up"):
        why = str(forward.get("error") or "not open yet")
        notes.append("store forward down" if brief else f"store forward down: {why}")
    signal = host.get("signal")
    if isinstance(signal, dict):
        name = f" {signal['name']}" if signal.get("name") else ""
        notes.append(f"owner{name}" if brief else f"owner signal{name}: {signal.get('detail', '')}")
    for key, what in (("benched_until", "benched"), ("cooldown_until", "cooling down")):
        until = num(host.get(key))
        if until is not None and until > options.now:
            if brief:
                notes.append(f"{what} {format_age(until - options.now)}")
            else:
                notes.append(f"{what} until {format_clock(until, options.tz)} "
                             f"(in {format_age(until - options.now)})")
    failures = host.get("failures")
    if isinstance(failures, int) and failures > 0:
        notes.append(f"{failures} failure(s)" if brief else f"{failures} failure(s) in a row")
    return notes


# The host's state and reason say these waits already (a limit, a cooldown, busy GPUs).
_STATE_SAYS = {"off-hours": "off-hours", "quota": "quota", "cordoned": "cordoned", "disabled": "disabled",
               "benched": "benched", "cooldown": "cooldown", "owner": "busy", "taken": "busy"}


def wait_note(host: Mapping[str, Any], *, brief: bool = False) -> str | None:
    """What holds back the host's slots that it does not run (its entry's `waiting`:
    fair share and which job, max_workers, idle_for, a host cap...), unless its state
    and reason say it already; None when nothing waits there."""
    wait = host.get("waiting")
    if not isinstance(wait, dict) or not wait.get("detail"):
        return None
    kind, detail = str(wait.get("kind") or "waiting"), str(wait["detail"])
    if _STATE_SAYS.get(kind) == host.get("state") or detail in str(host.get("reason") or ""):
        return None
    if brief:
        return detail if detail.startswith(kind) else f"{kind}: {detail}"
    return f"not joining ({kind}): {detail}"


def heartbeat(host: Mapping[str, Any], staleness: float) -> str:
    hb = num(host.get("heartbeat_age_s"))
    return format_age(hb + staleness) if hb is not None else "-"


def doc_staleness(doc: Mapping[str, Any], now: float) -> float:
    updated = num(doc.get("updated"))
    return max(0.0, now - updated) if updated is not None else 0.0


WIDE_MIN_WIDTH = 120  # from this many columns on, the hosts table shows every GPU's full reason


class HostsView:
    """The hosts table, laid out for the console it is drawn on: wide (full reasons)
    from WIDE_MIN_WIDTH columns on, else compact (one line per GPU, nothing wraps)."""

    def __init__(self, doc: Mapping[str, Any], options: ViewOptions) -> None:
        self.doc, self.options = doc, options

    def wide(self, width: int) -> bool:
        if self.options.layout in ("wide", "compact"):
            return self.options.layout == "wide"
        return width >= WIDE_MIN_WIDTH

    def __rich_console__(self, console, options):
        if self.wide(options.max_width):
            yield hosts_table(self.doc, self.options)
        else:
            yield hosts_table_compact(self.doc, self.options, options.max_width)


def hosts_table(doc: Mapping[str, Any], options: ViewOptions):
    """One row per host: daemon state, heartbeat age, GPUs, and why it is not used."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    staleness = doc_staleness(doc, options.now)
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD)
    table.add_column("host", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("workers", justify="right", no_wrap=True)
    table.add_column("heartbeat", justify="right", no_wrap=True)
    hosts = doc.get("hosts") or []
    table.add_column(slots_header(hosts), overflow="fold")
    table.add_column("note", overflow="fold", min_width=20)
    for host in hosts:
        state = str(host.get("state", "?"))
        table.add_row(f"[bold]{escape(str(host.get('name', '?')))}[/]",
                      f"[{HOST_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]",
                      str(host.get("workers", 0)), heartbeat(host, staleness), _gpu_lines(host),
                      "\n".join(escape(n) for n in host_notes(host, options)))
    if not hosts:
        table.add_row("[dim]no hosts[/]", "", "", "", "", "")
    return table


COMPACT_HOST_WIDTH = 14  # a longer host name is cut with an ellipsis (in full: `status HOST`)
COMPACT_GPU_WIDTH = 20
NOTE_MIN = 20
NOTE_LINES = 3  # a host's note takes the lines of its GPUs, and at least this many


def hosts_table_compact(doc: Mapping[str, Any], options: ViewOptions, width: int = 80):
    """The hosts for a narrow terminal (`width` columns): one line per GPU (`0 ours w3`,
    `1 busy alice`), the host's note beside them (in the lines its GPUs take, at least NOTE_LINES); every column has a
    fixed width, and what does not fit is cut with an ellipsis, never wrapped.
    `eltctl status HOST` shows a host's full entry."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    staleness = doc_staleness(doc, options.now)
    hosts = [h for h in doc.get("hosts") or [] if isinstance(h, dict)]
    rows = []
    for host in hosts:
        state = str(host.get("state", "?"))
        gpus = []
        word = slot_word(host)
        for gpu in host.get("gpus") or []:
            line = Text(gpu_brief(gpu, word))
            gstate = str(gpu.get("state", "?"))
            start = len(word) + 1 + len(str(gpu.get("index", "?"))) + 1
            line.stylize(GPU_STATE_STYLE.get(gstate, "white"), start, start + len(gstate))
            gpus.append(line)
        rows.append((Text(str(host.get("name", "?")), style="bold"),
                     Text(state, style=HOST_STATE_STYLE.get(state, "white")),
                     Text(str(host.get("workers", 0))), Text(heartbeat(host, staleness)),
                     gpus or [Text("CPU slots", style="dim")],
                     Text("; ".join(host_notes(host, options, brief=True)))))

    def fit(i: int, header: str, cap: int | None = None) -> int:
        longest = max([len(header)] + [max((t.cell_len for t in r[i]), default=0) if isinstance(r[i], list)
                                       else r[i].cell_len for r in rows])
        return min(longest, cap) if cap else longest

    widths = [fit(0, "host", COMPACT_HOST_WIDTH), fit(1, "state"), fit(2, "wk"), fit(3, "beat"),
              fit(4, slots_header(hosts), COMPACT_GPU_WIDTH)]
    overhead = 2 + 5 + 6  # the box's edges, the dividers, one padding (right) per column
    # The note gets what is left, at least NOTE_MIN: GPUs, then host names, give way first.
    for i, floor in ((0, 10), (4, 12)):
        excess = sum(widths) + overhead + NOTE_MIN - width
        if excess > 0:
            widths[i] = max(min(widths[i], floor), widths[i] - excess)
    note_w = max(NOTE_MIN, width - overhead - sum(widths))
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
                  caption="full reasons: eltctl status HOST" if hosts else None,
                  caption_justify="left", caption_style="dim")
    for header, w, justify in zip(("host", "state", "wk", "beat", slots_header(hosts), "note"), widths + [note_w],
                                  ("left", "left", "right", "right", "left", "left")):
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis", width=w)
    for name, state, workers, beat, gpus, note in rows:
        for t in (name, *gpus):
            t.no_wrap, t.overflow = True, "ellipsis"
        table.add_row(name, state, workers, beat, Text("\n").join(gpus), _fold_into(note, note_w, max(len(gpus), NOTE_LINES)))
    if not hosts:
        table.add_row(Text("no hosts", style="dim"), "", "", "", "", "")
    return table


def _fold_into(text, width: int, height: int):
    """`text` folded into at most `height` lines of `width` cells (the lines its host's
    GPUs take anyway), the last one cut with an ellipsis if it does not fit."""
    import textwrap

    from rich.text import Text

    lines = textwrap.wrap(text.plain, width, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > height:
        lines = lines[:height]
        lines[-1] = lines[-1][: max(0, width - 1)].rstrip() + "…"
    out = Text("\n".join(lines), style=text.style)
    out.no_wrap, out.overflow = True, "ellipsis"
    return out
