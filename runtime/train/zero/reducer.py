"""The sharded gradient reduction of one rank: each bucket reduced as backward completes it.

- `shard="optimizer"` (ZeRO-1): the gradients are all-reduced bucket by bucket as
  backward produces them (the replicated path's schedule), then each rank steps only
  the chunks it holds;
- `shard="gradients"` (ZeRO-2): each bucket is reduce-scattered as soon as backward
  completes it, straight into the rank's chunk; the parameters' gradients are freed as
  they are staged, so between steps a rank keeps only 1/W of the gradients. A backup
  chunk's gradient comes from its primary by point-to-point.

`_Reducer` is one part of ShardedGradients (sharded.py; buffers.py says how the parts
share the rank's attributes).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from ...member import collectives

# ZeRO-2 on the CPU: staging buffers per dtype kept from step to step (a bucket's full gradient while it
# is reduced). A bucket waits for the oldest one in flight to be reduced when all are taken, so
# between steps a rank keeps these few buckets, not the full gradients; a buffer freed every
# step would come back from the OS at a page fault per 4 KiB, every step. On CUDA the caching
# allocator does this already: each bucket gets its own.
STAGING_BUFFERS = 3


class _Reducer:
    """Per step: `begin(pg)`, backward with `grad_ready(index, p)` from each parameter's
    post-accumulate-grad hook, `finish()` (or `finish_round()` per micro-batch); `drop()`
    for a step that broke. Part of ShardedGradients."""

    def _init_reduction(self, reduce_scatter: bool | None) -> None:
        # ZeRO-2's reduction: reduce_scatter_tensor, or (None: on gloo) an all-reduce of the bucket
        # from which each rank keeps its chunks (see _launch).
        self._reduce_scatter_asked = reduce_scatter
        self._rs = True
        self._pg = None
        self._gloo = False  # the group of the last begin() is gloo's
        self._ok_upto = 0  # failed(): reductions before this one are known to have succeeded
        self._abort: threading.Event | None = None
        self._launching = False
        self._works: list = []  # the step's reductions, in bucket order (None: its launch failed)
        self._staging: dict[int, torch.Tensor] = {}  # ZeRO-2: bucket -> its staged full gradient
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}  # ZeRO-2 on the CPU: free staging buffers
        self._pooled: dict[int, torch.Tensor] = {}  # bucket -> the pool buffer its staging is a view of
        self._pool_size: dict[torch.dtype, int] = {}  # per dtype: staging buffers the pool owns (free or lent)
        self._retired = 0  # buckets whose reduction is waited for and taken out of the staging
        self._error: BaseException | None = None  # a launch or wait inside backward failed: finish raises it
        # ZeRO-2 with replicas: the backups' exchange (point-to-point into _shard_grads) is
        # posted and not yet waited for to its end
        self._exchanging = False
        # ZeRO-2 reducing each micro-batch (ElasticJob(reduce_each_micro_batch=True)): the
        # rounds of this step already reduced into _shard_grads (begin(accumulate=True),
        # finish_round); a later round's reduction is added to them, not written over them.
        self._rounds = 0
        self._rs_into: dict[int, torch.Tensor] = {}  # a later round's reduce-scatter: bucket -> its sum
        self._loose: list = []  # reductions of a failed round that may still be in flight (drop)
        # A dropped step left a reduction that may still write into the gradient buffers and
        # the staging pool (drop): they are replaced before they are used again (begin), and
        # a reshard's new path does not take them over (bind).
        self._stale = False
        # What finish() prepared for the coming step (_prepare_step): the pre-step copy of the
        # held chunks ({} where none is kept); None: not prepared.
        self._prepared: dict[str, list] | None = None

    @property
    def stale(self) -> bool:
        """A dropped step's reductions may still write into the gradient buffers (drop)."""
        return self._stale

    @property
    def reductions(self) -> tuple:
        """The works of this step's reductions launched so far, in bucket order."""
        return tuple(self._works)

    @property
    def staging_buffers(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-2 on the CPU: the free staging buffers of the pool."""
        return tuple(t for ts in self._pool.values() for t in ts)

    def begin(self, pg, abort: threading.Event | None = None, accumulate: bool = False) -> None:
        """Arm the reduction for the coming backward: the step's last (finish() follows),
        or (`accumulate`, ZeRO-2) a micro-batch before it, whose gradients are reduced into
        the held chunks' and added to those of the rounds before (finish_round follows).
        Every rank runs the same number of rounds in a step."""
        if accumulate and self.shard != "gradients":
            raise ValueError("only ZeRO-2 (shard='gradients') reduces each micro-batch")
        self._pg, self._abort = pg, abort
        asked = self._reduce_scatter_asked
        # Every chunk held here: an all-reduce gives them all at once (a reduce-scatter would
        # need the backups' exchange on top).
        gloo = self._gloo = collectives.is_gloo(pg)
        self._rs = False if self._full else asked if asked is not None else not gloo
        self._p2p_gather = self._p2p_gather_asked if self._p2p_gather_asked is not None else gloo
        if self._stale and not self._rounds:
            self._renew_grads()
        if self.shard == "optimizer":
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    view = self._param_view(self._grads, i)
                    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                        continue
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad.reshape(-1))
                    p.grad = view.view_as(p)
        self._ready = [0] * len(self.layout.buckets)
        self._fired: set[int] = set()
        self._works = []
        # A failure in an earlier round of this step is kept for finish() to raise.
        self._staging, self._pooled, self._retired = {}, {}, 0
        self._error = self._error if self._rounds else None
        self._rs_into = {}
        self._prepared = None
        self._ok_upto = 0  # reductions before this one are known to have succeeded (failed())
        self._launching = True

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body of parameter `index`: stage its gradient
        (ZeRO-2) and launch every complete bucket, in the one global order."""
        if not self._launching or index in self._fired:
            return
        self._fired.add(index)
        b = self._bucket_of[index]
        if self.shard == "gradients":
            self._stage(index, p)
        self._ready[b] += 1
        while len(self._works) < len(self.layout.buckets):
            nb = len(self._works)
            if self._ready[nb] < len(self.layout.buckets[nb].params):
                break
            self._launch(nb)

    def failed(self) -> BaseException | None:
        """A reduction of this backward already failed (checked without waiting; a wait
        inside backward that failed is kept in _error)."""
        if self._error is not None:
            return self._error
        if not self._gloo:
            return None  # NCCL: reading a work's future makes the compute stream wait for it
        self._ok_upto, error = collectives.first_failure(self._works, max(self._ok_upto, self._retired))
        return error

    def _stage(self, index: int, p: torch.Tensor) -> None:
        b = self._bucket_of[index]
        bucket = self.layout.buckets[b]
        if b not in self._staging:
            self._staging[b] = self._new_staging(b)
        slot = self.layout.slots[index]
        at = slot.offset - bucket.start
        with torch.no_grad():
            if p.grad is not None:
                self._staging[b][at:at + slot.numel].copy_(p.grad.reshape(-1))
            else:  # no gradient (an unused parameter): zeros in the sum
                self._staging[b][at:at + slot.numel].zero_()
        p.grad = None  # ZeRO-2: the full gradient lives only until its bucket is staged

    def _new_staging(self, b: int) -> torch.Tensor:
        """Bucket b's staging buffer: on the CPU a view of a pool buffer (STAGING_BUFFERS:
        when all are lent, the oldest bucket in flight is waited for and taken out first),
        elsewhere its own. Every parameter's slot is written when it is staged (its
        gradient, or zeros), so only the padding is zeroed here."""
        bucket = self.layout.buckets[b]
        width = bucket.chunk * self.layout.world
        dtype = self._flat[bucket.group].dtype
        if self.device.type != "cpu":
            t = torch.empty(width, dtype=dtype, device=self.device)
        else:
            free = self._pool.setdefault(dtype, [])
            while not free and self._pool_size.get(dtype, 0) >= STAGING_BUFFERS and self._error is None \
                    and self._retired < len(self._works):
                self._retire_next()
            if free:
                buf = free.pop()
            elif self._pool_size.get(dtype, 0) < STAGING_BUFFERS:
                widest = max(k.chunk * self.layout.world for k in self.layout.buckets
                             if self._flat[k.group].dtype == dtype)
                buf = self._empty(widest, dtype)
                self._pool_size[dtype] = self._pool_size.get(dtype, 0) + 1
            else:
                buf = None  # every buffer is held by a bucket not launched yet (or a failed wait): its own
            if buf is None:
                t = torch.empty(width, dtype=dtype, device=self.device)
            else:
                self._pooled[b] = buf
                t = buf[:width]
        t[bucket.numel:].zero_()
        return t

    def _retire_next(self) -> None:
        """Wait for the oldest reduction not yet taken out; ZeRO-2 on gloo (an all-reduce):
        copy the held chunks out of its staging; return its buffer to the pool. A failure
        is kept for finish() (this runs inside backward, from the gradient hooks)."""
        b = self._retired
        work = self._works[b]
        try:
            if work is None:
                raise RuntimeError("the reduction could not be launched")
            collectives.wait_work(work, self._abort)
        except Exception as e:  # noqa: BLE001 - raised by finish()
            self._error = self._error or e
            return
        self._retired += 1
        if self.shard != "gradients":  # ZeRO-1: the pieces' gradients are views of the reduced buckets
            return
        t = self._staging.pop(b)
        bucket = self.layout.buckets[b]
        off = self._offsets[b]
        if not self._rs:  # all-reduced: every held chunk is here
            with torch.no_grad():
                for h, j in enumerate(self._held):
                    held = self._section(self._shard_grads[bucket.group], bucket.group, h)[off:off + bucket.chunk]
                    src = t[j * bucket.chunk:(j + 1) * bucket.chunk]
                    if self._rounds:  # a later round: added to the rounds before
                        held.add_(src)
                    else:
                        held.copy_(src)
        elif b in self._rs_into:  # a later round's reduce-scatter
            with torch.no_grad():
                self._shard_grads[bucket.group][off:off + bucket.chunk].add_(self._rs_into.pop(b))
        buf = self._pooled.pop(b, None)
        if buf is not None:
            self._pool[buf.dtype].append(buf)

    def _launch(self, b: int) -> None:
        """Launch bucket b's reduction; a failure is kept for finish() (inside backward)."""
        try:
            self._works.append(self._launch_work(b))
        except Exception as e:  # noqa: BLE001 - a broken group: raised by finish()
            self._error = self._error or e
            self._works.append(None)

    def _launch_work(self, b: int):
        bucket = self.layout.buckets[b]
        width = bucket.chunk * self.layout.world
        if self.shard == "optimizer":
            t = self._grads[bucket.group][bucket.pstart:bucket.pstart + width]
            return collectives.allreduce_async(self._pg, t)
        for i in bucket.params:  # parameters whose gradient never came (unused, or no hook)
            if i not in self._fired:
                self._fired.add(i)
                self._stage(i, self.params[i])
        if b not in self._staging:
            self._staging[b] = self._new_staging(b)
        if not self._rs:
            # gloo's reduce-scatter took 2.6x its all-reduce of the same 25 MB bucket here
            # (3.2 s against 1.2 s, 2 ranks, loaded CPUs): all-reduce the staged bucket and keep
            # this rank's chunks (_retire_next). Same traffic as replicated.
            return collectives.allreduce_async(self._pg, self._staging[b])
        out = self._shard_grads[bucket.group][self._offsets[b]:self._offsets[b] + bucket.chunk]
        if self._rounds:  # a later round: its sum goes beside the chunk's, added at _retire_next
            out = self._rs_into[b] = self._empty(bucket.chunk, out.dtype)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._pg._reduce_scatter_base(out, self._staging[b], opts)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; afterwards every held
        chunk's gradient (summed over ranks) is in place."""
        self._launch_rest()
        if self._error is None:
            self._prepare_step()
        self._retire_all()
        self._rounds = 0
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._works = []
        if self.shard == "gradients" and self._rs and self.layout.replicas > 1:
            self._exchanging = True  # until every transfer is waited for (drop)
            with torch.no_grad():
                self._exchange_backups()
            self._exchanging = False

    def _launch_rest(self) -> None:
        """The buckets this backward did not launch (unused parameters, or no backward), in order."""
        while len(self._works) < len(self.layout.buckets):
            self._launch(len(self._works))
        self._launching = False

    def _retire_all(self) -> None:
        """Wait for every launched reduction and take it out (until one fails: _error)."""
        while self._error is None and self._retired < len(self._works):
            self._retire_next()

    def finish_round(self) -> None:
        """After a micro-batch's backward armed with begin(accumulate=True): launch the
        buckets not launched yet (a round with no backward, for a rank that has fewer
        micro-batches than another, launches them all: zeros), wait for all and add them
        into the held chunks' gradients. Between rounds the full gradients are gone
        (each is staged into its bucket as it comes, then dropped): only the held chunks'
        are kept, as after a step. A failure is kept for the step's finish(), which
        raises it; the rounds that follow still issue their collectives."""
        self._launch_rest()
        self._retire_all()
        if self._error is not None:
            self._loose.extend(w for w in self._works[self._retired:] if w is not None)
        self._works = []
        self._rounds += 1

    def _prepare_step(self) -> None:
        """What the step needs of the parameters and the optimizer state, which backward
        and the reductions do not change, done while the last buckets are still being
        reduced, where this rank would only wait: the backups' copies refreshed and the
        pre-step copy of the held chunks (at 2 ranks, 50 M parameters, ZeRO-1: 0.05 s of a
        0.54 s step). Where every chunk is held here (_full) there is no pre-step copy."""
        if self._inner is None:
            return
        self._refresh_masters()  # the backups' copies (the own chunk steps the parameters in place)
        self._prepared = {} if self._full else self.held_copy()

    def drop(self) -> None:
        """A dropped step. Where every reduction it launched has completed (succeeded or
        failed), the gradient buffers and the staging pool are kept: the next begin() zeroes
        the gradients again. Where one may still write into them (collectives.settled: a
        survivor waiting on a live ring neighbour that left its own), they are replaced, but
        only when next used (begin); a reshard's new path allocates its own (bind), so a
        crash's survivors allocate nothing here (fresh zeroed buffers for the 50 M model's
        gradients took 0.1-0.15 s of each survivor's pause at world 4, only for the new
        layout to replace them)."""
        settled = collectives.settled(self._works + self._loose) and not self._exchanging
        self._works, self._staging, self._pooled, self._launching, self._error = [], {}, {}, False, None
        self._prepared, self._exchanging = None, False
        self._rounds, self._rs_into, self._loose = 0, {}, []
        if not settled:
            self._stale = True
            self._pool, self._pool_size = {}, {}  # a buffer lent to a reduction in flight is never lent again
        for p in self.params:
            p.grad = None  # ZeRO-1: begin() points and zeroes the views again

    def _renew_grads(self) -> None:
        """Fresh gradient buffers for those a dropped step's reductions may still write (drop)."""
        with torch.no_grad():
            self._shard_grads = [self._zeros(t.numel(), t.dtype) for t in self._shard_grads]
            if self.shard == "optimizer":
                self._grads = [self._zeros(t.numel(), t.dtype) for t in self._grads]
            self._point_grads()
        self._stale = False

    def _exchange_backups(self) -> None:
        """ZeRO-2 with replicas: each primary sends its reduced chunk to its backups."""
        works = []
        for g in range(len(self._flat)):
            for dst in self.layout.holders[self.rank][1:]:
                works.append(collectives.send(self._pg, self._section(self._shard_grads[g], g, 0), dst, g))
            for h, j in enumerate(self._held[1:], start=1):
                works.append(collectives.recv(self._pg, self._section(self._shard_grads[g], g, h), j, g))
        collectives.wait_p2p(works, self._abort)

    def zero_grad(self) -> None:
        # ZeRO-2's chunk gradients (_shard_grads) need no zeroing: finish() writes every held
        # chunk whole (from the reduced buckets, or the primary's for a backup) before a step.
        with torch.no_grad():
            for t in self._grads:
                t.zero_()
        if self.shard == "gradients":
            for p in self.params:
                p.grad = None
        self._rounds, self._loose = 0, []

    @contextmanager
    def attached(self) -> Iterator["_Reducer"]:
        """Post-accumulate-grad hooks that call grad_ready, for a loop without a job."""
        handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i, p))
                   for i, p in enumerate(self.params)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
