"""Reading what a place holds: a checkpoint's manifest with the runtime's rules, a
listing of a checkpoint directory, and `sha256sum` output."""

from __future__ import annotations

import json

from eltctl.mirror.values import Located, MirrorError, Place
from eltctl_runtime.checkpoint import format as ckpt


def manifest_files(text: str, dirname: str) -> tuple[int, float, tuple[tuple[str, int, str], ...]]:
    """(step, created, files) of a manifest's text, with the runtime's rules; raises MirrorError."""
    try:
        m = json.loads(text)
    except ValueError as exc:
        raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} is not valid JSON: {exc}") from None
    files = m.get("files") if isinstance(m, dict) else None
    if (not isinstance(m, dict) or m.get("format") != ckpt.FORMAT or m.get("version") != ckpt.FORMAT_VERSION
            or not isinstance(m.get("step"), int) or not isinstance(m.get("created"), (int, float))
            or not isinstance(files, dict) or ckpt.STATE_FILE not in files):
        raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} is not a version {ckpt.FORMAT_VERSION} "
                          f"{ckpt.FORMAT} manifest")
    out = []
    for name, e in sorted(files.items()):
        if (not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str)
                or "/" in name or name in ("", ".", "..", ckpt.MANIFEST_FILE)):
            raise MirrorError(f"{dirname}: {ckpt.MANIFEST_FILE} has a bad entry {name!r}")
        out.append((name, e["size"], e["sha256"]))
    named = ckpt.parse_step_dirname(dirname)
    if named is not None and named != m["step"]:
        raise MirrorError(f"{dirname}: directory is named for step {named} but the manifest says {m['step']}")
    return m["step"], float(m["created"]), tuple(out)


SECTION = "\n@@ELTCTL@@ "  # starts each directory's part of a listing


def parse_listing(text: str, place: Place) -> list[Located]:
    out = []
    for chunk in text.split(SECTION)[1:]:
        name, _, body = chunk.partition("\n")
        name = name.strip()
        if ckpt.parse_step_dirname(name) is None:
            continue
        path = f"{place.directory}/{name}"
        try:
            step, created, files = manifest_files(body, name)
        except MirrorError as exc:
            step = ckpt.parse_step_dirname(name) or 0
            out.append(Located(step, place.label, path, 0.0, 0, (), verified=False, problem=str(exc)))
            continue
        out.append(Located(step, place.label, path, created, sum(f[1] for f in files), files,
                           script_step=manifest_script_step(body)))
    return sorted(out, key=lambda c: -c.step)


def manifest_script_step(text: str) -> int | None:
    """Restart mode: the script's step a snapshot's manifest names (`meta.script_step`), else None."""
    try:
        meta = json.loads(text).get("meta")
    except (ValueError, AttributeError):
        return None
    step = meta.get("script_step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def parse_sums(text: str) -> dict[str, str]:
    """`sha256sum` output (`HEX  path`) as {path: hex}."""
    sums = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if sep and len(digest) == 64:
            sums[name.lstrip("*")] = digest
    return sums
