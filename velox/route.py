"""Routing: which requests exist, who may make them, and what goes upstream.

Pure functions of the request and the settings, with no I/O: `classify` decides at header time
whether a path is served, forwarded or refused (400/404/405), `check_auth` enforces VELOX_API_KEYS
and the `[[key]]` tables (401), and `upstream_headers` turns the client's headers into the
upstream's: hop-by-hop headers dropped, the gateway's key swapped in, the client's gateway key
never forwarded.

Paths are refused, not normalised: a path that is not already in normal form gets 400
invalid_path before routing, so what is checked is what goes upstream (with the upstream's
key attached). Refused: dot segments (`/v1/../x`), empty segments (`/v1//x`, and a trailing
slash such as `/v1/chat/completions/`), backslashes, `;` parameters (`/v1/chat/completions;x`),
fragments, and percent-encoded dots, slashes and backslashes (`%2e %2f %5c`, any case), which an
upstream or a proxy in front of it may decode into the former. Query strings are not inspected
and stay allowed. Normalising instead would route a request to a path the client did not write;
no OpenAI client sends such paths.

The one exception is RFC 3986's own equivalence (§6.2.2.2): an escaped unreserved character
(letters, digits, `-`, `_`, `~`) is that character, so `normal_target` decodes those once and
the request is classified, checked and sent upstream in the decoded form: `/v1/chat/c%6Fmpletions`
is a chat completion (an upstream that decodes paths, uvicorn or Starlette, served it as one
while the gateway had forwarded it unread). Escapes a second decoding could turn into structure
(`%25`, `%3B`, `%3F`, `%23`, control bytes) are refused with the others; every other escape (a
reserved or non-ASCII byte of an ID) is kept as sent: no path the gateway serves contains one.

Azure OpenAI's deployment paths (`/v1/deployments/<name>/...`) are refused (404): an Azure
upstream would take the deployment from the client's path instead of from the route; clients
name the deployment as `model` on the OpenAI path.

Imports: _types, errors, config.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from velox._types import Headers, Request, Route
from velox.config import Settings
from velox.errors import InvalidPath, MethodNotAllowed, NotFound, Unauthorized

# OpenAI endpoints whose POST body must be JSON naming a model; other methods on them are
# either real OpenAI calls (GET /v1/chat/completions lists stored completions) or 405.
_MODEL_CALLS: dict[bytes, tuple[bytes, ...]] = {
    b"/v1/chat/completions": (b"POST", b"GET"),
    b"/v1/completions": (b"POST",),
    b"/v1/embeddings": (b"POST",),
    b"/v1/responses": (b"POST",),
}
# The other model-bearing endpoints: POST only; JSON naming a model, or a multipart form
# with a `model` field (parse.parse_other). Their model may be absent (the upstream's default):
# the request then takes the catch-all route.
_OTHER_CALLS = frozenset((
    b"/v1/images/generations", b"/v1/images/edits", b"/v1/images/variations",
    b"/v1/audio/speech", b"/v1/audio/transcriptions", b"/v1/audio/translations",
    b"/v1/moderations",
))
_POST = (b"POST",)
_KNOWN_FORWARDS: dict[bytes, tuple[bytes, ...]] = {
    b"/v1/models": (b"GET",),
}
_DEPLOYMENTS = b"/v1/deployments"
_PROBES = (b"GET", b"HEAD")

# RFC 9110 §7.6.1 connection-specific fields, plus those an HTTP/2 request must not carry
# (RFC 9113 §8.2.2) and those the egress recomputes (host becomes :authority, content-length
# is set from the body actually sent, expect is answered by ingress).
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
    b"te", b"trailer", b"host", b"content-length", b"expect", b"proxy-authorization",
    b"http2-settings",
})


# Connection values that name no other field (the common ones): no token list to build. The
# relay's answer filter (velox.relay, native relay_head) skips the same two.
PLAIN_CONNECTION = frozenset({b"keep-alive", b"close"})


# Anything that makes a path differ from its normal form, in the path part (query excluded):
# \ ; # anywhere, %2e %2f %5c in any case, an empty segment (// or a trailing /), a . or ..
# segment. "/" alone is the root and is allowed (see classify).
_NOT_NORMAL = re.compile(rb"[\\;#]|%(?:2[eEfF]|5[cC])|//|/\.{1,2}(?:/|$)|./$")
# Route's members as globals for the per-request paths: on Python 3.11 reading a member off
# its Enum class takes EnumType.__getattr__'s slow path (~0.3 us against ~0.04 for a global).
_MODEL_CALL, _FORWARD, _ROOT = Route.MODEL_CALL, Route.FORWARD, Route.ROOT
_MODEL_OTHER = Route.MODEL_OTHER
_HEALTH, _READY = Route.HEALTH, Route.READY


def classify(method: bytes, path: bytes) -> Route:
    """Route of a request line, or raise InvalidPath / NotFound / MethodNotAllowed."""
    bare = path.split(b"?", 1)[0]
    allowed = _MODEL_CALLS.get(bare)
    if allowed is None and _NOT_NORMAL.search(bare) is not None:
        raise InvalidPath(
            f"The URL path {bare.decode('latin-1')!r} is not in normal form (dot or empty "
            "segments, encoded or back slashes, ';' parameters); send the plain path.")
    if allowed is not None:
        if method == b"POST":
            return _MODEL_CALL
        if method in allowed:
            return _FORWARD
        raise _not_allowed(allowed)
    if bare in _OTHER_CALLS:
        if method == b"POST":
            return _MODEL_OTHER
        raise _not_allowed(_POST)
    allowed = _KNOWN_FORWARDS.get(bare)
    if allowed is not None:
        if method in allowed:
            return _FORWARD
        raise _not_allowed(allowed)
    if bare.startswith(b"/v1/"):
        if bare.startswith(_DEPLOYMENTS) and bare[15:16] in (b"", b"/"):
            raise NotFound(
                "Azure deployment paths are not served by this gateway: send the operation's "
                "/v1/ path (such as /v1/chat/completions) with the deployment as `model`.")
        return _FORWARD
    if bare == b"/":
        if method == b"POST":
            return _ROOT
        raise _not_allowed((b"POST",))
    if bare == b"/healthz" or bare == b"/readyz":
        if method in _PROBES:
            return _HEALTH if bare == b"/healthz" else _READY
        raise _not_allowed(_PROBES)
    raise NotFound(f"Unknown URL: {method.decode('latin-1')} {bare.decode('latin-1')}")


_HEX = frozenset(b"0123456789abcdefABCDEF")
# RFC 3986 §2.3: escaping these changes nothing; decoded (§6.2.2.2).
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_~")
# Escapes a decoding hop could turn into path structure or decode a second time: refused.
_STRUCTURAL = frozenset(b"%./\\;?#" + bytes(range(0x20)) + b"\x7f")


def normal_target(target: bytes) -> bytes:
    """The request target with escaped unreserved characters decoded in its path (the query
    is left alone); InvalidPath for a malformed escape or one of _STRUCTURAL. See the
    module docstring."""
    path, sep, query = target.partition(b"?")
    pieces = path.split(b"%")
    out = [pieces[0]]
    for piece in pieces[1:]:
        pair = piece[:2]
        if len(pair) < 2 or pair[0] not in _HEX or pair[1] not in _HEX:
            raise InvalidPath("The URL path has a '%' that starts no escape (two hex digits).")
        byte = int(pair, 16)
        if byte in _UNRESERVED:
            out.append(bytes((byte,)) + piece[2:])
        elif byte in _STRUCTURAL:
            raise InvalidPath(
                f"The URL path escapes {chr(byte)!r} (%{pair.decode()}), which a server that "
                "decodes paths would read as path structure; send the plain path.")
        else:
            out.append(b"%" + piece)
    return b"".join(out) + sep + query


def is_model_list(method: bytes, path: bytes) -> bool:
    """GET /v1/models[/ID]: with a tables file the gateway answers it itself."""
    if method != b"GET":
        return False
    bare = path.split(b"?", 1)[0]
    return bare == b"/v1/models" or bare.startswith(b"/v1/models/")


def _not_allowed(allowed: tuple[bytes, ...]) -> MethodNotAllowed:
    return MethodNotAllowed(
        "Method not allowed; this URL accepts " + ", ".join(m.decode() for m in allowed),
        headers=((b"allow", b", ".join(allowed)),),
    )


class Auth:
    """Client authentication and the upstream's credentials, prepared once per worker.

    Clients may present one of VELOX_API_KEYS or a `[[key]]` of the tables (matched by the
    SHA-256 of what was presented: one set lookup, whatever the number of keys); both kinds
    may be combined. With either, the client's own credential never goes upstream."""

    __slots__ = ("_client_keys", "_key_digests", "_digests", "_valid", "_upstream_value")

    def __init__(self, settings: Settings) -> None:
        self._client_keys = tuple(k.encode() for k in settings.api_keys)
        tables = settings.tables
        self._key_digests = frozenset(k.digest for k in tables.keys) if tables else frozenset()
        # Presented [[key]] → its digest, for keys already seen valid: a dict lookup instead of
        # a SHA-256 per request. Bounded (cleared when full); unknown keys are never kept.
        self._digests: dict[bytes, bytes] = {}
        # Whole Authorization values already accepted → check's result: one dict lookup per
        # request before any parsing, hashing or comparing (0.67 -> ~0.2 us for a [[key]],
        # 1.0 -> ~0.2 for one of three VELOX_API_KEYS). Bounded like _digests.
        self._valid: dict[bytes, bytes | None] = {}
        key = settings.upstream_api_key
        self._upstream_value = b"Bearer " + key.encode() if key else None

    @property
    def required(self) -> bool:
        return bool(self._client_keys or self._key_digests)

    def check(self, authorization: bytes | None) -> bytes | None:
        """Raise Unauthorized unless the client presented one of VELOX_API_KEYS or a `[[key]]`
        (if any are set). Returns the SHA-256 digest of the key it checked (caller_of's form),
        None when no key is required: the caller's identity (its `[[key]]`, its cache
        partition, who may share a batch) is then the credential that was checked, never
        another header of the request (an api-key beside it, say)."""
        if not self._client_keys and not self._key_digests:
            return None
        if authorization is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        valid = self._valid
        digest = valid.get(authorization, _UNSEEN)
        if digest is not _UNSEEN:
            return digest  # type: ignore[return-value]
        digest = self._check(authorization)
        if len(valid) >= _DIGESTS_MAX:
            valid.clear()
        valid[authorization] = digest
        return digest

    def _check(self, authorization: bytes) -> bytes:
        """check() for a value not seen valid yet: raises Unauthorized unless it is."""
        scheme, _, presented = authorization.partition(b" ")
        presented = presented.strip()
        if scheme.lower() == b"bearer" and presented:
            digest = self._digests.get(presented)
            if digest is not None:
                return digest
            # A set lookup of the digest: timing can tell nothing about the key itself.
            digest = hashlib.sha256(presented).digest()
            if digest in self._key_digests:
                if len(self._digests) >= _DIGESTS_MAX:
                    self._digests.clear()
                self._digests[presented] = digest
                return digest
            # Constant-time compare against every key so timing reveals neither key nor index.
            matched = False
            for key in self._client_keys:
                matched |= hmac.compare_digest(presented, key)
            if matched:
                return digest
        raise Unauthorized("Incorrect API key provided to the gateway.")

    def upstream_headers(self, headers: Headers) -> Headers:
        """The client's end-to-end headers with the default upstream's authorization applied."""
        out, passthrough = self.client_headers(headers)
        if self._upstream_value is not None:
            out.append((b"authorization", self._upstream_value))
        else:
            out += passthrough
        return out

    def passthrough_of(self, authorization: bytes | None) -> Headers:
        """client_headers' second item, from the client's (last) Authorization value."""
        if authorization is None or self._client_keys or self._key_digests:
            return []
        return [(b"authorization", authorization)]

    def client_headers(self, headers: Headers) -> tuple[Headers, Headers]:
        """(the client's end-to-end headers without its credential, the credential to pass on
        when the upstream has none of its own): hop-by-hop headers and those the Connection
        header names are dropped; the client's authorization passes on only when the gateway
        has no keys of its own (then the client's key is the upstream's)."""
        out: Headers = []
        client_auth = None
        listed: set[bytes] | None = None
        for header in headers:
            name = header[0]
            if name in HOP_BY_HOP:
                # "keep-alive" and "close" name no extra hop-by-hop headers: skip the parse.
                if name == b"connection" and header[1].lower() not in PLAIN_CONNECTION:
                    listed = connection_tokens(header[1], listed)
            elif name == b"authorization":
                client_auth = header
            else:
                out.append(header)
        if listed:
            out = [h for h in out if h[0] not in listed]
        if client_auth is not None and not self._client_keys and not self._key_digests:
            return out, [client_auth]
        return out, []


_DIGESTS_MAX = 4096  # distinct valid keys remembered per worker (Auth._digests, Auth._valid)
_UNSEEN = b"unseen"  # Auth._valid.get's default: no digest is this object


def caller_of(request: Request) -> bytes:
    """Who is asking: the SHA-256 digest (32 raw bytes) of the credential the client presented
    (the bearer value of Authorization, else Azure's api-key header, whatever their order),
    b"" when none. When the gateway checks keys, ingress sets it from the key it checked
    (Auth.check), so this reading of the headers serves only keyless gateways. Computed
    on first use and kept on the request: stages that need an identity (gateway keys, the
    cache key, batching's "allowed to share") share one digest, and requests of routes that
    need none pay nothing. A `[[key]]` table's `sha256` is the hex form of this digest."""
    caller = request.caller
    if caller is None:
        value = None
        for name, field in request.headers:
            if name == b"authorization":
                value = field  # ingress refuses a second one
                break
            if name == b"api-key" and value is None:
                value = field
        caller = b""
        if value is not None:
            scheme, _, token = value.partition(b" ")
            token = token.strip() if scheme.lower() == b"bearer" and token else value.strip()
            caller = hashlib.sha256(token).digest() if token else b""
        request.caller = caller
    return caller


def connection_tokens(value: bytes, into: set[bytes] | None) -> set[bytes]:
    """Names listed in a Connection header are hop-by-hop too (RFC 9110 §7.6.1): split at
    commas, ASCII whitespace stripped, lowercased, empty ones skipped (the native relay_head
    parses them the same way)."""
    names = into if into is not None else set()
    names.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return names
