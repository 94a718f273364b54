"""One rank's buffers of the sharded state: where each held chunk's parameters, gradients,
stepped copy and optimizer state live, and the views the step runs through.

The model's parameters become views of one padded flat buffer per group (as FSDP's flat
parameter), so the all-gather after the step writes them in place. ZeRO-1's gradients are
views of one padded gradient buffer per group; ZeRO-2 keeps one section per held chunk
(`_shard_grads`). Each held chunk has a master (the tensor the shard optimizer's state is
keyed by: the parameters' own chunk where it is stepped in place, else a copy) and, per
bucket, an optimizer of the script's class over views of its pieces (`_steppers`).

`_Buffers` is one part of ShardedGradients (sharded.py), which mixes it with the
reduction (reducer.py) and the step (stepper.py); the parts share the rank's attributes,
each part setting those it owns in its `_init_*`, so the step's hot path reads them
directly (no indirection per bucket or per parameter hook).
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..state import dtype_named
from . import hostmem
from .hostmem import Recycler
from .layout import ShardLayout

# The shard steps in pieces of at most this many elements (each a view of its chunk): the
# optimizer's temporaries (AdamW's denominator) stay this small, which the CPU allocator
# reuses, where one temporary the size of a whole chunk is a fresh mapping every step.
PIECE_ELEMS = 1 << 21


def line_bytes(n_bytes: int) -> int:
    """`n_bytes` rounded up to a cache line (how a Recycler carves)."""
    return -(-n_bytes // 64) * 64


def chunk_sections(lay: ShardLayout, g: int, j: int, names, dtype: torch.dtype,
                   sg: "_Buffers") -> dict[str, torch.Tensor]:
    """New state tensors (one per name) for chunk j's section of group g, on `sg`'s device
    and out of its recycler where it has one, their padding zeroed; the caller writes every
    real element (a reshard's slices, a checkpoint's)."""
    n, offs = lay.shard_len(g), lay.chunk_offsets()
    st = {k: sg._empty(n, dtype) for k in names}
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


class _Buffers:
    """The buffers and views of one rank's sharded state (module docstring); part of
    ShardedGradients."""

    def _init_buffers(self) -> None:
        self._flat: list[torch.Tensor] = []  # padded parameters per group (the params are views)
        self._grads: list[torch.Tensor] = []  # ZeRO-1: padded gradients per group (the .grad are views)
        self._shard_grads: list[torch.Tensor] = []  # per group: one section per held chunk
        self._masters: list[list[torch.Tensor]] = []  # per group, per held chunk: the stepped tensor
        self._inner: torch.optim.Optimizer | None = None  # holds the held chunks' state, keyed by the masters
        # Per bucket, per held chunk: an optimizer of the script's class over views of that chunk's
        # pieces (_build_steppers); the step runs through these, the state stays in _inner.
        self._steppers: list[list[tuple[torch.optim.Optimizer, list[tuple[int, int]]]]] = []
        self._unscale_view = _Pieces([])  # every piece: what GradScaler unscales (_point_grads)
        # Host memory this path's buffers are carved out of until its reshard's move is done
        # (the old layout's pre-step copy, or a joiner's prepared memory: hostmem.py); None:
        # everything is allocated.
        self.recycler: Recycler | None = None

    # -- read-only views (for tests and tools: what the buffers are, never to write through)

    @property
    def held(self) -> tuple[int, ...]:
        """The chunks this rank holds: its own first, then those it backs up."""
        return self._held

    @property
    def holds_every_chunk(self) -> bool:
        """Every chunk is held here (the step needs no all-gather, _step_local)."""
        return self._full

    @property
    def flat_params(self) -> tuple[torch.Tensor, ...]:
        """Per group: the padded parameter buffer the parameters are views of."""
        return tuple(self._flat)

    @property
    def flat_grads(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-1, per group: the padded gradient buffer (empty for ZeRO-2)."""
        return tuple(self._grads)

    @property
    def chunk_grads(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-2, per group: the held chunks' gradients, one section per held chunk."""
        return tuple(self._shard_grads)

    @property
    def masters(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per group, per held chunk: the tensor its optimizer state is keyed by."""
        return tuple(tuple(ms) for ms in self._masters)

    # -- setup

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D buffer on the parameters' device: out of the recycler where there is one."""
        if self.recycler is not None:
            return self.recycler.empty(n, dtype, self.device)
        if self.device.type == "cpu":
            return hostmem.empty(n, dtype)
        return torch.empty(n, dtype=dtype, device=self.device)

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self._empty(n, dtype).zero_()

    def _geometry(self, g: int) -> tuple:
        """Where group g's buckets lie in its padded buffer (start, padded width)."""
        return (self.layout.groups[g],) + tuple((b.pstart, b.chunk * self.layout.world)
                                                for b in self.layout.buckets if b.group == g)

    def bind(self, reuse: "_Buffers | None" = None, values: bool = True) -> None:
        """Make the parameters views of the padded flat buffers (values kept) and
        build the shard optimizer. No communication. `reuse`: this rank's path under
        the previous layout (a reshard): a group whose buckets lie at the same places
        with the same padded widths (a world change that every bucket's length divides
        alike) keeps its parameter buffer, of which the parameters already are views,
        and (ZeRO-1) its gradient buffer: nothing is allocated or copied for it.
        `values` False: the parameters' values are not kept (a joiner, whose reshard
        receives every chunk's parameters): they are not copied (on the join's critical
        path: with the masters' copy, which a step makes anyway, 0.3 s of the 50 M
        benchmark model's 0.47 s bind here)."""
        lay = self.layout
        same = [reuse is not None and g < len(reuse._flat) and reuse._geometry(g) == self._geometry(g)
                and reuse._flat[g].device == self.device for g in range(len(lay.groups))]
        with torch.no_grad():
            self._flat = []
            for g, (dtype, _pg) in enumerate(lay.groups):
                if same[g]:
                    self._flat.append(reuse._flat[g])
                    continue
                flat = self._empty(lay.padded(g), dtype_named(dtype))
                for b in lay.buckets:  # the parameters fill the rest
                    if b.group == g:
                        flat[b.pstart + b.numel:b.pstart + b.chunk * lay.world].zero_()
                self._flat.append(flat)
            for i, p in enumerate(self.params):
                view = self._param_view(self._flat, i)
                if view.data_ptr() != p.data_ptr():
                    if values:
                        view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)
            # ZeRO-2: the held chunks' gradients, one section per held chunk. ZeRO-1 has none: its
            # pieces' gradients are views of the all-reduced gradients (_point_grads).
            self._shard_grads = []
            for g, f in enumerate(self._flat if self.shard == "gradients" else ()):
                n = len(self._held) * lay.shard_len(g)
                was = reuse._shard_grads[g] if reuse is not None and g < len(reuse._shard_grads) else None
                if was is not None and was.numel() == n and was.dtype == f.dtype and was.device == f.device \
                        and not reuse._stale:
                    self._shard_grads.append(was.zero_())  # e.g. 2 -> 1 ranks with two replicas: 2 x 1/2 = 1 x 1
                else:
                    self._shard_grads.append(self._zeros(n, f.dtype))
            # A chunk stepped in place (_in_place: this rank's own chunk, or every chunk where
            # it holds them all) has its pieces step the parameters' buffer itself; its master
            # only keys the optimizer state and gives its sizes: one element, expanded (no
            # memory on any device: at world N that is 1/N of the model per rank, all of it
            # at world 1). A backup's master is a real copy: its values are only read within
            # a step, which writes every element (padding too) from the parameters first
            # (_refresh_masters), so none are copied here.
            self._masters = [[(torch.empty(1, dtype=f.dtype, device=f.device).expand(lay.shard_len(g))
                               if self._in_place(h) else self._empty(lay.shard_len(g), f.dtype))
                              for h in range(len(self._held))] for g, f in enumerate(self._flat)]
        if self.shard == "optimizer":
            self._grads = []
            for g, f in enumerate(self._flat):
                if same[g] and len(reuse._grads) > g and not reuse._stale:
                    self._grads.append(reuse._grads[g].zero_())
                else:
                    self._grads.append(self._zeros(f.numel(), f.dtype))
            for i, p in enumerate(self.params):
                p.grad = self._param_view(self._grads, i).view_as(p)
        else:
            self._grads = []
            for p in self.params:
                p.grad = None
        groups = []
        for g, (_dtype, pg) in enumerate(lay.groups):
            hyper = {k: v for k, v in self.optimizer.param_groups[pg].items() if k != "params"}
            groups.append({**hyper, "params": self._masters[g]})
        self._inner = type(self.optimizer)(groups) if groups else None
        self._build_steppers()
        self._point_grads()

    def host_bytes(self) -> int:
        """The bytes of the buffers a joiner's path allocates from bind to the end of its
        reshard (nothing of an earlier path to reuse): the parameters' padded buffer, ZeRO-1's
        gradient buffer, the chunk gradients, the backups' stepped copies and the held
        chunks' optimizer state, each rounded up to a cache line (what
        ShardedPath.prepare_join touches ahead)."""
        lay, held, total, line = self.layout, len(self._held), 0, line_bytes
        for g, (dtype, _pg) in enumerate(lay.groups):
            item, n, names = dtype_named(dtype).itemsize, lay.shard_len(g), len(self._names(g))
            total += line(lay.padded(g) * item) * (2 if self.shard == "optimizer" else 1)
            total += line(held * n * item) if self.shard == "gradients" else 0
            total += sum(line(n * item) for h in range(held) if not self._in_place(h))
            total += held * names * line(n * item)
        return total

    def _in_place(self, h: int) -> bool:
        """Held chunk h is stepped in the parameters' own buffer: this rank's own chunk
        (h 0, which the all-gather then sends from where it lies) or, where every chunk is
        held here (_full, no all-gather), every chunk. A backup (h > 0) of a sharded
        layout steps a copy: the all-gather writes the chunk's parameters from its primary
        while the backup steps."""
        return h == 0 or self._full

    def _build_steppers(self) -> None:
        """Per bucket and held chunk, an optimizer of the script's class over that chunk's
        pieces (views of the master, at most PIECE_ELEMS each), so the step goes bucket by
        bucket (each bucket's all-gather starts once its primary chunk has stepped) and its
        temporaries stay small."""
        cls = type(self.optimizer)
        self._steppers = []
        for b, bucket in enumerate(self.layout.buckets):
            g, off = bucket.group, self._offsets[b]
            end = off + bucket.chunk
            spans = [(lo, min(lo + PIECE_ELEMS, end)) for lo in range(off, end, PIECE_ELEMS)]
            per_h = []
            for h, j in enumerate(self._held):
                if self._in_place(h):  # the parameters themselves (chunk j of the padded buffer) are stepped
                    base = bucket.pstart + j * bucket.chunk - off
                    views = [self._flat[g][base + lo:base + hi] for lo, hi in spans]
                else:
                    views = [self._masters[g][h][lo:hi] for lo, hi in spans]
                per_h.append((cls([{**self._inner.param_groups[g], "params": views}]), spans))
            self._steppers.append(per_h)

    def _point_grads(self) -> None:
        """The pieces' .grad (again after the buffers are replaced): ZeRO-2, their sections
        of _shard_grads (the masters' too); ZeRO-1, their chunk's elements of the all-reduced
        gradients themselves, so nothing copies the held chunks' gradients out of them (at
        world 2 with two replicas that was the 50 M model's 200 MB at every step). Also the
        view GradScaler unscales (_unscale_view)."""
        for g, masters in enumerate(self._masters):
            n = self.layout.shard_len(g)
            for h, m in enumerate(masters):
                m.grad = self._shard_grads[g][h * n:(h + 1) * n] if self.shard == "gradients" else None
        for b, per_h in enumerate(self._steppers):
            bucket = self.layout.buckets[b]
            g, off = bucket.group, self._offsets[b]
            for h, (opt, spans) in enumerate(per_h):
                base = bucket.pstart + self._held[h] * bucket.chunk - off
                for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                    v.grad = (self._masters[g][h].grad[lo:hi] if self.shard == "gradients"
                              else self._grads[g][base + lo:base + hi])
        self._unscale_view = _Pieces([v for per_h in self._steppers for opt, _spans in per_h
                                      for v in opt.param_groups[0]["params"]])

    def _param_view(self, flats: list[torch.Tensor], i: int) -> torch.Tensor:
        return self._param_in(flats[self.layout.slots[i].group], i)

    def _param_in(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements in a padded buffer of its group."""
        slot = self.layout.slots[i]
        b = self.layout.buckets[self._bucket_of[i]]
        at = b.pstart + slot.offset - b.start
        return flat[at:at + slot.numel]

    def _chunk_of(self, flat: torch.Tensor, b: int, j: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return flat[bucket.pstart + j * bucket.chunk:bucket.pstart + (j + 1) * bucket.chunk]

    def _section(self, t: torch.Tensor, g: int, h: int) -> torch.Tensor:
        n = self.layout.shard_len(g)
        return t[h * n:(h + 1) * n]

    def _read_chunk(self, g: int, h: int, into: torch.Tensor) -> torch.Tensor:
        """Held chunk h's parameters of group g, bucket by bucket, into the section `into`."""
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.group == g:
                off = self._offsets[b]
                into[off:off + bucket.chunk].copy_(self._chunk_of(self._flat[g], b, self._held[h]))
        return into

    def _write_chunk(self, g: int, h: int, values: torch.Tensor) -> None:
        """The section `values` into held chunk h's parameters of group g, bucket by bucket."""
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.group == g:
                off = self._offsets[b]
                self._chunk_of(self._flat[g], b, self._held[h]).copy_(values[off:off + bucket.chunk])

    def _backups(self) -> Iterator[tuple[int, int]]:
        """(group, held index) of every chunk stepped in a copy (not _in_place)."""
        return ((g, h) for g in range(len(self._masters)) for h in range(len(self._held)) if not self._in_place(h))

    def _refresh_masters(self) -> None:
        """The backups' stepped copies from the parameters (a restore or a state apply may
        have changed them). A chunk stepped in place (_in_place) has none."""
        with torch.no_grad():
            for g, h in self._backups():
                self._read_chunk(g, h, self._masters[g][h])

    # -- the gradient reduction

    def release_recycler(self) -> None:
        """What the recycler still holds goes back to the OS (hostmem.Recycler.release)."""
        rec, self.recycler = self.recycler, None
        if rec is not None:
            rec.release()

    def take_state(self) -> list[torch.Tensor]:
        """The held chunks' optimizer state, let go of: a restore replaces it, and its new
        state is carved out of this (the path keeps no state, and no reference to it)."""
        if self._inner is None:
            return []
        out = [t for st in self._inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
        self._inner.state.clear()
        return out

    def discard(self) -> None:
        """This path was replaced (its move done): let go of its host buffers now, so their
        pages are back with the OS for the new path's first step (whatever cycles might
        keep the object itself alive). Not the parameters' buffer, which the new path may
        have kept and the parameters' views hold anyway."""
        if self._inner is not None:
            self._inner.state.clear()
        self._spares, self._spare_base, self._spare_arena = {}, None, None
        self._grads, self._shard_grads, self._masters, self._steppers = [], [], [], []
        self._unscale_view = _Pieces([])
        self._pool, self._pooled, self._staging = {}, {}, {}

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: optimizer state, gradients, stepped copies
        and, on the CPU, the pre-step copy's buffers and ZeRO-2's staging pool."""
        inner = self._inner
        opt = sum(t.numel() * t.element_size() for s in (inner.state.values() if inner else ())
                  for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        grads = sum(t.numel() * t.element_size() for t in self._grads + self._shard_grads)
        masters = sum(m.untyped_storage().nbytes() for ms in self._masters for m in ms)  # _full: expanded
        undo = sum(t.numel() * t.element_size() for t in self._spares.values())
        staging = sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)
        staging += sum(t.numel() * t.element_size() for t in self._pooled.values())
        return {"optimizer_state": opt, "gradients": grads, "shard_params": masters, "step_undo": undo,
                "staging": staging}
