"""The job's secret and signed store values (runtime/auth.py) on a real c10d TCPStore:
what is signed verifies, what anyone else writes is refused and counted, a value moved
to another key fails, compare_set replaces a forgery, the secret file's rules."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.protocol import Keys, job_prefix


@pytest.fixture(scope="module")
def tcp():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield master


def stores(tcp, job):
    secret = auth.new_secret()
    prefix = job_prefix(job)
    mine = auth.signed(dist.PrefixStore(prefix, tcp), prefix, secret)
    theirs = dist.PrefixStore(prefix, tcp)  # an attacker: the port, not the secret
    return mine, theirs


def test_signed_values_round_trip_and_forgeries_are_refused_and_counted(tcp):
    mine, theirs = stores(tcp, "a")
    mine.set(Keys.STATUS, '{"step": 7}')
    assert mine.check([Keys.STATUS]) and mine.get(Keys.STATUS) == b'{"step": 7}'
    theirs.set(Keys.STATUS, '{"step": 1000000000}')
    # The forgery is never handed out: the last verified value stands.
    assert not mine.check([Keys.STATUS])
    assert mine.get(Keys.STATUS) == b'{"step": 7}'
    theirs.set(Keys.leave("h1/0/1"), "1.0")
    assert not mine.check([Keys.leave("h1/0/1")])
    with pytest.raises(auth.ForgedValue):
        mine.get(Keys.leave("h1/0/1"))
    assert mine.forgeries.counts() == {"status": 2, "leave": 2}
    assert mine.forgeries.total == 4


def test_a_signed_value_moved_to_another_key_or_job_fails(tcp):
    mine, theirs = stores(tcp, "b")
    mine.set(Keys.desired("h1"), '{"seq": 3, "slots": [], "stop": true}')
    theirs.set(Keys.desired("h2"), theirs.get(Keys.desired("h1")))  # replayed for another host
    assert not mine.check([Keys.desired("h2")])
    other = auth.signed(dist.PrefixStore(job_prefix("c"), tcp), job_prefix("c"), mine.signer._secret)
    dist.PrefixStore(job_prefix("c"), tcp).set(Keys.desired("h1"), theirs.get(Keys.desired("h1")))
    assert not other.check([Keys.desired("h1")])  # same secret, other job: refused


def test_compare_set_first_signed_writer_wins_and_a_forgery_is_replaced(tcp):
    mine, theirs = stores(tcp, "d")
    theirs.set(Keys.plan(1), '{"members": ["evil"]}')  # written first, unsigned
    assert mine.compare_set(Keys.plan(1), "", '{"members": ["h1/0/1"]}') == b'{"members": ["h1/0/1"]}'
    # Now a signed plan is there: a second proposal adopts it.
    assert mine.compare_set(Keys.plan(1), "", '{"members": ["h2/0/1"]}') == b'{"members": ["h1/0/1"]}'
    assert mine.forgeries.counts() == {"gen/plan": 1}


def test_counters_pass_through(tcp):
    mine, theirs = stores(tcp, "e")
    assert mine.add(Keys.EVENTS_SEQ, 1) == 1
    assert theirs.add(Keys.EVENTS_SEQ, 10) == 11
    assert mine.add(Keys.EVENTS_SEQ, 0) == 11


def test_without_a_secret_the_store_is_unchanged(tcp):
    plain = dist.PrefixStore(job_prefix("f"), tcp)
    assert auth.signed(plain, job_prefix("f"), None) is plain
    assert auth.raw_store(plain) is plain


def test_the_secret_file_is_0600_and_its_rules_are_enforced(tmp_path):
    path = tmp_path / "secret"
    secret = auth.new_secret()
    old = os.umask(0)
    try:
        auth.write_secret(path, secret)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_secret(path) == secret
    assert auth.secret_from_env({auth.ENV_SECRET_FILE: str(path)}) == secret
    assert auth.secret_from_env({}) is None
    path.chmod(0o644)
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.read_secret(path)
    path.chmod(0o600)
    path.write_text("abc\n")
    with pytest.raises(auth.SecretError, match="hex digits"):
        auth.read_secret(path)
    with pytest.raises(auth.SecretError, match="does not exist"):
        auth.read_secret(tmp_path / "none")
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(auth.SecretError):
        auth.read_secret(link)


def test_family_names_the_kind_of_key():
    assert auth.family("gen/12/plan") == "gen/plan"
    assert auth.family("daemon/h1/desired") == "daemon/desired"
    assert auth.family("leave/h1/0/7") == "leave"
    assert auth.family("events/9") == "events"
