"""The job's store's limits (`Limits`, served by eltctl_runtime.store.server), and the
connection limit a process can honour under its open-file limit.

A store keeper must refuse a connection with an error, counted, before `accept`
could fail for want of a descriptor (EMFILE: the listener then stalls, nobody is
told why, and a legitimate client's connect waits in the backlog). So the keeper
raises its soft RLIMIT_NOFILE to its hard limit (`raise_nofile`) and serves at most
`connection_cap` connections. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPT_BURST = 64  # connections asyncio accepts in one pass, before their connection_made runs


@dataclass(frozen=True)
class Limits:
    max_value: int = 4 << 20  # bytes of one value
    max_key: int = 4096  # bytes of one key
    max_keys: int = 200_000
    max_total: int = 1 << 30  # bytes of keys and values held
    max_connections: int = 4096  # at most; the keeper lowers it below its open-file limit (connection_cap)
    max_frame: int = 16 << 20  # bytes of one request (a MULTI_SET carries several values)
    max_response: int = 16 << 20  # bytes of one answer (a PEEK or MULTI_GET names several values)
    max_unread: int = 256 << 20  # bytes of answers written to clients that do not read them, in all
    max_timeout_s: float = 3600.0  # a GET or WAIT waits at most this long
    frame_timeout_s: float = 10.0  # a frame begun must be complete within this
    silent_timeout_s: float = 5.0  # a new connection that sends nothing is closed after this
    idle_timeout_s: float = 300.0  # a connection idle between requests is closed after this
    evict_idle_s: float = 1.0  # at the connection limit, one idle this long may be closed to make room


# Descriptors kept beyond the store's connections: asyncio accepts ACCEPT_BURST
# connections in one pass before their connection_made runs, and the connections
# closed to make room for one burst are closed in the loop's next pass, after the
# next burst is accepted; the keeper has its own files and SSH connections too.
FD_RESERVE = 3 * ACCEPT_BURST + 64


def connection_cap(nofile: int, wanted: int, fds_per_client: int = 1, reserve: int = FD_RESERVE) -> int:
    """The connection limit a server with `nofile` open files (its soft RLIMIT_NOFILE)
    can honour: `wanted`, or less so that every accepted client (`fds_per_client`
    descriptors: 2 when each also holds an SSH channel's end in the same process) and
    the `reserve` fit. At least 1."""
    return max(1, min(wanted, (nofile - reserve) // max(fds_per_client, 1)))


def raise_nofile() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (an unprivileged
    process may); returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):  # e.g. over fs.nr_open: keep the old one
        return soft
    return want


__all__ = ["ACCEPT_BURST", "FD_RESERVE", "Limits", "connection_cap", "raise_nofile"]
