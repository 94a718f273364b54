"""The sharded step of one rank, and the step in doubt.

The step: the GradScaler's unscale on the shard, one 2-element all-reduce of (sum of
squared gradient norms, inf/NaN found) over the primary chunks, so the global-norm clip
and the skip decision are the same on every rank; the shard's optimizer step; the
parameters all-gathered. Until that all-gather ends the held chunks' pre-step values and
optimizer state are kept: a generation that breaks inside it (a rank lost there) leaves
the chunks a step ahead of the parameters and the parameters half-gathered, and `settle`
undoes (or keeps) that step in the next generation before `reshard` rebuilds the
parameters.

`Stepper` owns the step's own state (the pre-step copy and its reused buffers, a step in
doubt's undo, what finish prepared) and the group it steps over (handed at `begin`); it is
handed the script's optimizer (the hyperparameters copied in at every step), the rank's
Placement and the ShardBuffers it steps. ShardedGradients (sharded.py) holds it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...member import collectives
from .. import gradients
from .buffers import ShardBuffers
from .hostmem import Recycler
from .layout import Placement

# The tags of the parameters' point-to-point gather on gloo (GATHER_TAG + bucket); reshard's
# transfers use tag 0.
GATHER_TAG = 1 << 20


@dataclass(frozen=True)
class StepResult:
    grad_norm: float | None  # the global norm before clipping (only when clipping)
    skipped: bool  # the GradScaler found inf/NaN in some rank's shard: nobody stepped


class _Transfers:
    """Point-to-point sends and receives waited for as one (a bucket's gather on gloo)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Stepper:
    """`step()` after the reduction (ShardedGradients.finish); `settle()` for a step in doubt.

    Owns the step's state below. Handed: `optimizer` (the script's: its hyperparameters),
    `place` (Placement) and `buffers` (ShardBuffers: the parameters, masters, pieces and
    optimizer state it steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, place: Placement, buffers: ShardBuffers,
                 p2p_gather: bool | None) -> None:
        self.optimizer = optimizer
        self.place = place
        self.buffers = buffers
        # The parameters' gather: all_gather_into_tensor, or (None: on gloo) point-to-point
        # sends and receives of the same chunks (gather_bucket).
        self._p2p_gather_asked = p2p_gather
        self._p2p_gather = False
        self._pg = None
        self._abort: threading.Event | None = None
        self._spares: dict[tuple, torch.Tensor] = {}  # CPU: the pre-step copy's buffers, reused every step
        self._spare_base: torch.Tensor | None = None  # CPU: the one allocation they are carved out of
        self._spare_arena: Recycler | None = None
        # The step in flight: the held chunks' values and optimizer state from before the
        # shard's optimizer step, kept until the parameters' all-gather has finished
        # (`settle` undoes or keeps a step whose gather broke).
        self._undo: dict[str, list] | None = None
        # What finish() prepared for the coming step (prepare): the pre-step copy of the
        # held chunks ({} where none is kept); None: not prepared.
        self._prepared: dict[str, list] | None = None

    def use_group(self, pg, abort: threading.Event | None) -> None:
        """The group (and abort event) the coming steps' collectives use."""
        self._pg, self._abort = pg, abort

    def begin(self, pg, abort: threading.Event | None, gloo: bool) -> None:
        """A step begins over `pg` (gloo's: `gloo`): nothing is prepared for it yet."""
        self._pg, self._abort = pg, abort
        self._p2p_gather = self._p2p_gather_asked if self._p2p_gather_asked is not None else gloo
        self._prepared = None

    def prepare(self) -> None:
        """What the step needs of the parameters and the optimizer state, which backward
        and the reductions do not change, done while the last buckets are still being
        reduced, where this rank would only wait (ShardedGradients.finish): the backups'
        copies refreshed and the pre-step copy of the held chunks (at 2 ranks, 50 M
        parameters, ZeRO-1: 0.05 s of a 0.54 s step). Where every chunk is held here
        (`full`) there is no pre-step copy."""
        if self.buffers.inner is None:
            return
        self.buffers.refresh_masters()  # the backups' copies (the own chunk steps the parameters in place)
        self._prepared = {} if self.place.full else self.held_copy()

    def drop(self) -> None:
        """A dropped step: what finish() prepared for it is not used."""
        self._prepared = None

    def take_spares(self) -> list[torch.Tensor]:
        """The pre-step copy's buffers, let go of (dead between steps; a later step of this
        path makes new ones), for a reshard to carve the new layout's buffers out of. This
        path keeps no reference, so where that reshard breaks with receives still posted
        into them, nothing of this path's is ever written by those."""
        if self._undo is not None:
            return []  # a step in doubt: settle() reads them first
        spares = [self._spare_base] if self._spare_base is not None else list(self._spares.values())
        self._spares, self._spare_base, self._spare_arena = {}, None, None
        return spares

    def discard(self) -> None:
        """Let go of the pre-step copy's buffers (ShardedGradients.discard)."""
        self._spares, self._spare_base, self._spare_arena = {}, None, None

    def undo_bytes(self) -> int:
        """The pre-step copy's bytes (CPU: kept between steps)."""
        return sum(t.numel() * t.element_size() for t in self._spares.values())

    def step(self, max_grad_norm: float | None = None, scaler: Any = None) -> StepResult:
        """Unscale, clip by the global norm, step the held chunks, all-gather the
        parameters. Every rank decides alike: the norm and the inf/NaN flag are
        all-reduced. Call after finish()."""
        buffers, place = self.buffers, self.place
        inner = buffers.inner
        if inner is None:
            return StepResult(None, False)
        for g, (_dtype, pg) in enumerate(place.layout.groups):
            for k, v in self.optimizer.param_groups[pg].items():
                if k != "params":
                    inner.param_groups[g][k] = v
        prepared, self._prepared = self._prepared, None
        if prepared is None:  # finish() did not prepare the step (the tests' bare step() calls)
            buffers.refresh_masters()
        stats = torch.zeros(2, dtype=torch.float64, device=buffers.device)
        found_infs: list[torch.Tensor] = []
        unscale_view = buffers.unscale_view
        if scaler is not None and scaler.is_enabled():
            scaler.unscale_(unscale_view)
            found_infs = list(scaler._per_optimizer_states[id(unscale_view)]["found_inf_per_device"].values())
            stats[1] = float(sum(float(f) for f in found_infs))
        if max_grad_norm is not None:
            # Each rank sums its primary chunks, all-reduced below; where every rank holds every
            # chunk, each sums them all, in chunk order, so every rank gets the same norm alone.
            pick = ([per_h[place.held.index(j)] for j in range(place.layout.world)] if place.full else per_h[:1]
                    for per_h in buffers.pieces)
            with torch.no_grad():  # float64, piece by piece, as the replicated path's norm
                gradients.add_squares(stats[0], [v.grad for chosen in pick for opt, _spans in chosen
                                                 for v in opt.param_groups[0]["params"]])
        if (max_grad_norm is not None or found_infs) and not place.full:
            collectives.wait_work(collectives.allreduce_async(self._pg, stats), self._abort)
        skipped = bool(stats[1] > 0)
        norm = None
        if max_grad_norm is not None:
            norm, coef = gradients.clip_coefficient(max_grad_norm, float(stats[0]))
            with torch.no_grad():
                for v in unscale_view.param_groups[0]["params"]:
                    v.grad.mul_(coef)
        if found_infs:
            for f in found_infs:
                f.fill_(1.0 if skipped else 0.0)
        if not skipped and not place.full:
            self._undo = self._pre_step_copy(scaler if found_infs else None, prepared or None)
        if found_infs:
            # scaler.step(inner) would step only if no rank found inf/NaN (below); its update
            # reads only the found_inf flags, so it goes before the step and the gather.
            scaler.update()
        if not skipped and place.full:
            self._step_local()
        elif not skipped:
            self.gather_params(self._step_shard())
        self._undo = None  # the gather finished: the step stands on every rank that got here
        return StepResult(norm, skipped)

    def _step_shard(self) -> Iterator[int]:
        """The optimizer step of the held chunks, piece by piece (ShardBuffers.pieces),
        bucket by bucket: yields each bucket once its primary chunk has stepped (its
        all-gather can start), then steps the backups. Each piece's state is a view of its
        chunk's state in `inner` (its step count a copy); a chunk without state yet (the
        first step) gets the state the pieces' optimizers made, joined into one tensor per
        name. Run it to the end: the step counts are written back last."""
        buffers, buckets = self.buffers, self.place.layout.buckets
        inner, pieces = buffers.inner, buffers.pieces
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        states = [[inner.state.get(m) for m in ms] for ms in buffers.masters]

        def step(b: int, h: int) -> None:
            opt, spans = pieces[b][h]
            st = states[buckets[b].group][h]
            opt.param_groups[0].update(hyper[buckets[b].group])
            for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                if st:
                    opt.state[v] = {k: (t[lo:hi] if t.dim() else t.clone()) if isinstance(t, torch.Tensor) else t
                                    for k, t in st.items()}
                else:
                    opt.state.pop(v, None)
            opt.step()

        for b in range(len(pieces)):
            step(b, 0)
            yield b
        for b in range(len(pieces)):
            for h in range(1, len(self.place.held)):
                step(b, h)
        # The step counts (and, on the first step, the new state) back into inner.
        got_of: dict[tuple[int, int], list[tuple[dict, int, int]]] = {}
        for b, per_h in enumerate(pieces):
            g = buckets[b].group
            for h, (opt, spans) in enumerate(per_h):
                for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                    got_of.setdefault((g, h), []).append((opt.state.pop(v, None) or {}, lo, hi))
        with torch.no_grad():
            for (g, h), got in got_of.items():
                m, st = buffers.masters[g][h], states[g][h]
                first = got[0][0]
                if st:
                    for k, t in first.items():
                        if not (isinstance(t, torch.Tensor) and t.dim()):
                            st[k] = t
                    continue
                new: dict[str, Any] = {}
                for k, t in first.items():
                    if isinstance(t, torch.Tensor) and t.dim():
                        whole = buffers.zeros(m.numel(), t.dtype)
                        for piece_state, lo, hi in got:
                            whole[lo:hi].copy_(piece_state[k])
                        new[k] = whole
                    else:
                        new[k] = t
                if new:
                    inner.state[m] = new

    def _step_local(self) -> None:
        """Every chunk held here (Placement.full): step them all, no all-gather. The pieces
        are views of the parameters' own padded buffer (ShardBuffers.pieces), so the step
        writes the parameters in place (no masters' refresh, no copy back). Every rank steps
        the same chunks from the same all-reduced gradients, states and hyperparameters, so
        every rank's parameters come out alike (as in replicated training); and as no
        collective follows the step, no rank can be left with a step in doubt (no
        pre-step copy)."""
        for _b in self._step_shard():
            pass

    def _spare(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped as `like` for the pre-step copy: on the CPU the same one every
        step (torch's CPU allocator hands a block this big back to the OS when freed, and a
        fresh one costs a page fault per 4 KiB at every step); elsewhere a new one (CUDA's
        caching allocator reuses the memory, and between steps the forward can have it)."""
        if like.device.type != "cpu":
            return torch.empty_like(like)
        t = self._spares.get(key)
        if t is None or t.shape != like.shape or t.dtype != like.dtype:
            if self._spare_arena is None:
                # All of the copy's buffers in one allocation: the next reshard can carve the new
                # layout's buffers, whatever their sizes, out of it whole (take_spares).
                self._spare_base = self.buffers.empty(self._spare_bytes(), torch.uint8)
                self._spare_arena = Recycler()
                self._spare_arena.give(self._spare_base)
            t = self._spares[key] = self._spare_arena.empty(like.numel(), like.dtype).view(like.shape)
        return t

    def _spare_bytes(self) -> int:
        """The pre-step copy's size: per held chunk its values and each state tensor, each
        rounded up to a cache line."""
        buffers, lay = self.buffers, self.place.layout
        return sum((1 + len(buffers.names(g))) * (-(-lay.shard_len(g) * m.element_size() // 64) * 64)
                   for g, ms in enumerate(buffers.masters) for m in ms)

    def _pre_step_copy(self, scaler: Any = None, held: dict[str, list] | None = None) -> dict[str, Any]:
        """The held chunks' values and optimizer state before the step (a rank lost
        between the shard's step and the end of the all-gather leaves the survivors'
        chunks one step ahead of the parameters, and their parameters half-gathered),
        and an enabled GradScaler's scale and growth tracker (its update() comes before
        the gather: an undone step must not count towards its growth). Into buffers
        reused from step to step on the CPU (_spare); settle copies out of them. `held`:
        the chunks' part, copied already (held_copy, by prepare())."""
        scaled = None
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            scaled = (scaler, scaler._scale.clone(), scaler._growth_tracker.clone())
        return {**(held if held is not None else self.held_copy()), "scaler": scaled}

    def held_copy(self) -> dict[str, list]:
        """The held chunks' values and optimizer state, into the spare buffers (_pre_step_copy)."""
        buffers = self.buffers
        inner = buffers.inner
        masters, state = [], []
        with torch.no_grad():
            for g, ms in enumerate(buffers.masters):
                masters.append([buffers.values(g, h, self._spare(("master", g, h), m)) for h, m in enumerate(ms)])
                state.append([])
                for h, m in enumerate(ms):
                    st = inner.state.get(m)
                    state[g].append({k: ((self._spare((k, g, h), v).copy_(v) if v.dim() else v.clone())
                                         if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                                    if st else None)
        return {"masters": masters, "state": state}

    @property
    def step_in_doubt(self) -> bool:
        """True after a step whose parameter all-gather did not finish here (dropped)."""
        return self._undo is not None

    def forget_step_in_doubt(self) -> None:
        """A restore replaces the state and the parameters: a step in doubt is not settled."""
        self._undo = None

    def settle(self, keep: bool) -> None:
        """Resolve a step whose all-gather broke (`step_in_doubt`): `keep` (another
        rank committed it, so every rank had stepped its chunks) leaves the held chunks
        stepped; else they go back to their pre-step values and optimizer state. Either
        way the held chunks' parameters are written back from them: the broken gather
        may have left any chunk of the parameters half-written, so the caller then has
        every chunk's parameters sent from its holders (reshard's resend_params)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        buffers = self.buffers
        inner = buffers.inner
        with torch.no_grad():
            if not keep:
                for g, ms in enumerate(buffers.masters):
                    for h, m in enumerate(ms):
                        buffers.set_values(g, h, undo["masters"][g][h])
                        st = undo["state"][g][h]
                        if st is None:
                            inner.state.pop(m, None)
                        else:  # copies: the undo's tensors are the spare buffers of the next step's copy
                            inner.state[m] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in st.items()}
                if undo["scaler"] is not None:
                    scaler, scale, growth = undo["scaler"]
                    scaler._scale.copy_(scale)
                    scaler._growth_tracker.copy_(growth)
        buffers.write_params()

    def gather_params(self, stepped: Iterator[int] | None = None) -> None:
        """All-gather every bucket's chunks from their primaries into the parameters:
        each bucket as soon as `stepped` (the shard's step, _step_shard) yields it, so
        the gathers overlap the rest of the step; without it, every bucket at once.
        `stepped` is run to its end even if a launch fails (the error is raised after)."""
        works, error = [], None
        for b in (stepped if stepped is not None else range(len(self.place.layout.buckets))):
            if error is None:
                try:
                    works.append(self.gather_bucket(b))
                except Exception as e:  # noqa: BLE001 - raised once the shard has stepped to the end
                    error = e
        if error is not None:
            raise error
        p2p = [t for w in works if isinstance(w, _Transfers) for t in w.works]
        if p2p:
            collectives.wait_p2p(p2p, self._abort)
        for w in works:
            if not isinstance(w, _Transfers):
                collectives.wait_work(w, self._abort)

    def gather_bucket(self, b: int):
        """Launch bucket b's all-gather: each rank's own chunk, stepped in place, from where
        it lies in the parameters' buffer. An in-place all-gather (NCCL's documented form,
        input = output + rank * chunk), or on gloo (`_p2p_gather`) the same exchange as
        point-to-point sends and receives: this rank's chunk to every other rank, every
        other rank's straight into its place (gloo's all-gather of the 50 M model's 200 MB
        took 0.16 s at 2 ranks and 0.32 s at 4 here, the sends and receives 0.06 and 0.16).
        Returns something to wait() on; gather_params waits abortably."""
        place = self.place
        lay = place.layout
        bucket = lay.buckets[b]
        flat = self.buffers.flat[bucket.group]
        mine = place.chunk_of(flat, b, place.held[0])
        if not self._p2p_gather:
            out = flat[bucket.pstart:bucket.pstart + bucket.chunk * lay.world]
            return self._pg._allgather_base(out, mine)
        works = []
        tag = GATHER_TAG + b  # each bucket its own tag: its messages cannot match another's
        for j in range(lay.world):
            if j != place.held[0]:
                works.append(collectives.send(self._pg, mine, j, tag))
                works.append(collectives.recv(self._pg, place.chunk_of(flat, b, j), j, tag))
        return _Transfers(works)
