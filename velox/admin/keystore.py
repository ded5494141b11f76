"""Gateway keys made at run time: records, checks, and where they are kept.

The `[[key]]` tables of VELOX_CONFIG stay as they are (read-only here). Keys made through the
admin API (`keyapi.py`) live in this store: a name, its limits (`models`, `rpm`, `tpm`,
`max_parallel`), `budget_usd` and `team` (reserved for the governance tables, stored and shown,
enforced by nothing yet), `expires_at`, when it was made and last rotated, by whom, and the
SHA-256 of its secret. The secret itself is returned once, by `create` and `rotate`, and kept
nowhere. A rotation keeps the previous hash until `old_until` (the overlap), so clients can
move to the new secret without a failed request.

Where they are kept:

* Without VELOX_REDIS_URL: an SQLite database in VELOX_STATE_DIR (`keys.sqlite3`; the
  directory is made, mode 0700, by the first change: a gateway nobody makes a key on writes
  nothing). Each change is one transaction: the record, the store's version (a counter bumped
  by every change) and the audit line.
* With VELOX_REDIS_URL: Redis is the truth for every host sharing it, and SQLite is this
  host's copy (a restart with Redis unreachable starts from it). A change is one Lua script
  (`WRITE_LUA`): it checks the name (free for a creation; for a change, the record's version
  is the one this host read, so two hosts changing one key cannot both win), bumps the
  version counter, writes the record, the name's version in a sorted set and an audit entry
  (a stream), and PUBLISHes the new version. Every host's watcher thread listens on that
  channel and also reads the counter every `POLL_S` (a lost message or a reconnect costs at
  most that): when it moved, one script (`READ_LUA`) returns the counter and every record
  changed since this host's version (a record gone from the hash was revoked). So a change
  made on one host is applied by every other within `POLL_S` (1 s) whatever happens to
  pub/sub, and within milliseconds normally. With Redis unreachable, changes are refused
  (503): a change one host made alone would be lost or contradicted when Redis returns;
  reads and lookups go on from the local copy. A Redis that lost its data (a restart without
  persistence) is re-seeded from the first host that notices it.

The audit log says who (the admin token's label, `VELOX_ADMIN_TOKENS`), what (the action, the
key's name and the fields changed: never a secret or a hash) and when. It is kept with the
truth (the SQLite table, or the Redis stream `velox:keys:audit`, trimmed to about 100,000
entries), and each line is also logged by `velox.audit`.

`lookup(digest)` answers which run-time key a presented credential's SHA-256 belongs to: its
current hash, or its previous one until the overlap ends; an expired key answers None. It is
the store-level rule; the workers apply the same one to the rows they are sent.

Keys in the workers' request path
---------------------------------
* Getting a change to the workers: the store calls its listeners (`on_change(fn)`) after every
  change it applies, its own or another host's; `velox.admin.keyfeed` sends the changed rows
  (names, hashes, limits, table indexes: no secrets exist to send) to every worker over the
  control channel (`control.py`), and each worker swaps its set in one loop callback
  (velox.admission.runtime): a request sees the old or the new key set, never half of one. A
  worker that starts inherits the set at fork and is sent the whole set once its channel is
  attached. Shared memory read on every request was the other way (a generation counter, or
  a table the workers would search): it costs every request for changes that come a few
  times a minute; a frame costs nothing until a change and is read within one loop turn.
* The key table: a run-time key's buckets and gauge are entries of the same growing table of
  native `Limits` segments as a file key's, at an index the supervisor claims
  (`SharedKeys.claim`, the one function that knows the table's size: `tables.MAX_KEYS`,
  1,000,000 keys for file and run-time keys together; a segment of 4,096 is added, and handed
  to the running workers, when the table is full). A revoked key's index is reused last
  (oldest first), so its requests in flight have released their places long before.
* Lookup cost: the request path stays one dict lookup of the 32-byte digest (ingress has
  hashed the credential already); run-time keys are entries of the same dict.
  `benches/bench_keys.py::test_keys_stage_ten_keys` measures the stage at 10 keys from the
  file and at run time.
* With several hosts, each supervisor's watcher applies Redis's changes and feeds its own
  workers the same way: Redis -> watcher (<= 1 s by polling, ms by pub/sub) -> control frame.
  The limits of a run-time key are leased from Redis like a file key's
  (`key:<name>:rpm|tpm`, velox.cluster.leases).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from velox.config.tables import _NAME, KEY_INTS

log = logging.getLogger("velox.keystore")
audit_log = logging.getLogger("velox.audit")

# 32 random bytes: 256 bits, as many as the hash keeps; the prefix makes a key recognisable
# in a secret scanner or a leaked log.
KEY_PREFIX = "vx-"
DB_NAME = "keys.sqlite3"
POLL_S = 1.0  # the watcher reads Redis's version at least this often
REDIS_TIMEOUT_S = 2.0
DEFAULT_OVERLAP_S = 60
MAX_OVERLAP_S = 7 * 86400
# Limits and names as the [[key]] tables bound them (a name is a metrics label too).
INTS = KEY_INTS
NAME = TEAM = _NAME
CREATE_FIELDS = ("name", "models", "rpm", "tpm", "max_parallel", "budget_usd", "team",
                 "expires_at")
PATCH_FIELDS = CREATE_FIELDS[1:]
AUDIT_MAX = 100_000

R_PREFIX = "velox:keys:"
R_DOCS, R_VERSION, R_LOG = R_PREFIX + "doc", R_PREFIX + "version", R_PREFIX + "log"
R_AUDIT, R_CHANNEL = R_PREFIX + "audit", R_PREFIX + "changed"

# KEYS: docs, version, log, audit, channel. ARGV: op (create|update|delete), name, doc,
# expected version of the record ("" for a creation), audit entry (JSON).
WRITE_LUA = """
local exists = redis.call('HEXISTS', KEYS[1], ARGV[2])
if ARGV[1] == 'create' then
  if exists == 1 then return -1 end
else
  if exists == 0 then return -2 end
  if tonumber(redis.call('ZSCORE', KEYS[3], ARGV[2])) ~= tonumber(ARGV[4]) then return -3 end
end
local v = redis.call('INCR', KEYS[2])
if ARGV[1] == 'delete' then
  redis.call('HDEL', KEYS[1], ARGV[2])
else
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
redis.call('ZADD', KEYS[3], v, ARGV[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'e', ARGV[5])
redis.call('PUBLISH', KEYS[5], v)
return v
"""
# KEYS: docs, version, log. ARGV: the caller's version. -> {version, name, v, doc|false, ...}
READ_LUA = """
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
local out = {v}
if v <= tonumber(ARGV[1]) then return out end
local changed = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. ARGV[1], '+inf', 'WITHSCORES')
for i = 1, #changed, 2 do
  out[#out + 1] = changed[i]
  out[#out + 1] = changed[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[1], changed[i])
end
return out
"""
# Re-seed a Redis that lost everything (no version counter) from this host's copy.
# KEYS: docs, version, log. ARGV: version, then name, doc pairs.
SEED_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[i])
end
return 1
"""


class KeyError_(ValueError):
    """A refused change: `status` is the HTTP status the admin API answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def sha256_hex(secret: str | bytes) -> str:
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


def iso(ts: float | None) -> str | None:
    """Unix seconds as ISO 8601 in UTC (the console shows them in the viewer's zone)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    name: str
    sha256: str  # hex SHA-256 of the current secret
    created_at: float
    created_by: str
    models: tuple[str, ...] | None = None
    rpm: int = 0
    tpm: int = 0
    max_parallel: int = 0
    budget_usd: float | None = None  # reserved for the governance tables: stored, not enforced
    team: str | None = None  # reserved likewise
    expires_at: float | None = None
    rotated_at: float | None = None
    old_sha256: str | None = None  # the previous secret's hash, valid until old_until
    old_until: float | None = None
    version: int = 0  # the store's version when this record was last written

    def doc(self) -> bytes:
        """What the stores keep (hashes included; never leaves the admin process)."""
        fields = dataclasses.asdict(self)
        fields.pop("version")
        return orjson.dumps(fields)

    @classmethod
    def from_doc(cls, raw: bytes | str, version: int) -> KeyRecord:
        fields = orjson.loads(raw)
        if fields.get("models") is not None:
            fields["models"] = tuple(fields["models"])
        return cls(**fields, version=version)

    def public(self, now: float) -> dict[str, Any]:
        """The record as the API shows it: no hash, times in ISO 8601."""
        overlap = self.old_until is not None and self.old_until > now
        return {
            "name": self.name, "source": "runtime",
            "models": list(self.models) if self.models is not None else None,
            "rpm": self.rpm, "tpm": self.tpm, "max_parallel": self.max_parallel,
            "budget_usd": self.budget_usd, "team": self.team,
            "expires_at": iso(self.expires_at),
            "expired": self.expires_at is not None and self.expires_at <= now,
            "created_at": iso(self.created_at), "created_by": self.created_by,
            "rotated_at": iso(self.rotated_at),
            "previous_secret_valid_until": iso(self.old_until) if overlap else None,
        }


# --- checking what the API was sent -----------------------------------------------------------


def _int_field(name: str, value: Any) -> int:
    lo, hi = INTS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KeyError_(f"{name} must be an integer from {lo} to {hi:,} (0: no limit), "
                        f"got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = orjson.dumps(value).decode() if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expires(value: Any, now: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise KeyError_(f"expires_at must be an ISO 8601 time like 2027-01-31T00:00:00Z "
                            f"or unix seconds, got {_show(value)}") from None
        if parsed.tzinfo is None:
            raise KeyError_("expires_at needs a time zone (e.g. a trailing Z for UTC), got "
                            f"{_show(value)}")
        ts = parsed.timestamp()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        ts = float(value)
    else:
        raise KeyError_(f"expires_at must be an ISO 8601 time or unix seconds, got "
                        f"{_show(value)}")
    if ts <= now:
        raise KeyError_(f"expires_at {_show(value)} is in the past")
    return ts


def check_fields(body: Any, allowed: tuple[str, ...], routes: Iterable[str] | None,
                 now: float) -> dict[str, Any]:
    """The fields of a creation (`CREATE_FIELDS`) or a change (`PATCH_FIELDS`), checked and
    converted; KeyError_ naming the field otherwise. `routes`: the route models a key's
    `models` may name (None: not checked)."""
    if not isinstance(body, dict):
        raise KeyError_("the body must be a JSON object")
    unknown = [k for k in body if k not in allowed]
    if unknown:
        raise KeyError_(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: "
                        + ", ".join(allowed))
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name == "name":
            if not isinstance(value, str) or not NAME.fullmatch(value):
                raise KeyError_("name must be 1-64 letters, digits, '_', '.' or '-' (starting "
                                f"with a letter or digit), got {_show(value)}")
            out[name] = value
        elif name in INTS:
            out[name] = _int_field(name, value)
        elif name == "models":
            out[name] = _models(value, routes)
        elif name == "budget_usd":
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, int | float) or value < 0):
                raise KeyError_(f"budget_usd must be a number >= 0 or null, got {_show(value)}")
            out[name] = None if value is None else float(value)
        elif name == "team":
            if value is not None and (not isinstance(value, str) or not TEAM.fullmatch(value)):
                raise KeyError_(f"team must be 1-64 letters, digits, '_', '.' or '-', or null, "
                                f"got {_show(value)}")
            out[name] = value
        elif name == "expires_at":
            out[name] = _expires(value, now)
    return out


def _models(value: Any, routes: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise KeyError_(f"models must be an array of route models (strings) or null, got "
                        f"{_show(value)}")
    if len(set(value)) != len(value):
        raise KeyError_(f"models names a route twice: {_show(value)}")
    if routes is not None:
        known = list(routes)
        for model in value:
            if model not in known:
                raise KeyError_(f"models: {model!r} names no route; routes: "
                                + ", ".join(map(repr, known)))
    return tuple(value)


# --- the store ------------------------------------------------------------------------------


class _Local:
    """This host's SQLite copy (the truth without Redis). Opened lazily: the file and its
    directory are made by the first write."""

    def __init__(self, state_dir: str) -> None:
        # VELOX_STATE_DIR=off: an in-memory database, nothing kept across restarts.
        self.memory = state_dir in ("", "off")
        self.path = Path(os.path.expanduser(state_dir)) / DB_NAME
        self.db: sqlite3.Connection | None = None
        if not self.memory and self.path.exists():
            self._open()

    def _open(self) -> sqlite3.Connection:
        if self.db is None:
            if self.memory:
                db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            else:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                os.chmod(self.path, 0o600)
                db.execute("PRAGMA journal_mode=WAL")
                # WAL: durable at checkpoints, never torn
                db.execute("PRAGMA synchronous=NORMAL")
            db.executescript("""
                CREATE TABLE IF NOT EXISTS runtime_keys (
                    name TEXT PRIMARY KEY, version INTEGER NOT NULL, doc BLOB NOT NULL);
                CREATE TABLE IF NOT EXISTS keys_meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
                CREATE TABLE IF NOT EXISTS keys_audit (
                    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, entry BLOB NOT NULL);
            """)
            self.db = db
        return self.db

    def load(self) -> tuple[int, list[KeyRecord]]:
        if self.db is None:
            return 0, []
        row = self.db.execute("SELECT v FROM keys_meta WHERE k = 'version'").fetchone()
        records = [KeyRecord.from_doc(doc, version) for _, version, doc in
                   self.db.execute("SELECT name, version, doc FROM runtime_keys")]
        return (row[0] if row else 0), records

    def apply(self, version: int, upserts: Iterable[KeyRecord], gone: Iterable[str],
              audit: Iterable[tuple[float, bytes]] = ()) -> None:
        db = self._open()
        with _transaction(db):
            db.executemany("INSERT OR REPLACE INTO runtime_keys VALUES (?, ?, ?)",
                           [(r.name, r.version, r.doc()) for r in upserts])
            db.executemany("DELETE FROM runtime_keys WHERE name = ?", [(n,) for n in gone])
            db.execute("INSERT OR REPLACE INTO keys_meta VALUES ('version', ?)", (version,))
            db.executemany("INSERT INTO keys_audit (at, entry) VALUES (?, ?)", list(audit))
            db.execute("DELETE FROM keys_audit WHERE id <= (SELECT MAX(id) FROM keys_audit) - ?",
                       (AUDIT_MAX,))

    def audit(self, limit: int) -> list[dict[str, Any]]:
        if self.db is None:
            return []
        rows = self.db.execute("SELECT entry FROM keys_audit ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [orjson.loads(entry) for (entry,) in rows]

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


class _transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


class KeyStore:
    """Run-time keys of this host, kept in step with Redis when there is one.

    Thread-safe: the admin server's threads call it, the watcher thread applies other hosts'
    changes. `clock` (unix seconds) is injectable for socket-free tests.
    """

    def __init__(self, state_dir: str, redis_url: str = "", *,
                 config_names: Iterable[str] = (), routes: Iterable[str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.config_names = frozenset(config_names)
        self.routes = tuple(routes) if routes is not None else None
        self.local = _Local(state_dir)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.version, records = self.local.load()
        self.by_name: dict[str, KeyRecord] = {r.name: r for r in records}
        self.by_digest: dict[str, KeyRecord] = {}
        self._index()
        self.listeners: list[Callable[[int, list[KeyRecord], list[str]], None]] = []
        self.redis: Any = None
        self.redis_down = ""  # why the last Redis call failed ("" while it answers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if redis_url:
            import redis

            self.redis = redis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                              socket_connect_timeout=REDIS_TIMEOUT_S)
            self._write = self.redis.register_script(WRITE_LUA)
            self._read = self.redis.register_script(READ_LUA)
            self._seed = self.redis.register_script(SEED_LUA)
            self.sync()

    # --- reading ------------------------------------------------------------------------

    def get(self, name: str) -> KeyRecord | None:
        with self.lock:
            return self.by_name.get(name)

    def records(self) -> list[KeyRecord]:
        with self.lock:
            return sorted(self.by_name.values(), key=lambda r: r.name)

    def snapshot(self) -> tuple[int, list[KeyRecord]]:
        """(version, every record) at one instant."""
        with self.lock:
            return self.version, list(self.by_name.values())

    def lookup(self, digest_hex: str) -> KeyRecord | None:
        """The key a credential's SHA-256 belongs to now (see the module docstring)."""
        now = self.clock()
        with self.lock:
            record = self.by_digest.get(digest_hex)
        if record is None:
            return None
        if record.sha256 != digest_hex and (record.old_until is None or record.old_until <= now):
            return None  # the previous secret, after its overlap
        if record.expires_at is not None and record.expires_at <= now:
            return None
        return record

    def audit(self, limit: int = 100) -> list[dict[str, Any]]:
        """The last `limit` changes, newest first, from wherever the truth is."""
        if self.redis is not None:
            try:
                entries = self.redis.xrevrange(R_AUDIT, count=limit)
                return [orjson.loads(fields[b"e"]) for _, fields in entries]
            except Exception as exc:
                self._down(exc)
        with self.lock:
            return self.local.audit(limit)

    def wait_version(self, version: int, timeout: float) -> bool:
        """Block until this store has applied `version` (tests wait on it, not on a clock)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def on_change(self, listener: Callable[[int, list[KeyRecord], list[str]], None]) -> None:
        """Call `listener(version, changed records, revoked names)` after every change applied
        (this host's or another's); the hook step 2 feeds the workers from."""
        self.listeners.append(listener)

    # --- changing -----------------------------------------------------------------------

    def create(self, who: str, body: Any) -> tuple[KeyRecord, str]:
        now = self.clock()
        fields = check_fields(body, CREATE_FIELDS, self.routes, now)
        name = fields.get("name")
        if name is None:
            raise KeyError_("name is required")
        if name in self.config_names:
            raise KeyError_(f"a key named {name!r} exists already (in the configuration file)")
        secret = new_secret()
        record = KeyRecord(**fields, sha256=sha256_hex(secret), created_at=now,
                           created_by=who)
        detail = {k: v for k, v in fields.items() if k != "name"}
        self._commit("create", record, None, who, detail)
        return self.get(name) or record, secret

    def update(self, who: str, name: str, body: Any) -> KeyRecord:
        now = self.clock()
        fields = check_fields(body, PATCH_FIELDS, self.routes, now)
        current = self._current(name)
        changed = {k: [_plain(getattr(current, k)), _plain(v)] for k, v in fields.items()
                   if getattr(current, k) != v}
        if not changed:
            return current
        record = dataclasses.replace(current, **fields)
        self._commit("update", record, current, who, {"changed": changed})
        return self.get(name) or record

    def rotate(self, who: str, name: str, overlap_s: Any = DEFAULT_OVERLAP_S,
               ) -> tuple[KeyRecord, str]:
        if isinstance(overlap_s, bool) or not isinstance(overlap_s, int | float) \
                or not 0 <= overlap_s <= MAX_OVERLAP_S:
            raise KeyError_(f"overlap_s must be a number of seconds from 0 to {MAX_OVERLAP_S:,}, "
                            f"got {_show(overlap_s)}")
        now = self.clock()
        current = self._current(name)
        secret = new_secret()
        record = dataclasses.replace(current, sha256=sha256_hex(secret), rotated_at=now,
                                     old_sha256=current.sha256 if overlap_s else None,
                                     old_until=now + overlap_s if overlap_s else None)
        self._commit("rotate", record, current, who, {"overlap_s": overlap_s})
        return self.get(name) or record, secret

    def revoke(self, who: str, name: str) -> None:
        current = self._current(name)
        self._commit("revoke", None, current, who, {})

    def _current(self, name: str) -> KeyRecord:
        record = self.get(name)
        if record is not None:
            return record
        if name in self.config_names:
            raise KeyError_(f"the key {name!r} comes from the configuration file (VELOX_CONFIG) "
                            "and is read-only here: change its [[key]] table and send SIGHUP")
        raise KeyError_(f"no run-time key named {name!r}", 404)

    def _commit(self, action: str, record: KeyRecord | None, current: KeyRecord | None,
                who: str, detail: Mapping[str, Any]) -> None:
        name = record.name if record is not None else current.name  # type: ignore[union-attr]
        now = self.clock()
        entry = {"at": iso(now), "ts": now, "who": who, "action": action, "key": name,
                 **({"detail": detail} if detail else {})}
        raw_entry = orjson.dumps(entry)
        if self.redis is not None:
            self._commit_redis(action, name, record, current, raw_entry)
        else:
            with self.lock:
                if action == "create" and name in self.by_name:
                    raise KeyError_(f"a key named {name!r} exists already")
                version = self.version + 1
                upserts = [dataclasses.replace(record, version=version)] if record else []
                self.local.apply(version, upserts, [] if record else [name],
                                 [(now, raw_entry)])
                self._apply_locked(version, upserts, [] if record else [name])
        audit_log.info("%s", raw_entry.decode())

    def _commit_redis(self, action: str, name: str, record: KeyRecord | None,
                      current: KeyRecord | None, entry: bytes) -> None:
        op = {"create": "create", "revoke": "delete"}.get(action, "update")
        try:
            result = self._write(
                keys=[R_DOCS, R_VERSION, R_LOG, R_AUDIT, R_CHANNEL],
                args=[op, name, record.doc() if record else b"",
                      current.version if current else "", entry, AUDIT_MAX])
        except Exception as exc:
            self._down(exc)
            raise KeyError_(f"Redis (VELOX_REDIS_URL) is unreachable, and it holds the keys of "
                            f"every host: nothing was changed; try again when it answers "
                            f"({type(exc).__name__})", 503) from None
        self.redis_down = ""
        if result == -1:
            raise KeyError_(f"a key named {name!r} exists already")
        if result == -2:
            raise KeyError_(f"no run-time key named {name!r}", 404)
        if result == -3:
            self.sync()
            raise KeyError_(f"the key {name!r} was changed by another host meanwhile; read it "
                            "again and retry", 409)
        self.sync()  # applies this change (and any other host's before it) locally

    # --- applying -----------------------------------------------------------------------

    def _index(self) -> None:
        by_digest = {}
        for r in self.by_name.values():
            by_digest[r.sha256] = r
            if r.old_sha256 is not None:
                by_digest.setdefault(r.old_sha256, r)
        self.by_digest = by_digest

    def _apply_locked(self, version: int, upserts: list[KeyRecord], gone: list[str]) -> None:
        for name in gone:
            old = self.by_name.pop(name, None)
            if old is not None:
                self._unindex(old)
        for record in upserts:
            old = self.by_name.get(record.name)
            if old is not None:
                self._unindex(old)
            self.by_name[record.name] = record
            self.by_digest[record.sha256] = record
            if record.old_sha256 is not None:
                self.by_digest.setdefault(record.old_sha256, record)
        self.version = max(self.version, version)
        self.changed.notify_all()
        for listener in self.listeners:
            try:
                listener(version, upserts, gone)
            except Exception:
                log.exception("key store listener failed")

    def _unindex(self, record: KeyRecord) -> None:
        for digest in (record.sha256, record.old_sha256):
            if digest is not None and self.by_digest.get(digest) is record:
                del self.by_digest[digest]

    def sync(self) -> bool:
        """Apply what changed in Redis since this host's version; False if Redis failed."""
        if self.redis is None:
            return True
        try:
            reply = self._read(keys=[R_DOCS, R_VERSION, R_LOG], args=[self.version])
            if int(reply[0]) == 0 and self.version > 0:
                self._reseed()
                return True
        except Exception as exc:
            self._down(exc)
            return False
        if self.redis_down:
            log.info("key store: Redis answers again; changes are taken again")
        self.redis_down = ""
        remote = int(reply[0])
        upserts, gone = [], []
        for i in range(1, len(reply), 3):
            name, version, doc = reply[i].decode(), int(float(reply[i + 1])), reply[i + 2]
            if doc:
                upserts.append(KeyRecord.from_doc(doc, version))
            else:
                gone.append(name)
        if not upserts and not gone and remote <= self.version:
            return True
        with self.lock:
            upserts = [r for r in upserts if r.version > self._version_of(r.name)]
            self.local.apply(max(remote, self.version), upserts, gone)
            self._apply_locked(remote, upserts, gone)
        return True

    def _version_of(self, name: str) -> int:
        record = self.by_name.get(name)
        return record.version if record is not None else -1

    def _reseed(self) -> None:
        with self.lock:
            records = list(self.by_name.values())
            version = self.version
        args: list[Any] = [version]
        for r in records:
            args += [r.name, r.doc()]
        if self._seed(keys=[R_DOCS, R_VERSION, R_LOG], args=args):
            log.warning("key store: Redis had lost the run-time keys; wrote this host's %d "
                        "key(s) back (version %d)", len(records), version)

    def _down(self, exc: BaseException) -> None:
        why = f"{type(exc).__name__}: {exc}"
        if not self.redis_down:
            log.warning("key store: cannot reach Redis (%s); changes are refused, lookups use "
                        "this host's copy", why)
        self.redis_down = why

    # --- the watcher (with Redis) ---------------------------------------------------------

    def start(self) -> None:
        if self.redis is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="velox-keys", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(POLL_S + REDIS_TIMEOUT_S + 1)
        with self.lock:
            self.local.close()

    def _watch(self) -> None:
        pubsub = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(R_CHANNEL)
                    self.sync()  # what changed while this host was not listening
                message = pubsub.get_message(timeout=POLL_S)
                if message is None or int(message["data"]) > self.version:
                    self.sync()
            except Exception as exc:
                self._down(exc)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
                pubsub = None
                self._stop.wait(POLL_S)
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:
                pass


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
