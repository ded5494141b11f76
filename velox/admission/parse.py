"""Parse stage: read what routing needs from a model call's JSON body, and nothing more.

The body is parsed with orjson straight from the arena's memoryview (no intermediate bytes).
Only `model` and `stream` are read; the body itself is forwarded as the original bytes, never
re-serialised. Bodies of paths that are merely forwarded are not parsed at all. The other
model-bearing endpoints (images, audio, moderations) are read by `parse_other`: a JSON body's
`model`, or a multipart form's `model` field (`form_model`), either optional.

A large body is not given to orjson on the event loop: orjson holds the GIL and builds every
string of the document, about 16 ms for a 16 MiB body, during which the worker serves no one.
`scan_model_call` makes the same accept/reject decision with the native scanner, which
allocates nothing and releases the GIL (about 4 ms for the same body), so the worker runs it
in a thread and keeps serving meanwhile. Both functions accept exactly the same bodies.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from velox.core.api import COUNT_TOKENS
from velox.core.errors import BadRequest, MalformedJSON, MissingParameter
from velox.core.types import Request
from velox.ingress import scan
from velox.providers import messages

_loads = orjson.loads
_JSONDecodeError = orjson.JSONDecodeError
_scan = scan.scan_json

_EMPTY = "The request body is empty; expected a JSON object with a 'model'."
_NOT_OBJECT = "The request body must be a JSON object."
_NO_MODEL = "You must provide a model parameter."

# What the native scanner's error codes mean, in the words of an error message.
_SCAN_ERRORS = {
    scan.JSON_E_EMPTY: "no JSON value",
    scan.JSON_E_TRUNCATED: "the body ends inside a value",
    scan.JSON_E_SYNTAX: "unexpected character",
    scan.JSON_E_TRAILING: "trailing characters after the JSON value",
    scan.JSON_E_DEPTH: f"more than {scan.JSON_MAX_DEPTH} nested arrays or objects",
    scan.JSON_E_NUMBER: "malformed number",
    scan.JSON_E_RANGE: "number out of range",
    scan.JSON_E_CONTROL: "control character in a string",
    scan.JSON_E_ESCAPE: "invalid escape in a string",
    scan.JSON_E_SURROGATE: "unpaired UTF-16 surrogate in a string",
    scan.JSON_E_UTF8: "invalid UTF-8 in a string",
    scan.JSON_E_TOO_LARGE: "document too large",
}


def parse_model_call(request: Request, required: bool = True) -> None:
    """Set request.model and request.stream, or raise a 400 error naming the problem.
    `required` False: a body without `model` leaves request.model None (parse_other)."""
    doc = _object(request.body)
    model = doc.get("model")
    if type(model) is not str or not model:
        if required or model is not None:
            raise MissingParameter(_NO_MODEL, param="model")
        model = None
    request.model = model
    request.stream = doc.get("stream") is True
    # The affinity key of `hash` routes (the x-velox-affinity header wins; see dispatch).
    key = doc.get("prompt_cache_key") or doc.get("user")
    if type(key) is str:
        request.affinity = key


def _object(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The body as a JSON object, or the 400 saying why it is none."""
    if not body:
        raise BadRequest(_EMPTY)
    try:
        doc = _loads(body)
    except _JSONDecodeError as exc:
        raise MalformedJSON(f"We could not parse the JSON body of your request: {exc}") from None
    if type(doc) is not dict:
        raise BadRequest(_NOT_OBJECT)
    return doc


def parse_messages(request: Request, api: int) -> None:
    """A Messages API call (velox.core.api): parse_model_call's reading, after the checks
    Anthropic itself makes first (`model`, `max_tokens`, `messages`: 400s the caller answers in
    Anthropic's shape). The affinity key is the body's metadata.user_id."""
    doc = _object(request.body)
    messages.check(doc, count_tokens=api == COUNT_TOKENS)
    request.model = doc["model"]
    request.stream = api != COUNT_TOKENS and doc.get("stream") is True
    metadata = doc.get("metadata")
    user = metadata.get("user_id") if type(metadata) is dict else None
    if type(user) is str:
        request.affinity = user


def parse_other(request: Request) -> None:
    """The other model-bearing endpoints (route.Kind.MODEL_OTHER): a multipart form's `model`
    field (form_model), else a JSON body's `model`; either may be absent (the upstream's
    default model: the request takes the catch-all route)."""
    content_type = None
    for name, value in request.headers:
        if name == b"content-type":
            content_type = value
            break
    if content_type is not None and \
            content_type.partition(b";")[0].strip().lower() == b"multipart/form-data":
        request.model, request.model_span = form_model(request.body, content_type)
    else:
        parse_model_call(request, required=False)


_BOUNDARY = re.compile(rb'(?:^|;)\s*boundary\s*=\s*(?:"([^"]{1,70})"|([^\s;",]{1,70}))', re.I)
_DISPOSITION = re.compile(rb"content-disposition\s*:(.*)", re.I)
_NAME = re.compile(rb'(?:^|;)\s*(name\*?)\s*=\s*(?:"([^"]*)"|([^\s;]*))', re.I)
_MODEL_MAX = 256  # bytes of a form's model value


def form_model(body: bytes | bytearray | memoryview, content_type: bytes
               ) -> tuple[str | None, tuple[int, int] | None]:
    """(the `model` field of a multipart/form-data body, its value's [start, end) in body),
    (None, None) when the form has none. What the gateway checks must be what the upstream
    reads, so a form read two ways is refused (400) rather than guessed: two `model` fields,
    a name spelt otherwise (`name*=`, another case, escapes), a missing boundary or closing
    delimiter, a model that is no short UTF-8 text."""
    found = _BOUNDARY.search(b";" + content_type.partition(b";")[2])
    if found is None:
        raise BadRequest("A multipart/form-data body needs a boundary parameter in its "
                         "Content-Type.")
    data = bytes(body)
    delimiter = b"--" + (found.group(1) or found.group(2))
    pos = data.find(delimiter)  # a preamble before the first delimiter is no part (RFC 2046)
    span = None
    while pos >= 0:
        pos += len(delimiter)
        if data.startswith(b"--", pos):
            break  # the close delimiter
        head_end = data.find(b"\r\n\r\n", pos)
        end = data.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if end < 0:
            raise BadRequest("The multipart/form-data body ends inside a part (no closing "
                             "boundary).")
        if _is_model_part(data[pos:head_end]):
            if span is not None:
                raise BadRequest("The form has two `model` fields; send one.", param="model")
            span = (head_end + 4, end)
        pos = end + 2
    else:
        raise BadRequest("The multipart/form-data body has no part with its boundary.")
    if span is None:
        return None, None
    raw = data[span[0]:span[1]]
    try:
        model = raw.decode()
    except UnicodeDecodeError:
        model = ""
    if not model or len(raw) > _MODEL_MAX or not model.isprintable():
        raise BadRequest("The form's `model` field must be a model name.", param="model")
    return model, span


def _is_model_part(head: bytes) -> bool:
    """A part's header block names the `model` field (BadRequest if it names it unclearly)."""
    names = [m for line in head.split(b"\r\n") for d in [_DISPOSITION.match(line.strip())]
             if d is not None for m in _NAME.finditer(d.group(1))]
    model = False
    for param in names:
        value = param.group(2) if param.group(2) is not None else param.group(3)
        if param.group(1) != b"name" or value.lower().strip(b" \t\"") == b"model" or \
                b"%" in value or b"\\" in value:
            if param.group(1) != b"name" or value != b"model":
                raise BadRequest("The form names its `model` field in a way servers read "
                                 "differently; send name=\"model\".", param="model")
            model = True
    return model


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
    if top_kind != scan.JSON_OBJECT:
        raise BadRequest(_NOT_OBJECT)
    if model_kind != scan.JSON_STRING or end - start <= 2:  # "" is two bytes
        raise MissingParameter(_NO_MODEL, param="model")
    model = _loads(body[start:end])  # the model name alone: a few bytes
    return model, stream_kind == scan.JSON_TRUE
