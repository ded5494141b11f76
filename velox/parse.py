"""Parse stage: read what routing needs from a model call's JSON body, and nothing more.

The body is parsed with orjson straight from the arena's memoryview (no intermediate bytes).
Only `model` and `stream` are read; the body itself is forwarded as the original bytes, never
re-serialised. Bodies of paths that are merely forwarded are not parsed at all.

A large body is not given to orjson on the event loop: orjson holds the GIL and builds every
string of the document, about 16 ms for a 16 MiB body, during which the worker serves no one.
`scan_model_call` makes the same accept/reject decision with the native scanner, which
allocates nothing and releases the GIL (about 4 ms for the same body), so the worker runs it
in a thread and keeps serving meanwhile. Both functions accept exactly the same bodies.

Imports: _types, errors, the native extension (scan_json), orjson.
"""

from __future__ import annotations

import orjson

from velox import _native
from velox._types import Request
from velox.errors import BadRequest, MalformedJSON, MissingParameter

_loads = orjson.loads
_JSONDecodeError = orjson.JSONDecodeError
_scan = _native.scan_json

_EMPTY = "The request body is empty; expected a JSON object with a 'model'."
_NOT_OBJECT = "The request body must be a JSON object."
_NO_MODEL = "You must provide a model parameter."

# What the native scanner's error codes mean, in the words of an error message.
_SCAN_ERRORS = {
    _native.JSON_E_EMPTY: "no JSON value",
    _native.JSON_E_TRUNCATED: "the body ends inside a value",
    _native.JSON_E_SYNTAX: "unexpected character",
    _native.JSON_E_TRAILING: "trailing characters after the JSON value",
    _native.JSON_E_DEPTH: f"more than {_native.JSON_MAX_DEPTH} nested arrays or objects",
    _native.JSON_E_NUMBER: "malformed number",
    _native.JSON_E_RANGE: "number out of range",
    _native.JSON_E_CONTROL: "control character in a string",
    _native.JSON_E_ESCAPE: "invalid escape in a string",
    _native.JSON_E_SURROGATE: "unpaired UTF-16 surrogate in a string",
    _native.JSON_E_UTF8: "invalid UTF-8 in a string",
    _native.JSON_E_TOO_LARGE: "document too large",
}


def parse_model_call(request: Request) -> None:
    """Set request.model and request.stream, or raise a 400 error naming the problem."""
    body = request.body
    if not body:
        raise BadRequest(_EMPTY)
    try:
        doc = _loads(body)
    except _JSONDecodeError as exc:
        raise MalformedJSON(f"We could not parse the JSON body of your request: {exc}") from None
    if type(doc) is not dict:
        raise BadRequest(_NOT_OBJECT)
    model = doc.get("model")
    if type(model) is not str or not model:
        raise MissingParameter(_NO_MODEL, param="model")
    request.model = model
    request.stream = doc.get("stream") is True
    # The affinity key of `hash` routes (the x-velox-affinity header wins; see dispatch).
    key = doc.get("prompt_cache_key") or doc.get("user")
    if type(key) is str:
        request.affinity = key


def scan_model_call(body: bytes | bytearray | memoryview) -> tuple[str, bool]:
    """(model, stream) of a model call's body, or a 400 error: what parse_model_call decides,
    computed without building the document. Safe to call from a thread (the scan releases the
    GIL for large bodies); the body must not change meanwhile."""
    if not body:
        raise BadRequest(_EMPTY)
    error, offset, start, end, model_kind, stream_kind, top_kind = _scan(body)
    if error:
        reason = _SCAN_ERRORS.get(error, "invalid JSON")
        raise MalformedJSON(
            f"We could not parse the JSON body of your request: {reason} at byte {offset}")
    if top_kind != _native.JSON_OBJECT:
        raise BadRequest(_NOT_OBJECT)
    if model_kind != _native.JSON_STRING or end - start <= 2:  # "" is two bytes
        raise MissingParameter(_NO_MODEL, param="model")
    model = _loads(body[start:end])  # the model name alone: a few bytes
    return model, stream_kind == _native.JSON_TRUE
