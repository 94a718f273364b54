"""This rank's share of each step, as the job keeps it: which of the step's samples
it takes and in how large micro-batches.

Three things shape a share, and they meet here so the job's step only asks:

- the split in force (balance.py's pure `Split`): equal shares at the start of a
  generation, then proportional to the ranks' speeds, re-planned at every commit
  from the paces the control tail carried (tail.py) and adopted only once proposed
  at CONFIRM_COMMITS commits in a row;
- this rank's own pace (balance.py's `Pace`): its compute time, from the batch
  handed to the script to the end of its backward (waits in collectives and the
  empty rounds of reduce_each_micro_batch excluded), per sample;
- the micro-batch size: the script's, capped by the host's max_micro_batch and by
  the size this rank last ran out of memory with (halved; the step is redone by
  every rank, this one in smaller micro-batches).

Nothing here does I/O or a collective; the job owns one `Shares`.
"""

from __future__ import annotations

import time

from .balance import Pace, Split, worker_report
from .sampler import SamplerState

CONFIRM_COMMITS = 3  # a new balanced split is adopted once proposed at this many commits in a row
# The pace slot of a catching-up rank that holds the state now (catchup.py): below 0, so the
# split and the status read it as not measured (balance.known_paces) like the 0 of a rank
# without samples.
READY_SLOT = -1.0
# The pace slot of a catching-up rank of synchronous steps that dropped the steps it kept and
# asks for a newer copy of the state (catchup.py); read as not measured too.
AGAIN_SLOT = -2.0


class Shares:
    """The split in force, this rank's pace and its micro-batch limit (module docstring)."""

    def __init__(self, *, balance: bool, min_share: int, micro: int | None) -> None:
        self.balance = balance
        # BatchNorm in training mode needs more than one sample per rank: a balanced
        # split never gives a rank fewer than two then.
        self.min_share = min_share
        self.micro = micro  # the script's micro_batch_size
        self.pace = Pace()
        self.split = Split(minimum=min_share)
        self.proposal: tuple[list[int], int] | None = None  # a new split proposed, and at how many commits in a row
        self.split_gen = -1  # the generation the split in force was planned in
        self.t_handed = 0.0  # when the batch in flight went to the script (perf_counter)
        self.compute_s = 0.0  # compute time of the step in flight
        # What the last commit carried: every rank's pace and the split's counts.
        self.last_paces: list[float] = []
        self.last_counts: list[int] = []
        # Out of memory on a share: the micro-batch size this rank redoes the
        # step with (0: none this step), and the limit found so far.
        self.oom_retry = 0
        self.oom_limit: int | None = None
        # Ranks that train on nothing for now (joiners catching up, catchup.py); the others
        # split each step equally meanwhile. `ready`: this rank, catching up, holds the state
        # now; its pace slot says so (READY_SLOT) and it trains from the next step. `again`:
        # it asks for a newer copy of the state (AGAIN_SLOT, synchronous steps).
        self.idle: frozenset[int] = frozenset()
        self.ready = False
        self.again = False

    # -- the split ------------------------------------------------------------------
    def in_force(self, generation: int) -> Split:
        """The split of this generation's steps; a new generation starts from
        equal shares and is re-planned at its first commit."""
        if self.split_gen != generation or not self.balance:
            self.split, self.split_gen = Split(minimum=self.min_share), generation
            self.proposal = None
        return self.split

    def indices(self, sampler: SamplerState, rank: int, world_size: int, generation: int) -> list[int]:
        """Rank `rank`'s share of the step `sampler` is at, in the current layout:
        proportional to the ranks' speeds with balancing on, else equal."""
        split = self.in_force(generation)
        if self.idle:
            if rank in self.idle:
                return []
            active = [r for r in range(world_size) if r not in self.idle]
            return sampler.local_indices(active.index(rank), len(active), None, split.minimum)
        return sampler.local_indices(rank, world_size, split.weights, split.minimum)

    def replan(self, paces: list[float], global_count: int, total: int, world_size: int, generation: int) -> None:
        """At a commit: every rank's pace, identical floats on every rank, and
        the split of the next steps planned from them (the same on every rank)."""
        W = world_size
        self.last_counts = self.in_force(generation).counts(global_count, W)
        if self.idle:  # the step's split among the ranks that trained (indices)
            active = [r for r in range(W) if r not in self.idle]
            equal = iter(Split().counts(global_count, len(active)))
            self.last_counts = [0 if r in self.idle else next(equal) for r in range(W)]
        self.last_paces = paces
        if self.balance:
            cand = self.split.replanned(paces, total)
            now, new = self.split.counts(total, W), cand.counts(total, W)
            if new == now:
                self.split, self.proposal = cand, None
                return
            # A new split is adopted only once the same one has been proposed at
            # CONFIRM_COMMITS commits in a row: measured paces are noisy (on a busy
            # machine two equal ranks swap a few samples back and forth), and every
            # change costs the shares the input pipeline has prefetched.
            seen = self.proposal[1] + 1 if self.proposal and self.proposal[0] == new else 1
            if seen >= CONFIRM_COMMITS:
                self.split, self.proposal = cand, None
            else:
                self.proposal = (new, seen)

    def report(self, members: tuple[str, ...] | list[str], total: int) -> dict | None:
        """Each member's share and speed as of the last commit (balance.worker_report)."""
        if len(self.last_paces) != len(members):
            return None  # no step committed in this generation yet
        return worker_report(members, self.last_counts, self.last_paces, total)

    # -- this rank's pace -----------------------------------------------------------
    def handed(self) -> None:
        """The batch goes to the script: this rank's compute time starts."""
        self.t_handed = time.perf_counter()

    def backward_done(self) -> None:
        """From the batch handed over to the end of backward: the buckets'
        all-reduces launched in backward are asynchronous, no wait is in it."""
        self.compute_s += time.perf_counter() - self.t_handed

    def computed(self, seconds: float) -> None:
        """`seconds` of this rank's compute outside a micro-batch's forward and backward
        (local steps' inner steps before the step's last: inner.py)."""
        self.compute_s += seconds

    def not_computed(self, seconds: float) -> None:
        """`seconds` since the batch was handed over that are not this rank's compute."""
        self.t_handed += seconds

    def step_slots(self, samples: int) -> tuple[float, int]:
        """The step is reduced: this rank's pace slot and out-of-memory slot for the
        control tail (tail.py). A step redone after running out of memory tells
        nothing about the pace."""
        if not self.oom_retry:
            self.pace = self.pace.observed(self.compute_s, samples)
        oom, self.compute_s, self.oom_retry = self.oom_retry, 0.0, 0
        return (READY_SLOT if self.ready else AGAIN_SLOT if self.again else self.pace.slot), oom

    def dropped(self) -> None:
        """A step dropped before its tail was written: forget its time and its redo."""
        self.compute_s, self.oom_retry = 0.0, 0

    # -- micro-batches and out of memory -------------------------------------------
    def micro_limit(self, max_micro_batch: int | None) -> int | None:
        """The micro-batch size: the script's, capped by this host's
        max_micro_batch (ELTCTL_MAX_MICRO_BATCH) and by the size this rank
        last ran out of memory with (halved)."""
        limits = [m for m in (self.micro, max_micro_batch, self.oom_limit) if m]
        return min(limits) if limits else None

    def out_of_memory(self, n: int, error: BaseException) -> int:
        """This rank ran out of memory on `n` samples: the micro-batch size it redoes
        the step with (half), or `error` again when there is nothing smaller to try."""
        if n <= 1:
            raise error
        self.oom_retry = (n + 1) // 2
        return self.oom_retry

    def redone(self, limits: list[int], rank: int) -> None:
        """A step redone: the ranks' out-of-memory slots; this rank's becomes its limit."""
        mine = limits[rank]
        if mine:
            self.oom_limit = min(mine, self.oom_limit or mine)
