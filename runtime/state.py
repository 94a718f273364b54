"""The training state as data: capture it, pack it for one broadcast, apply it.

State moves between processes as a JSON skeleton plus one flat byte tensor
(never pickle): the skeleton keeps the nesting (including the int keys of an
optimizer state dict), the scalars, and for each tensor its dtype, shape and
byte range in the flat buffer.
"""

from __future__ import annotations

import ctypes
import json
import random
from typing import Any

import torch

_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)}


def encode(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """A JSON-able skeleton of nested dicts/lists/tuples/scalars/tensors, and the
    tensors in skeleton order."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {"__t__": len(tensors) - 1, "dtype": str(x.dtype), "shape": list(x.shape)}
        if isinstance(x, dict):
            return {"__d__": [[k, type(k).__name__, walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"__l__": [walk(v) for v in x], "tuple": isinstance(x, tuple)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot encode {type(x).__name__} in training state")

    return walk(obj), tensors


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


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, through torch alone.

    Hosts have Python and torch only: `Tensor.numpy()` raises there ("Numpy is not
    available"), and `bytes(t.untyped_storage())` walks the storage byte by byte
    (about 2 s per MB here). So the bytes are read from the tensor's own memory,
    which a contiguous CPU tensor keeps alive for the duration of the copy.
    """
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return bytes((ctypes.c_ubyte * n).from_address(t.data_ptr()))


def pack(obj: Any) -> tuple[bytes, torch.Tensor]:
    """(JSON header, flat uint8 CPU tensor) for a broadcast."""
    skeleton, tensors = encode(obj)
    parts, offset, layout = [], 0, []
    for t in tensors:
        b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        layout.append([offset, b.numel()])
        parts.append(b)
        offset += b.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
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


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict) -> dict:
    """Everything needed to resume exactly: model, optimizer, progress (step,
    epoch, position, generation) and RNG states."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "progress": dict(progress),
        "rng": rng_state(),
    }


def apply(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Adopt a captured state in place; returns its progress dict."""
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state["model"].items():
            own[k].copy_(v)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return dict(state["progress"])


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of parameters and optimizer state (tests compare it across ranks)."""
    import hashlib

    h = hashlib.sha256()
    header, flat = pack({"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]})
    h.update(tensor_bytes(flat))
    return h.hexdigest()
