"""The job's figures in the Prometheus text exposition format (version 0.0.4).

`render(doc, ledger)` is a pure function of a status document (controller/status.py;
docs/control-plane.md) and the usage ledger's figures (`ledger_figures`): one family
per figure, each with its HELP and TYPE lines, names with the `eltctl_` prefix,
counters ending in `_total`, times in seconds, every sample labelled with `job`, and
label values escaped as the format says (backslash, double quote, newline). A figure
the document does not know (no step yet, elastic mode's restarts) is left out, never
written as 0. The families (docs/commands.md, `eltctl metrics`, lists them):

    eltctl_info{job,state,phase,mode} 1            gauge
    eltctl_status_updated_timestamp_seconds        gauge   when the controller made the document
    eltctl_controller_up                           gauge   1: the live controller answered
    eltctl_world_size, eltctl_min_workers          gauge
    eltctl_generation, eltctl_step                 gauge
    eltctl_total_steps, eltctl_eta_seconds         gauge   where the training ends, the time left to it
    eltctl_samples_per_second, eltctl_loss         gauge   samples/s: over the last 30 s of commits
    eltctl_network_share                           gauge   the network wait's share of a step (0..1)
    eltctl_bytes_per_step                          gauge   bytes a rank all-reduces per step
    eltctl_checkpoint_step, eltctl_checkpoint_age_seconds   gauge
    eltctl_hosts{state}, eltctl_host_workers{host} gauge
    eltctl_resize_pauses_total                     counter  resizes (generation changes) seen
    eltctl_resize_pause_seconds_total              counter  training time they paused
    eltctl_yields_total{host,cause}                counter  workers that gave their slot back
    eltctl_worker_ends_total{host,how}             counter  every ended worker, by how it ended
    eltctl_gpu_seconds_total{host}                 counter  GPU time the job held (usage ledger)
    eltctl_restarts_total                          counter  restart mode: the script's restarts
    eltctl_forged_values_total{reader,host,family} counter  store values that failed their signature
    eltctl_store_keeper_restarts_total             counter
    eltctl_notifications_total{result}             counter  delivered, failed, dropped
    eltctl_fairshare_held_gpus, _wanted_gpus       gauge   fair share (docs/fairshare.md): held, wanted more
    eltctl_fairshare_share_gpus, _pool_gpus        gauge   the job's fair share and the pool (another job seen)
    eltctl_fairshare_releasing_gpus                gauge   GPUs it gives back now
    eltctl_fairshare_usage_gpu_hours{user}         gauge   its user's recent usage (decayed GPU-hours)
    eltctl_fairshare_priority                      gauge   `[job] priority`

`write_metrics` replaces the file atomically (a temporary `.<name>.*.tmp` beside it,
renamed: node_exporter's textfile collector reads `*.prom` only and never sees half a
file), mode 0644 so that node_exporter's account can read it. No socket is opened.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Mapping

# how a worker ended (ledger/recorder.py how_ended) -> counted as a yield (it gave its slot back)
YIELD_CAUSES = ("yield", "signal", "window", "quota", "cordon", "disabled", "straggler")


def escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


class Exposition:
    """The families written so far, in order; each family once."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.lines: list[str] = []
        self._open: str | None = None

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[Mapping[str, Any], Any]]) -> None:
        """One family: `samples` are (labels, value); None values are left out, and a
        family with no sample is not written at all."""
        kept = [(labels, v) for labels, v in samples if _num(v) is not None]
        if not kept:
            return
        self.lines.append(f"# HELP {name} {escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in kept:
            pairs = {"job": self.job, **{k: v for k, v in labels.items() if v is not None}}
            text = ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs.items())
            self.lines.append(f"{name}{{{text}}} {format_value(value)}")

    def one(self, name: str, kind: str, help_text: str, value: Any, **labels: Any) -> None:
        self.family(name, kind, help_text, [(labels, value)])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""


def render(doc: Mapping[str, Any], ledger: Mapping[str, Any] | None = None, *,
           controller_alive: bool | None = None) -> str:
    """The exposition text of status document `doc` and the ledger's figures
    (`ledger_figures`; None: left out). `controller_alive`: whether the live controller
    answered (None: the document's own `controller.alive`)."""
    e = Exposition(str(doc.get("job") or "?"))
    ctl = doc.get("controller") if isinstance(doc.get("controller"), dict) else {}
    alive = ctl.get("alive") if controller_alive is None else controller_alive
    e.one("eltctl_info", "gauge", "The job's state, phase and mode (always 1).", 1,
          state=doc.get("state"), phase=doc.get("phase"), mode=doc.get("mode"))
    e.one("eltctl_status_updated_timestamp_seconds", "gauge",
          "When the controller made the status document, in seconds since the epoch.", doc.get("updated"))
    e.one("eltctl_controller_up", "gauge", "1 when the job's controller runs (answered), else 0.",
          1 if alive else 0)
    e.one("eltctl_world_size", "gauge", "Workers that train now.", doc.get("world_size"))
    e.one("eltctl_min_workers", "gauge", "The job's min_workers.", doc.get("min_workers"))
    e.one("eltctl_generation", "gauge", "The runtime's worker generation (a new one at every resize).",
          doc.get("generation"))
    e.one("eltctl_step", "gauge", "The job's last committed step.", doc.get("step"))
    e.one("eltctl_total_steps", "gauge", "The step the training ends at (max_steps or its epochs' steps).",
          doc.get("total_steps"))
    e.one("eltctl_eta_seconds", "gauge", "Seconds until the training ends at the recent rate (while workers run).",
          doc.get("eta_s"))
    e.one("eltctl_samples_per_second", "gauge", "Training speed, samples per second (while workers run).",
          doc.get("samples_per_s"))
    e.one("eltctl_loss", "gauge", "The loss rank 0 last reported.", doc.get("loss"))
    net = doc.get("network") if isinstance(doc.get("network"), dict) else {}
    e.one("eltctl_network_share", "gauge", "The share of rank 0's step spent waiting for the gradients' "
          "all-reduces after backward: wait / (compute + wait), smoothed (while workers run).", net.get("share"))
    e.one("eltctl_bytes_per_step", "gauge", "Bytes rank 0 puts into all-reduces per step (gradients and control).",
          net.get("bytes_per_step"))
    ck = doc.get("checkpoint") if isinstance(doc.get("checkpoint"), dict) else {}
    e.one("eltctl_checkpoint_step", "gauge", "The step of the job's last checkpoint.", ck.get("step"))
    e.one("eltctl_checkpoint_age_seconds", "gauge", "The age of the job's last checkpoint.", ck.get("age_s"))

    hosts = [h for h in doc.get("hosts") or [] if isinstance(h, dict)]
    states: dict[str, int] = {}
    for h in hosts:
        states[str(h.get("state"))] = states.get(str(h.get("state")), 0) + 1
    e.family("eltctl_hosts", "gauge", "The inventory's hosts by state.",
             [({"state": s}, n) for s, n in sorted(states.items())])
    e.family("eltctl_host_workers", "gauge", "The job's workers on each host.",
             [({"host": h.get("name")}, h.get("workers")) for h in hosts])

    resizes = doc.get("resizes") if isinstance(doc.get("resizes"), dict) else {}
    e.one("eltctl_resize_pauses_total", "counter",
          "Resizes (generation changes) the controller saw, each pausing the training.", resizes.get("count"))
    e.one("eltctl_resize_pause_seconds_total", "counter", "Training time the resizes paused, in seconds.",
          resizes.get("pause_s"))

    if ledger is not None:
        ends = ledger.get("ends") or {}
        e.family("eltctl_yields_total", "counter",
                 "Workers that gave their slot back, by cause (an owner's process or signal, working hours, "
                 "quota, cordon, disabled, straggler).",
                 [({"host": host, "cause": how}, n) for (host, how), n in sorted(ends.items())
                  if how in YIELD_CAUSES])
        e.family("eltctl_worker_ends_total", "counter", "The job's workers that ended, by how (the usage ledger's "
                 "words: yield, signal, planned, crash, lost, finished, down, ...).",
                 [({"host": host, "how": how}, n) for (host, how), n in sorted(ends.items())])
        e.family("eltctl_gpu_seconds_total", "counter", "GPU time the job's workers held, in seconds.",
                 [({"host": host}, round(s, 3)) for host, s in sorted((ledger.get("gpu_seconds") or {}).items())])

    if doc.get("mode") == "restart":
        e.one("eltctl_restarts_total", "counter", "Restart mode: times the script's processes were restarted.",
              doc.get("restarts") or 0)
    forged = doc.get("forged") if isinstance(doc.get("forged"), dict) else {}
    samples: list[tuple[dict, Any]] = []
    for reader in ("controller", "rank0"):
        counts = forged.get(reader) if isinstance(forged.get(reader), dict) else {}
        samples += [({"reader": reader, "family": fam}, n) for fam, n in sorted(counts.items())]
    for host, counts in sorted((forged.get("hosts") or {}).items()) if isinstance(forged.get("hosts"), dict) else []:
        if isinstance(counts, dict):
            samples += [({"reader": "host", "host": host, "family": fam}, n) for fam, n in sorted(counts.items())]
    if forged:
        e.family("eltctl_forged_values_total", "counter",
                 "Store values not signed with the job's secret, read and ignored, by reader and key family.",
                 samples or [({"reader": "controller", "family": "any"}, 0)])
    keeper = doc.get("keeper") if isinstance(doc.get("keeper"), dict) else None
    if keeper is not None:
        e.one("eltctl_store_keeper_restarts_total", "counter", "Times the controller restarted the store keeper.",
              keeper.get("restarts") or 0)
    notify = doc.get("notify") if isinstance(doc.get("notify"), dict) else None
    if notify is not None:
        e.family("eltctl_notifications_total", "counter", "Notification deliveries, by result.",
                 [({"result": r}, notify.get(r) or 0) for r in ("delivered", "failed", "dropped")])
    fair = doc.get("fairshare") if isinstance(doc.get("fairshare"), dict) else None
    if fair is not None and fair.get("held") is not None:
        e.one("eltctl_fairshare_held_gpus", "gauge", "Fair share: GPUs the job holds (as it published them).",
              fair.get("held"))
        e.one("eltctl_fairshare_wanted_gpus", "gauge", "Fair share: how many more GPUs the job could use.",
              fair.get("wanted"))
        e.one("eltctl_fairshare_share_gpus", "gauge",
              "Fair share: the job's share of the pool (written only while another job shares its hosts).",
              fair.get("share"))
        if fair.get("share") is not None:
            e.one("eltctl_fairshare_pool_gpus", "gauge", "Fair share: the GPUs the jobs sharing the hosts split.",
                  fair.get("pool"))
        release = fair.get("release") if isinstance(fair.get("release"), dict) else {}
        e.one("eltctl_fairshare_releasing_gpus", "gauge", "Fair share: GPUs the job gives back now.",
              sum(v for v in release.values() if _num(v) is not None))
        e.one("eltctl_fairshare_usage_gpu_hours", "gauge",
              "Fair share: the job's recent usage, GPU-hours decayed by usage_half_life.", fair.get("usage_gpu_h"),
              user=fair.get("user"))
        e.one("eltctl_fairshare_priority", "gauge", "Fair share: the job's [job] priority.", fair.get("priority"))
    return e.text()


def ledger_figures(conn: sqlite3.Connection, now: float, live: bool) -> dict[str, Any]:
    """What `render` takes from the usage ledger: GPU-seconds per host, ever, and how
    many workers ended how on each host."""
    from eltctl.ledger.figures import ended_counts, gpu_seconds

    per_host, _ = gpu_seconds(conn, now, 0.0, live=live)
    return {"gpu_seconds": per_host, "ends": ended_counts(conn)}


def write_metrics(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically, readable by other accounts (0644)."""
    from eltctl_runtime.files import write_atomic

    write_atomic(path, text, mode=0o644, sync=False)


__all__ = ["YIELD_CAUSES", "Exposition", "escape_label", "format_value", "ledger_figures", "render", "write_metrics"]
