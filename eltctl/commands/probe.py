"""`eltctl probe`: which hosts are reachable and which GPUs are free, busy, ours or taken
(held by another eltctl job: the reason names it)."""

from __future__ import annotations

from typing import List, Optional

import typer

from eltctl.completion import complete_host

STATE_STYLE = {"ok": "green", "cpu-only": "cyan", "unhealthy": "yellow", "unreachable": "red",
               "free": "green", "busy": "red", "ours": "blue", "taken": "magenta"}


def probe(
    ctx: typer.Context,
    hosts: Optional[List[str]] = typer.Argument(None, metavar="HOST", help="Only these hosts (default: every host).",
                                                show_default=False, autocompletion=complete_host),
    json_out: bool = typer.Option(
        False, "--json", help="Print the JSON document (a list of hosts; see README) instead of a table."),
    no_link_test: bool = typer.Option(
        False, "--no-link-test",
        help="Skip the link test (about a second: each usable host sends to the next over the data plane)."),
) -> None:
    """Probe every host (or HOSTS): reachable or why not, and each GPU free / busy / ours / taken (by which job)
    with the reason."""
    from eltctl.linkspeed import probe_inventory_with_links
    from eltctl.probe import probe_inventory, reports_to_json

    inventory = ctx.obj.inventory()
    chosen = inventory.hosts_named(hosts) if hosts else None  # unknown names: exit 2, with a did-you-mean
    reports = (probe_inventory if no_link_test else probe_inventory_with_links)(inventory, hosts=chosen)
    if json_out:
        import json
        import sys

        sys.stdout.write(json.dumps(reports_to_json(reports), indent=2) + "\n")
        return
    render(reports)


def render(reports) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(header_style="bold", expand=False)
    table.add_column("host", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("GPU", justify="right", no_wrap=True)
    table.add_column("job", overflow="fold")  # which eltctl job holds the GPU (ours or taken)
    table.add_column("memory MiB", justify="right", no_wrap=True)
    table.add_column("util", justify="right", no_wrap=True)
    table.add_column("reason", ratio=1, overflow="fold")
    for r in reports:
        facts = [r.address]
        if r.cpu_count:
            facts.append(f"{r.cpu_count} CPUs")
        if r.load_avg:
            facts.append(f"load {r.load_avg[0]:.2f}")
        if r.users:
            facts.append("users " + ", ".join(r.users))
        if r.link is not None:
            facts.append(link_fact(r.link))
        reason = escape(r.reason)
        if r.error is not None and r.error.hint:
            reason += f"\n[bold]fix:[/] {escape(r.error.hint)}"
        reason += f"\n[dim]{escape(' · '.join(facts))}[/]"
        table.add_row(f"[bold]{escape(r.name)}[/]", f"[{STATE_STYLE[r.state.value]}]{r.state.value}[/]",
                      "", "", "", "", reason, end_section=not r.gpus)
        for i, g in enumerate(r.gpus):
            mem = "?" if g.gpu.memory_used_mib is None else str(g.gpu.memory_used_mib)
            total = "?" if g.gpu.memory_total_mib is None else str(g.gpu.memory_total_mib)
            util = "n/a" if g.gpu.utilization is None else f"{g.gpu.utilization}%"
            table.add_row("", f"[{STATE_STYLE[g.state.value]}]{g.state.value}[/]", str(g.gpu.index),
                          escape(g.job or ""), f"{mem}/{total}", util, escape(g.reason),
                          end_section=i == len(r.gpus) - 1)
    Console(highlight=False).print(table)
    counts: dict[str, int] = {}
    for r in reports:
        for g in r.gpus:
            counts[g.state.value] = counts.get(g.state.value, 0) + 1
    cpu = sum(r.slots for r in reports if r.state.value == "cpu-only")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no GPUs"
    reachable = sum(1 for r in reports if r.reachable)
    Console(highlight=False).print(
        f"{reachable} of {len(reports)} host(s) reachable; GPUs: {summary}; CPU slots: {cpu}")
    from eltctl.commands.lab import refused_lines  # the claims directories' refusals (issue 49)

    for line in refused_lines([(r.name, x) for r in reports for x in r.refused]):
        Console(highlight=False).print(line)
    from eltctl import linkspeed

    for line in linkspeed.up_lines([linkspeed.Figure.from_json(r.link) for r in reports if r.link is not None]):
        Console(highlight=False, soft_wrap=True).print(escape(line))


def link_fact(link: dict) -> str:
    """The host's link test, for its facts line."""
    if link.get("mbit_s") is None:
        return f"link to {link.get('to')}: {link.get('error') or 'too fast to time'}"
    return f"link to {link.get('to')}: {link['mbit_s']:,.0f} Mbit/s"
