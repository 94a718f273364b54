"""The host daemon (membership daemon): runs one job's workers on one host.

    python -m eltctl_runtime.daemon --config ~/.eltctl/jobs/<job>/<host>/daemon.json [--detach]

The controller starts one per used host over SSH, detached (or with `--detach`,
which starts the daemon again in a new session with stdin /dev/null and output
appended to daemon.log, prints `ok PID` once it holds the pid file, and exits:
0 started, 3 another daemon already runs (`running PID`), 2 bad configuration).
The daemon

* connects to the job's store (`link.StoreLink`, a background thread;
  signed with the job's secret when daemon.json names a `secret_file`, which
  its workers get as ELTCTL_SECRET_FILE: a forged value is counted, logged once
  and ignored, the last verified desired state stands)
  and applies the controller's desired state `daemon/<host>/desired`
  (`{seq, slots, stop}`, polled every 0.25 s): one worker per desired slot
  (a GPU index, or a CPU slot number), a planned leave (`leave/<worker_id>` and
  SIGTERM) for a slot no longer desired, and on `stop` it waits for its workers
  (the controller wrote the runtime's job-wide `stop` key) and exits;
* claims each slot before it starts a worker there (runtime/claims.py: a flock
  on `<claims dir>/gpu<N>`, passed to the worker, so it lasts exactly as long as
  the worker); a slot another eltctl job has claimed is reported `taken` and
  left alone (no yield, no crash), and another job's GPU process is never taken
  for an owner (docs/control-plane.md, "Several jobs on one lab");
* reaps its workers: an exit that was not asked for is reported at once
  (`protocol.report_dead` and an event of kind `crash`) and never restarted
  by the daemon itself: only a new desired seq listing the slot starts one;
* watches its GPUs every `watch_interval` with `nvidia-smi` (gpuwatch.py): a
  process that is not this job's on a GPU a worker uses makes that worker leave
  at once (planned), records a `yield` (state and event, naming the user and pid),
  and keeps the slot empty until a new seq lists it. Once the runtime's plan
  lists that worker as left, the worker normally exits within ~0.3 s (the
  runtime skips the interpreter's teardown, exiting.py), so the owner gets the
  GPU back in about watch_interval + one step + 0.3 s; a process still
  lingering after `evict_grace` (a script that hangs after its loop) is
  SIGKILLed, a backstop;
* watches the owner signals beyond the GPU that daemon.json's `owner` names
  (eltctl_runtime.owner: another user's login, console input, foreign CPU load,
  foreign memory) every `watch_interval`: a firing signal makes every worker of
  the host leave in the planned way (not urgent: no eviction) and records one
  `yield` per slot naming the signal; while the start condition does not hold
  (e.g. a login idle for less than idle_to_start) an armed slot gets no worker
  but a yield, as for a foreign GPU process;
* writes `daemon/<host>/state` about every second (below);
* on SIGTERM makes all its workers leave in the planned way, waits, and exits;
  SIGKILL leaves the workers running (own sessions), and the next daemon adopts
  them through `workers/<slot>.pid` (alive, and /proc/<pid>/environ carries
  ELTCTL_JOB=<job> and an ELTCTL_WORKER_ID of this host and slot), or, for a
  worker whose pid file was never written, through that environment alone;
* keeps its workers running whatever happens to the store or the controller.

`daemon/<host>/state` (JSON, about once a second)::

    {"time", "heartbeat": wall clock of the write, "pid", "started", "host", "job",
     "phase": "running" | "stopping" | "stopped" | "failed",
     "seq_applied": int | null, "wanted": [slots of that seq],
     "slot_kind": "gpu" | "cpu", "valid_slots": [slots it has] | null (any GPU),
     "follows_gpus": bool,
         # the kind is fixed at its start (config.py gpu_host), and so are the slots unless
         # follows_gpus (daemon.json's follow_gpus: its GPU list came from the probe): then
         # they are what nvidia-smi lists, and a desired slot refused earlier is taken up
         # once listed (logic.late_slots). A desired slot it does not have is refused, so
         # the controller replaces a daemon of the wrong kind (or, not following, too few GPUs)
     "config": daemon.json's config ("": none): the controller's digest of the job's code,
         # settings and this host's entry it was started with; an idle daemon with an
         # older one is replaced, and its crash events (which carry it) count no failure
     "workers": [{"slot", "worker_id", "pid", "state", "since", "adopted", "detail", "start"
                  [, "exit_code", "cause", "at_start"]}],
         # start: when a live worker's process started (wall clock)
         # an ended worker: cause is the line of its log that says why (the last
         # traceback's exception line, else its last line; "" if none), at_start
         # whether it failed before any generation plan listed it (its first step)
         # live states: running, stopping, leaving, killed, evicted; the last ended
         # worker of an empty slot: left, finished, crashed, lost (logic.WorkerState)
     "gpus": [{"index", "state": "ours" | "busy" | "free" | "taken" | "unknown", "reason", "since"}],
         # taken: another eltctl job holds it ("taken by job X (user u, pid p)"): never an owner
     "yielded": [{"slot", "user", "pid", "time" [, "signal"]}], "crashes": int (this daemon's life),
     "history": [{"worker_id", "slot", "start", "end", "state", "why"}],
         # the newest 200 ended workers, oldest first, host wall clock (history.py;
         # protocol.history_entry); kept in history.json across daemon restarts
     "signal": null | {"name": "login" | "keyboard" | "load" | "memory", "detail", "since": wall clock}
         # the owner signal that holds the host now (fired, or the start condition fails)
     "taken": {"<slot>": "<other job>"},   # slots whose GPU claim another job holds: nothing starts there
     "health": "ok" | "unhealthy" (nvidia-smi failed or hung),
     "watch": {"health": "ok" | "none" | "failed" | "hung", "reason", "since", "last_s"},
     "store": {"connected", "reconnects", "last_error"},
     "forged": {"<family>": int},   # store values that failed the job's signature check, per key
         # family (auth.family, e.g. "daemon/desired"), ignored and counted; {} when none
     "demands": [{"job", "user", "time", "priority", "held", "wanted", ...}],
         # the fresh fair-share demand entries in the host's claims directory, as their files
         # hold them (claims.DemandReader, read every watch_interval; eltctl/demand.py): the
         # controller learns of another job's new demand from them, not only at its next probe;
         # only the entries believed (claims.judge: the file's owner is the account they name)
     "refused": {"count": int, "entries": [{"file", "owner", "reason"}]}}
         # the entries of the claims directory not believed at its last look (claims.judge):
         # written by another account than the one they name, a name outside the strict set,
         # a time in the future, a lock with no live process of its account (issue 49)

Events it appends to the runtime's `events/<n>`: `{time, kind, host, workers,
pause_s: null, detail}` with kind `yield` or `crash` (`protocol.event_document`);
a crash adds `cause`, `at_start`, `exit_code` and `ran_s` (seconds it ran, when at_start).

Files under `job_dir` (`~/.eltctl/jobs/<job>/<host>/`): `daemon.json` (this
configuration), `daemon.pid` (flocked for life: one daemon per job and host),
`daemon.log`, `daemon.memory.json` (applied seq, yields, the next worker
incarnation; removed on a clean stop), `workers/<slot>.pid`, `workers/<slot>.log`.

The modules: `config` (daemon.json, the worker environment), `logic` (the
decisions, pure), `service` (the executor: observe, decide, act), `link` (the
store link thread), `procs` (/proc, the pid lock, worker processes), `forkserver` and
`zygote` (the workers' interpreter with torch imported, forked per worker),
`gpuwatch` (the nvidia-smi watch), `history` (the ended workers), `main` (the command line). The store keys
and documents it shares with the controller and the runtime: protocol.py.
"""

from .config import DaemonConfig, DaemonConfigError, worker_env
from .main import main
from .service import Daemon

__all__ = ["Daemon", "DaemonConfig", "DaemonConfigError", "main", "worker_env"]
