"""Reading checkpoints: a checkpoint's state (a sharded one's optimizer state rebuilt
from its shard files with torch alone), the choice of the checkpoint a restore takes,
another rank's restore taken up here, and the trained state taken out of eltctl
(`load_checkpoint`, `export_checkpoint`: the control side calls these).

`load_checkpoint(path)` returns a checkpoint's state as plain data (`model`,
`optimizer`, `extra_state`, `step`, `epoch`) and `export_checkpoint(path, out)`
writes that into one file that `torch.load(out, weights_only=True)` opens
without eltctl: how the trained model leaves eltctl.

Readers (load_checkpoint, export_checkpoint, CheckpointStore.load) get a sharded
checkpoint's optimizer state as one plain full state dict (`assemble_optimizer`),
whatever the world size or shard setting of the run that restores it. Standard
library only at import; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..files import fsync_dir
from .format import (MANIFEST_FILE, STATE_FILE, TMP_PREFIX, CheckpointInfo, InvalidCheckpoint, PendingCheck,
                     check_dir, check_hashes, check_sizes, parse_step_dirname, read_manifest)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Which checkpoint a restore takes (CheckpointStore.latest_for_restore, latest_valid)


def newest_for_restore(infos: list[CheckpointInfo], directory: Path, assemble: bool,
                       mmap: bool) -> tuple[CheckpointInfo, dict, PendingCheck | None] | None:
    """CheckpointStore.latest_for_restore over its committed checkpoints `infos` (newest first)."""
    if len(infos) >= 2:
        newest = infos[0]
        try:
            m = check_sizes(newest.path)
        except InvalidCheckpoint as exc:
            log.warning("Skipping checkpoint of step %d: %s", newest.step, exc)
        else:
            check = PendingCheck(newest.path, m)
            try:
                state = load_state(newest.path, assemble=assemble, mmap=mmap)
            except Exception as exc:  # noqa: BLE001 - unreadable: the older ones, checked first
                log.warning("Skipping checkpoint of step %d: %s does not load: %s", newest.step,
                            newest.state_file, exc)
                try:
                    check.confirm()  # its reads end before the fall-back reads the others
                except InvalidCheckpoint:
                    pass
            else:
                log.info("Restoring from the checkpoint of step %d in %s (its files are hashed meanwhile).",
                         newest.step, newest.path)
                return newest, state, check
        infos = infos[1:]
    found = first_valid(infos, directory, assemble, mmap)
    return (*found, None) if found is not None else None


def first_valid(infos: list[CheckpointInfo], directory: Path, assemble: bool,
                mmap: bool) -> tuple[CheckpointInfo, dict] | None:
    """The first of `infos` that verifies and loads, with its state (CheckpointStore.latest_valid)."""
    for info in infos:
        try:
            check_dir(info.path)
        except InvalidCheckpoint as exc:
            log.warning("Skipping checkpoint of step %d: %s", info.step, exc)
            continue
        try:
            state = load_state(info.path, assemble=assemble, mmap=mmap)
        except Exception as exc:  # any unreadable payload: fall back to an older checkpoint
            log.warning("Skipping checkpoint of step %d: %s does not load: %s", info.step, info.state_file, exc)
            continue
        log.info("Restoring from the checkpoint of step %d in %s.", info.step, info.path)
        return info, state
    log.info("No valid checkpoint in %s.", directory)
    return None


# ---------------------------------------------------------------------------
# A checkpoint's state


def load_state(path: Path | str, assemble: bool = True, mmap: bool = False) -> dict:
    """A checkpoint directory's state.pt (weights_only, to CPU), not verified; for a sharded
    checkpoint with "optimizer" replaced by the full state dict rebuilt from its shards
    (with `assemble`; else as stored: the param_groups alone, and a rank takes its chunks
    with train/zero/checkpoint.py's load_optimizer_chunks). `mmap`: the tensors map
    state.pt rather than being read in (a restore that copies them into the model at once)."""
    import torch

    path = Path(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=mmap)
    m = read_manifest(path)
    if m.get("sharded") is not None and assemble:
        try:
            groups = state["optimizer"]["param_groups"]
        except (KeyError, TypeError) as exc:
            raise InvalidCheckpoint(f"{path}: sharded checkpoint whose {STATE_FILE} has no optimizer "
                                    "param_groups") from exc
        state["optimizer"] = assemble_optimizer(path, m["sharded"], groups)
    return state


def assemble_optimizer(path: Path | str, sharded: Mapping[str, Any], param_groups: Any) -> dict[str, Any]:
    """The full optimizer state dict (the format of the script's optimizer's
    `state_dict()`, as zero.ShardedGradients.full_state_dict gives it) rebuilt from a
    sharded checkpoint's files with torch alone: the manifest's layout says where each
    chunk's elements belong. The shard files are memory-mapped."""
    import torch

    from ..train.zero.optim import step_tensor

    path = Path(path)
    lay = sharded["layout"]
    world = len(lay["members"])
    buckets = lay["buckets"]  # [group, start, numel, chunk, pstart, params]
    slots = lay["slots"]  # [group, offset, numel] per parameter
    step = int(sharded["step"])
    state: dict[int, dict[str, Any]] = {}
    if step:
        shards = []
        for j, fname in enumerate(sharded["files"]):
            sd = torch.load(path / fname, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, dict) or sd.get("chunk") != j:
                raise InvalidCheckpoint(f"{path}: {fname} is not the shard of chunk {j}")
            shards.append(sd["state"])
        bucket_of = {i: b for b, bk in enumerate(buckets) for i in bk[5]}
        offsets, seen = [], {}
        for bk in buckets:
            offsets.append(seen.get(bk[0], 0))
            seen[bk[0]] = offsets[-1] + bk[3]
        for g in range(len(lay["groups"])):
            padded = sum(bk[3] * world for bk in buckets if bk[0] == g)
            for name in sharded["names"][g]:
                full = torch.zeros(padded, dtype=shards[0][g][name].dtype)
                for b, (bg, _start, _numel, chunk, pstart, _members) in enumerate(buckets):
                    if bg != g:
                        continue
                    for j in range(world):
                        full[pstart + j * chunk:pstart + (j + 1) * chunk].copy_(
                            shards[j][g][name][offsets[b]:offsets[b] + chunk])
                for i, (pg_of, off, numel) in enumerate(slots):
                    if pg_of != g:
                        continue
                    bk = buckets[bucket_of[i]]
                    at = bk[4] + off - bk[1]
                    opt_index, shape = sharded["params"][i]
                    entry = state.setdefault(int(opt_index), {})
                    # "adamw": what counts_steps was called when AdamW was the only optimizer that did
                    if sharded.get("counts_steps", sharded.get("adamw")) and "step" not in entry:
                        entry["step"] = step_tensor(step)
                    entry[name] = full[at:at + numel].view(shape).clone()
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def is_sharded(path: Path | str) -> bool:
    """True if a checkpoint directory holds sharded optimizer state (its manifest says so)."""
    return read_manifest(Path(path)).get("sharded") is not None


# ---------------------------------------------------------------------------
# Taking the trained state out (the control side calls these: torch is imported inside)


EXPORT_KEYS = ("model", "optimizer", "extra_state", "step", "epoch")


def _newest_first(directory: Path) -> list[Path]:
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        raise InvalidCheckpoint(f"{directory}: cannot list the checkpoints directory: {exc}") from exc
    steps = [(s, p) for p in entries if (s := parse_step_dirname(p.name)) is not None and p.is_dir()]
    return [p for _s, p in sorted(steps, reverse=True)]


def _exported(state: Mapping[str, Any], where: Path) -> dict[str, Any]:
    try:
        progress = state["progress"]
        return {"model": state["model"], "optimizer": state["optimizer"],
                "extra_state": dict(state.get("extra_state") or {}),
                "step": int(progress["step"]), "epoch": int(progress["epoch"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidCheckpoint(f"{where}: {STATE_FILE} is not an ElasticJob state (no {exc})") from exc


def _load_verified(path: Path) -> dict[str, Any]:
    check_dir(path)
    try:
        state = load_state(path)
    except InvalidCheckpoint:
        raise
    except Exception as exc:  # any unreadable payload is an invalid checkpoint
        raise InvalidCheckpoint(f"{path}: {STATE_FILE} does not load: {exc}") from exc
    return _exported(state, path)


def load_checkpoint(path: Path | str, step: int | None = None) -> dict[str, Any]:
    """The training state of a checkpoint as plain data, on CPU:
    `{"model", "optimizer", "extra_state", "step", "epoch"}` (state dicts; extra
    state by name, e.g. "scheduler", "grad_scaler").

    `path` is a checkpoint directory (`step-NNNNNNNN`) or a checkpoints
    directory; there, the newest checkpoint that verifies and loads is taken
    (a damaged newer one is skipped, with a warning), or the one of `step`.
    Nothing is written or removed. Raises InvalidCheckpoint saying what is
    wrong."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists():
        state = _load_verified(path)
        if step is not None and state["step"] != step:
            raise InvalidCheckpoint(f"{path} holds step {state['step']}, not {step}; name the checkpoints "
                                    "directory to choose among its steps")
        return state
    candidates = _newest_first(path)
    if step is not None:
        chosen = [p for p in candidates if parse_step_dirname(p.name) == step]
        if not chosen:
            have = ", ".join(str(parse_step_dirname(p.name)) for p in candidates) or "none"
            raise InvalidCheckpoint(f"{path}: no checkpoint of step {step} (steps there: {have})")
        return _load_verified(chosen[0])
    problems = []
    for p in candidates:
        try:
            return _load_verified(p)
        except InvalidCheckpoint as exc:
            log.warning("Skipping checkpoint: %s", exc)
            problems.append(str(exc))
    if not candidates:
        raise InvalidCheckpoint(f"{path}: no checkpoint here (neither a {MANIFEST_FILE} nor step-NNNNNNNN "
                                "directories); name a job's checkpoint directory or one step-NNNNNNNN in it")
    raise InvalidCheckpoint(f"{path}: no checkpoint verifies and loads: " + "; ".join(problems))


def export_checkpoint(path: Path | str, out: Path | str, step: int | None = None) -> dict[str, Any]:
    """Write the state load_checkpoint(path, step) returns to `out` with
    torch.save, atomically (a reader sees no file or the whole one).
    `torch.load(out, weights_only=True)` opens it without eltctl installed:
    it holds only tensors, dicts, lists and plain values. Returns
    `{"step", "epoch", "out", "size"}`."""
    import torch

    state = load_checkpoint(path, step)
    out = Path(out)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent if str(out.parent) else ".")
    return {"step": state["step"], "epoch": state["epoch"], "out": str(out), "size": out.stat().st_size}


# ---------------------------------------------------------------------------
# Another rank's restore, taken up on this one (the job's restore)


def _machine_id() -> str | None:
    """This machine's kernel for this boot (Linux's boot_id), or None where it cannot tell."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def restore_identity(path: Path | str) -> dict[str, Any]:
    """What a restoring rank says of the checkpoint directory it restores (with its "path",
    "sha256" and "host"), so that another rank can tell it reads the very same files:
    this machine's boot id and the directory's device and inode (covered_by_restorer)."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    machine = _machine_id()
    return {"machine": machine, "dir": [st.st_dev, st.st_ino]} if machine else {}


def covered_by_restorer(desc: Mapping[str, Any], host: str) -> bool:
    """Whether the restoring rank's hashes (all of the checkpoint's files, confirmed on every
    rank before the first step) cover what this rank reads of the checkpoint `desc`: it is
    on the same host, or it reads the very same directory on the same machine (the same
    kernel, device and inode: the same files, whatever the hosts are called, as for the
    simulated hosts of a test bed or a benchmark on one machine). Elsewhere (another
    machine, a copy at the same path, shared storage) a rank hashes what it reads."""
    if host == desc.get("host"):
        return True
    machine = desc.get("machine")
    if not machine or machine != _machine_id():
        return False
    try:
        st = os.stat(desc["path"])
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == list(desc.get("dir") or ())


def load_restored(path: Path | str, sha256: str, *, assemble: bool, mmap: bool, verify: bool,
                  defer: bool) -> tuple[dict, PendingCheck | None] | None:
    """Another rank's restore, taken up on this one: the state of the checkpoint at `path`
    whose state.pt has `sha256` (load_state's `assemble`, `mmap`), or None when that
    checkpoint is not there (no such directory, or another checkpoint at that path). With
    `verify` (the restoring rank's hashes do not cover its reads: covered_by_restorer) the files it reads (state.pt; with `assemble` the shard files too: without,
    restore_chunks reads and hashes those) are hashed: with `defer` on threads while it
    loads, the PendingCheck returned for the caller to confirm before it uses the state,
    else first. Raises InvalidCheckpoint when the checkpoint is there but damaged or
    unreadable."""
    path = Path(path)
    try:
        m = read_manifest(path)
        if m["files"][STATE_FILE]["sha256"] != sha256:
            return None
    except InvalidCheckpoint:
        if not (path / MANIFEST_FILE).exists():
            return None
        raise
    m = check_sizes(path)
    names = list(m["files"]) if assemble else [STATE_FILE]
    check = None
    if verify:
        if defer:
            check = PendingCheck(path, m, names)
        else:
            check_hashes(path, m, names)
    try:
        state = load_state(path, assemble=assemble, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload
        if check is not None:
            try:
                check.confirm()  # its reads end here
            except InvalidCheckpoint:
                pass
        raise InvalidCheckpoint(f"{path}: {STATE_FILE} does not load here: {exc}") from exc
    return state, check
