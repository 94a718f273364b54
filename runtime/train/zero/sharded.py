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

The class is made of three parts, one concern each: its buffers (buffers.py), the
reduction (reducer.py) and the step (stepper.py); what stays here is the rank's identity
in the layout and its state in and out.

Checkpoints: `shard_state_dict` is one rank's own part (plain tensors and JSON
scalars); `full_state_dict` gathers one plain state dict in the format of the
script's optimizer's `state_dict()`, which `load_full_state_dict` takes back at
any world size.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import torch

from ...member import collectives
from .. import state as state_mod
from ..state import dtype_named
from .buffers import _Buffers, chunk_sections
from .layout import ShardLayout, param_groups_of
from .optim import SHARD_MODES, check_optimizer, counts_steps, state_names, step_tensor
from .reducer import _Reducer
from .stepper import _Stepper

FORMAT = "eltctl-zero/1"


class ShardedGradients(_Buffers, _Reducer, _Stepper):
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
        self._pg_of = param_groups_of(self.params, optimizer)
        self._opt_index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        self._held = layout.held(rank)
        # Every rank holds every chunk (shard_replicas=2 at 2 ranks, or 1 rank): the step needs
        # no collective after the gradients' all-reduce (_step_local).
        self._full = len(self._held) == layout.world
        self._offsets = layout.chunk_offsets()
        self._bucket_of = [0] * len(params)
        for b, bucket in enumerate(layout.buckets):
            for i in bucket.params:
                self._bucket_of[i] = b
        self._init_buffers()
        self._init_reduction(reduce_scatter)
        self._init_step(p2p_gather)

    # -- state

    def _names(self, g: int) -> tuple[str, ...]:
        return state_names(self.optimizer, self.optimizer.param_groups[self.layout.groups[g][1]])

    def steps_taken(self) -> int:
        """The optimizer's step count (0: no state yet); every held chunk steps alike."""
        inner = self._inner
        for ms in self._masters:
            for m in ms:
                st = inner.state.get(m) if inner else None
                if st:
                    return int(float(st["step"])) if "step" in st else 1
        return 0

    def _chunk_state(self, g: int, h: int) -> dict[str, torch.Tensor]:
        st = self._inner.state.get(self._masters[g][h]) if self._inner else None
        return {k: v for k, v in (st or {}).items() if k != "step"}

    def _set_state(self, step: int, tensors: list[list[dict[str, torch.Tensor]]], adopt: bool = False) -> None:
        """Take the held chunks' state (per group, per held chunk); step 0: none. `adopt`:
        the tensors are this rank's own, fresh ones (reshard, a checkpoint's chunks): kept as
        they are where dtype and device already fit, not copied."""
        inner = self._inner
        if inner is None:
            return
        inner.state.clear()
        if step == 0:
            return
        for g, ms in enumerate(self._masters):
            for h, m in enumerate(ms):
                st: dict[str, Any] = {}
                if counts_steps(inner):
                    st["step"] = step_tensor(step)
                for k in self._names(g):
                    t = tensors[g][h][k]
                    st[k] = t if adopt and t.dtype == m.dtype and t.device == m.device else t.to(m.dtype).clone()
                inner.state[m] = st

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, for its own checkpoint file."""
        return {"format": FORMAT, "layout": self.layout.to_json(), "rank": self.rank, "held": list(self._held),
                "step": self.steps_taken(),
                "chunks": [[self._chunk_state(g, h) for h in range(len(self._held))]
                           for g in range(len(self._masters))],
                "param_groups": copy.deepcopy(self.optimizer.state_dict()["param_groups"])}

    def load_shard_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format") != FORMAT:
            raise ValueError(f"not a sharded optimizer state ({FORMAT})")
        if sd["layout"] != self.layout.to_json() or sd["rank"] != self.rank:
            raise ValueError("this shard was written under another layout or rank; load the full state "
                             "(load_full_state_dict) or reshard")
        self.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
        self._set_state(int(sd["step"]), sd["chunks"])

    def full_state_dict(self) -> dict[str, Any]:
        """One plain state dict in the script's optimizer's format (collective over
        the group of the last begin(); every rank gets it)."""
        sd = self.optimizer.state_dict()
        step = self.steps_taken()
        state: dict[int, dict[str, Any]] = {}
        if step:
            for g in range(len(self._masters)):
                for name in self._names(g):
                    full = torch.zeros_like(self._flat[g])
                    works = []
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group != g:
                            continue
                        off = self._offsets[b]
                        out = full[bucket.pstart:bucket.pstart + bucket.chunk * self.layout.world]
                        src = self._chunk_state(g, 0)[name][off:off + bucket.chunk].contiguous()
                        works.append(self._pg._allgather_base(out, src))
                    for w in works:
                        collectives.wait_work(w, self._abort)
                    for i, p in enumerate(self.params):
                        if self.layout.slots[i].group != g:
                            continue
                        entry = state.setdefault(self._opt_index[id(p)], {})
                        if counts_steps(self.optimizer) and "step" not in entry:
                            entry["step"] = step_tensor(step)
                        entry[name] = self._param_in(full, i).view_as(p).clone()
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Take this rank's chunks of a plain full state dict (any world size)."""
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
        for g in range(len(self._masters)):
            per_h: list[dict[str, torch.Tensor]] = [{} for _ in self._held]
            for name in self._names(g):
                full = torch.zeros_like(self._flat[g])
                for i, p in enumerate(self.params):
                    entry = saved.get(self._opt_index[id(p)], {})
                    if self.layout.slots[i].group == g and entry.get(name) is not None:
                        self._param_in(full, i).copy_(entry[name].reshape(-1))
                for h, j in enumerate(self._held):
                    sec = self._zeros(self.layout.shard_len(g), full.dtype)
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group == g:
                            sec[self._offsets[b]:self._offsets[b] + bucket.chunk].copy_(self._chunk_of(full, b, j))
                    per_h[h][name] = sec
            tensors.append(per_h)
        self._set_state(step, tensors, adopt=True)



# ---------------------------------------------------------------------------- sharded checkpoints
# (the sharded checkpoint writes and reads the files; these take a rank's part and the facts that
# rebuild the full state from the parts without torch.distributed.)

SHARD_FILE_FORMAT = "eltctl-zero-shard/1"


def checkpoint_shard(sg: ShardedGradients) -> dict[str, Any]:
    """This rank's PRIMARY chunk's optimizer state, cloned to CPU (consistent with the step
    just taken): `{"format", "chunk", "state": [per group {name: tensor}]}`. Backups are not
    saved: the primaries of all ranks cover every chunk once."""
    step = sg.steps_taken()
    state = [({k: v.detach().to("cpu", copy=True) for k, v in sg._chunk_state(g, 0).items()} if step else {})
             for g in range(len(sg._masters))]
    return {"format": SHARD_FILE_FORMAT, "chunk": sg.rank, "state": state}


def checkpoint_layout(sg: ShardedGradients) -> dict[str, Any]:
    """Plain JSON facts (the layout, the optimizer's step count, the state names per group,
    each parameter's index in the script's optimizer and its shape) from which the full
    optimizer state is rebuilt out of the shard files (checkpoint.assemble_optimizer)."""
    step = sg.steps_taken()
    return {"format": FORMAT, "layout": json.loads(sg.layout.to_json()), "step": step,
            "optimizer": type(sg.optimizer).__name__, "counts_steps": counts_steps(sg.optimizer),
            "names": [list(sg._names(g)) if step else [] for g in range(len(sg.layout.groups))],
            "params": [[sg._opt_index[id(p)], list(p.shape)] for p in sg.params]}


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
        for h, j in enumerate(sg._held):
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
    if sharded["params"] != [[sg._opt_index[id(p)], list(p.shape)] for p in sg.params]:
        raise ValueError("the checkpoint was written for other parameters (order, shapes or optimizer)")
    sg.optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
    step = int(sharded["step"])
    tensors: list[list[dict[str, torch.Tensor]]] = []
    for g in range(len(new.groups)):
        dtype = dtype_named(new.groups[g][0])
        tensors.append([chunk_sections(new, g, j, sg._names(g), dtype, sg) for j in sg._held]
                       if step else [{} for _ in sg._held])
        have = sharded["names"][g] if g < len(sharded["names"]) else []
        for per_h in tensors[-1]:  # a state the checkpoint lacks (say amsgrad turned on since) starts at zero
            for k, t in per_h.items():
                if k not in have:
                    t.zero_()
    if step:
        for h, g, dst, jo, og, src, take in _checkpoint_pieces(sg, sharded):
            for name in sharded["names"][og]:
                tensors[g][h][name][dst:dst + take].copy_(shards[jo][og][name][src:src + take])
    sg._set_state(step, tensors, adopt=True)
