"""Two hosts' key stores sharing a real redis-server (the store level; the request path comes
when the workers enforce run-time keys).

Each store has its own Redis connections and its own watcher thread, as two supervisors
would. Waits are on the store's version (a condition variable), with the 2 s bound of the
design: pub/sub normally, the watcher's 1 s poll when a message is lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from velox.admin import keystore
from velox.admin.keystore import KeyError_, KeyStore, sha256_hex
from velox_lab.launch import RedisProcess

BOUND_S = 2.0


@pytest.fixture
def hosts(tmp_path: Path, redis_server: RedisProcess) -> Iterator[tuple[KeyStore, KeyStore]]:
    a = KeyStore(str(tmp_path / "a"), redis_server.url)
    b = KeyStore(str(tmp_path / "b"), redis_server.url)
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_each_host_sees_the_others_creations_and_revocations(
        hosts: tuple[KeyStore, KeyStore]) -> None:
    a, b = hosts
    record, secret = a.create("alice", {"name": "team-a", "rpm": 600})
    assert b.wait_version(record.version, BOUND_S)
    assert b.lookup(sha256_hex(secret)) is not None and b.get("team-a").rpm == 600  # type: ignore[union-attr]
    other, other_secret = b.create("bob", {"name": "team-b"})
    assert a.wait_version(other.version, BOUND_S)
    assert a.lookup(sha256_hex(other_secret)) is not None
    b.revoke("bob", "team-a")
    assert a.wait_version(b.version, BOUND_S)
    assert a.get("team-a") is None and a.lookup(sha256_hex(secret)) is None
    # One audit for all hosts (the Redis stream), newest first.
    assert [(e["who"], e["action"]) for e in a.audit()] == [
        ("bob", "revoke"), ("bob", "create"), ("alice", "create")]


def test_a_name_is_taken_once_across_hosts_and_a_stale_change_is_refused(
        hosts: tuple[KeyStore, KeyStore]) -> None:
    a, b = hosts
    record, _ = a.create("alice", {"name": "k"})
    # b has not necessarily applied it yet: Redis refuses the duplicate anyway.
    with pytest.raises(KeyError_, match="exists already"):
        b.create("bob", {"name": "k"})
    assert b.wait_version(record.version, BOUND_S)
    # b writes from the record it read before a's change (as two admins racing): refused.
    stale = b.get("k")
    assert stale is not None
    a.update("alice", "k", {"rpm": 5})
    with pytest.raises(KeyError_) as caught:
        b._commit("update", dataclasses.replace(stale, rpm=9), stale, "bob", {})
    assert caught.value.status == 409 and "another host" in str(caught.value)
    assert b.wait_version(a.version, BOUND_S)
    assert a.get("k").rpm == b.get("k").rpm == 5  # type: ignore[union-attr]


def test_a_lost_message_is_made_up_for_by_the_poll(
        hosts: tuple[KeyStore, KeyStore], redis_server: RedisProcess) -> None:
    a, b = hosts
    record, _ = a.create("alice", {"name": "seen"})
    assert b.wait_version(record.version, BOUND_S)
    # A change whose PUBLISH goes to a channel nobody listens on: b sees it by polling.
    raw = redis.Redis.from_url(redis_server.url)
    doc = keystore.KeyRecord(name="quiet", sha256="0" * 64, created_at=1.0,
                             created_by="x").doc()
    version = raw.register_script(keystore.WRITE_LUA)(
        keys=[keystore.R_DOCS, keystore.R_VERSION, keystore.R_LOG, keystore.R_AUDIT,
              "velox:keys:nobody"], args=["create", "quiet", doc, "", b"{}", 100])
    assert b.wait_version(int(version), BOUND_S)
    assert b.get("quiet") is not None


def test_redis_down_refuses_changes_and_keeps_lookups(
        hosts: tuple[KeyStore, KeyStore], redis_server: RedisProcess) -> None:
    a, b = hosts
    record, secret = a.create("alice", {"name": "k"})
    assert b.wait_version(record.version, BOUND_S)
    redis_server.kill()
    with pytest.raises(KeyError_) as caught:
        a.create("alice", {"name": "other"})
    assert caught.value.status == 503 and "unreachable" in str(caught.value)
    assert a.get("other") is None
    assert b.lookup(sha256_hex(secret)) is not None  # from this host's copy
    # Back, empty (no persistence): the first host to notice writes its keys back.
    redis_server.start()
    assert a.sync() or b.sync()
    assert a.sync() and b.sync()
    c_record, _ = b.create("bob", {"name": "after"})
    assert a.wait_version(c_record.version, BOUND_S + 2)
    assert a.get("k") is not None and a.get("after") is not None


def test_a_new_host_starts_from_redis_and_a_restart_from_its_copy(
        tmp_path: Path, hosts: tuple[KeyStore, KeyStore], redis_server: RedisProcess) -> None:
    a, _ = hosts
    _, secret = a.create("alice", {"name": "k"})
    late = KeyStore(str(tmp_path / "late"), redis_server.url)
    try:
        assert late.lookup(sha256_hex(secret)) is not None
    finally:
        late.stop()
    redis_server.kill()
    restarted = KeyStore(str(tmp_path / "late"), redis_server.url)  # Redis unreachable
    try:
        assert restarted.lookup(sha256_hex(secret)) is not None
        assert restarted.redis_down
    finally:
        restarted.stop()
