"""The cache's entries and its store: the key, what is stored and how, the store's interface.

One store for the whole gateway (`velox._native.SharedCache`, one shared mapping the supervisor
creates before it forks: `create_store`), so a prompt is missed once per gateway, not once per
worker, and held once. An entry is a flag (event stream or not), the answer's headers as
stored (`stored_headers`: without the gateway's own and momentary ones) and its body
(`encode_entry`); `Replay` is one decoded for writing to clients.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from velox.core.types import Headers

if TYPE_CHECKING:
    from velox.config.settings import Settings

CACHEABLE_PATHS = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings",
                             b"/v1/messages"))
# Body members that do not change the answer (who asks, how usage is reported, tags).
IGNORED_MEMBERS = ("user", "stream_options", "metadata")
HEADER = b"x-velox-cache"
HIT, MISS, BYPASS = b"hit", b"miss", b"bypass"
# Response headers not stored: the gateway's own, and those that describe one moment of the
# upstream (its rate-limit state, the date) rather than the answer.
_NOT_STORED = frozenset((b"server-timing", b"x-velox-upstream", b"x-velox-attempts", HEADER,
                         b"date", b"age", b"set-cookie"))
EVENT_STREAM = b"text/event-stream"
_JSON = b"application/json"
_DONE = b"data: [DONE]"
_PERSON = b"velox-cache-v1"  # BLAKE2b personalisation: a new entry format changes every key
_ENTRY = struct.Struct("<BI")  # is-event-stream, length of the header block
_sort = orjson.OPT_SORT_KEYS


class Store(Protocol):
    """What the cache needs of its store (velox._native.SharedCache; a fake in the tests)."""

    @property
    def max_value(self) -> int: ...

    def get(self, key: bytes, now_ms: int, max_age_ms: int = -1) -> tuple[bytes, int] | None: ...

    def put(self, key: bytes, value: bytes, now_ms: int, ttl_ms: int) -> bool: ...

    def claim(self, key: bytes, now_ms: int, hold_ms: int) -> bool: ...

    def renew(self, key: bytes, now_ms: int, hold_ms: int) -> bool: ...

    def unwait(self, key: bytes, /) -> None: ...

    def waiting(self, key: bytes, /) -> int: ...

    def release(self, key: bytes, /) -> object: ...

    def pending(self, key: bytes, now_ms: int) -> bool: ...

    def stats(self) -> dict[str, int]: ...


def enabled(settings: Settings) -> bool:
    """Caching is on somewhere: VELOX_CACHE=1 or a route with `cache = true`."""
    tables = settings.tables
    return settings.cache or (tables is not None and any(r.cache for r in tables.routes))


def create_store(settings: Settings) -> Store | None:
    """The gateway's shared store, or None when no route caches. Call before forking."""
    if not enabled(settings):
        return None
    from velox._native import SharedCache

    store: Store = SharedCache(settings.cache_max_bytes)
    return store


# --- the key and the controls ------------------------------------------------------------------


def cache_control(headers: Headers) -> tuple[bool, bool, int]:
    """(no_cache, no_store, max_age_ms) from the request's Cache-Control header(s); -1: no
    max-age. Unknown directives are ignored (RFC 9111 §5.2); a max-age that is not a
    non-negative integer counts as 0 (only a fresh answer will do), one past 2^31 as 2^31."""
    no_cache = no_store = False
    max_age = -1
    for name, value in headers:
        if name != b"cache-control":
            continue
        for directive in value.split(b","):
            word, _, arg = directive.strip().partition(b"=")
            word = word.strip().lower()
            if word == b"no-cache":
                no_cache = True
            elif word == b"no-store":
                no_store = True
            elif word == b"max-age":
                arg = arg.strip().strip(b'"')
                seconds = min(int(arg), 1 << 31) if arg.isdigit() else 0
                max_age = seconds if max_age < 0 else min(max_age, seconds)
    return no_cache, no_store, max_age * 1000 if max_age >= 0 else -1


def json_object(data: bytes | bytearray | memoryview) -> dict[str, Any] | None:
    """The JSON object `data` holds, or None when it is not one orjson can read (not JSON, or
    JSON of another type)."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return doc if type(doc) is dict else None


def canonical_body(body: bytes | bytearray | memoryview) -> bytes | None:
    """The body as sorted-key compact JSON without the members that do not change the
    answer; None when it is not a JSON object orjson can read (then it is not cached)."""
    doc = json_object(body)
    if doc is None:
        return None
    for name in IGNORED_MEMBERS:
        doc.pop(name, None)
    return orjson.dumps(doc, option=_sort)


def cache_key(path: bytes, model: str, caller: bytes, stream: bool, canonical: bytes) -> bytes:
    """BLAKE2b-256 of the parts; each variable-length part is length-prefixed, so no two
    different tuples hash the same bytes."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    for part in (path, model.encode(), caller):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(b"\x01" if stream else b"\x00")
    h.update(canonical)
    return h.digest()


# --- what is stored ----------------------------------------------------------------------------


def encode_entry(sse: bool, headers: Headers, body: bytes) -> bytes:
    """One stored answer: flag, the response headers (NUL-separated; header fields cannot
    hold NUL), then the body (JSON, or the event stream's bytes as the upstream sent them)."""
    block = b"\0".join(b"%b\0%b" % (name, value) for name, value in headers)
    return _ENTRY.pack(1 if sse else 0, len(block)) + block + body


def decode_entry(value: bytes) -> tuple[bool, Headers, memoryview]:
    """(is-event-stream, headers, body); the body is a view of `value`, not a copy."""
    sse, size = _ENTRY.unpack_from(value)
    start = _ENTRY.size
    parts = value[start:start + size].split(b"\0") if size else []
    fields = list(zip(parts[::2], parts[1::2], strict=False))  # NUL-separated name, value
    return bool(sse), fields, memoryview(value)[start + size:]


def storable(status: int, headers: Headers, body: bytes) -> bool:
    """A complete 200 whose body is what its content type says."""
    if status != 200:
        return False
    content_type = b""
    for name, value in headers:
        if name == b"content-type":
            content_type = value.lower()
            break
    if content_type.startswith(_JSON):
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            return False
        return True
    if content_type.startswith(EVENT_STREAM):
        return complete_event_stream(body)
    return False


def complete_event_stream(body: bytes) -> bool:
    """The stream's last event is `data: [DONE]` and no event is an error (an `event: error`
    line, or a data object with a top-level `error`)."""
    events = [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if not events or events[-1].strip() != _DONE:
        return False
    for event in events[:-1]:
        for line in event.split(b"\n"):
            field, _, value = line.partition(b":")
            value = value.strip()
            if field == b"event" and value == b"error":
                return False
            if field == b"data":
                if value == b"[DONE]":
                    return False  # [DONE] before the end
                if b'"error"' in value:
                    try:
                        doc = orjson.loads(value)
                    except orjson.JSONDecodeError:
                        return False
                    if type(doc) is dict and "error" in doc:
                        return False
    return True


def stored_headers(headers: Headers) -> Headers:
    return [h for h in headers if h[0] not in _NOT_STORED and not h[0].startswith(b"x-ratelimit")]


class Replay:
    """A stored answer decoded for writing. One whose body is larger than ingress writes at
    once (WHOLE_BYTES) stays referenced by each client's send queue until that client has
    taken it; while any does, its worker remembers it (weak references to its bodies, as
    stored and without the usage chunk) and writes later hits of its key from the same bytes."""

    __slots__ = ("sse", "headers", "born_ms", "bodies")

    def __init__(self, sse: bool, headers: Headers, born_ms: int) -> None:
        self.sse = sse
        self.headers = headers  # shared by every answer written from it: never appended to
        self.born_ms = born_ms  # now_ms() when the entry was stored (now minus its age)
        self.bodies: dict[bool, weakref.ref[memoryview]] = {}  # key: the usage chunk removed

    def fresh(self, now: int, ttl_ms: int, max_age_ms: int) -> bool:
        age = now - self.born_ms
        return age < ttl_ms and (max_age_ms < 0 or age <= max_age_ms)

    def body(self, bare: bool) -> memoryview | None:
        ref = self.bodies.get(bare)
        return None if ref is None else ref()
