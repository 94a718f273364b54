"""The job's secret and its signed store values (stdlib only).

Anyone who reaches the store's port can read and write any key: the c10d TCPStore
has no authentication. So every value of the job's control plane is signed with a
per-job secret (`SECRET_BYTES` random bytes, made by the controller at `up`, carried
to the hosts only over SSH into 0600 files, named to workers by `ENV_SECRET_FILE`),
and every value read is checked before it is parsed or acted on:

    elt1.<64 hex digits of HMAC-SHA256(secret, scope NUL run NUL key NUL value)>.<value>

`scope` is the job's key prefix and `key` the key relative to it, so a value signed
for one key (one host's desired document, one generation's plan, one join number) is
refused under any other. The MAC is compared with `hmac.compare_digest`.

`run` is the store's run id: a fresh random id made at every store keeper start
(`new_run_id`), written 0600 to the file `run` (RUN_FILE_NAME) in the controller's
state directory and, before the host can reach the new store, beside `secret` in
each host's job directory; workers find it through ELTCTL_RUN_FILE. The secret is the
job's for all its `up`s, the run id is one store's: a value signed in an earlier run
(a plan, `done`, a desired document, a crash event of run 1) read in run 2 fails its
check like a forgery (counted, never acted on). Every signer reads the run file when
it connects, and again when it reconnects after a store loss, so a new keeper's run
id is picked up. No run file (a setup older than run ids, tests): run id "".

`SignedStore` wraps a job-scoped store (a c10d PrefixStore, or protocol.JobScope):
`set` signs; `check` is true only for keys whose values verify; `get` returns the
verified value, and when the value there is forged, the last verified value of that
key (or raises `ForgedValue` if there never was one); `compare_set` (used with an
empty `expected`: the first writer wins) replaces a forged value rather than adopt it.
Every forged value read is counted (`Forgeries`) and logged once per key family,
never acted on; so are other anomalies (`Forgeries.note(key, what)`: "replayed",
"deleted"). `peek` reads a value in one store call that never waits. Counters (`add`:
join/seq, dead/seq, events/seq) cannot be signed, so no reader depends on one: the
join queue and the event log are runs of signed entries (protocol.claim, scan).
The rendezvous of gloo and NCCL (gen/<g>/pg) is signed through pgstore.PgStore, a
c10d Store over this one.

Replays: across runs of the store, the run id refuses them. Within a run each reader
keeps its values moving forward: a plan or a join or event entry is written once
(compare_set), a desired document is applied only above the last seq applied, a
heartbeat is news only when its beat number goes up, a daemon's state only when its
time does. What a signature does not stop: deleting keys for good or overwriting them
with garbage (a denial of service, counted; a key deleted right after each write is
watched for its writer's next write, protocol.watch_deleted), and reading values.
The store's reachability is the other half (docs/commands.md, Security).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("eltctl_runtime")

SECRET_BYTES = 32
ENV_SECRET_FILE = "ELTCTL_SECRET_FILE"
SECRET_FILE_NAME = "secret"  # in the job's directory on each host, and in the controller's state dir
# The keeper's run id (a fresh one at every keeper start): written to the controller's
# state dir and, before the store is reachable there, to each host's job directory
# (eltctl/storekeeper.py, eltctl/storeforward.py); mode 0600.
ENV_RUN_FILE = "ELTCTL_RUN_FILE"
RUN_FILE_NAME = "run"  # the store's run id: in the job's directory on each host, and in the controller's state dir
RUN_ID_BYTES = 16

_MAGIC = b"elt1."
_MAC_HEX = 64
_HEAD = len(_MAGIC) + _MAC_HEX + 1  # magic, MAC, "."


class SecretError(Exception):
    """The secret file is missing, malformed, or readable by others."""


class ForgedValue(ValueError):
    """A store value failed its signature check and no verified value of that key is known."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the store value of {key!r} is not signed with the job's secret (ignored)")
        self.key = key


# ---------------------------------------------------------------------------- the secret


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def encode_secret(secret: bytes) -> str:
    """The secret as the text written to a secret file (hex, one line)."""
    return secret.hex() + "\n"


def decode_secret(text: str, where: str = "the secret") -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"{where} is not {2 * SECRET_BYTES} hex digits") from None
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"{where} holds {len(secret)} bytes, not {SECRET_BYTES}")
    return secret


def write_secret(path: Path, secret: bytes) -> None:
    """Write `secret` to `path` with mode 0600 from the start (atomically: a reader
    never sees a half-written or world-readable file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, encode_secret(secret).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_secret(path: Path) -> bytes:
    """The secret in `path`. Refuses a file that is not a regular file owned by this
    user, or that others can read or write: it would let them sign."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SecretError(f"the job's secret file {path} does not exist") from None
    except OSError as exc:
        raise SecretError(f"cannot read the job's secret file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"the job's secret file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise SecretError(f"the job's secret file {path} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise SecretError(f"the job's secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others "
                              f"can read it; it must be 0600 (chmod 600 {path})")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return decode_secret(data.decode("ascii", "replace"), f"the job's secret file {path}")


def secret_from_env(environ: Any = None) -> bytes | None:
    """The secret named by ELTCTL_SECRET_FILE, or None when it is not set (a job
    started without eltctl's controller: unsigned). A set but unreadable file raises."""
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_SECRET_FILE, "")
    return read_secret(Path(path)) if path else None


# ---------------------------------------------------------------------------- the run id


def new_run_id() -> str:
    """A fresh run id (hex): one per store keeper start."""
    return secrets.token_hex(RUN_ID_BYTES)


def write_run_file(path: Path, run: str) -> None:
    """Write the run id `run` to `path`, 0600 from the start, atomically."""
    if not _valid_run(run):
        raise SecretError(f"a run id is hex digits, not {run!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (run + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _valid_run(run: str) -> bool:
    return len(run) <= 128 and all(c in "0123456789abcdef" for c in run)


def read_run_id(path: Path | str | None) -> str:
    """The run id in `path`; "" when `path` is None or the file does not exist (a setup
    without run ids). A file that exists but is not this user's 0600 file of hex digits
    raises SecretError: who can write it can make the job refuse its own values."""
    if path is None or str(path) == "":
        return ""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise SecretError(f"cannot read the store's run file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise SecretError(f"the store's run file {path} must be a regular file of this user that only it "
                              "can write (0600)")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    run = data.decode("ascii", "replace").strip()
    if not _valid_run(run):
        raise SecretError(f"the store's run file {path} does not hold a run id (hex digits)")
    return run


def run_from_env(environ: Any = None) -> str:
    """The run id in the file ELTCTL_RUN_FILE names ("" when unset or absent). Read at
    every (re)connect: a restarted store keeper has a new one."""
    environ = os.environ if environ is None else environ
    return read_run_id(environ.get(ENV_RUN_FILE, "") or None)


# ---------------------------------------------------------------------------- signing


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Signer:
    """Signs and checks the values of one job's keys in one store (`scope`: the job's key
    prefix; `run`: the store's run id, "" when there is none)."""

    def __init__(self, secret: bytes, scope: str, run: str = "") -> None:
        if len(secret) != SECRET_BYTES:
            raise SecretError(f"a job secret is {SECRET_BYTES} bytes, not {len(secret)}")
        self._secret = secret
        self._scope = scope.encode()
        self.run = run
        self._run = run.encode()

    def _mac(self, key: str, value: bytes) -> bytes:
        msg = b"\0".join((self._scope, self._run, key.encode(), value))
        return hmac.digest(self._secret, msg, "sha256").hex().encode()  # one-shot: OpenSSL's HMAC

    def seal(self, key: str, value: str | bytes) -> bytes:
        v = _bytes(value)
        return _MAGIC + self._mac(key, v) + b"." + v

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The value `raw` carries under `key`, or None when it is not validly signed."""
        if raw is None or len(raw) < _HEAD or not raw.startswith(_MAGIC) or raw[_HEAD - 1:_HEAD] != b".":
            return None
        mac, value = raw[len(_MAGIC):_HEAD - 1], raw[_HEAD:]
        return value if hmac.compare_digest(mac, self._mac(key, value)) else None


def family(key: str) -> str:
    """The family of a key for counting (`gen/12/plan` -> `gen/plan`, `leave/h1/0/7` -> `leave`)."""
    parts = key.split("/")
    if parts[0] in ("gen", "daemon") and len(parts) >= 3:
        # (joined, not spelled: protocol.py alone spells store keys; tests/runtime/test_protocol.py)
        return "/".join((parts[0], parts[2] if parts[0] == "gen" else parts[-1]))
    return parts[0]


class Forgeries:
    """Forged values read, per key family (thread-safe). Each family is logged once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def note(self, key: str, what: str = "forged") -> None:
        """Count one bad value of `key`: "forged" (its signature does not verify in this
        run), or another anomaly counted beside the forgeries under "<family> <what>":
        "replayed" (a validly signed value older than one already acted on), "deleted"
        (a key whose writer keeps writing read as missing)."""
        fam = family(key) if what == "forged" else f"{family(key)} {what}"
        with self._lock:
            first = fam not in self._counts
            self._counts[fam] = self._counts.get(fam, 0) + 1
        if not first:
            return
        if what == "forged":
            log.warning("ignored a store value of %s that is not signed with the job's secret in this store's run "
                        "(someone who reaches the store's port wrote it, or replayed it from an earlier run; "
                        "forged values are counted, never acted on)", key)
        else:
            log.warning("store value of %s: %s (someone who reaches the store's port may be at work; counted, "
                        "never acted on)", key, what)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


COMPARE_SET_TRIES = 8
ABSENT = "-eltctl-absent-"  # peek's expected value: never a stored value (no "elt1." head, not JSON)


class SignedStore:
    """A job-scoped store whose values are signed (the module docstring says how).
    `raw` is the wrapped store (for process groups and the counters)."""

    def __init__(self, inner: Any, signer: Signer, forgeries: Forgeries | None = None) -> None:
        self.raw = inner
        self.signer = signer
        self.forgeries = forgeries if forgeries is not None else Forgeries()
        self._good: dict[str, bytes] = {}
        # key -> the raw bytes its last verified value was read as: the same bytes read
        # again verify alike (the MAC is a function of them), so they are not checked twice
        self._good_raw: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _verified(self, key: str, raw: bytes) -> bytes | None:
        with self._lock:
            if self._good_raw.get(key) == raw:
                return self._good[key]
        value = self.signer.open(key, raw)
        if value is None:
            self.forgeries.note(key)
            return None
        with self._lock:
            self._good[key] = value
            self._good_raw[key] = raw
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.signer.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.checked(key, self.raw.get(key))

    def checked(self, key: str, raw: bytes) -> bytes:
        """What `get` returns for `raw`, the bytes just read under `key`: its verified value,
        else (forged: counted) the key's last verified value, else ForgedValue."""
        value = self._verified(key, raw)
        if value is not None:
            return value
        with self._lock:
            good = self._good.get(key)
        if good is None:
            raise ForgedValue(key)
        return good

    def peek(self, key: str) -> bytes | None:
        """The key's verified value, or None when it is missing or forged (counted), in
        one store call that never waits: c10d's compare_set with an expected value no
        one writes answers the value there, or that expected value when there is none.
        (`check` then `get` waits for the store's timeout when the key is deleted in
        between, as someone who reaches the store can do.)"""
        cur = self.raw.compare_set(key, ABSENT, ABSENT)
        if cur == ABSENT.encode():
            return None
        return self._verified(key, cur)

    def peek_many(self, keys: list[str]) -> list[bytes | None]:
        """`peek` of several keys (verified values; None: missing or forged, counted), in
        one request that never waits when the store has one (SocketStore's PEEK through
        storeclient.KeptPrefixStore), else one `peek` each."""
        fn = getattr(self.raw, "peek_many", None)
        if fn is None:
            return [self.peek(k) for k in keys]
        return [None if raw is None else self._verified(k, raw) for k, raw in zip(keys, fn(keys))]

    def set_and_peek(self, sets: list[tuple[str, str | bytes]], keys: list[str]) -> list[bytes | None]:
        """`set` each of `sets` (signed), then `peek_many(keys)`: one round trip on a
        SocketStore (the control thread's poll)."""
        sealed = [(k, self.signer.seal(k, v)) for k, v in sets]
        fn = getattr(self.raw, "set_and_peek", None)
        if fn is None:
            for k, v in sealed:
                self.raw.set(k, v)
            return self.peek_many(keys)
        return [None if raw is None else self._verified(k, raw) for k, raw in zip(keys, fn(sealed, keys))]

    def check(self, keys: list[str]) -> bool:
        """Every key holds a verified value. Read with `peek` (one call each, never
        waiting): a key deleted between a check and a get would make c10d's get wait
        for the store's timeout."""
        return all(self.peek(k) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """The first writer wins, as c10d's compare_set with an empty `expected`; a
        forged value in the way is replaced (only while it is still the one read)."""
        if expected != "":
            raise ValueError("SignedStore.compare_set takes an empty `expected` only")
        want = self.signer.seal(key, desired)
        seen = b""
        for _ in range(COMPARE_SET_TRIES):
            cur = self.raw.compare_set(key, seen, want)
            value = self._verified(key, cur)
            if value is not None:
                return value
            # a forgery is there: replace it if it still is (a c10d store hands back a
            # non-empty `expected` unchanged when the key is gone: then insert again)
            seen = b"" if cur == seen else cur
        raise ForgedValue(key)


def signed(store: Any, job_prefix: str, secret: bytes | None, forgeries: Forgeries | None = None,
           run: str = "") -> Any:
    """`store` (scoped to the job whose prefix is `job_prefix`) signed with `secret` in
    the store's run `run`; `store` itself when there is no secret (a job run without
    eltctl's controller)."""
    if secret is None:
        return store
    return SignedStore(store, Signer(secret, job_prefix, run), forgeries)


def raw_store(store: Any) -> Any:
    """The unsigned store under `store` (itself when it is not a SignedStore)."""
    return store.raw if isinstance(store, SignedStore) else store
