"""One process group per generation, and collectives that an abort can interrupt.

Raw ProcessGroupGloo / ProcessGroupNCCL objects are built on the generation's
fresh store prefix (re-using keys hangs, pytorch#55967) instead of
init_process_group, and an aborted group is never destroyed on the training
thread: a gloo group's destructor blocks until its stuck collective times out
(58 s measured with a 60 s timeout, even after abort()). A daemon thread keeps
the reference instead, so neither training nor interpreter exit waits for it.

Every group is checked before any collective uses it (`verify_pairs`): gloo's TCP
listener gives an incoming connection to whichever pair waits for the sequence number
the connection names, with no authentication, and the numbers are predictable; another
account on a host that connects to a new group's listener first takes that pair (it
receives the rank's tensors; an answer would be summed in). So each rank sends each
peer, over that very pair, a message signed with the job's secret for (generation,
sender, receiver, group id), and checks the one it receives from each peer. A wrong or
missing message fails the group like a forged rendezvous value: Aborted, counted
(`gen/pair`, `gen/pair missing` among the Forgeries `status --json` shows), and the
roll call forms the next generation on fresh listeners. A handshake that keeps failing
(someone racing every new group) is reported, one line per failure naming the pairs,
who is connected to the rank's listener and the count, and backed off (`PairFailures`).
The handshake authenticates a pair when it forms, nothing that crosses it later: what
that leaves open is in docs/control-plane.md, "What the data plane exposes".
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..netif import BIND_ADDRESS_ENV, connections_to_my_listeners, local_address_towards
from ..protocol import Keys

log = logging.getLogger("eltctl_runtime")

T = TypeVar("T")

# Collectives are waited on by the runtime, which aborts them itself; the
# backend's own timeout only bounds how long a forgotten group lingers.
BACKEND_TIMEOUT = timedelta(seconds=300)
# How long verify_pairs waits for every peer's message: the ranks leave the group's
# construction together (gloo connects its full mesh there), so seconds are plenty;
# NCCL connects its point-to-point channels in the handshake itself.
PAIR_CHECK_S = 10.0
PAIR_CHECK_NCCL_S = 60.0
# A handshake that keeps failing (someone racing the listeners of every new group) would
# abort generation after generation at once: from the second failure in a row the rank
# waits before it answers the roll call (so before the next group forms), doubling up to
# the cap. Its heartbeat goes on meanwhile, so nobody takes it for hung.
PAIR_BACKOFF_FIRST_S = 1.0
PAIR_BACKOFF_MAX_S = 16.0


class Aborted(Exception):
    """The current generation was aborted (peer died, hung, or reported an error).
    `backend_error` is True when this rank's own collective failed (e.g. a ring
    neighbour's connection was reset): positive evidence that a peer is gone."""

    def __init__(self, message: str, backend_error: bool = False) -> None:
        super().__init__(message)
        self.backend_error = backend_error


def bind_address(store_host: str, store_port: int) -> str:
    """Where this worker's gloo/NCCL listen: $ELTCTL_BIND_ADDRESS when set (the daemon
    sets it from its SSH connection when the store is reached through an SSH forward
    on 127.0.0.1, which says nothing about the network), else the local address
    towards the store (`local_address_towards`)."""
    chosen = os.environ.get(BIND_ADDRESS_ENV, "").strip()
    return chosen or local_address_towards(store_host, store_port)


def make_group(store, rank: int, size: int, device: torch.device, bind_host: str):
    if device.type == "cuda":
        # Never tear the process down from the watchdog: the runtime aborts
        # the communicator itself and moves to the next generation.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # As torchft does (torchft/process_group.py): non-blocking communicators,
        # so abort() can interrupt init and collectives; eager connect, so a
        # joiner's NCCL init happens while the group forms, not in step one.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = BACKEND_TIMEOUT
        opts.config.blocking = False
        opts.global_ranks_in_group = list(range(size))
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(device)
        return pg
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = BACKEND_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def bury(pg, *keep) -> None:
    """Drop an aborted group without blocking anyone (see module docstring). `keep`:
    what must live as long as the group (its Python store, pgstore.py)."""
    if pg is None:
        return
    abort = getattr(pg, "abort", None)
    if abort is not None and pg.name() == "NCCL":
        try:
            abort()
        except RuntimeError:
            pass  # already aborted by the watchdog
    threading.Thread(target=_hold, args=(pg, keep), name="eltctl-buried-pg", daemon=True).start()


# How long a released gloo group is kept before its destructor runs: past the pause (the
# new group's formation, the state sync and the first steps), so its CPU time is not spent
# while every rank waits. On a host with few free cores a destructor that ran at once, even
# on a thread of its own, took that time from the new group's formation (seen: 15-20 ms of
# a 100 ms join on 2 busy cores). Nothing uses the old group meanwhile.
RELEASE_DELAY_S = 2.0


def release(pg, *keep) -> None:
    """Drop a cleanly finished group (no work in flight) off the caller's thread and after the
    pause: a gloo group's destructor takes 10 to 60 ms (it closes its pairs and joins its
    threads, without the GIL), which a planned resize would otherwise pause for. A gloo
    group goes RELEASE_DELAY_S later; an NCCL one at once (its communicator holds device
    memory the next one may need). `keep`: what must outlive the group (its Python store,
    pgstore.py)."""
    if pg is not None:
        delay = 0.0 if pg.name() == "NCCL" else RELEASE_DELAY_S
        threading.Thread(target=_drop, args=(pg, keep, delay), name="eltctl-old-pg", daemon=True).start()


def _drop(pg, keep, delay: float) -> None:
    if delay > 0:
        time.sleep(delay)
    del pg  # the thread's own references go when it ends: the destructor runs on it
    del keep


def _hold(pg, keep) -> None:
    time.sleep(BACKEND_TIMEOUT.total_seconds() + 30)
    del pg  # its stuck work has timed out by now, so the destructor is quick
    del keep  # after the group: its destructor may still call its store


def wait_work(work, abort: threading.Event | None, poll_s: float = 0.02) -> None:
    """Wait for a collective, leaving at once (Aborted) when `abort` is set or
    the backend reports an error (e.g. a ring neighbour's connection reset).
    `abort` None: nothing can abort the wait (a caller outside a generation): a plain
    wait() (gloo's reduce-scatter reports completion only from wait(), as its
    point-to-point works do: polled, it would never end); its error is an Aborted too."""
    if abort is not None and not work.is_completed():
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _f: done.set())
            waiter = done.wait
        except RuntimeError:  # backends without futures: poll
            def waiter(t: float) -> bool:
                time.sleep(min(t, 0.0005))
                return work.is_completed()
        while not work.is_completed() and not waiter(poll_s):
            if abort is not None and abort.is_set():
                raise Aborted("the generation was aborted while waiting for a collective")
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - every backend error means the same here
        raise Aborted(f"collective failed: {e}", backend_error=True) from e


def run_abortable(fn: Callable[[], T], abort: threading.Event | None, what: str) -> T:
    """Run a blocking call (process group construction) in a helper thread so
    an abort can leave it; an abandoned call finishes or times out on its own.
    `abort` None: nothing can abort it."""
    box: dict = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        done.set()

    threading.Thread(target=target, name=f"eltctl-{what}", daemon=True).start()
    while not done.wait(0.02):
        if abort is not None and abort.is_set():
            raise Aborted(f"the generation was aborted during {what}")
    if "error" in box:
        raise Aborted(f"{what} failed: {box['error']}") from box["error"]
    return box["value"]


def send(pg, t: torch.Tensor, dst: int, tag: int = 0):
    """Post a point-to-point send (its work, for wait_p2p). gloo raises at once when the
    pair's connection is already closed (the peer died before this was posted): that is
    an Aborted with backend_error, as a failure in the wait is."""
    try:
        return pg.send([t], dst, tag)
    except RuntimeError as e:
        raise Aborted(f"a send to rank {dst} failed: {e}", backend_error=True) from e


def recv(pg, t: torch.Tensor, src: int, tag: int = 0):
    """Post a point-to-point receive into `t` (as send)."""
    try:
        return pg.recv([t], src, tag)
    except RuntimeError as e:
        raise Aborted(f"a receive from rank {src} failed: {e}", backend_error=True) from e


def wait_p2p(works: list, abort: threading.Event | None, what: str = "shard transfers") -> None:
    """Wait for point-to-point sends and receives (send/recv's works): the one abortable
    point-to-point wait (zero's shard transfers and gather, the sharded checkpoint's
    bytes, the job's state transfer). gloo's report completion only from wait()
    (is_completed() stays False, there is no future), so an abortable wait runs their
    wait() on a helper thread (run_abortable); a backend's error (a peer gone) is an
    Aborted with backend_error, as wait_work's. `what` names the transfer in the error;
    `abort` None: nothing can abort the wait (plain wait()s)."""
    if abort is None:
        for w in works:
            w.wait()
        return
    try:
        run_abortable(lambda: [w.wait() for w in works], abort, what)
    except Aborted as e:
        if e.__cause__ is not None:
            raise Aborted(str(e), backend_error=True) from e.__cause__
        raise


def is_gloo(pg) -> bool:
    return pg is not None and pg.name().upper() == "GLOO"


def first_failure(works: list, start: int = 0) -> tuple[int, BaseException | None]:
    """Look at launched works from index `start` on without waiting for any: the index of
    the first one not completed yet (each before it succeeded), and the error of the first
    that failed (None where none has). A None entry (its launch failed) counts as failed.
    A peer gone shows here within milliseconds on gloo (its pair's connection closed),
    long before the generation's abort flag, which waits for the peer's report. gloo's
    works only: an NCCL work's future value() makes the current stream wait for it."""
    i = start
    while i < len(works):
        w = works[i]
        if w is None:
            return i, RuntimeError("a reduction could not be launched")
        try:
            fut = w.get_future()  # (Work.exception and is_success are deprecated)
        except RuntimeError:  # a work without a future: nothing to tell without waiting
            return i, None
        if not fut.done():
            return i, None
        try:
            fut.value()
        except Exception as e:  # noqa: BLE001 - the reduction's error
            return i, e
        i += 1
    return i, None


def settled(works: list) -> bool:
    """Whether none of the collectives `works` can still write into its buffers: each one
    launched has completed, succeeded or failed (a None entry never launched). After an
    abort some may not have: a survivor's all-reduce waiting on a ring neighbour that is
    alive but left its own (failed) one runs on until the group's timeout, so buffers it
    writes into must not be reused. Collectives only: gloo's point-to-point works report
    completion only from wait() (wait_p2p), so they would always read as unsettled."""
    for w in works:
        if w is None:
            continue
        try:
            if not w.is_completed():
                return False
        except RuntimeError:  # a backend that cannot tell: assume it may still write
            return False
    return True


def allreduce(pg, t: torch.Tensor, abort: threading.Event | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait_work(pg.allreduce([t], opts), abort)
    return t


# Point-to-point tag of allreduce_small's exchange (zero/'s shard transfers use others).
SMALL_TAG = 0x7A11
SMALL_MAX = 1 << 16  # elements: above this the exchange's W-1 copies per rank cost more than a ring's trips


def allreduce_small(pg, t: torch.Tensor, abort: threading.Event | None) -> torch.Tensor:
    """Sum a small tensor (a step's control tail) over the group in place, by a direct
    exchange: each rank sends it to every other and adds the W contributions in rank
    order, so every rank holds the same bits. On the wire that is one trip from each
    rank to each other, where a ring all-reduce takes 2(W-1) trips one after another:
    with 5 ms between hosts a world of 4 spent 51 ms more per step on a tail of a few
    dozen floats than with 0.2 ms (docs/network.md). gloo only; elsewhere (NCCL, whose
    point-to-point calls need grouping) and for a tensor of more than SMALL_MAX
    elements it is the all-reduce."""
    world, me = pg.size(), pg.rank()
    if world == 1:
        return t
    if not is_gloo(pg) or t.numel() > SMALL_MAX:
        return allreduce(pg, t, abort)
    parts = [t if r == me else torch.empty_like(t) for r in range(world)]
    works = [recv(pg, parts[r], r, SMALL_TAG) for r in range(world) if r != me]
    works += [send(pg, t, r, SMALL_TAG) for r in range(world) if r != me]
    wait_p2p(works, abort, "the control tail's exchange")
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return t.copy_(total)


def allreduce_async(pg, t: torch.Tensor, op=dist.ReduceOp.SUM):
    """Launch an all-reduce and return its work (wait on it with wait_work)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return pg.allreduce([t], opts)


def broadcast(pg, t: torch.Tensor, root: int, abort: threading.Event | None) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    wait_work(pg.broadcast([t], opts), abort)
    return t


def allgather(pg, t: torch.Tensor, abort: threading.Event | None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    wait_work(pg.allgather([out], [t]), abort)
    return out


# ---------------------------------------------------------------------------- pair handshake


def group_id(plan_json: str | bytes) -> str:
    """The id of the group a generation's plan forms (its digest, 32 hex digits): with the
    generation and the store's run id in every handshake message, no message of another
    group (an earlier formation, another run) verifies in this one."""
    raw = plan_json.encode() if isinstance(plan_json, str) else bytes(plan_json)
    return hashlib.sha256(raw).hexdigest()[:32]


def pair_messages(signer, generation: int, gid: str, rank: int, size: int) -> list[bytes]:
    """What rank `rank` sends each rank j (its own entry included, never sent): the group
    id sealed under Keys.pair(generation, rank, j). All of one length."""
    return [signer.seal(Keys.pair(generation, rank, j), gid) for j in range(size)]


def check_pair_messages(signer, generation: int, gid: str, rank: int, got: list[bytes]) -> list[int]:
    """The peers whose message to `rank` does not verify (sealed by someone else, for
    another pair, generation, group or run)."""
    want = gid.encode()
    return [j for j, raw in enumerate(got)
            if j != rank and signer.open(Keys.pair(generation, j, rank), raw) != want]


def pair_backoff_s(failures: int) -> float:
    """How long a rank waits after `failures` failed handshakes in a row: nothing after
    one (a single race or hiccup costs only its abort), then 1, 2, 4 ... s, at most
    PAIR_BACKOFF_MAX_S."""
    if failures < 2:
        return 0.0
    return min(PAIR_BACKOFF_MAX_S, PAIR_BACKOFF_FIRST_S * 2 ** (failures - 2))


class PairFailures:
    """This process's pair handshakes that failed in a row (one data plane per worker),
    for the back-off and its report; a handshake that passes clears them."""

    def __init__(self) -> None:
        self.in_a_row = 0
        self.suspects: dict[str, int] = {}  # peer (rank and worker) -> failures it was suspect in

    def passed(self) -> None:
        if self.in_a_row:
            log.info("pair handshake: passed after %d failed one(s) in a row", self.in_a_row)
        self.in_a_row = 0
        self.suspects = {}

    def failed(self, peers: list[str]) -> float:
        """Count a failure whose suspect pairs are `peers`; the back-off it earns."""
        self.in_a_row += 1
        for p in peers:
            self.suspects[p] = self.suspects.get(p, 0) + 1
        return pair_backoff_s(self.in_a_row)

    def report(self, generation: int, rank: int, listen: str | None, what: str, backoff_s: float,
               connected: list[tuple[str, int, int | None]]) -> str:
        """The log line: which pairs, how many failures, who is connected, what happens next."""
        me = os.getuid()
        others = [c for c in connected if c[2] is not None and c[2] != me]
        counts: dict[tuple[str, int | None], int] = {}
        for address, _port, uid in others or connected:  # another account's, when any: the suspects
            counts[(address, uid)] = counts.get((address, uid), 0) + 1
        who = ", ".join(f"{address} ({n} connection{'s' if n > 1 else ''}"
                        + (f", uid {uid}, another account" if uid is not None and uid != me else "") + ")"
                        for (address, uid), n in sorted(counts.items(), key=lambda kv: -kv[1])[:8])
        suspects = ", ".join(f"{p} ({n}x)" for p, n in sorted(self.suspects.items())) or "unknown"
        return (f"pair handshake of generation {generation} failed ({what}) for rank {rank}"
                f"{f' listening on {listen}' if listen else ''}: {self.in_a_row} failed in a row; pairs "
                f"with {suspects}; connected to this rank's data-plane listener: {who or 'nobody now'}. "
                "Someone may be connecting first to every new group's listener (gloo gives a pair to "
                "whoever names its sequence number; docs/control-plane.md, \"The data plane\")"
                + (f"; the next group forms after a {backoff_s:g} s back-off" if backoff_s else ""))


FAILURES = PairFailures()  # this process's; verify_pairs' default


def verify_pairs(pg, signed_store, generation: int, gid: str, rank: int, size: int, device: torch.device,
                 abort: threading.Event, timeout_s: float | None = None, *, peers: list[str] | None = None,
                 listen: str | None = None, failures: PairFailures | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
    """The signed pair handshake (module docstring), right after the group forms and
    before any collective uses it. One all-to-all: gloo's (gloo/alltoall.cc) and NCCL's
    send each peer its block over the direct pair (no ring, no relay), so every pair
    (i, j) carries i's message to j. `signed_store`: the job's SignedStore (its signer
    and Forgeries); a job without a secret (a plain store) has nothing to sign with and
    skips the check. Raises Aborted when a peer's message is wrong or missing after
    `timeout_s` (counted), when the generation is aborted meanwhile, or when the
    backend fails (a peer gone: backend_error).

    A wrong or missing message is also counted in `failures` (this process's
    `FAILURES`): one log line names the suspect pairs (`peers`: the members by rank),
    this rank's address (`listen`), who is connected to its listeners and how many
    handshakes failed in a row, and from the second one in a row the rank backs off
    (`pair_backoff_s`) before raising."""
    failures = FAILURES if failures is None else failures
    signer = getattr(signed_store, "signer", None)
    forgeries = getattr(signed_store, "forgeries", None)
    if signer is None or size < 2:
        return
    if timeout_s is None:
        timeout_s = PAIR_CHECK_NCCL_S if device.type == "cuda" else PAIR_CHECK_S
    out = pair_messages(signer, generation, gid, rank, size)
    n = len(out[0])
    send = torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).to(device)
    recv = torch.zeros_like(send)
    opts = dist.AllToAllOptions()
    opts.timeout = timedelta(seconds=timeout_s)
    work = pg.alltoall_base(recv, send, [], [], opts)
    end = time.monotonic() + timeout_s
    missing = False
    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _f: done.set())
    except RuntimeError:  # backends without futures: poll
        pass
    while not work.is_completed() and not done.wait(0.01):
        if abort.is_set():
            raise Aborted(f"the generation was aborted during generation {generation}'s pair handshake")
        if time.monotonic() > end:
            missing = True
            break
    if not missing:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - every backend error means the same here
            if "timed out" not in str(e).lower():
                raise Aborted(f"generation {generation}'s pair handshake failed: {e}", backend_error=True) from e
            missing = True

    def named(ranks: list[int]) -> list[str]:
        return [f"rank {j}" + (f" ({peers[j]})" if peers and j < len(peers) else "") for j in ranks]

    def back_off(suspects: list[int], what: str) -> None:
        wait = failures.failed(named(suspects))
        log.warning("%s", failures.report(generation, rank, listen, what, wait, connections_to_my_listeners()))
        if wait:
            sleep(wait)

    if missing:
        _pair_anomaly(forgeries, Keys.pair(generation, -1, rank), "missing")
        # Which peers' messages never came: readable only on the CPU (a CUDA copy would wait
        # for the stuck all-to-all); a block gloo had not written yet reads as not verified.
        suspects = _unverified(signer, generation, gid, rank, size, n, recv) if device.type == "cpu" else []
        back_off(suspects, "a message missing")
        raise Aborted(f"generation {generation}'s pair handshake: no message from some peer of rank {rank} "
                      f"within {timeout_s:g} s (another account may hold a pair of the group: it is not used)")
    got = bytes(recv.cpu().tolist())
    bad = check_pair_messages(signer, generation, gid, rank, [got[j * n:(j + 1) * n] for j in range(size)])
    if bad:
        for j in bad:
            _pair_anomaly(forgeries, Keys.pair(generation, j, rank), "forged")
        back_off(bad, "a message not signed for its pair")
        raise Aborted(f"generation {generation}'s pair handshake: the message of rank(s) {bad} to rank {rank} "
                      "is not signed for this pair with the job's secret (someone else holds that pair): "
                      "the group is not used")
    failures.passed()


def _unverified(signer, generation: int, gid: str, rank: int, size: int, n: int, recv: torch.Tensor) -> list[int]:
    got = bytes(recv.clone().tolist())
    return check_pair_messages(signer, generation, gid, rank, [got[j * n:(j + 1) * n] for j in range(size)])


def _pair_anomaly(forgeries, key: str, what: str) -> None:
    log.warning("pair handshake %s: %s (gloo's listener gives a pair to whoever connects first; the "
                "generation's group is dropped and the next one forms on fresh listeners)", key, what)
    if forgeries is not None:
        forgeries.note(key, what)
