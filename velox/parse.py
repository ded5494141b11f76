"""Parse stage: read what routing needs from a model call's JSON body, and nothing more.

The body is parsed with orjson straight from the arena's memoryview (no intermediate bytes).
Only `model` and `stream` are read; the body itself is forwarded as the original bytes, never
re-serialised. Bodies of paths that are merely forwarded are not parsed at all.

Imports: _types, errors.
"""

from __future__ import annotations

import orjson

from velox._types import Request
from velox.errors import BadRequest, MalformedJSON, MissingParameter

_loads = orjson.loads
_JSONDecodeError = orjson.JSONDecodeError


def parse_model_call(request: Request) -> None:
    """Set request.model and request.stream, or raise a 400 error naming the problem."""
    body = request.body
    if not body:
        raise BadRequest("The request body is empty; expected a JSON object with a 'model'.")
    try:
        doc = _loads(body)
    except _JSONDecodeError as exc:
        raise MalformedJSON(f"We could not parse the JSON body of your request: {exc}") from None
    if type(doc) is not dict:
        raise BadRequest("The request body must be a JSON object.")
    model = doc.get("model")
    if type(model) is not str or not model:
        raise MissingParameter("You must provide a model parameter.", param="model")
    request.model = model
    request.stream = doc.get("stream") is True
