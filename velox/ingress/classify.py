"""What a request is: which paths exist and which are refused, decided at header time.

A pure function of the request line, with no I/O: `classify` decides whether a path is
served, forwarded or refused (400/404/405) and gives it its `Kind`.

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
"""

from __future__ import annotations

import re

from velox.core.errors import InvalidPath, MethodNotAllowed, NotFound
from velox.core.types import Kind

# OpenAI endpoints whose POST body must be JSON naming a model; other methods on them are
# either real OpenAI calls (GET /v1/chat/completions lists stored completions) or 405.
_MODEL_CALLS: dict[bytes, tuple[bytes, ...]] = {
    b"/v1/chat/completions": (b"POST", b"GET"),
    b"/v1/completions": (b"POST",),
    b"/v1/embeddings": (b"POST",),
    b"/v1/responses": (b"POST",),
    # The Anthropic Messages API in front (velox.core.api): a model call like chat completions.
    b"/v1/messages": (b"POST",),
    b"/v1/messages/count_tokens": (b"POST",),
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

# Anything that makes a path differ from its normal form, in the path part (query excluded):
# \ ; # anywhere, %2e %2f %5c in any case, an empty segment (// or a trailing /), a . or ..
# segment. "/" alone is the root and is allowed (see classify).
_NOT_NORMAL = re.compile(rb"[\\;#]|%(?:2[eEfF]|5[cC])|//|/\.{1,2}(?:/|$)|./$")
# Kind's members as globals for the per-request paths: on Python 3.11 reading a member off
# its Enum class takes EnumType.__getattr__'s slow path (~0.3 us against ~0.04 for a global).
_MODEL_CALL, _FORWARD, _ROOT = Kind.MODEL_CALL, Kind.FORWARD, Kind.ROOT
_MODEL_OTHER = Kind.MODEL_OTHER
_HEALTH, _READY = Kind.HEALTH, Kind.READY


def classify(method: bytes, path: bytes) -> Kind:
    """Kind of a request line, or raise InvalidPath / NotFound / MethodNotAllowed."""
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


