"""The job's facts at the top of the view: state, workers, progress, where a step's time goes,
checkpoint, mirror, controller."""

from __future__ import annotations

from typing import Any

from eltctl.statusview.formatting import JOB_STATE_STYLE, ViewOptions, format_age, num, show
from eltctl.statusview.snapshot import Snapshot, controller_down


def job_summary(snapshot: Snapshot, options: ViewOptions):
    """Two columns of facts about the job, and the controller line."""
    from rich.markup import escape
    from rich.table import Table

    doc = snapshot.document
    now = options.now
    updated = num(doc.get("updated"))
    staleness = max(0.0, now - updated) if updated is not None else 0.0

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    state = str(doc.get("state", "?"))
    state_text = f"[{JOB_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]"
    message = str(doc.get("message") or "")
    if message:
        state_text += f" [dim]({escape(message)})[/]"
    grid.add_row("job", f"[bold]{escape(str(doc.get('job', '?')))}[/] {state_text}")

    lo, hi = doc.get("min_workers"), doc.get("max_workers")
    bounds = f"min {show(lo)}, max {hi if hi is not None else 'any'}"
    restart_mode = doc.get("mode") == "restart"
    workers = f"{show(doc.get('world_size'))} ({bounds})   generation {show(doc.get('generation'))}"
    if restart_mode:
        n = doc.get("restarts") or 0
        workers += f"   restart mode, {n} restart{'' if n == 1 else 's'}"
    grid.add_row("workers", workers)

    progress = f"step {show(doc.get('step'))}" + steps_of(doc)
    if restart_mode:  # the script's own step (report() or [job] progress), and the snapshots eltctl took
        if doc.get("step") is None:
            progress = "step [dim]unknown (set \\[job] progress or call eltctl_runtime.report)[/]"
        progress += f"   snapshot {show(doc.get('snapshot'))}"
    if doc.get("epoch") is not None:
        progress += f"   epoch {doc.get('epoch')}"
    sps = num(doc.get("samples_per_s"))
    if sps is not None:
        progress += f"   {sps:,.1f} samples/s"
    loss = num(doc.get("loss"))
    if loss is not None:
        progress += f"   loss {loss:.4g}"
    if doc.get("runtime_current") is False and doc.get("step") is not None:
        # the last status of a run none of whose workers runs now: history, not a live figure
        progress += "   [dim](where it stopped; no worker runs now)[/]"
    grid.add_row("progress", progress)
    finish = finish_line(doc, now, staleness, options)
    if finish is not None:
        grid.add_row("finishes", finish)
    network = network_line(doc.get("network"))
    if network is not None:
        grid.add_row("network", network)
        hint = network_hint(doc.get("network"))
        if hint is not None:
            grid.add_row("[yellow]hint[/]", hint)

    ckpt = doc.get("checkpoint")
    if isinstance(ckpt, dict) and ckpt.get("step") is not None:
        # age_s is the controller's measure (host clocks may be off); `time` is rank 0's clock
        t = num(ckpt.get("time"))
        age = num(ckpt.get("age_s")) + staleness if num(ckpt.get("age_s")) is not None else (
            now - t if t is not None else None)
        where = f" on {escape(str(ckpt['host']))}" if ckpt.get("host") else ""
        if restart_mode:
            script_step = ckpt.get("script_step")
            what = f"snapshot {ckpt.get('step')}" + (f" (script step {script_step})" if script_step is not None
                                                     else "")
        else:
            what = f"step {ckpt.get('step')}"
        grid.add_row("checkpoint", f"{what}{where}, {format_age(age)} ago")
    else:
        grid.add_row("checkpoint", "[dim]none yet[/]")

    mirror = mirror_line(doc.get("mirror"), now, staleness, "snapshot" if restart_mode else "step")
    if mirror is not None:
        grid.add_row("mirror", mirror)
    unprotected = mirror_warning(doc.get("mirror"))
    if unprotected is not None:
        grid.add_row("[red]warning[/]", unprotected)

    forged = forged_line(doc.get("forged"))
    if forged is not None:
        grid.add_row("[red]warning[/]", forged)
    from eltctl.statusview.refused import refused_line  # the claims directory's refusals (issue 49)

    refused = refused_line(doc)
    if refused is not None:
        grid.add_row("[red]warning[/]", refused)
    keeper = doc.get("keeper") if isinstance(doc.get("keeper"), dict) else {}
    if keeper.get("attack"):  # the keeper's store refused requests: someone else talks to it
        grid.add_row("[red]warning[/]", escape(str(keeper["attack"])))

    fair = fairshare_line(doc.get("fairshare"))
    if fair is not None:
        grid.add_row("fair share", fair)

    notify = notify_line(doc.get("notify"), now)
    if notify is not None:
        grid.add_row("notify", notify)

    controller = doc.get("controller") if isinstance(doc.get("controller"), dict) else {}
    pid = controller.get("pid")
    if snapshot.controller_alive:
        line = f"running (pid {pid})" if pid is not None else "running"
        line += f", status {format_age(staleness)} old"
    else:
        line = (f"[bold yellow]{escape(controller_down(doc))}[/]\n"
                f"[dim]showing the last status it wrote, {format_age(staleness)} old[/]")
    grid.add_row("controller", line)
    return grid


def steps_of(doc: Any) -> str:
    """`of M (p%)` after the step, when the training says where it ends (`total_steps`)."""
    total, step = doc.get("total_steps"), doc.get("step")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        return ""
    done = f" ({min(step, total) / total:.0%})" if isinstance(step, int) and not isinstance(step, bool) else ""
    return f" of {total}{done}"


# Above this share of the step in the network wait, the network sets the job's speed.
NETWORK_BOUND = 0.5


def network_line(net: Any) -> str | None:
    """The `network` row: the network's share of a step, its wait of the whole, the bytes
    each rank all-reduces per step (the document's `network`, controller/status.py
    network_entry); None when the runtime does not report it."""
    if not isinstance(net, dict) or num(net.get("share")) is None:
        return None
    wait, compute = num(net.get("wait_s")), num(net.get("compute_s"))
    line = f"{num(net.get('share')):.0%} of the step"
    if wait is not None and compute is not None:
        line += f" (wait {_seconds(wait)} of {_seconds(wait + compute)})"
    size = num(net.get("bytes_per_step"))
    if size is not None:
        line += f", {format_bytes(size)} per step"
    if net.get("mode") == "local":  # local steps: the parameters are averaged once per round
        line += f"; local steps, averaged every {net.get('sync_every')} steps"
        options = [o for o, on in (("overlapped", net.get("sync_overlap")), ("in bf16", net.get("grad_dtype")),
                                   (f"inner steps of {net.get('inner_batch')}", net.get("inner_batch"))) if on]
        if options:
            line += f" ({', '.join(options)})"
    return line


def network_hint(net: Any) -> str | None:
    """When the network's wait is over NETWORK_BOUND of the step: it, not the workers'
    compute, sets the job's speed, and which modes send less (docs/network.md); else None."""
    share = num(net.get("share")) if isinstance(net, dict) else None
    if share is None or share <= NETWORK_BOUND:
        return None
    if net.get("mode") == "local":
        more = [o for o, on in (("sync_overlap=True hides the averaging under the next round's steps",
                                 not net.get("sync_overlap")),
                                ("grad_dtype=\"bf16\" halves its bytes", not net.get("grad_dtype"))) if on]
        return ("the network sets the job's speed even with local steps: a larger sync_every averages less "
                f"often{''.join('; ' + m for m in more)} (docs/network.md, \"Local steps (DiLoCo)\")")
    return ("the network sets the job's speed, not the workers' compute: a bf16 all-reduce "
            "(ElasticJob(grad_dtype=\"bf16\")) halves the bytes (docs/network.md, \"Where a step's time goes\")")


def _seconds(s: float) -> str:
    return f"{s:.2g} s" if s < 10 else f"{s:.0f} s"


def format_bytes(n: float) -> str:
    """Decimal units, three significant digits: 200 MB, 1.5 kB, 812 B."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 999.5:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def finish_line(doc: Any, now: float, staleness: float, options: ViewOptions) -> str | None:
    """The `finishes` row: the time left to `total_steps` at the recent rate (`eta_s`, as of
    the document, less its age), the clock time and the steps/s it assumes; None while
    unknown (no bound on the steps, no worker running, no rate yet)."""
    from eltctl.statusview.formatting import format_clock

    eta = num(doc.get("eta_s"))
    if eta is None:
        return None
    left = max(0.0, eta - staleness)
    sps = num(doc.get("steps_per_s"))
    rate = f" at {sps:.3g} steps/s" if sps is not None else ""
    return f"in {format_age(left)} (about {format_clock(now + left, options.tz)}){rate}"


def mirror_line(mirror: Any, now: float, staleness: float = 0.0, unit: str = "step") -> str | None:
    """The `mirror` row: target, newest mirrored step and its age, lag, last error
    (None when the job has no `[storage] mirror`). `unit`: "snapshot" in restart mode
    (its checkpoints are numbered by the snapshot counter)."""
    from rich.markup import escape

    if not isinstance(mirror, dict):
        return None
    line = escape(str(mirror.get("target", "?")))
    if mirror.get("step") is None:
        line += ": [dim]nothing mirrored yet[/]"
    else:
        t = num(mirror.get("time"))
        age = num(mirror.get("age_s")) + staleness if num(mirror.get("age_s")) is not None else (
            now - t if t is not None else None)
        line += f": {unit} {mirror.get('step')}, {format_age(age)} old"
    lag = mirror.get("lag_steps")
    if isinstance(lag, int):
        line += "   [green]up to date[/]" if lag == 0 else f"   [yellow]{lag} {unit}s behind[/]"
    if mirror.get("last_error") and not isinstance(mirror.get("problem"), dict):
        line += f"\n[red]last error: {escape(str(mirror['last_error']))}[/]"
    return line


def mirror_warning(mirror: Any) -> str | None:
    """The warning row when the mirror failed in a way retrying cannot fix (the status
    document's `mirror.problem`: {kind, message, fix}); None otherwise."""
    from rich.markup import escape

    problem = mirror.get("problem") if isinstance(mirror, dict) else None
    if not isinstance(problem, dict):
        return None
    line = (f"[red]the mirror cannot work ({escape(str(problem.get('kind', '?')))}): checkpoints are on the hosts "
            f"only; tried again in 10 min, or at once by `eltctl up` once fixed[/]"
            f"\n{escape(str(problem.get('message', '')))}")
    if problem.get("fix"):
        line += f"\n[bold]fix:[/] {escape(str(problem['fix']))}"
    return line


def fairshare_line(fair: Any) -> str | None:
    """The `fair share` row (docs/fairshare.md): this job's share of the pool when another
    job shares its hosts, what it holds and wants, its user's recent usage, its priority,
    and what fair share does now; None before the controller published a demand."""
    from rich.markup import escape

    if not isinstance(fair, dict) or fair.get("held") is None:
        return None
    share = fair.get("share")
    unit = str(fair.get("unit") or "GPU")  # status.json's: "GPU" (fair share counts no CPU slot)
    head = (f"{share} of {show(fair.get('pool'))} {unit}s" if share is not None
            else "[dim]no other job on its hosts[/]")
    # recent usage is GPU-hours only (the ledger's GPU intervals): none to show on CPU slots
    usage = "" if unit == "CPU slot" else f", recent usage {num(fair.get('usage_gpu_h')) or 0:.2f} GPU-h"
    line = (f"{head}   holding {show(fair.get('held'))}, wants {show(fair.get('wanted'))} more   "
            f"user {escape(str(fair.get('user') or '?'))}{usage}"
            f"   priority {show(fair.get('priority'))}")
    if fair.get("reason"):
        line += f"\n[dim]{escape(str(fair['reason']))}[/]"
    return line


def notify_line(notify: Any, now: float) -> str | None:
    """The `notify` row: the last failed delivery of a notification (the document's
    `notify.last_failure`, notify/delivery.py) and whether one got through since; None
    while none failed."""
    from rich.markup import escape

    fail = notify.get("last_failure") if isinstance(notify, dict) else None
    if not isinstance(fail, dict):
        return None
    t = num(fail.get("time"))
    line = (f"[yellow]last failure {format_age(now - t if t is not None else None)} ago[/]: "
            f"{escape(str(fail.get('kind')))} to {escape(str(fail.get('target')))} after "
            f"{_int(fail.get('attempts'))} attempt(s): {escape(str(fail.get('error')))}")
    last = notify.get("last") if isinstance(notify.get("last"), dict) else {}
    if last.get("ok") and (num(last.get("time")) or 0) > (t or 0):
        line += "   [green]delivered since[/]"
    return line


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def forged_line(forged: Any) -> str | None:
    """The warning row when forged store values were read (the document's `forged`:
    controller/status.py `forged_summary`); None when there were none."""
    from rich.markup import escape

    if not isinstance(forged, dict) or _int(forged.get("total")) <= 0:
        return None
    readers: list[tuple[str, Any]] = [("controller", forged.get("controller"))]
    hosts = forged.get("hosts")
    readers += sorted(hosts.items()) if isinstance(hosts, dict) else []
    readers.append(("rank 0", forged.get("rank0")))
    parts = []
    for who, counts in readers:
        if isinstance(counts, dict) and counts:
            each = ", ".join(f"{k} {_int(v)}" for k, v in sorted(counts.items()))
            parts.append(f"{who}: {each}")
    n = _int(forged["total"])
    return (f"[bold red]{n} forged store value{'' if n == 1 else 's'} ignored[/] ({escape('; '.join(parts))})\n"
            "[dim]someone who reaches the store's port wrote values not signed with the job's secret; "
            "they were ignored, not acted on (docs/commands.md, Security)[/]")
