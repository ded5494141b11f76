"""The run-time key store without sockets: an injected clock, SQLite in a temporary directory.

Rotation overlap (the old secret works until its end, not after), expiry, checks that refuse
bad input and change nothing, restart from the same directory, the audit log's content (who,
what, when; never a secret or a hash), and the read-only keys of the configuration file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from velox.admin.keystore import DB_NAME, KeyError_, KeyStore, sha256_hex


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def store(tmp_path: Path, clock: Clock, **kw: object) -> KeyStore:
    return KeyStore(str(tmp_path / "state"), clock=clock, **kw)  # type: ignore[arg-type]


def test_nothing_is_written_until_the_first_change(tmp_path: Path) -> None:
    s = store(tmp_path, Clock())
    assert s.records() == [] and not (tmp_path / "state").exists()
    s.create("admin", {"name": "a"})
    db = tmp_path / "state" / DB_NAME
    assert db.exists() and oct(db.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"


def test_create_looks_up_by_hash_and_keeps_only_the_hash(tmp_path: Path) -> None:
    clock = Clock()
    s = store(tmp_path, clock, routes=["gpt-4o", "*"])
    record, secret = s.create("alice", {"name": "team-a", "rpm": 600, "tpm": 10_000,
                                        "max_parallel": 4, "models": ["gpt-4o"],
                                        "budget_usd": 12.5, "team": "search",
                                        "expires_at": "2030-01-01T00:00:00Z"})
    assert secret.startswith("vx-") and len(secret) > 40
    assert record.sha256 == sha256_hex(secret) and record.created_by == "alice"
    assert s.lookup(sha256_hex(secret)) == record
    assert s.lookup(sha256_hex(secret + "x")) is None
    raw = (tmp_path / "state" / DB_NAME).read_bytes()
    assert secret.encode() not in raw
    public = record.public(clock())
    assert public["models"] == ["gpt-4o"] and public["expires_at"] == "2030-01-01T00:00:00Z"
    assert record.sha256 not in repr(public) and "sha256" not in public


def test_rotation_overlap_old_secret_until_its_end_then_not(tmp_path: Path) -> None:
    clock = Clock()
    s = store(tmp_path, clock)
    _, first = s.create("admin", {"name": "k"})
    record, second = s.rotate("admin", "k", overlap_s=60)
    assert second != first
    assert s.lookup(sha256_hex(second)) == record
    assert s.lookup(sha256_hex(first)) == record  # inside the overlap
    assert record.public(clock())["previous_secret_valid_until"] is not None
    clock.t += 59.9
    assert s.lookup(sha256_hex(first)) == record
    clock.t += 0.1  # the overlap's end: the old secret stops
    assert s.lookup(sha256_hex(first)) is None
    assert s.lookup(sha256_hex(second)) == record
    assert s.get("k").public(clock())["previous_secret_valid_until"] is None  # type: ignore[union-attr]
    # A second rotation forgets the first secret entirely and overlaps the second.
    _, third = s.rotate("admin", "k", overlap_s=0)
    assert s.lookup(sha256_hex(second)) is None and s.lookup(sha256_hex(third)) is not None


def test_expired_key_answers_nothing(tmp_path: Path) -> None:
    clock = Clock()
    s = store(tmp_path, clock)
    _, secret = s.create("admin", {"name": "k", "expires_at": clock.t + 10})
    assert s.lookup(sha256_hex(secret)) is not None
    clock.t += 10
    assert s.lookup(sha256_hex(secret)) is None
    assert s.get("k").public(clock())["expired"] is True  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "words"), [
    ({"name": "k", "colour": "red"}, "unknown field(s) 'colour'"),
    ({"name": "k", "rpm": -1}, "rpm must be an integer from 0"),
    ({"name": "k", "tpm": 1.5}, "tpm must be an integer"),
    ({"name": "k", "max_parallel": True}, "max_parallel must be an integer"),
    ({"name": "k", "models": ["nope"]}, "'nope' names no route"),
    ({"name": "k", "models": "gpt-4o"}, "models must be an array"),
    ({"name": "bad name"}, "name must be 1-64 letters"),
    ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "is in the past"),
    ({"name": "k", "expires_at": "2030-01-01T00:00:00"}, "needs a time zone"),
    ({"name": "k", "budget_usd": -3}, "budget_usd must be a number >= 0"),
    ({"rpm": 5}, "name is required"),
    (["k"], "must be a JSON object"),
])
def test_bad_input_is_refused_with_the_field_and_changes_nothing(
        tmp_path: Path, body: object, words: str) -> None:
    s = store(tmp_path, Clock(), routes=["gpt-4o"])
    s.create("admin", {"name": "existing", "rpm": 1})
    before = (s.version, s.records(), s.audit())
    with pytest.raises(KeyError_) as caught:
        s.create("admin", body)
    assert words in str(caught.value) and caught.value.status == 400
    assert (s.version, s.records(), s.audit()) == before


def test_duplicate_names_are_refused_the_files_keys_too(tmp_path: Path) -> None:
    s = store(tmp_path, Clock(), config_names=["from-file"])
    s.create("admin", {"name": "k"})
    for name in ("k", "from-file"):
        with pytest.raises(KeyError_, match="exists already"):
            s.create("admin", {"name": name})
    for change in (lambda: s.update("admin", "from-file", {"rpm": 1}),
                   lambda: s.rotate("admin", "from-file"), lambda: s.revoke("admin", "from-file")):
        with pytest.raises(KeyError_, match="read-only here"):
            change()
    with pytest.raises(KeyError_) as caught:
        s.revoke("admin", "nobody")
    assert caught.value.status == 404
    assert len(s.audit()) == 1


def test_update_revoke_and_a_restart_keeps_the_keys(tmp_path: Path) -> None:
    clock = Clock()
    s = store(tmp_path, clock)
    _, a = s.create("admin", {"name": "a", "rpm": 10})
    _, b = s.create("admin", {"name": "b"})
    s.update("bob", "a", {"rpm": 20, "models": None})
    _, a2 = s.rotate("admin", "a", overlap_s=30)
    s.revoke("admin", "b")
    s.stop()
    again = store(tmp_path, clock)
    assert [r.name for r in again.records()] == ["a"]
    assert again.get("a").rpm == 20  # type: ignore[union-attr]
    assert again.lookup(sha256_hex(a2)) is not None and again.lookup(sha256_hex(a)) is not None
    assert again.lookup(sha256_hex(b)) is None
    assert again.version == s.version == 5
    clock.t += 31
    assert again.lookup(sha256_hex(a)) is None


def test_audit_says_who_what_when_and_never_a_secret_or_hash(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    s = store(tmp_path, clock)
    secrets, hashes = [], []
    with caplog.at_level(logging.INFO, logger="velox.audit"):
        record, secret = s.create("alice", {"name": "k", "rpm": 5})
        secrets.append(secret)
        hashes.append(record.sha256)
        s.update("bob", "k", {"rpm": 6})
        record, secret = s.rotate("carol", "k", overlap_s=5)
        secrets.append(secret)
        hashes.append(record.sha256)
        s.revoke("dave", "k")
    entries = s.audit()
    assert [(e["who"], e["action"], e["key"]) for e in entries] == [
        ("dave", "revoke", "k"), ("carol", "rotate", "k"), ("bob", "update", "k"),
        ("alice", "create", "k")]
    assert entries[2]["detail"] == {"changed": {"rpm": [5, 6]}}
    assert all(e["ts"] == clock.t and e["at"].endswith("Z") for e in entries)
    assert len(caplog.records) == 4
    text = repr(entries) + caplog.text + (tmp_path / "state" / DB_NAME).read_bytes().decode(
        "latin-1")
    for secret in secrets:
        assert secret not in text
    audit_text = repr(entries) + caplog.text
    for digest in hashes:
        assert digest not in audit_text


def test_listeners_hear_every_change(tmp_path: Path) -> None:
    s = store(tmp_path, Clock())
    heard: list[tuple[int, list[str], list[str]]] = []
    s.on_change(lambda v, up, gone: heard.append((v, [r.name for r in up], gone)))
    s.create("admin", {"name": "a"})
    s.update("admin", "a", {"rpm": 1})
    s.revoke("admin", "a")
    assert heard == [(1, ["a"], []), (2, ["a"], []), (3, [], ["a"])]
    assert s.wait_version(3, 0.0) and not s.wait_version(4, 0.01)
