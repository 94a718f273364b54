"""Sharded checkpoints (ZeRO): each rank's chunk of the optimizer state is its own file
of one step directory, and each rank takes its chunks back from those files at a restore.

    step-00001234/
      state.pt                   the job's state; its "optimizer" holds only param_groups
      optimizer-00000-of-00004.pt ... one per rank of the layout: that rank's primary chunk
                                 (zero.checkpoint_shard), written by the rank itself when it is
                                 on the writer's host, else sent to the writer (point-to-point)
      manifest.json              every file's size and sha256, and "sharded": the layout and
                                 the facts that rebuild the full state (zero.checkpoint_layout)

The directory commits as one (the writer's CheckpointStore renames it into place after
every file is in it: `save_sharded`), so verification, mirroring and signing treat it
like any checkpoint: the mirror copies every file the manifest lists and the MAC covers
the manifest, which holds every file's sha256. A restore under any layout (any world
size, shard setting, replicas) reads each rank's chunks straight out of the
memory-mapped shard files (`load_optimizer_chunks`, `restore_chunks`), or has one rank
that can read them send the full state. The format and the readers that need no process
group (`assemble_optimizer`: the full state, for load_checkpoint and export) are
runtime/checkpoint/.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.format import (STATE_FILE, TMP_PREFIX, CheckpointError, InvalidCheckpoint, PendingCheck,
                                  check_sizes, read_manifest, shard_filename, verify_shard_files)
from ...checkpoint.load import covered_by_restorer, load_state
from ...checkpoint.store import CheckpointStore, write_staged
from ...member import collectives, transfer
from .. import state as state_mod
from . import sharded as zero

log = logging.getLogger(__name__)

SHARD_TAG = 0x5AD  # point-to-point tag of the shard transfer


def _send_bytes(pg: Any, dst: int, data: Any, abort: Any) -> None:
    view = memoryview(bytearray(data) if isinstance(data, bytes) else data).cast("B")  # frombuffer: writable
    n = torch.tensor([len(view)], dtype=torch.int64)
    collectives.wait_p2p([collectives.send(pg, n, dst, SHARD_TAG)], abort, "shard transfers")
    if len(view):
        body = torch.frombuffer(view, dtype=torch.uint8)
        collectives.wait_p2p([collectives.send(pg, body, dst, SHARD_TAG)], abort, "shard transfers")


def _recv_bytes(pg: Any, src: int, abort: Any) -> Any:
    """The bytes `src` sent with _send_bytes, in a bytearray (received in place through a
    tensor on its memory: the writer hands them to its store as they are, with no copy).
    A peer already gone when a receive is posted is an Aborted (collectives.recv), as one
    gone during it."""
    n = torch.zeros(1, dtype=torch.int64)
    collectives.wait_p2p([collectives.recv(pg, n, src, SHARD_TAG)], abort, "shard transfers")
    buf = bytearray(int(n[0]))
    if buf:
        body = torch.frombuffer(buf, dtype=torch.uint8)
        collectives.wait_p2p([collectives.recv(pg, body, src, SHARD_TAG)], abort, "shard transfers")
    return buf


def save_sharded(step: int, state: dict, sg: Any, pg: Any, *, hosts: list[str], directory: Path | str,
                 store: CheckpointStore | None = None, writer: int = 0, meta: dict | None = None,
                 abort: threading.Event | None = None) -> None:
    """Checkpoint sharded optimizer state as one step directory on the writer's host.
    Every rank of `pg` calls it at the same step (collective; pg rank == layout rank).

    - every rank clones its primary chunk to CPU now (the state of this step);
    - a rank on the writer's host (`hosts[rank] == hosts[writer]`) writes its shard file
      itself beside `directory` (in parallel with the others), hashing it as it writes,
      and tells the writer its name, size and sha256;
    - a rank on another host serializes its shard and sends it to the writer point to
      point; the writer receives them one at a time, in rank order, writing each to disk
      before the next, so the writer's memory holds one shard at a time, never the state;
    - the writer (`store` given; its directory is `directory`) then hands everything to
      its store: the rest (state.pt with `state` whose "optimizer" keeps only the
      param_groups, the manifest, the atomic rename, retention, on_committed, the
      mirror) happens on the store's thread as for `save_async`.

    Ranks other than the writer return when their shard is on the writer's disk or in
    flight to it. On any failure the staged files are removed and no step directory
    appears; the exception propagates (a collective failure means the group is broken)."""
    rank, world = pg.rank(), pg.size()
    if world != sg.layout.world or len(hosts) != world:
        raise ValueError(f"save_sharded: group of {world}, layout of {sg.layout.world}, {len(hosts)} hosts")
    if not 0 <= writer < world:
        raise ValueError(f"writer rank {writer} is not in a group of {world}")
    directory = Path(directory)
    shard = zero.checkpoint_shard(sg)
    name = shard_filename(sg.rank, world)
    tag = f"shard{sg.rank:05d}"
    if rank != writer:
        if hosts[rank] == hosts[writer]:
            path, size, sha = write_staged(directory, step, tag, shard)
            msg = {"name": name, "path": str(path), "size": size, "sha256": sha}
            try:
                _send_bytes(pg, writer, json.dumps(msg).encode(), abort)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        else:
            buf = io.BytesIO()
            torch.save(shard, buf)
            del shard
            _send_bytes(pg, writer, json.dumps({"name": name}).encode(), abort)
            _send_bytes(pg, writer, buf.getbuffer(), abort)
        return
    if store is None:
        raise ValueError("save_sharded: the writer rank needs the CheckpointStore")
    if Path(store.directory) != directory:
        raise ValueError(f"save_sharded: the store writes {store.directory}, not {directory}")
    staged: list[tuple[str, Path, int, str]] = []
    try:
        staged.append((name, *store.stage(step, tag, shard)))
        del shard
        for r in range(world):
            if r == writer:
                continue
            msg = json.loads(bytes(_recv_bytes(pg, r, abort)).decode())
            if "path" in msg:  # written on this host by rank r
                path = Path(msg["path"])
                if path.parent != directory or not path.name.startswith(TMP_PREFIX):
                    raise CheckpointError(f"rank {r} staged its shard outside {directory}: {path}")
                staged.append((msg["name"], path, int(msg["size"]), str(msg["sha256"])))
            else:  # sent: to disk before the next one arrives
                data = _recv_bytes(pg, r, abort)
                staged.append((msg["name"], *store.stage(step, f"shard{r:05d}", data=data)))
                del data
        if sorted(n for n, *_ in staged) != [shard_filename(j, world) for j in range(world)]:
            raise CheckpointError(f"shard files of step {step} do not cover the layout: {[n for n, *_ in staged]}")
    except BaseException:
        store.unstage(p for _n, p, _s, _h in staged)
        raise
    whole = dict(state)
    whole["optimizer"] = {"state": {}, "param_groups": zero.checkpoint_param_groups(sg)}
    sharded = {**zero.checkpoint_layout(sg), "files": [shard_filename(j, world) for j in range(world)]}
    store.save_async_files(step, whole, sorted(staged), sharded, meta)


def restore_sharded(path: Path | str, sg: Any) -> dict:
    """Restore a rank's sharded optimizer state from a checkpoint directory, under the
    rank's own layout (any world size, shard setting, replicas). From a sharded checkpoint
    only the element ranges of the rank's held chunks are read from the memory-mapped shard
    files (no full state is built); from a plain one, its chunks of the full state. Not
    verified here (check_dir first, as latest_valid does). Returns state.pt's state (its
    "optimizer" as stored: the param_groups alone for a sharded checkpoint)."""
    path = Path(path)
    m = read_manifest(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if m.get("sharded") is None:
        sg.load_full_state_dict(state["optimizer"])
        return state
    load_optimizer_chunks(path, sg, state["optimizer"]["param_groups"], manifest=m)
    return state


def load_optimizer_chunks(path: Path | str, sg: Any, param_groups: Any, manifest: Mapping[str, Any] | None = None,
                          verify: bool = False) -> None:
    """A rank's held chunks (zero.ShardedGradients `sg`, under its own layout) straight
    from a sharded checkpoint's memory-mapped shard files: only the shard files its chunks
    take elements from are opened (zero.checkpoint_chunks_needed), and of those only the
    element ranges it needs are read; no full state is built. `param_groups`: the
    optimizer's hyperparameters (state.pt's "optimizer"). `verify`: each of those files is
    hashed against the manifest first (verify_shard_files); else they are not verified here."""
    path = Path(path)
    m = manifest if manifest is not None else read_manifest(path)
    sharded = m.get("sharded")
    if sharded is None:
        raise InvalidCheckpoint(f"{path}: not a sharded checkpoint")
    shards: dict[int, Any] = {}
    if sharded["step"]:
        need = zero.checkpoint_chunks_needed(sg, sharded)
        if verify:
            verify_shard_files(path, m, need)
        for j in need:
            fname = sharded["files"][j]
            sd = torch.load(path / fname, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, dict) or sd.get("chunk") != j:
                raise InvalidCheckpoint(f"{path}: {fname} is not the shard of chunk {j}")
            shards[j] = sd["state"]
    zero.load_checkpoint_chunks(sg, sharded, shards, param_groups)


def restore_chunks(ckpt: Mapping[str, Any], sg: Any, pg: Any, host: str, abort: Any = None,
                   checks: list | None = None) -> dict[str, Any]:
    """Every rank of `pg` (pg rank == `sg`'s layout rank) takes its chunks of the sharded
    checkpoint one rank restored from (`ckpt`: its "path", state.pt's "sha256" and the
    "host" it was read on; the job's restore sends it with the rest of the state). When
    every rank can read that checkpoint at that path (its host; another host on shared
    storage, or with the same checkpoint there), each reads only its own chunks out of the
    memory-mapped shard files (load_optimizer_chunks: no full state is built, nothing
    travels); a rank on another host first hashes the shard files it reads (the restoring
    rank verified those on its own host); with `checks` (a list) it hashes them on threads
    while it reads them instead, and appends that PendingCheck for the caller to confirm
    before the state is used. Else the lowest rank that has the files
    assembles the full state and broadcasts it, and every rank takes its chunks of it.
    A collective. Returns what it did, for the log."""
    t0 = time.perf_counter()
    path, rank = Path(ckpt["path"]), pg.rank()
    verify = not covered_by_restorer(ckpt, host)
    try:
        manifest = read_manifest(path)
        has = manifest["files"][STATE_FILE]["sha256"] == ckpt["sha256"]
        if has and verify and manifest["sharded"]["step"]:
            need = zero.checkpoint_chunks_needed(sg, manifest["sharded"])
            if checks is None:
                verify_shard_files(path, manifest, need)
            else:
                names = [manifest["sharded"]["files"][j] for j in need]
                check_sizes(path)
                checks.append(PendingCheck(path, manifest, names))
    except (InvalidCheckpoint, KeyError, TypeError, IndexError) as exc:
        if verify and path.exists():
            log.warning("checkpoint %s: this rank cannot take its chunks from it here (%s); they come from "
                        "a rank that can", path, exc)
        has = False
    flags = torch.zeros(pg.size(), dtype=torch.float64, device=sg.device)
    flags[rank] = 1.0 if has else 0.0
    collectives.allreduce(pg, flags, abort)
    holders = [r for r, f in enumerate(flags.tolist()) if f > 0]
    groups = copy.deepcopy(sg.optimizer.state_dict()["param_groups"])
    if len(holders) == pg.size():
        load_optimizer_chunks(path, sg, groups, manifest)  # verified above where it had to be, or being hashed
        return {"restored_chunks_from_files_s": round(time.perf_counter() - t0, 4), "verified_here": verify,
                "hashed_meanwhile": verify and checks is not None}
    if not holders:
        raise CheckpointError(f"no rank can read the sharded checkpoint {path} the job restored from")
    src = holders[0]
    packed = state_mod.pack({"state": load_state(path)["optimizer"]["state"]}) if rank == src else None
    # to every other rank (a broadcast): each takes its chunks of the full state
    got = transfer.send_packed(pg, packed, src, rank, [r for r in range(pg.size()) if r != src], abort,
                               device=sg.device)
    header, flat = packed if rank == src else got
    state = state_mod.unpack(header, flat)["state"]
    sg.load_full_state_dict({"state": state, "param_groups": groups})
    return {"restored_full_state_from_rank": src, "s": round(time.perf_counter() - t0, 4)}
