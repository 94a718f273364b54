"""The mirror's pure decisions, tested by tables: the back-off schedule, what retention
deletes, the order to try restore candidates in, the lag, comparing checksums, and
sorting a failure into retried or permanent (`classify`) with its fix (`fault_fix`).
(Which host a checkpoint path belongs to is `eltctl.hosts.layout.checkpoint_host`.)"""

from __future__ import annotations

from typing import Iterable, Sequence

from eltctl.mirror.values import Fault, FaultKind, Located

# errno names (as the host program reports them) and the words the same errors print
# as (`strerror`, what cp, mkdir, mv and tar write): the kind each means.
_ERRNO_KINDS = {
    "EACCES": FaultKind.PERMISSION, "EPERM": FaultKind.PERMISSION,
    "ENOSPC": FaultKind.NO_SPACE, "EDQUOT": FaultKind.NO_SPACE,
    "EROFS": FaultKind.READ_ONLY,
    "ENOENT": FaultKind.MISSING_PATH, "ENOTDIR": FaultKind.MISSING_PATH,
}
_TEXT_KINDS = (
    ("permission denied", FaultKind.PERMISSION),
    ("operation not permitted", FaultKind.PERMISSION),
    ("no space left on device", FaultKind.NO_SPACE),
    ("disk quota exceeded", FaultKind.NO_SPACE),
    ("read-only file system", FaultKind.READ_ONLY),
    ("not a directory", FaultKind.MISSING_PATH),
    ("no such file or directory", FaultKind.MISSING_PATH),
)
# HostError kinds (eltctl.hosts.transport.ErrorKind values) of the mirror host's login.
_LOGIN_KINDS = {"host-key-unknown": FaultKind.HOST_KEY, "host-key-changed": FaultKind.HOST_KEY,
                "auth": FaultKind.AUTH}


def backoff_delay(attempt: int, *, base: float = 2.0, cap: float = 60.0) -> float:
    """Seconds to wait before retry `attempt` (1 = first retry): base * 2^(attempt-1), capped."""
    if attempt < 1:
        return 0.0
    return min(cap, base * (2 ** min(attempt - 1, 30)))


def retention_plan(present: Iterable[int], keep: int, verified: int) -> list[int]:
    """Mirrored steps to delete once `verified` has just been copied and verified.

    The newest `keep` steps stay, and so does `verified` whatever its rank; nothing
    newer than `verified` is deleted (a newer copy is not known to be good), so the
    last good checkpoint is never deleted before a newer one has been verified.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ordered = sorted(set(present) | {verified}, reverse=True)
    kept = set(ordered[:keep]) | {verified}
    return sorted(s for s in ordered if s not in kept and s < verified)


def restore_order(candidates: Iterable[Located]) -> list[Located]:
    """The order to try checkpoints in: newest step first; for one step a host's copy
    before the mirror's (no transfer, or a shorter one), then by host name."""
    return sorted(candidates, key=lambda c: (-c.step, c.on_mirror, c.where))


def lag(newest_committed: int | None, newest_mirrored: int | None) -> int | None:
    """How many steps the mirror is behind the newest committed checkpoint (None: unknown)."""
    if newest_committed is None:
        return None
    if newest_mirrored is None:
        return newest_committed
    return max(0, newest_committed - newest_mirrored)


def compare_sums(expected: Sequence[tuple[str, int, str]], sums: dict[str, str]) -> str | None:
    """None if every file has its manifest's sha256, else what differs."""
    for name, _size, sha in expected:
        got = sums.get(name)
        if got is None:
            return f"{name} is missing"
        if got != sha:
            return f"{name} sha256 {got[:12]}... differs from the manifest's {sha[:12]}..."
    return None


def classify(message: str, *, errno: str | None = None, login_error: str | None = None,
             source_gone: bool = False) -> FaultKind:
    """What kind of failure a mirror error is: TRANSIENT (retry with back-off) or a
    permanent kind (retrying cannot help; a person must act).

    `errno`: the OS error's name where the host program reported one; `login_error`: the
    HostError kind when connecting to the ssh:// mirror host failed; `source_gone`: the
    checkpoint left its host (a missing SOURCE is not the mirror's missing path: the
    caller drops that step instead). Anything not recognised is TRANSIENT: a failure
    eltctl does not understand is retried, as before."""
    if login_error is not None:
        return _LOGIN_KINDS.get(login_error, FaultKind.TRANSIENT)
    if source_gone:
        return FaultKind.TRANSIENT
    if errno in _ERRNO_KINDS:
        return _ERRNO_KINDS[errno]
    low = message.lower()
    for words, kind in _TEXT_KINDS:
        if words in low:
            return kind
    return FaultKind.TRANSIENT


def fault_fix(kind: FaultKind, *, target: str, directory: bool, job_dir: str) -> str | None:
    """What a person does about a permanent failure of the mirror `target` (None: transient)."""
    if kind is FaultKind.PERMISSION:
        if directory:
            return (f"every account that touches {job_dir} (this machine's, and each host's login) must be able "
                    "to create, write, rename and remove there: log in to the hosts as the same uid as here, "
                    "use an ssh:// mirror, or make the mirror a group-writable directory "
                    "(docs/checkpoints.md, \"Which accounts touch the mirror\"); `eltctl doctor` checks it")
        return (f"the mirror host's account cannot write {job_dir}: fix the directory's owner or mode there "
                "(`eltctl doctor` checks it)")
    if kind is FaultKind.NO_SPACE:
        return f"free space (or quota) on {target}, or keep fewer copies ([storage] keep)"
    if kind is FaultKind.READ_ONLY:
        return f"{target} is mounted read-only: mount it read-write"
    if kind is FaultKind.MISSING_PATH:
        return (f"{target} is not there as a directory: mount it (same path on this machine and every host) "
                "or create it, or fix [storage] mirror")
    if kind is FaultKind.HOST_KEY:
        return ("record the mirror host's key in the known_hosts file of [ssh] (e.g. log in once with ssh and "
                "check its fingerprint)")
    if kind is FaultKind.AUTH:
        return "let the key of [ssh] identity_file log in to the mirror host as the ssh:// address's user"
    return None
