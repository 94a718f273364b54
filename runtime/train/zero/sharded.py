"""`ShardedGradients`: the sharded gradient path and optimizer state of one rank, and its
state in and out (state dicts, a sharded checkpoint's parts).

`ShardedGradients` is the sharded gradient path of one rank:

- the model's parameters become views of one padded flat buffer per group (as
  FSDP's flat parameter), so the all-gather after the step writes them in place;
- `shard="optimizer"` (ZeRO-1): the gradients are all-reduced bucket by bucket
  as backward produces them (the replicated path's schedule), then each rank
  steps only the chunks it holds;
- `shard="gradients"` (ZeRO-2): each bucket is reduce-scattered as soon as
  backward completes it, straight into the rank's chunk; the parameters'
  gradients are freed as they are staged, so between steps a rank keeps only
  1/W of the gradients. A backup chunk's gradient comes from its primary by
  point-to-point;
- the step: the GradScaler's unscale on the shard, one 2-element all-reduce of
  (sum of squared gradient norms, inf/NaN found) over the primary chunks, so the
  global-norm clip and the skip decision are the same on every rank; the shard's
  optimizer step; the parameters all-gathered. Until that all-gather ends the
  held chunks' pre-step values and optimizer state are kept: a generation that
  breaks inside it (a rank lost there) leaves the chunks a step ahead of the
  parameters and the parameters half-gathered, and `settle` undoes (or keeps)
  that step in the next generation before `reshard` rebuilds the parameters.

The class holds three collaborators, one concern each, and delegates to them:

- `ShardBuffers` (buffers.py) owns the flat buffers, the gradient buffers, the masters,
  the pieces' optimizers and the held chunks' optimizer state;
- `Reducer` (reducer.py) owns the step's reductions and is handed the buffers;
- `Stepper` (stepper.py) owns the pre-step copy and the step in doubt and is handed the
  buffers.

Each is also handed the rank's `Placement` (layout.py: its place in the layout, pure and
fixed), and the reducer and the stepper the group at every `begin`. None holds a reference
back to this class. What stays here is the rank's identity (parameters, optimizer,
layout, rank), the group of the last begin() and its state in and out.

Checkpoints: `shard_state_dict` is one rank's own part (plain tensors and JSON
scalars); `full_state_dict` gathers one plain state dict in the format of the
script's optimizer's `state_dict()`, which `load_full_state_dict` takes back at
any world size.
"""

from __future__ import annotations

import copy
import json
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ...member import collectives
from .. import state as state_mod
from ..state import dtype_named
from .buffers import ShardBuffers, chunk_sections
from .hostmem import Recycler
from .layout import Placement, ShardLayout, param_groups_of
from .optim import SHARD_MODES, check_optimizer, counts_steps, step_tensor
from .reducer import Reducer
from .stepper import StepResult, Stepper

FORMAT = "eltctl-zero/1"


class ShardedGradients:
    """The sharded gradient path and optimizer state of one rank (module docstring).

    Use: `bind()` once (no communication), then per step `begin(pg)`, backward
    with `grad_ready(index, p)` called from each parameter's post-accumulate-grad
    hook (`attached()` registers such hooks), `finish()`, `step()`, `zero_grad()`.
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, layout: ShardLayout,
                 rank: int, shard: str = "optimizer", reduce_scatter: bool | None = None,
                 p2p_gather: bool | None = None) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES} (or None for replicated), not {shard!r}")
        check_optimizer(optimizer)
        if len(params) != len(layout.slots) or any(p.numel() != s.numel for p, s in zip(params, layout.slots)):
            raise ValueError("the layout was planned for other parameters")
        self.params = list(params)
        self.optimizer = optimizer
        self.layout = layout
        self.rank = rank
        self.shard = shard
        param_groups_of(self.params, optimizer)  # every parameter is in the optimizer
        self._opt_index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        self._place = place = Placement.of(layout, rank, shard)
        self._buffers = ShardBuffers(self.params, optimizer, place)
        self._reducer = Reducer(self.params, place, self._buffers, reduce_scatter)
        self._stepper = Stepper(optimizer, place, self._buffers, p2p_gather)
        self._pg = None  # the group of the last begin() (or use_group): full_state_dict's
        self._abort: threading.Event | None = None

    # -- the parts (for the sharded path's moves, tools and tests)

    @property
    def buffers(self) -> ShardBuffers:
        return self._buffers

    @property
    def reducer(self) -> Reducer:
        return self._reducer

    @property
    def stepper(self) -> Stepper:
        return self._stepper

    # -- read-only views (for tests and tools: what the buffers are, never to write through)

    @property
    def held(self) -> tuple[int, ...]:
        """The chunks this rank holds: its own first, then those it backs up."""
        return self._place.held

    @property
    def holds_every_chunk(self) -> bool:
        """Every chunk is held here (the step needs no all-gather: Stepper._step_local)."""
        return self._place.full

    @property
    def flat_params(self) -> tuple[torch.Tensor, ...]:
        """Per group: the padded parameter buffer the parameters are views of."""
        return tuple(self._buffers.flat)

    @property
    def flat_grads(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-1, per group: the padded gradient buffer (empty for ZeRO-2)."""
        return tuple(self._buffers.grads)

    @property
    def chunk_grads(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-2, per group: the held chunks' gradients, one section per held chunk."""
        return tuple(self._buffers.chunk_grads)

    @property
    def masters(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per group, per held chunk: the tensor its optimizer state is keyed by."""
        return tuple(tuple(ms) for ms in self._buffers.masters)

    @property
    def stale(self) -> bool:
        """A dropped step's reductions may still write into the gradient buffers (drop)."""
        return self._reducer.stale

    @property
    def reductions(self) -> tuple:
        """The works of this step's reductions launched so far, in bucket order."""
        return self._reducer.reductions

    @property
    def staging_buffers(self) -> tuple[torch.Tensor, ...]:
        """ZeRO-2 on the CPU: the free staging buffers of the pool."""
        return self._reducer.staging_buffers

    @property
    def device(self) -> torch.device:
        return self._buffers.device

    # -- buffers and memory

    @property
    def recycler(self) -> Recycler | None:
        """Host memory the buffers are carved out of until a reshard's move is done (hostmem.py)."""
        return self._buffers.recycler

    @recycler.setter
    def recycler(self, rec: Recycler | None) -> None:
        self._buffers.recycler = rec

    def bind(self, reuse: "ShardedGradients | None" = None, values: bool = True) -> None:
        """Make the parameters views of the padded flat buffers (values kept) and
        build the shard optimizer. No communication. `reuse`: this rank's path under
        the previous layout (a reshard): a group whose buckets lie at the same places
        with the same padded widths (a world change that every bucket's length divides
        alike) keeps its parameter buffer, of which the parameters already are views,
        and (ZeRO-1) its gradient buffer: nothing is allocated or copied for it; not
        a gradient buffer a dropped step's reductions may still write (`stale`).
        `values` False: the parameters' values are not kept (a joiner, whose reshard
        receives every chunk's parameters): they are not copied (on the join's critical
        path: with the masters' copy, which a step makes anyway, 0.3 s of the 50 M
        benchmark model's 0.47 s bind here)."""
        self._buffers.bind(reuse._buffers if reuse is not None else None,
                           reuse is not None and reuse._reducer.stale, values)

    def host_bytes(self) -> int:
        """The host bytes a joiner's path allocates from bind to the end of its reshard
        (ShardBuffers.host_bytes)."""
        return self._buffers.host_bytes()

    def release_recycler(self) -> None:
        """What the recycler still holds goes back to the OS (hostmem.Recycler.release)."""
        self._buffers.release_recycler()

    def take_state(self) -> list[torch.Tensor]:
        """The held chunks' optimizer state, let go of (ShardBuffers.take_state)."""
        return self._buffers.take_state()

    def take_spares(self) -> list[torch.Tensor]:
        """The pre-step copy's buffers, let go of (Stepper.take_spares)."""
        return self._stepper.take_spares()

    def discard(self) -> None:
        """This path was replaced (its move done): let go of its host buffers now, so their
        pages are back with the OS for the new path's first step (whatever cycles might
        keep the object itself alive). Not the parameters' buffer, which the new path may
        have kept and the parameters' views hold anyway."""
        self._buffers.discard()
        self._stepper.discard()
        self._reducer.discard()

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: optimizer state, gradients, stepped copies
        and, on the CPU, the pre-step copy's buffers and ZeRO-2's staging pool."""
        return {**self._buffers.memory(), "step_undo": self._stepper.undo_bytes(),
                "staging": self._reducer.staging_bytes()}

    # -- the step

    def use_group(self, pg, abort: threading.Event | None) -> None:
        """The group (and abort event) of this rank's generation, before its first begin()
        (full_state_dict, a checkpoint, may come first)."""
        self._pg, self._abort = pg, abort
        self._reducer.use_group(pg, abort)
        self._stepper.use_group(pg, abort)

    def begin(self, pg, abort: threading.Event | None = None, accumulate: bool = False) -> None:
        """Arm the reduction for the coming backward (Reducer.begin)."""
        self._reducer.begin(pg, abort, accumulate)
        self._stepper.begin(pg, abort, self._reducer.on_gloo)
        self._pg, self._abort = pg, abort

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body of parameter `index` (Reducer.grad_ready)."""
        self._reducer.grad_ready(index, p)

    def failed(self) -> BaseException | None:
        return self._reducer.failed()

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; afterwards every held
        chunk's gradient (summed over ranks) is in place. The step is prepared in between,
        while the last buckets are still being reduced (Stepper.prepare)."""
        reducer = self._reducer
        reducer.launch_rest()
        if not reducer.broken:
            self._stepper.prepare()
        reducer.complete()

    def finish_round(self) -> None:
        self._reducer.finish_round()

    def drop(self) -> None:
        """A dropped step (Reducer.drop); what finish() prepared for it is not used."""
        self._reducer.drop()
        self._stepper.drop()

    def zero_grad(self) -> None:
        self._reducer.zero_grad()

    @contextmanager
    def attached(self) -> Iterator["ShardedGradients"]:
        """Post-accumulate-grad hooks that call grad_ready, for a loop without a job."""
        ready = self._reducer.grad_ready
        handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: ready(i, p))
                   for i, p in enumerate(self.params)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def step(self, max_grad_norm: float | None = None, scaler: Any = None) -> StepResult:
        """Unscale, clip by the global norm, step the held chunks, all-gather the
        parameters (Stepper.step). Call after finish()."""
        return self._stepper.step(max_grad_norm, scaler)

    @property
    def step_in_doubt(self) -> bool:
        """True after a step whose parameter all-gather did not finish here (dropped)."""
        return self._stepper.step_in_doubt

    def settle(self, keep: bool) -> None:
        """Resolve a step in doubt, keeping or undoing it (Stepper.settle)."""
        self._stepper.settle(keep)

    def forget_step_in_doubt(self) -> None:
        """A restore replaces the state and the parameters: a step in doubt is not settled."""
        self._stepper.forget_step_in_doubt()

    def gather_params(self, stepped: Iterator[int] | None = None) -> None:
        """All-gather every bucket's chunks from their primaries into the parameters
        (Stepper.gather_params)."""
        self._stepper.gather_params(stepped)

    def gather_bucket(self, b: int):
        """Launch bucket b's all-gather (Stepper.gather_bucket)."""
        return self._stepper.gather_bucket(b)

    # -- state

    def opt_index(self, p: torch.Tensor) -> int:
        """Parameter `p`'s index in the script's optimizer (its state_dict's key)."""
        return self._opt_index[id(p)]

    def steps_taken(self) -> int:
        """The optimizer's step count (0: no state yet); every held chunk steps alike."""
        return self._buffers.steps_taken()

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, for its own checkpoint file."""
        buf, held = self._buffers, self._place.held
        return {"format": FORMAT, "layout": self.layout.to_json(), "rank": self.rank, "held": list(held),
                "step": self.steps_taken(),
                "chunks": [[buf.chunk_state(g, h) for h in range(len(held))] for g in range(len(buf.masters))],
                "param_groups": copy.deepcopy(self.optimizer.state_dict()["param_groups"])}

    def load_shard_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format") != FORMAT:
            raise ValueError(f"not a sharded optimizer state ({FORMAT})")
        if sd["layout"] != self.layout.to_json() or sd["rank"] != self.rank:
            raise ValueError("this shard was written under another layout or rank; load the full state "
                             "(load_full_state_dict) or reshard")
        self.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
        self._buffers.set_state(int(sd["step"]), sd["chunks"])

    def full_state_dict(self) -> dict[str, Any]:
        """One plain state dict in the script's optimizer's format (collective over
        the group of the last begin(); every rank gets it)."""
        buf, place = self._buffers, self._place
        sd = self.optimizer.state_dict()
        step = self.steps_taken()
        state: dict[int, dict[str, Any]] = {}
        if step:
            for g in range(len(buf.masters)):
                for name in buf.names(g):
                    full = torch.zeros_like(buf.flat[g])
                    works = []
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group != g:
                            continue
                        off = place.offsets[b]
                        out = full[bucket.pstart:bucket.pstart + bucket.chunk * self.layout.world]
                        src = buf.chunk_state(g, 0)[name][off:off + bucket.chunk].contiguous()
                        works.append(self._pg._allgather_base(out, src))
                    for w in works:
                        collectives.wait_work(w, self._abort)
                    for i, p in enumerate(self.params):
                        if self.layout.slots[i].group != g:
                            continue
                        entry = state.setdefault(self._opt_index[id(p)], {})
                        if counts_steps(self.optimizer) and "step" not in entry:
                            entry["step"] = step_tensor(step)
                        entry[name] = place.param_in(full, i).view_as(p).clone()
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Take this rank's chunks of a plain full state dict (any world size)."""
        buf, place = self._buffers, self._place
        self.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
        saved = sd.get("state") or {}
        step = 0
        for entry in saved.values():
            if "step" in entry:
                step = int(float(entry["step"]))
                break
            step = 1 if entry else step
        if not saved:
            step = 0
        tensors: list[list[dict[str, torch.Tensor]]] = []
        for g in range(len(buf.masters)):
            per_h: list[dict[str, torch.Tensor]] = [{} for _ in place.held]
            for name in buf.names(g):
                full = torch.zeros_like(buf.flat[g])
                for i, p in enumerate(self.params):
                    entry = saved.get(self._opt_index[id(p)], {})
                    if self.layout.slots[i].group == g and entry.get(name) is not None:
                        place.param_in(full, i).copy_(entry[name].reshape(-1))
                for h, j in enumerate(place.held):
                    sec = buf.zeros(self.layout.shard_len(g), full.dtype)
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group == g:
                            sec[place.offsets[b]:place.offsets[b] + bucket.chunk].copy_(place.chunk_of(full, b, j))
                    per_h[h][name] = sec
            tensors.append(per_h)
        buf.set_state(step, tensors, adopt=True)


# ---------------------------------------------------------------------------- sharded checkpoints
# (the sharded checkpoint writes and reads the files; these take a rank's part and the facts that
# rebuild the full state from the parts without torch.distributed.)

SHARD_FILE_FORMAT = "eltctl-zero-shard/1"


def checkpoint_shard(sg: ShardedGradients) -> dict[str, Any]:
    """This rank's PRIMARY chunk's optimizer state, cloned to CPU (consistent with the step
    just taken): `{"format", "chunk", "state": [per group {name: tensor}]}`. Backups are not
    saved: the primaries of all ranks cover every chunk once."""
    step = sg.steps_taken()
    state = [({k: v.detach().to("cpu", copy=True) for k, v in sg.buffers.chunk_state(g, 0).items()} if step else {})
             for g in range(len(sg.buffers.masters))]
    return {"format": SHARD_FILE_FORMAT, "chunk": sg.rank, "state": state}


def checkpoint_layout(sg: ShardedGradients) -> dict[str, Any]:
    """Plain JSON facts (the layout, the optimizer's step count, the state names per group,
    each parameter's index in the script's optimizer and its shape) from which the full
    optimizer state is rebuilt out of the shard files (checkpoint.assemble_optimizer)."""
    step = sg.steps_taken()
    return {"format": FORMAT, "layout": json.loads(sg.layout.to_json()), "step": step,
            "optimizer": type(sg.optimizer).__name__, "counts_steps": counts_steps(sg.optimizer),
            "names": [list(sg.buffers.names(g)) if step else [] for g in range(len(sg.layout.groups))],
            "params": [[sg.opt_index(p), list(p.shape)] for p in sg.params]}


def checkpoint_param_groups(sg: ShardedGradients) -> list[dict[str, Any]]:
    """The script's optimizer's param_groups (hyperparameters), as its state_dict() gives them."""
    return copy.deepcopy(sg.optimizer.state_dict()["param_groups"])


def _checkpoint_pieces(sg: ShardedGradients, sharded: dict[str, Any]) -> Iterator[tuple[int, ...]]:
    """Where each piece of this rank's held chunks (under ITS layout) lies in a sharded
    checkpoint (`sharded`: the manifest's entry): (h, new group, offset in held chunk h's
    section, old chunk, old group, offset in that chunk's section, length)."""
    old = ShardLayout.from_json(json.dumps(sharded["layout"]))
    new = sg.layout
    old_bucket = {i: b for b, bk in enumerate(old.buckets) for i in bk.params}
    new_bucket = {i: b for b, bk in enumerate(new.buckets) for i in bk.params}
    old_off, new_off = old.chunk_offsets(), new.chunk_offsets()
    for i, (os_, ns) in enumerate(zip(old.slots, new.slots)):
        ob, nb = old.buckets[old_bucket[i]], new.buckets[new_bucket[i]]
        o_at, n_at = os_.offset - ob.start, ns.offset - nb.start  # bucket-local starts
        for h, j in enumerate(sg.held):
            lo, hi = max(n_at, j * nb.chunk), min(n_at + ns.numel, (j + 1) * nb.chunk)
            k = lo - n_at
            while k < hi - n_at:
                q = o_at + k
                jo = q // ob.chunk
                take = min(hi - n_at - k, (jo + 1) * ob.chunk - q)
                yield (h, ns.group, new_off[new_bucket[i]] + n_at + k - j * nb.chunk,
                       jo, os_.group, old_off[old_bucket[i]] + q - jo * ob.chunk, take)
                k += take


def checkpoint_chunks_needed(sg: ShardedGradients, sharded: dict[str, Any]) -> list[int]:
    """The chunks of a sharded checkpoint (`sharded`: the manifest's entry) that this rank's
    held chunks under ITS layout take elements from (load_checkpoint_chunks reads only these)."""
    return sorted({jo for _h, _g, _dst, jo, _og, _src, _n in _checkpoint_pieces(sg, sharded)})


def load_checkpoint_chunks(sg: ShardedGradients, sharded: dict[str, Any], shards: list[list[dict[str, torch.Tensor]]],
                           param_groups: list[dict[str, Any]]) -> None:
    """Load this rank's chunks (under ITS layout, any world size) straight from a sharded
    checkpoint's per-chunk states (`shards[j]`: chunk j's [per group {name: tensor}], e.g.
    memory-mapped files; only those of checkpoint_chunks_needed are looked up), copying
    only the element ranges its held chunks need: no full state is built. `sharded`: the
    manifest's entry (checkpoint_layout)."""
    new = sg.layout
    # its hyperparameters and state names would be another class's
    reason = state_mod.optimizer_mismatch(sharded.get("optimizer"), state_mod.optimizer_class(sg.optimizer))
    if reason:
        raise state_mod.OptimizerMismatch(reason)
    if sharded["params"] != [[sg.opt_index(p), list(p.shape)] for p in sg.params]:
        raise ValueError("the checkpoint was written for other parameters (order, shapes or optimizer)")
    sg.optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
    step = int(sharded["step"])
    tensors: list[list[dict[str, torch.Tensor]]] = []
    for g in range(len(new.groups)):
        dtype = dtype_named(new.groups[g][0])
        tensors.append([chunk_sections(new, g, j, sg.buffers.names(g), dtype, sg.buffers) for j in sg.held]
                       if step else [{} for _ in sg.held])
        have = sharded["names"][g] if g < len(sharded["names"]) else []
        for per_h in tensors[-1]:  # a state the checkpoint lacks (say amsgrad turned on since) starts at zero
            for k, t in per_h.items():
                if k not in have:
                    t.zero_()
    if step:
        for h, g, dst, jo, og, src, take in _checkpoint_pieces(sg, sharded):
            for name in sharded["names"][og]:
                tensors[g][h][name][dst:dst + take].copy_(shards[jo][og][name][src:src + take])
    sg.buffers.set_state(step, tensors, adopt=True)
