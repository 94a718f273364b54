"""The training state as data: capture it, pack it for one broadcast, apply it.

State moves between processes as a JSON skeleton plus one flat byte tensor
(never pickle): the skeleton keeps the nesting (including the int keys of an
optimizer state dict), the scalars, and for each tensor its dtype, shape and
byte range in the flat buffer.

The state is the model's state dict (parameters and buffers), the optimizer's,
the progress (step, epoch, sampler position), the RNG states, and the state
dicts of the job's extra stateful objects (`extra_state`: a scheduler, the
GradScaler, an EMA), by name. What those hold must be what a scheduler's or a
GradScaler's state dict holds: dicts with str/int keys, lists, tuples, tensors,
None, bool, int, float (inf and NaN included) and str. Anything else (a
function, an arbitrary object) is refused with the key path that holds it.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Callable

import torch

from .zero import hostmem
from ..member.transfer import tensor_bytes  # one helper (member/transfer.py); state.tensor_bytes stays

_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)}

log = logging.getLogger("eltctl_runtime")


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype whose str() is `name` ("torch.float32")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise TypeError(f"dtype {name} is not supported in the training state or the gradient buffers; "
                        f"supported: {', '.join(sorted(_DTYPES))}") from None


def encode(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """A JSON-able skeleton of nested dicts/lists/tuples/scalars/tensors, and the
    tensors in skeleton order. Raises TypeError naming the key path of anything else."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            dtype_named(str(x.dtype))
            tensors.append(x)
            return {"__t__": len(tensors) - 1, "dtype": str(x.dtype), "shape": list(x.shape)}
        if isinstance(x, dict):
            out = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"{where} has the key {k!r} ({type(k).__name__}); the training state "
                                    "takes only str and int keys")
                out.append([k, type(k).__name__, walk(v, f"{where}[{k!r}]")])
            return {"__d__": out}
        if isinstance(x, (list, tuple)):
            return {"__l__": [walk(v, f"{where}[{i}]") for i, v in enumerate(x)], "tuple": isinstance(x, tuple)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"{where} is a {type(x).__name__}, which cannot travel in the training state "
                        "(to joiners and into checkpoints): a state_dict() may hold only dicts, lists, "
                        "tuples, tensors, None, bool, int, float and str")

    return walk(obj, "state"), tensors


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__t__" in x:
                return tensors[x["__t__"]]
            if "__d__" in x:
                return {(int(k) if kind == "int" else k): walk(v) for k, kind, v in x["__d__"]}
            if "__l__" in x:
                items = [walk(v) for v in x["__l__"]]
                return tuple(items) if x["tuple"] else items
        return x

    return walk(skeleton)


def pack(obj: Any, *, first: Any = None, then: Callable[[], None] | None = None) -> tuple[bytes, torch.Tensor]:
    """(JSON header, flat uint8 CPU tensor) for a broadcast. `first`: a part of `obj` whose
    tensors are copied before the others, and `then` is called once they are (a joiner's
    source with local steps: its next inner step changes only the inner optimizer's state,
    so it waits for that part, not the whole copy: catchup.py)."""
    skeleton, tensors = encode(obj)
    parts, offset, layout = [], 0, []
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)  # copied to the host below, once
        layout.append([offset, b.numel()])
        parts.append(b)
        offset += b.numel()
    # Huge pages where the kernel allows (hostmem.empty): in the ranks of the events benchmark
    # the source's 617 MB copy held its first optimizer step 0.5-0.9 s so, 1.0-1.5 s in 4 KiB
    # pages (a fresh process's first huge-page buffer can be slower: docs/network.md).
    flat = hostmem.empty(offset, torch.uint8)
    early = {id(t) for t in encode(first)[1]} if first is not None else set()
    for go_first in (True, False):
        for t, b, (at, n) in zip(tensors, parts, layout):
            if (id(t) in early) == go_first:
                flat[at:at + n].copy_(b)
        if go_first and then is not None:
            then()
    header = json.dumps({"skeleton": skeleton, "layout": layout}).encode()
    return header, flat


def unpack(header: bytes, flat: torch.Tensor) -> Any:
    meta = json.loads(header)
    tensors: list[torch.Tensor] = []
    specs: list[dict] = []

    def collect(x: Any) -> None:
        if isinstance(x, dict):
            if "__t__" in x:
                specs.append(x)
            for v in x.values():
                collect(v)
        elif isinstance(x, list):
            for v in x:
                collect(v)

    collect(meta["skeleton"])
    specs.sort(key=lambda s: s["__t__"])
    for spec, (off, n) in zip(specs, meta["layout"]):
        dtype = _DTYPES[spec["dtype"]]
        tensors.append(flat[off : off + n].clone().view(dtype).reshape(spec["shape"]))
    return decode(meta["skeleton"], tensors)


def rng_state() -> dict:
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "cuda": [s for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def extra_state_dicts(extra: dict[str, Any] | None) -> dict[str, Any]:
    """{name: obj.state_dict()} of the extra stateful objects."""
    return {name: obj.state_dict() for name, obj in (extra or {}).items()}


def check_encodable(extra: dict[str, Any] | None) -> None:
    """Raise TypeError, naming the key, if an extra object's state cannot travel."""
    encode({"extra_state": extra_state_dicts(extra)})


class OptimizerMismatch(ValueError):
    """A saved state's optimizer state is another optimizer class's."""


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """What a state records as its optimizer's class (`optimizer_class`): the class name."""
    return type(optimizer).__name__


def optimizer_mismatch(saved: str | None, ours: str, where: object = None) -> str | None:
    """Why a state captured with optimizer class `saved` cannot go into an optimizer of
    class `ours` (`where`: the checkpoint, for the message), or None when it can (a state
    from before the class was recorded included).

    Loaded anyway, another class's state fails at the first step (an SGD checkpoint in an
    Adam job: KeyError 'betas'; the reverse: KeyError 'momentum'), or, worse, trains on
    silently with the other class's hyperparameters (an AdamW checkpoint makes an Adam job
    AdamW: its param_groups carry decoupled_weight_decay=True)."""
    if saved is None or saved == ours:
        return None
    return (f"the checkpoint's optimizer state is {saved}'s, this job's optimizer is {ours}: build the job with "
            f"{saved}; or start without the checkpoint (move its step-* directories away, or give the job "
            f"another checkpoint directory); or export it (eltctl checkpoints export) and load only its model "
            f"into the new job before it starts" + (f". The checkpoint: {where}" if where is not None else ""))


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict,
            extra: dict[str, Any] | None = None) -> dict:
    """Everything needed to resume exactly: model (parameters and buffers),
    optimizer (and its class, optimizer_mismatch), progress (step, epoch,
    position, generation), RNG states and the extra objects' state dicts."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_class": optimizer_class(optimizer),
        "extra_state": extra_state_dicts(extra),
        "progress": dict(progress),
        "rng": rng_state(),
    }


def apply(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          extra: dict[str, Any] | None = None) -> dict:
    """Adopt a captured state in place; returns its progress dict.

    An extra object the state has no entry for (a checkpoint written before it
    was added) keeps its own state, with a warning; an entry no object takes
    is ignored, with a warning."""
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state["model"].items():
            own[k].copy_(v)
    optimizer.load_state_dict(state["optimizer"])
    saved = state.get("extra_state") or {}
    for name, obj in (extra or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
        else:
            log.warning("the saved state has no extra_state[%r]; that object keeps its own state", name)
    for name in sorted(set(saved) - set(extra or {})):
        log.warning("the saved state holds extra_state[%r], which this job does not have; it is ignored", name)
    set_rng_state(state["rng"])
    return dict(state["progress"])


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                extra: dict[str, Any] | None = None) -> str:
    """A hash of parameters, buffers, optimizer state and the extra objects'
    state (tests compare it across ranks)."""
    return fingerprint_of(model.state_dict(), optimizer.state_dict()["state"], extra)


def fingerprint_of(model_state: dict, optimizer_state: dict, extra: dict[str, Any] | None = None) -> str:
    """`fingerprint` from a model state dict and an optimizer's "state" (a sharded
    job hashes the state gathered from its shards)."""
    import hashlib

    h = hashlib.sha256()
    header, flat = pack({"model": model_state, "optimizer": optimizer_state})
    h.update(tensor_bytes(flat))
    if extra:
        header, flat = pack(extra_state_dicts(extra))
        h.update(header)
        h.update(tensor_bytes(flat))
    return h.hexdigest()
