"""A strict reader of the Prometheus text exposition format (0.0.4), for the tests.

It checks what `promtool check metrics` and the Prometheus parser insist on, and the
conventions eltctl promises: metric and label names match their grammar; every
family has one HELP and one TYPE line before its samples, and its samples are
contiguous (a family never appears twice); a TYPE is counter, gauge, summary,
histogram or untyped; a counter's name ends in `_total`; label values are quoted
with only \\\\, \\" and \\n escapes; values are floats (NaN, +Inf, -Inf); no
duplicate series; the text ends with a newline. `parse` returns {family: {"type",
"help", "samples": [(name, {label: value}, float)]}} or raises ValueError naming the
line.
"""

from __future__ import annotations

import math
import re

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = ("counter", "gauge", "summary", "histogram", "untyped")


def _value(text: str, where: str) -> float:
    if text in ("NaN", "+Inf", "-Inf", "Inf"):
        return float(text.replace("Inf", "inf"))
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ValueError(f"{where}: {text!r} is not a float")
    return float(text)


def _labels(text: str, where: str) -> tuple[dict[str, str], str]:
    """Parse `{a="x",b="y"}` at the start of text; returns (labels, rest)."""
    assert text.startswith("{")
    labels: dict[str, str] = {}
    i = 1
    while True:
        if text[i] == "}":
            return labels, text[i + 1:]
        m = LABEL_NAME.match(text, i)
        if not m:
            raise ValueError(f"{where}: bad label name at {text[i:]!r}")
        name = m.group(0)
        if name.startswith("__"):
            raise ValueError(f"{where}: label {name} is reserved")
        i = m.end()
        if text[i:i + 2] != '="':
            raise ValueError(f"{where}: label {name} without =\"")
        i += 2
        value = []
        while True:
            c = text[i]
            if c == "\\":
                nxt = text[i + 1]
                if nxt not in '\\"n':
                    raise ValueError(f"{where}: bad escape \\{nxt} in label {name}")
                value.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            elif c == "\n":
                raise ValueError(f"{where}: newline in label {name}")
            else:
                value.append(c)
                i += 1
        if name in labels:
            raise ValueError(f"{where}: label {name} twice")
        labels[name] = "".join(value)
        if text[i] == ",":
            i += 1
        elif text[i] != "}":
            raise ValueError(f"{where}: expected , or }} after label {name}")


def parse(text: str) -> dict[str, dict]:
    if text and not text.endswith("\n"):
        raise ValueError("the text does not end with a newline")
    families: dict[str, dict] = {}
    current: str | None = None
    series: set[tuple] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        where = f"line {n}"
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                if not METRIC_NAME.fullmatch(name):
                    raise ValueError(f"{where}: bad metric name {name!r}")
                fam = families.get(name)
                if fam is not None and current != name:
                    raise ValueError(f"{where}: family {name} appears twice")
                fam = families.setdefault(name, {"type": None, "help": None, "samples": []})
                if fam["samples"]:
                    raise ValueError(f"{where}: {parts[1]} of {name} after its samples")
                key = parts[1].lower()
                if fam[key] is not None:
                    raise ValueError(f"{where}: two {parts[1]} lines for {name}")
                value = parts[3] if len(parts) > 3 else ""
                if key == "type":
                    if value not in TYPES:
                        raise ValueError(f"{where}: unknown type {value!r}")
                    if value == "counter" and not name.endswith("_total"):
                        raise ValueError(f"{where}: counter {name} does not end in _total")
                elif re.search(r"\\[^\\n]", value):
                    raise ValueError(f"{where}: bad escape in HELP")
                fam[key] = value
                current = name
            continue  # a comment
        m = METRIC_NAME.match(line)
        if not m:
            raise ValueError(f"{where}: bad sample line {line!r}")
        name, rest = m.group(0), line[m.end():]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            labels, rest = _labels(rest, where)
        if not rest.startswith(" "):
            raise ValueError(f"{where}: no space before the value")
        fields = rest.split()
        if len(fields) not in (1, 2):
            raise ValueError(f"{where}: expected a value and an optional timestamp")
        value = _value(fields[0], where)
        family = name
        if family not in families:
            for suffix in ("_sum", "_count", "_bucket"):
                if name.endswith(suffix) and name[: -len(suffix)] in families:
                    family = name[: -len(suffix)]
        if family not in families:
            raise ValueError(f"{where}: sample {name} without HELP and TYPE")
        if family != current:
            raise ValueError(f"{where}: sample of {family} away from its family")
        fam = families[family]
        if fam["type"] is None or fam["help"] is None:
            raise ValueError(f"{where}: {family} lacks a HELP or a TYPE line")
        key = (name, tuple(sorted(labels.items())))
        if key in series:
            raise ValueError(f"{where}: duplicate series {key}")
        series.add(key)
        if fam["type"] == "counter" and (value < 0 or math.isnan(value)):
            raise ValueError(f"{where}: counter {name} is {value}")
        fam["samples"].append((name, labels, value))
    return families


def value(families: dict[str, dict], name: str, **labels: str) -> float | None:
    """The value of the one sample of `name` whose labels include `labels` (None: none)."""
    found = [v for n, ls, v in families.get(name, {}).get("samples", [])
             if n == name and all(ls.get(k) == str(x) for k, x in labels.items())]
    if len(found) > 1:
        raise AssertionError(f"{len(found)} samples of {name} match {labels}")
    return found[0] if found else None
