"""The process groups' rendezvous store: every value gloo and NCCL exchange is signed.

A process group's rendezvous goes through the job's store: gloo's full mesh writes
each rank's listening address under `gen/<g>/pg/0/<rank>` and every rank reads every
other's; NCCL writes its ncclUniqueId the same way. Anyone who reaches the store can
rewrite a value there, and a rewritten address puts them between two ranks (a relay
that changes what the collectives carry, with no error). So a generation's group is
formed on a `PgStore`: a `torch.distributed.Store` (a Python subclass, which gloo's
and NCCL's C++ rendezvous call like any store) over the job's `auth.SignedStore`,
scoped to `gen/<g>/pg`:

- `set`, `multi_set`, `append`, `compare_set` sign the value (HMAC over the job's
  scope, the full key and the value: a value copied from another rank's key or an
  older generation does not verify);
- `get`, `multi_get` return only verified values: a forged one is counted (the
  `gen/pg` family of the Forgeries that `status --json` shows) and raises
  `auth.ForgedValue`, which names the key. The group's construction fails, the
  generation is aborted like any that breaks while forming (its members' roll call
  forms the next one, on a fresh prefix), and no rank ever connects to an address it
  did not get from a member;
- `add` (counters) and `wait`, `delete_key`, `num_keys` pass through: a counter
  cannot be signed, and neither backend's rendezvous trusts one for an address.

The C++ side holds the Python object only by a raw reference: whoever builds a group
on a PgStore keeps the store referenced for as long as the group lives (train/job.py and
restart/supervisor.py keep it beside the group and bury them together, collectives.bury), and
`clone()` keeps its clones. NCCL calls it for the group's whole life: its watchdog
polls `check(["exception_dump"])` (seen with torch 2.11 on an H200; a forged
`exception_dump` reads as absent, counted, so nobody can trigger a dump through it). A job without a secret (run without eltctl's controller)
has no signatures: `pg_store` gives a `PlainPgStore` then (the PrefixStore, its waits in
slices as below).
Every wait of a group's rendezvous goes in slices of at most half a second
(`storeclient.sliced_wait`, and the keeper's client slices its own): a construction
abandoned on an abort (its peers never write their addresses) waits on for gloo's 300 s,
and a client that holds its lock through one long wait would keep the roll call that
follows, on the same connection, from writing a word until then.

`append` is a read, a concatenation and a signed write: not atomic (neither backend's
rendezvous appends).

`wait` brings the keys' raw values with it where the store can (storeclient's
`wait_and_peek`: one round trip) and the `get` that follows (gloo waits for each peer's
key, then gets it) checks those bytes as it would check a fresh read; a key this store
writes or deletes meanwhile is read again.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .auth import ForgedValue, SignedStore
from ..protocol import Keys
from .client import sliced_wait

__all__ = ["ForgedValue", "PgStore", "pg_store"]


class PgStore(dist.Store):
    """A c10d Store for one generation's process group, signed (module docstring)."""

    def __init__(self, signed: SignedStore, prefix: str) -> None:
        super().__init__()
        self._signed = signed
        self._raw = signed.raw  # the job-scoped unsigned store under it (waits, counters)
        self._prefix = prefix
        self._timeout: timedelta | None = None
        self._clones: list[PgStore] = []  # the C++ side holds clones by raw reference
        # full key -> the raw bytes a `wait` fetched with it, for the `get` that follows
        self._fetched: dict[str, bytes] = {}
        self._fetched_lock = threading.Lock()

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    # -- signed values ---------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._forget(self._key(key))
        self._signed.set(self._key(key), value)

    def _forget(self, full: str) -> None:
        """A key this store writes or deletes: bytes a wait fetched for it are stale."""
        with self._fetched_lock:
            self._fetched.pop(full, None)

    def get(self, key: str) -> bytes:
        # SignedStore.get: a forged value is counted and raises ForgedValue (naming the key)
        # unless this process already verified the key's value (then that value). The bytes
        # a `wait` just fetched (gloo waits for each peer's key, then gets it) are checked
        # the same way, without a second request.
        full = self._key(key)
        with self._fetched_lock:
            raw = self._fetched.pop(full, None)
        if raw is not None:
            return self._signed.checked(full, raw)
        return self._signed.get(full)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def append(self, key: str, value: bytes | str) -> None:
        full = self._key(key)
        self._forget(full)
        old = self._signed.get(full) if self._raw.check([full]) else b""
        self._signed.set(full, old + (value.encode() if isinstance(value, str) else bytes(value)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        full = self._key(key)
        self._forget(full)
        if not expected:
            return self._signed.compare_set(full, "", desired)
        # A seal is deterministic (an HMAC): the sealed `expected` is what the store holds
        # when the verified value is `expected`, so the raw compare_set stays atomic.
        seal = self._signed.signer.seal
        current = self._raw.compare_set(full, seal(full, expected), seal(full, desired))
        value = self._signed.signer.open(full, current)
        if value is None:
            self._signed.forgeries.note(full)
            raise ForgedValue(full)
        return value

    def check(self, keys: list[str]) -> bool:
        return self._signed.check([self._key(k) for k in keys])

    # -- passed through --------------------------------------------------------
    def add(self, key: str, amount: int) -> int:
        return self._raw.add(self._key(key), amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        full = [self._key(k) for k in keys]
        timeout = timeout if timeout is not None else self._timeout
        fetch = getattr(self._raw, "wait_and_peek", None)
        if fetch is not None:
            # The values come with the wait (one round trip): the `get` that follows each
            # wait in the backends' rendezvous verifies them then (never trusted here).
            got = fetch(full, timeout)
            with self._fetched_lock:
                self._fetched.update((k, v) for k, v in zip(full, got) if v is not None)
        else:
            sliced_wait(self._raw, full, timeout)

    def delete_key(self, key: str) -> bool:
        self._forget(self._key(key))
        return self._raw.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._raw.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        # Only this wrapper's waits: the job's store (shared with the control plane) keeps its own.
        self._timeout = timeout

    def clone(self) -> "PgStore":
        twin = PgStore(self._signed, self._prefix)
        twin._timeout = self._timeout
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        return True


class PlainPgStore(dist.Store):
    """A job without a secret: the PrefixStore `gen/<g>/pg` over the job's store, whose
    waits (and gets, which wait for a missing key) go in slices (storeclient.sliced_wait):
    over c10d's TCPStore, whose client holds its lock through a wait, a group's
    construction abandoned on an abort would otherwise keep the roll call that follows
    from writing a word until gloo's 300 s ran out. Kept referenced as long as the group."""

    def __init__(self, job_store: Any, prefix: str) -> None:
        super().__init__()
        self._base = job_store
        self._prefix = prefix
        self._store = dist.PrefixStore(prefix, job_store)
        self._timeout: timedelta | None = None
        self._clones: list[PlainPgStore] = []

    def set(self, key: str, value) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        sliced_wait(self._store, [key], self._timeout)
        return self._store.get(key)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._store.multi_set(keys, values)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        sliced_wait(self._store, keys, self._timeout)
        return self._store.multi_get(keys)

    def append(self, key: str, value) -> None:
        self._store.append(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        sliced_wait(self._store, keys, timeout if timeout is not None else self._timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> "PlainPgStore":
        twin = PlainPgStore(self._base, self._prefix)
        twin._timeout = self._timeout
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        return True


def pg_store(job_store: Any, generation: int) -> Any:
    """The store generation `generation`'s process group forms on: a PgStore when
    `job_store` (the job-scoped store of membership.job_store) is signed, else a
    PlainPgStore (the PrefixStore `gen/<g>/pg` over it, its waits in slices). Keep it referenced while the group lives."""
    prefix = Keys.pg_prefix(generation)
    if isinstance(job_store, SignedStore):
        return PgStore(job_store, prefix)
    return PlainPgStore(job_store, prefix)
