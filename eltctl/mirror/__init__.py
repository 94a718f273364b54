"""The checkpoint mirror: copies of the hosts' checkpoints on shared storage, and restore.

A checkpoint (runtime/checkpoint.py) is committed by rank 0 on ITS host, under
`~/.eltctl/jobs/<job>/<host>/checkpoints/step-NNNNNNNN/`. This package keeps copies of
them at `[storage] mirror`, under `<mirror>/<job>/step-NNNNNNNN/` (the same layout,
so `CheckpointStore` and `verify_dir` read a mirror directory as they read a host's),
and chooses, when a job starts with no survivor, the newest valid checkpoint among the
hosts' copies and the mirror.

Where the copying runs: the controller drives it over the connections it already has,
so the hosts need no credentials or packages of their own (only /bin/sh, cp, tar,
sha256sum, mv):

- a shared directory (`/mnt/nfs/ckpt`): the host holding the checkpoint copies it into
  the directory itself (one hop, it is mounted there) with the `mirror_copy` host
  program (eltctl/hosts/programs/mirror_copy.py), ONE command: copy while a second
  thread hashes, compare with the source manifest's sums (read by the controller
  first), fsync, rename into place. A host without Python does
  the same with `cp -R`, `sha256sum` and `mv`, the controller comparing;
- `ssh://[user@]host[:port]/path`: the controller opens `tar -cf -` on the holding host
  and `tar -xf -` on the mirror host and relays the bytes between the two SSH channels
  (`Transport.open_stream` on both; nothing lands on the control machine), then the
  mirror host hashes, compares and renames (mirror_copy's `publish`, or the shell tools).

Who wrote a mirrored checkpoint: the controller adds `manifest.mac` (HMAC-SHA256 with
the job's secret) to each copy it verified, and restore refuses a mirrored checkpoint
whose MAC fails (`signing`).

Guarantees: a copy is written under `.tmp-*`, verified, then renamed (`mv` within
one directory is atomic), so a reader never sees a partial checkpoint; retention
(`retention_plan`) runs only after a newer checkpoint verified and never deletes it;
expired checkpoints are renamed to `.tmp-*` before removal, as the runtime does.

`MirrorWorker` is the background part: the controller calls `notify(host, step)` when
rank 0 reports a new committed checkpoint; an asyncio task mirrors the newest one,
retrying with exponential back-off (`backoff_delay`) while the mirror is unreachable
(a permanent failure, `FaultKind`: permission, no space, a missing path, the mirror
host's key, is not retried but held with its fix), without ever blocking training (the copy runs beside it; a newer notice
replaces an older one still waiting). `status()` is what `eltctl status` shows.

The decisions (what to restore from, what retention deletes, the back-off schedule,
lag) are pure functions tested by tables; the rest is thin shell over a `Transport`.

The package, one module per part (each imports only those above it):

- `values`: `Located`, `Place`, `RestoreChoice`, `MirrorError`, `FaultKind`, `Fault`, `MIRROR_LABEL`;
- `target`: `[storage] mirror` parsed (`parse_target`, `MirrorTarget`);
- `decisions`: the pure functions (back-off, retention plan, restore order, lag, sums,
  sorting a failure into transient or permanent and its fix);
- `manifests`: reading manifests, listings and `sha256sum` output;
- `places`: shell on a place (list, read, verify; `host_place`);
- `copy`: one checkpoint from one place to another (`copy_checkpoint`);
- `retention`: `apply_retention` on the mirror;
- `job`: `Mirror`, the mirror of one job and its connection;
- `signing`: the MAC of a mirrored manifest (`manifest.mac`), checked before a restore;
- `restore`: `prepare_restore` before a start with no survivor;
- `worker`: `MirrorWorker`, the background copier;
- `listing`: `list_all` for `eltctl checkpoints`;
- `check`: `check_mirror`, the mirror as every account that touches it will use it
  (`eltctl doctor`, and `eltctl up` before it starts anything).
"""

from eltctl.hosts.layout import checkpoint_host
from eltctl.mirror.copy import copy_checkpoint
from eltctl.mirror.decisions import backoff_delay, compare_sums, lag, restore_order, retention_plan
from eltctl.mirror.job import MIRROR_UNLISTED, Mirror
from eltctl.mirror.listing import CheckpointListing, list_all
from eltctl.mirror.manifests import manifest_files
from eltctl.mirror.places import host_place, list_place, read_located, verify_located
from eltctl.mirror.restore import RestorePlan, prepare_restore
from eltctl.mirror.retention import apply_retention
from eltctl.mirror.target import MirrorTarget, TargetKind, parse_target
from eltctl.mirror.values import MIRROR_LABEL, Located, MirrorError, Place, RestoreChoice
from eltctl.mirror.worker import MirrorWorker

__all__ = [
    "MIRROR_LABEL", "MIRROR_UNLISTED", "CheckpointListing", "Located", "Mirror", "MirrorError", "MirrorTarget",
    "MirrorWorker",
    "Place", "RestoreChoice", "RestorePlan", "TargetKind", "apply_retention", "backoff_delay",
    "checkpoint_host", "compare_sums", "copy_checkpoint", "host_place", "lag", "list_all", "list_place",
    "manifest_files", "parse_target", "prepare_restore", "read_located", "restore_order", "retention_plan",
    "verify_located",
]
