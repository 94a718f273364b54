"""The sharded gradient reduction of one rank: each bucket reduced as backward completes it.

- `shard="optimizer"` (ZeRO-1): the gradients are all-reduced bucket by bucket as
  backward produces them (the replicated path's schedule), then each rank steps only
  the chunks it holds;
- `shard="gradients"` (ZeRO-2): each bucket is reduce-scattered as soon as backward
  completes it, straight into the rank's chunk; the parameters' gradients are freed as
  they are staged, so between steps a rank keeps only 1/W of the gradients. A backup
  chunk's gradient comes from its primary by point-to-point.

`Reducer` owns the step's reductions (the works in flight, ZeRO-2's staging buffers and
their pool, a failure kept for finish, whether a dropped step left its buffers stale) and
the group it reduces over (handed at `begin`); it is handed the parameters (their hooks'
gradients), the rank's Placement and the ShardBuffers it reduces into. ShardedGradients
(sharded.py) holds it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ...member import collectives
from .buffers import ShardBuffers
from .layout import Placement

# ZeRO-2 on the CPU: staging buffers per dtype kept from step to step (a bucket's full gradient while it
# is reduced). A bucket waits for the oldest one in flight to be reduced when all are taken, so
# between steps a rank keeps these few buckets, not the full gradients; a buffer freed every
# step would come back from the OS at a page fault per 4 KiB, every step. On CUDA the caching
# allocator does this already: each bucket gets its own.
STAGING_BUFFERS = 3


class Reducer:
    """Per step: `begin(pg)`, backward with `grad_ready(index, p)` from each parameter's
    post-accumulate-grad hook, `launch_rest()` and `complete()` (ShardedGradients.finish),
    or `finish_round()` per micro-batch; `drop()` for a step that broke.

    Owns the reductions' state below. Handed: `params`, `place` (Placement) and `buffers`
    (ShardBuffers: the gradient buffers it reduces into, replaced only there)."""

    def __init__(self, params: list[torch.Tensor], place: Placement, buffers: ShardBuffers,
                 reduce_scatter: bool | None) -> None:
        self.params = params
        self.place = place
        self.buffers = buffers
        # ZeRO-2's reduction: reduce_scatter_tensor, or (None: on gloo) an all-reduce of the bucket
        # from which each rank keeps its chunks (see _launch).
        self._reduce_scatter_asked = reduce_scatter
        self._rs = True
        self._pg = None
        self._gloo = False  # the group of the last begin() is gloo's
        self._ok_upto = 0  # failed(): reductions before this one are known to have succeeded
        self._abort: threading.Event | None = None
        self._launching = False
        self._ready: list[int] = []  # per bucket: its parameters staged so far (this backward)
        self._fired: set[int] = set()  # the parameters whose gradient came (this backward)
        self._works: list = []  # the step's reductions, in bucket order (None: its launch failed)
        self._staging: dict[int, torch.Tensor] = {}  # ZeRO-2: bucket -> its staged full gradient
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}  # ZeRO-2 on the CPU: free staging buffers
        self._pooled: dict[int, torch.Tensor] = {}  # bucket -> the pool buffer its staging is a view of
        self._pool_size: dict[torch.dtype, int] = {}  # per dtype: staging buffers the pool owns (free or lent)
        self._retired = 0  # buckets whose reduction is waited for and taken out of the staging
        self._error: BaseException | None = None  # a launch or wait inside backward failed: finish raises it
        # ZeRO-2 with replicas: the backups' exchange (point-to-point into chunk_grads) is
        # posted and not yet waited for to its end
        self._exchanging = False
        # ZeRO-2 reducing each micro-batch (ElasticJob(reduce_each_micro_batch=True)): the
        # rounds of this step already reduced into chunk_grads (begin(accumulate=True),
        # finish_round); a later round's reduction is added to them, not written over them.
        self._rounds = 0
        self._rs_into: dict[int, torch.Tensor] = {}  # a later round's reduce-scatter: bucket -> its sum
        self._loose: list = []  # reductions of a failed round that may still be in flight (drop)
        # A dropped step left a reduction that may still write into the gradient buffers and
        # the staging pool (drop): they are replaced before they are used again (begin), and
        # a reshard's new path does not take them over (ShardedGradients.bind).
        self._stale = False

    @property
    def stale(self) -> bool:
        """A dropped step's reductions may still write into the gradient buffers (drop)."""
        return self._stale

    @property
    def on_gloo(self) -> bool:
        """The group of the last begin() is gloo's."""
        return self._gloo

    @property
    def broken(self) -> bool:
        """A launch or a wait of this step failed (finish raises it)."""
        return self._error is not None

    @property
    def reductions(self) -> tuple:
        """The works of this step's reductions launched so far, in bucket order."""
        return tuple(self._works)

    @property
    def staging_buffers(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-2 on the CPU: the free staging buffers of the pool."""
        return tuple(t for ts in self._pool.values() for t in ts)

    def use_group(self, pg, abort: threading.Event | None) -> None:
        """The group (and abort event) the reductions of the coming steps use."""
        self._pg, self._abort = pg, abort

    def begin(self, pg, abort: threading.Event | None = None, accumulate: bool = False) -> None:
        """Arm the reduction for the coming backward: the step's last (finish() follows),
        or (`accumulate`, ZeRO-2) a micro-batch before it, whose gradients are reduced into
        the held chunks' and added to those of the rounds before (finish_round follows).
        Every rank runs the same number of rounds in a step."""
        place = self.place
        if accumulate and place.shard != "gradients":
            raise ValueError("only ZeRO-2 (shard='gradients') reduces each micro-batch")
        self._pg, self._abort = pg, abort
        asked = self._reduce_scatter_asked
        # Every chunk held here: an all-reduce gives them all at once (a reduce-scatter would
        # need the backups' exchange on top).
        gloo = self._gloo = collectives.is_gloo(pg)
        self._rs = False if place.full else asked if asked is not None else not gloo
        if self._stale and not self._rounds:
            self.buffers.renew_grads()
            self._stale = False
        if place.shard == "optimizer":
            grads = self.buffers.grads
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    view = place.param_view(grads, i)
                    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                        continue
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad.reshape(-1))
                    p.grad = view.view_as(p)
        self._ready = [0] * len(place.layout.buckets)
        self._fired = set()
        self._works = []
        # A failure in an earlier round of this step is kept for finish() to raise.
        self._staging, self._pooled, self._retired = {}, {}, 0
        self._error = self._error if self._rounds else None
        self._rs_into = {}
        self._ok_upto = 0  # reductions before this one are known to have succeeded (failed())
        self._launching = True

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body of parameter `index`: stage its gradient
        (ZeRO-2) and launch every complete bucket, in the one global order."""
        if not self._launching or index in self._fired:
            return
        self._fired.add(index)
        place = self.place
        b = place.bucket_of[index]
        if place.shard == "gradients":
            self._stage(index, p)
        self._ready[b] += 1
        buckets = place.layout.buckets
        while len(self._works) < len(buckets):
            nb = len(self._works)
            if self._ready[nb] < len(buckets[nb].params):
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
        lay = self.place.layout
        b = self.place.bucket_of[index]
        bucket = lay.buckets[b]
        if b not in self._staging:
            self._staging[b] = self._new_staging(b)
        slot = lay.slots[index]
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
        lay, buffers = self.place.layout, self.buffers
        bucket = lay.buckets[b]
        width = bucket.chunk * lay.world
        dtype = buffers.flat[bucket.group].dtype
        device = buffers.device
        if device.type != "cpu":
            t = torch.empty(width, dtype=dtype, device=device)
        else:
            free = self._pool.setdefault(dtype, [])
            while not free and self._pool_size.get(dtype, 0) >= STAGING_BUFFERS and self._error is None \
                    and self._retired < len(self._works):
                self._retire_next()
            if free:
                buf = free.pop()
            elif self._pool_size.get(dtype, 0) < STAGING_BUFFERS:
                widest = max(k.chunk * lay.world for k in lay.buckets if buffers.flat[k.group].dtype == dtype)
                buf = buffers.empty(widest, dtype)
                self._pool_size[dtype] = self._pool_size.get(dtype, 0) + 1
            else:
                buf = None  # every buffer is held by a bucket not launched yet (or a failed wait): its own
            if buf is None:
                t = torch.empty(width, dtype=dtype, device=device)
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
        place = self.place
        if place.shard != "gradients":  # ZeRO-1: the pieces' gradients are views of the reduced buckets
            return
        t = self._staging.pop(b)
        bucket = place.layout.buckets[b]
        off = place.offsets[b]
        chunk_grads = self.buffers.chunk_grads[bucket.group]
        if not self._rs:  # all-reduced: every held chunk is here
            with torch.no_grad():
                for h, j in enumerate(place.held):
                    held = place.section(chunk_grads, bucket.group, h)[off:off + bucket.chunk]
                    src = t[j * bucket.chunk:(j + 1) * bucket.chunk]
                    if self._rounds:  # a later round: added to the rounds before
                        held.add_(src)
                    else:
                        held.copy_(src)
        elif b in self._rs_into:  # a later round's reduce-scatter
            with torch.no_grad():
                chunk_grads[off:off + bucket.chunk].add_(self._rs_into.pop(b))
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
        place = self.place
        bucket = place.layout.buckets[b]
        width = bucket.chunk * place.layout.world
        if place.shard == "optimizer":
            t = self.buffers.grads[bucket.group][bucket.pstart:bucket.pstart + width]
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
        out = self.buffers.chunk_grads[bucket.group][place.offsets[b]:place.offsets[b] + bucket.chunk]
        if self._rounds:  # a later round: its sum goes beside the chunk's, added at _retire_next
            out = self._rs_into[b] = self.buffers.empty(bucket.chunk, out.dtype)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._pg._reduce_scatter_base(out, self._staging[b], opts)

    def launch_rest(self) -> None:
        """The buckets this backward did not launch (unused parameters, or no backward), in
        order: the first half of ShardedGradients.finish (the step is prepared between the
        two, while the last buckets are still being reduced)."""
        while len(self._works) < len(self.place.layout.buckets):
            self._launch(len(self._works))
        self._launching = False

    def complete(self) -> None:
        """The second half of ShardedGradients.finish: wait for every reduction; afterwards
        every held chunk's gradient (summed over ranks) is in place (ZeRO-2 with replicas:
        a backup's from its primary, point to point). Raises a failure kept from backward."""
        self._retire_all()
        self._rounds = 0
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._works = []
        lay = self.place.layout
        if self.place.shard == "gradients" and self._rs and lay.replicas > 1:
            self._exchanging = True  # until every transfer is waited for (drop)
            with torch.no_grad():
                self._exchange_backups()
            self._exchanging = False

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
        self.launch_rest()
        self._retire_all()
        if self._error is not None:
            self._loose.extend(w for w in self._works[self._retired:] if w is not None)
        self._works = []
        self._rounds += 1

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
        self._exchanging = False
        self._rounds, self._rs_into, self._loose = 0, {}, []
        if not settled:
            self._stale = True
            self._pool, self._pool_size = {}, {}  # a buffer lent to a reduction in flight is never lent again
        for p in self.params:
            p.grad = None  # ZeRO-1: begin() points and zeroes the views again

    def _exchange_backups(self) -> None:
        """ZeRO-2 with replicas: each primary sends its reduced chunk to its backups."""
        place, works = self.place, []
        for g, t in enumerate(self.buffers.chunk_grads):
            for dst in place.layout.holders[place.rank][1:]:
                works.append(collectives.send(self._pg, place.section(t, g, 0), dst, g))
            for h, j in enumerate(place.held[1:], start=1):
                works.append(collectives.recv(self._pg, place.section(t, g, h), j, g))
        collectives.wait_p2p(works, self._abort)

    def zero_grad(self) -> None:
        # ZeRO-2's chunk gradients (chunk_grads) need no zeroing: finish() writes every held
        # chunk whole (from the reduced buckets, or the primary's for a backup) before a step.
        with torch.no_grad():
            for t in self.buffers.grads:
                t.zero_()
        if self.place.shard == "gradients":
            for p in self.params:
                p.grad = None
        self._rounds, self._loose = 0, []

    def discard(self) -> None:
        """Let go of the staging buffers (ShardedGradients.discard)."""
        self._pool, self._pooled, self._staging = {}, {}, {}

    def staging_bytes(self) -> int:
        """ZeRO-2 on the CPU: the staging pool's bytes, kept between steps."""
        staging = sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)
        return staging + sum(t.numel() * t.element_size() for t in self._pooled.values())
