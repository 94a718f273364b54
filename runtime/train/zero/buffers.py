"""One rank's buffers of the sharded state: where each held chunk's parameters, gradients,
stepped copy and optimizer state live, and the views the step runs through.

The model's parameters become views of one padded flat buffer per group (as FSDP's flat
parameter), so the all-gather after the step writes them in place. ZeRO-1's gradients are
views of one padded gradient buffer per group; ZeRO-2 keeps one section per held chunk
(`chunk_grads`). Each held chunk has a master (the tensor the shard optimizer's state is
keyed by: the parameters' own chunk where it is stepped in place, else a copy) and, per
bucket, an optimizer of the script's class over views of its pieces (`pieces`).

`ShardBuffers` owns these buffers and the held chunks' optimizer state (`inner`); it is
handed the parameters, the script's optimizer (its class and hyperparameters) and the
rank's Placement. ShardedGradients (sharded.py) holds one, and hands it to its Reducer
(reducer.py) and its Stepper (stepper.py), which read and write through the buffers it
owns (the lists below; only this object replaces them: bind, renew_grads, discard).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..state import dtype_named
from . import hostmem
from .hostmem import Recycler
from .layout import Placement, ShardLayout
from .optim import counts_steps, state_names, step_tensor

# The shard steps in pieces of at most this many elements (each a view of its chunk): the
# optimizer's temporaries (AdamW's denominator) stay this small, which the CPU allocator
# reuses, where one temporary the size of a whole chunk is a fresh mapping every step.
PIECE_ELEMS = 1 << 21


def line_bytes(n_bytes: int) -> int:
    """`n_bytes` rounded up to a cache line (how a Recycler carves)."""
    return -(-n_bytes // 64) * 64


def chunk_sections(lay: ShardLayout, g: int, j: int, names, dtype: torch.dtype,
                   buffers: "ShardBuffers") -> dict[str, torch.Tensor]:
    """New state tensors (one per name) for chunk j's section of group g, on the buffers'
    device and out of their recycler where they have one, their padding zeroed; the caller
    writes every real element (a reshard's slices, a checkpoint's)."""
    n, offs = lay.shard_len(g), lay.chunk_offsets()
    st = {k: buffers.empty(n, dtype) for k in names}
    for b, bucket in enumerate(lay.buckets):
        lo, hi = bucket.span(j)
        if bucket.group == g and hi - lo < bucket.chunk:
            for t in st.values():
                t[offs[b] + hi - lo:offs[b] + bucket.chunk].zero_()
    return st


class _Pieces:
    """What GradScaler.unscale_ reads of an optimizer (its param groups' parameters' .grad),
    over the pieces of every held chunk: it unscales the gradients the step reads, and only
    those, and finds an inf/NaN there."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


class ShardBuffers:
    """The buffers, views and optimizer state of one rank's sharded state (module docstring).

    Owns: `flat`, `grads`, `chunk_grads`, `masters`, `inner`, `pieces`, `unscale_view`,
    `recycler`. Handed: `params` (made views of `flat`), `optimizer` (the script's: its
    class and hyperparameters; never stepped) and `place` (the rank's Placement)."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, place: Placement) -> None:
        self.params = params
        self.optimizer = optimizer
        self.place = place
        self.flat: list[torch.Tensor] = []  # padded parameters per group (the params are views)
        self.grads: list[torch.Tensor] = []  # ZeRO-1: padded gradients per group (the .grad are views)
        self.chunk_grads: list[torch.Tensor] = []  # ZeRO-2, per group: one section per held chunk
        self.masters: list[list[torch.Tensor]] = []  # per group, per held chunk: the stepped tensor
        self.inner: torch.optim.Optimizer | None = None  # holds the held chunks' state, keyed by the masters
        # Per bucket, per held chunk: an optimizer of the script's class over views of that chunk's
        # pieces (_build_pieces); the step runs through these, the state stays in `inner`.
        self.pieces: list[list[tuple[torch.optim.Optimizer, list[tuple[int, int]]]]] = []
        self.unscale_view = _Pieces([])  # every piece: what GradScaler unscales (point_grads)
        # Host memory these buffers are carved out of until a reshard's move is done (the old
        # layout's pre-step copy, or a joiner's prepared memory: hostmem.py); None: everything
        # is allocated.
        self.recycler: Recycler | None = None

    # -- allocation

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D buffer on the parameters' device: out of the recycler where there is one."""
        if self.recycler is not None:
            return self.recycler.empty(n, dtype, self.device)
        if self.device.type == "cpu":
            return hostmem.empty(n, dtype)
        return torch.empty(n, dtype=dtype, device=self.device)

    def zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(n, dtype).zero_()

    def bind(self, reuse: "ShardBuffers | None" = None, reuse_stale: bool = False, values: bool = True) -> None:
        """Make the parameters views of the padded flat buffers (values kept) and build the
        shard optimizer (ShardedGradients.bind says when a group's buffers are reused).
        `reuse_stale`: a dropped step's reductions may still write into `reuse`'s gradient
        buffers: they are not taken over."""
        place, lay = self.place, self.place.layout
        same = [reuse is not None and g < len(reuse.flat) and reuse.place.geometry(g) == place.geometry(g)
                and reuse.flat[g].device == self.device for g in range(len(lay.groups))]
        with torch.no_grad():
            self.flat = []
            for g, (dtype, _pg) in enumerate(lay.groups):
                if same[g]:
                    self.flat.append(reuse.flat[g])
                    continue
                flat = self.empty(lay.padded(g), dtype_named(dtype))
                for b in lay.buckets:  # the parameters fill the rest
                    if b.group == g:
                        flat[b.pstart + b.numel:b.pstart + b.chunk * lay.world].zero_()
                self.flat.append(flat)
            for i, p in enumerate(self.params):
                view = place.param_view(self.flat, i)
                if view.data_ptr() != p.data_ptr():
                    if values:
                        view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)
            # ZeRO-2: the held chunks' gradients, one section per held chunk. ZeRO-1 has none: its
            # pieces' gradients are views of the all-reduced gradients (point_grads).
            self.chunk_grads = []
            for g, f in enumerate(self.flat if place.shard == "gradients" else ()):
                n = len(place.held) * lay.shard_len(g)
                was = reuse.chunk_grads[g] if reuse is not None and g < len(reuse.chunk_grads) else None
                if was is not None and was.numel() == n and was.dtype == f.dtype and was.device == f.device \
                        and not reuse_stale:
                    self.chunk_grads.append(was.zero_())  # e.g. 2 -> 1 ranks with two replicas: 2 x 1/2 = 1 x 1
                else:
                    self.chunk_grads.append(self.zeros(n, f.dtype))
            # A chunk stepped in place (Placement.in_place: this rank's own chunk, or every chunk
            # where it holds them all) has its pieces step the parameters' buffer itself; its master
            # only keys the optimizer state and gives its sizes: one element, expanded (no
            # memory on any device: at world N that is 1/N of the model per rank, all of it
            # at world 1). A backup's master is a real copy: its values are only read within
            # a step, which writes every element (padding too) from the parameters first
            # (refresh_masters), so none are copied here.
            self.masters = [[(torch.empty(1, dtype=f.dtype, device=f.device).expand(lay.shard_len(g))
                              if place.in_place(h) else self.empty(lay.shard_len(g), f.dtype))
                             for h in range(len(place.held))] for g, f in enumerate(self.flat)]
        if place.shard == "optimizer":
            self.grads = []
            for g, f in enumerate(self.flat):
                if same[g] and len(reuse.grads) > g and not reuse_stale:
                    self.grads.append(reuse.grads[g].zero_())
                else:
                    self.grads.append(self.zeros(f.numel(), f.dtype))
            for i, p in enumerate(self.params):
                p.grad = place.param_view(self.grads, i).view_as(p)
        else:
            self.grads = []
            for p in self.params:
                p.grad = None
        groups = []
        for g, (_dtype, pg) in enumerate(lay.groups):
            hyper = {k: v for k, v in self.optimizer.param_groups[pg].items() if k != "params"}
            groups.append({**hyper, "params": self.masters[g]})
        self.inner = type(self.optimizer)(groups) if groups else None
        self._build_pieces()
        self.point_grads()

    def host_bytes(self) -> int:
        """The bytes of the buffers a joiner's path allocates from bind to the end of its
        reshard (nothing of an earlier path to reuse): the parameters' padded buffer, ZeRO-1's
        gradient buffer, the chunk gradients, the backups' stepped copies and the held
        chunks' optimizer state, each rounded up to a cache line (what
        ShardedPath.prepare_join touches ahead)."""
        place, lay, line = self.place, self.place.layout, line_bytes
        held, total = len(place.held), 0
        for g, (dtype, _pg) in enumerate(lay.groups):
            item, n, names = dtype_named(dtype).itemsize, lay.shard_len(g), len(self.names(g))
            total += line(lay.padded(g) * item) * (2 if place.shard == "optimizer" else 1)
            total += line(held * n * item) if place.shard == "gradients" else 0
            total += sum(line(n * item) for h in range(held) if not place.in_place(h))
            total += held * names * line(n * item)
        return total

    def _build_pieces(self) -> None:
        """Per bucket and held chunk, an optimizer of the script's class over that chunk's
        pieces (views of the master, at most PIECE_ELEMS each), so the step goes bucket by
        bucket (each bucket's all-gather starts once its primary chunk has stepped) and its
        temporaries stay small."""
        place, cls = self.place, type(self.optimizer)
        self.pieces = []
        for b, bucket in enumerate(place.layout.buckets):
            g, off = bucket.group, place.offsets[b]
            end = off + bucket.chunk
            spans = [(lo, min(lo + PIECE_ELEMS, end)) for lo in range(off, end, PIECE_ELEMS)]
            per_h = []
            for h, j in enumerate(place.held):
                if place.in_place(h):  # the parameters themselves (chunk j of the padded buffer) are stepped
                    base = bucket.pstart + j * bucket.chunk - off
                    views = [self.flat[g][base + lo:base + hi] for lo, hi in spans]
                else:
                    views = [self.masters[g][h][lo:hi] for lo, hi in spans]
                per_h.append((cls([{**self.inner.param_groups[g], "params": views}]), spans))
            self.pieces.append(per_h)

    def point_grads(self) -> None:
        """The pieces' .grad (again after the buffers are replaced): ZeRO-2, their sections
        of chunk_grads (the masters' too); ZeRO-1, their chunk's elements of the all-reduced
        gradients themselves, so nothing copies the held chunks' gradients out of them (at
        world 2 with two replicas that was the 50 M model's 200 MB at every step). Also the
        view GradScaler unscales (unscale_view)."""
        place = self.place
        zero2 = place.shard == "gradients"
        for g, masters in enumerate(self.masters):
            n = place.layout.shard_len(g)
            for h, m in enumerate(masters):
                m.grad = self.chunk_grads[g][h * n:(h + 1) * n] if zero2 else None
        for b, per_h in enumerate(self.pieces):
            bucket = place.layout.buckets[b]
            g, off = bucket.group, place.offsets[b]
            for h, (opt, spans) in enumerate(per_h):
                base = bucket.pstart + place.held[h] * bucket.chunk - off
                for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                    v.grad = self.masters[g][h].grad[lo:hi] if zero2 else self.grads[g][base + lo:base + hi]
        self.unscale_view = _Pieces([v for per_h in self.pieces for opt, _spans in per_h
                                     for v in opt.param_groups[0]["params"]])

    def renew_grads(self) -> None:
        """Fresh gradient buffers for those a dropped step's reductions may still write
        (Reducer.drop), the pieces pointed at them."""
        with torch.no_grad():
            self.chunk_grads = [self.zeros(t.numel(), t.dtype) for t in self.chunk_grads]
            if self.place.shard == "optimizer":
                self.grads = [self.zeros(t.numel(), t.dtype) for t in self.grads]
            self.point_grads()

    # -- the held chunks' values

    def read_chunk(self, g: int, h: int, into: torch.Tensor) -> torch.Tensor:
        """Held chunk h's parameters of group g, bucket by bucket, into the section `into`."""
        place = self.place
        for b, bucket in enumerate(place.layout.buckets):
            if bucket.group == g:
                off = place.offsets[b]
                into[off:off + bucket.chunk].copy_(place.chunk_of(self.flat[g], b, place.held[h]))
        return into

    def write_chunk(self, g: int, h: int, values: torch.Tensor) -> None:
        """The section `values` into held chunk h's parameters of group g, bucket by bucket."""
        place = self.place
        for b, bucket in enumerate(place.layout.buckets):
            if bucket.group == g:
                off = place.offsets[b]
                place.chunk_of(self.flat[g], b, place.held[h]).copy_(values[off:off + bucket.chunk])

    def values(self, g: int, h: int, into: torch.Tensor) -> torch.Tensor:
        """Held chunk h's stepped values of group g, copied into the section `into`."""
        return self.read_chunk(g, h, into) if self.place.in_place(h) else into.copy_(self.masters[g][h])

    def set_values(self, g: int, h: int, values: torch.Tensor) -> None:
        """Write held chunk h's values of group g (a section) back where it is stepped."""
        if self.place.in_place(h):
            self.write_chunk(g, h, values)
        else:
            self.masters[g][h].copy_(values)

    def backups(self) -> Iterator[tuple[int, int]]:
        """(group, held index) of every chunk stepped in a copy (not in place)."""
        place = self.place
        return ((g, h) for g in range(len(self.masters)) for h in range(len(place.held)) if not place.in_place(h))

    def refresh_masters(self) -> None:
        """The backups' stepped copies from the parameters (a restore or a state apply may
        have changed them). A chunk stepped in place has none."""
        with torch.no_grad():
            for g, h in self.backups():
                self.read_chunk(g, h, self.masters[g][h])

    def write_params(self) -> None:
        """The parameters of every backed-up chunk from its stepped copy (a chunk stepped in
        place is its parameters already)."""
        with torch.no_grad():
            for g, h in self.backups():
                self.write_chunk(g, h, self.masters[g][h])

    # -- the held chunks' optimizer state (in `inner`, keyed by the masters)

    def names(self, g: int) -> tuple[str, ...]:
        """The state tensors' names of group g's optimizer param group."""
        return state_names(self.optimizer, self.optimizer.param_groups[self.place.layout.groups[g][1]])

    def steps_taken(self) -> int:
        """The optimizer's step count (0: no state yet); every held chunk steps alike."""
        inner = self.inner
        for ms in self.masters:
            for m in ms:
                st = inner.state.get(m) if inner else None
                if st:
                    return int(float(st["step"])) if "step" in st else 1
        return 0

    def chunk_state(self, g: int, h: int) -> dict[str, torch.Tensor]:
        """Held chunk h's state tensors of group g (no step count)."""
        st = self.inner.state.get(self.masters[g][h]) if self.inner else None
        return {k: v for k, v in (st or {}).items() if k != "step"}

    def set_state(self, step: int, tensors: list[list[dict[str, torch.Tensor]]], adopt: bool = False) -> None:
        """Take the held chunks' state (per group, per held chunk); step 0: none. `adopt`:
        the tensors are this rank's own, fresh ones (reshard, a checkpoint's chunks): kept as
        they are where dtype and device already fit, not copied."""
        inner = self.inner
        if inner is None:
            return
        inner.state.clear()
        if step == 0:
            return
        for g, ms in enumerate(self.masters):
            for h, m in enumerate(ms):
                st: dict[str, Any] = {}
                if counts_steps(inner):
                    st["step"] = step_tensor(step)
                for k in self.names(g):
                    t = tensors[g][h][k]
                    st[k] = t if adopt and t.dtype == m.dtype and t.device == m.device else t.to(m.dtype).clone()
                inner.state[m] = st

    def take_state(self) -> list[torch.Tensor]:
        """The held chunks' optimizer state, let go of: a restore replaces it, and its new
        state is carved out of this (the path keeps no state, and no reference to it)."""
        if self.inner is None:
            return []
        out = [t for st in self.inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
        self.inner.state.clear()
        return out

    # -- letting go

    def release_recycler(self) -> None:
        """What the recycler still holds goes back to the OS (hostmem.Recycler.release)."""
        rec, self.recycler = self.recycler, None
        if rec is not None:
            rec.release()

    def discard(self) -> None:
        """Let go of these buffers (not the parameters' buffer, which a new path may have kept
        and the parameters' views hold anyway): ShardedGradients.discard."""
        if self.inner is not None:
            self.inner.state.clear()
        self.grads, self.chunk_grads, self.masters, self.pieces = [], [], [], []
        self.unscale_view = _Pieces([])

    def memory(self) -> dict[str, int]:
        """Bytes these buffers keep between steps: optimizer state, gradients, stepped copies."""
        inner = self.inner
        opt = sum(t.numel() * t.element_size() for s in (inner.state.values() if inner else ())
                  for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        grads = sum(t.numel() * t.element_size() for t in self.grads + self.chunk_grads)
        masters = sum(m.untyped_storage().nbytes() for ms in self.masters for m in ms)  # full: expanded
        return {"optimizer_state": opt, "gradients": grads, "shard_params": masters}
