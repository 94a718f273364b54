"""`eltctl lab`: every eltctl job on the inventory's hosts, its user, priority, GPUs held
and wanted, recent usage and fair share, from the hosts themselves (docs/fairshare.md)."""

from __future__ import annotations

import typer


def lab(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Print the JSON document (docs/commands.md) instead of a table."),
) -> None:
    """Every eltctl job on the inventory's hosts: user, priority, GPUs held and wanted, recent usage and fair share."""
    from eltctl.lab import lab_view, view_to_json
    from eltctl.probe import probe_inventory

    inventory = ctx.obj.inventory()
    view = lab_view(probe_inventory(inventory), inventory.policy.usage_half_life)
    if json_out:
        import json
        import sys

        sys.stdout.write(json.dumps(view_to_json(view), indent=2) + "\n")
        return
    render(view)


def render(view) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    for part in lab_renderables(view):
        console.print(part)


# (header, justify) of the table: short headers, whole at any width; values give way
# instead (job and user cut with an ellipsis). Below LAB_WIDE_MIN columns the hosts leave
# the table for a line per job under it, so the table fits 60 columns.
LAB_COLUMNS = (("job", "left"), ("user", "left"), ("prio", "right"), ("held", "right"), ("wants", "right"),
               ("GPU-h", "right"), ("share", "right"), ("hosts", "left"))
LAB_WIDE_MIN = 100


class LabTable:
    """The jobs' table, laid out for the console it is drawn on."""

    def __init__(self, view) -> None:
        self.view = view

    def __rich_console__(self, console, options):
        yield from lab_table(self.view, options.max_width)


def lab_table(view, width: int) -> list:
    """The table for `width` columns: with a hosts column from LAB_WIDE_MIN on, else the
    hosts in a line per job under it."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    wide = width >= LAB_WIDE_MIN
    cpu = any(j.held_cpu for j in view.jobs)

    def shown(v, fmt="{}"):
        return "?" if v is None else fmt.format(v)

    def held(j) -> str:  # a CPU slot is never counted as a GPU
        if not cpu:
            return str(j.held)
        return " + ".join(p for p in (f"{j.held_gpus} GPU" if j.held_gpus else "",
                                      f"{j.held_cpu} CPU" if j.held_cpu else "") if p) or "0"

    def hosts(j) -> str:
        return escape(", ".join(f"{h}:{n}" for h, n in j.hosts)) + ("" if j.published else
                                                                   " [dim](no demand published)[/]")

    rows = [[j.job, j.user, shown(j.priority), held(j), shown(j.wanted), shown(j.usage_gpu_h, "{:.2f}"),
             shown(j.share)] for j in view.jobs]
    columns = LAB_COLUMNS if wide else LAB_COLUMNS[:-1]
    natural = [max([len(name)] + [len(r[i]) for r in rows]) if i < 7 else 0 for i, (name, _) in enumerate(columns)]
    # job and user get what the figures (and, wide, a hosts column of 20) leave, at most their longest
    # (the box's edges and dividers, one cell each, and a padding cell each side of a column)
    left = width - (3 * len(columns) + 1) - sum(natural[2:]) - (20 if wide else 0)
    job_w = max(3, min(natural[0], left // 2))
    user_w = max(4, min(natural[1], left - job_w))
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD)
    for i, (name, justify) in enumerate(columns):
        if name == "hosts":
            table.add_column(name, overflow="fold")
            continue
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",
                         width={0: job_w, 1: user_w}.get(i, natural[i]))
    for j, r in zip(view.jobs, rows):
        share = f"[yellow]{r[6]}[/]" if j.share is not None and j.held_gpus > j.share else r[6]
        table.add_row(f"[bold]{escape(r[0])}[/]", escape(r[1]), *r[2:6], share, *([hosts(j)] if wide else []))
    if wide:
        return [table]
    return [table] + [f"[bold]{escape(j.job)}[/] on {hosts(j) or '[dim]no host[/]'}" for j in view.jobs]


def lab_renderables(view) -> list:
    """The table (or the line saying there is no job) and the summary line."""
    cpu = any(j.held_cpu for j in view.jobs)
    parts: list = [LabTable(view)] if view.jobs else ["No eltctl job holds a GPU or a CPU slot or published a "
                                                      "demand on these hosts."]
    tail = f"; unreachable: {', '.join(view.unreachable)}" if view.unreachable else ""
    unit = "slots" if cpu else "GPUs"
    parts.append(f"{len(view.jobs)} job(s) on {len(view.hosts)} host(s); {view.pool} {unit} shared, "
                 f"{view.free} GPU(s) free{tail}")
    return parts + refused_lines(view.refused)


def refused_lines(refused) -> list[str]:
    """The entries of the hosts' claims directories that were not believed (issue 49):
    a warning line, then one line per entry naming the file and its owner's account."""
    from rich.markup import escape

    if not refused:
        return []
    lines = [f"[bold red]{len(refused)} entr{'y' if len(refused) == 1 else 'ies'} of the GPU claims directories "
             "not believed[/] (written by another account, or malformed; docs/fairshare.md):"]
    lines += [f"  {escape(host)}: {escape(r.file)} (owner [bold]{escape(r.owner)}[/]): {escape(r.reason)}"
              for host, r in refused]
    return lines
