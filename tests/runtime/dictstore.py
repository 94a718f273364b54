"""An in-memory stand-in for a c10d store, for the pure protocol tests (tests/runtime)."""

from __future__ import annotations


class DictStore:
    """The duck-typed store the runtime's helpers need: set/get/add/check/compare_set over a
    dict (c10d's compare_set semantics)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def add(self, key, amount):
        n = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(n).encode()
        return n

    def check(self, keys):
        return all(k in self.data for k in keys)

    def compare_set(self, key, expected, desired):
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        cur = self.data.get(key)
        if (cur is None and expected == b"") or cur == expected:
            self.data[key] = desired
            return desired
        return cur if cur is not None else expected
