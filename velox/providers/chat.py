"""The OpenAI chat-completions shapes a translator writes for its clients, and its refusals.

Every non-OpenAI kind answers OpenAI clients with the same few shapes: a `chat.completion`, a
stream of `chat.completion.chunk` events ending with `data: [DONE]`, the usage object with its
cached and reasoning parts, and the OpenAI error shape (made by `velox.core.errors.to_response`, the
one error mapping, from a `ProviderError` that carries the status the client's SDK maps to the
right exception class). `Chunks` writes the chunk events of one answer from a prefix encoded once,
so a text delta costs one `orjson.dumps` of the delta and two concatenations.
"""

from __future__ import annotations

import binascii
from base64 import b64decode
from typing import Any

import orjson

from velox.core.errors import Source, VeloxError, to_response

from .base import Answer, Headers, Untranslatable, Usage

_dumps = orjson.dumps
JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache")]
DONE = b"data: [DONE]\n\n"


class ProviderError(VeloxError):
    """An upstream's error, told to the client in its own API with the status its SDK maps to
    the same exception class (the provider's message kept)."""

    source = Source.UPSTREAM

    def __init__(self, status: int, type_: str, message: str, *,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message, headers=headers)
        self.status = status
        self.type = type_
        self.code = None
        # The existing rule for retries and breakers: 429 and 5xx are upstream failures.
        self.retryable = status == 429 or status >= 500


def error_answer(exc: VeloxError) -> Answer:
    response = to_response(exc)
    return Answer(response.status, list(response.headers), response.body)


def error_event(exc: VeloxError) -> bytes:
    """The event that ends a broken OpenAI stream (and no `[DONE]` after it), as the relay
    writes one for an OpenAI upstream."""
    return b"data: " + to_response(exc).body + b"\n\n"


def refuse(kind: str, param: str, what: str) -> Untranslatable:
    """A 400 naming the field and the upstream kind, raised before anything is sent."""
    return Untranslatable(f"{param}: {what} cannot be sent to an upstream of kind '{kind}'.",
                          param=param)


def openai_usage(usage: Usage) -> dict[str, Any]:
    prompt_details: dict[str, int] = {"cached_tokens": usage.cached_input}
    if usage.cache_write:
        prompt_details["cache_write_tokens"] = usage.cache_write
    return {"prompt_tokens": usage.input, "completion_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
            "prompt_tokens_details": prompt_details,
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning}}


def completion(id_: str, created: int, model: str, message: dict[str, Any], finish: str,
               usage: Usage | None) -> bytes:
    body: dict[str, Any] = {
        "id": id_, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = openai_usage(usage)
    return _dumps(body)


class Chunks:
    """The `chat.completion.chunk` events of one streamed answer (one choice, index 0)."""

    __slots__ = ("_head", "_id")

    def __init__(self, id_: str, created: int, model: str) -> None:
        self._id = (b'data: {"id":' + _dumps(id_) + b',"object":"chat.completion.chunk",'
                    b'"created":' + b"%d" % created + b',"model":' + _dumps(model))
        self._head = self._id + b',"choices":[{"index":0,"delta":'

    def delta(self, delta: dict[str, Any]) -> bytes:
        return self._head + _dumps(delta) + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def content(self, text: str) -> bytes:
        return (self._head + b'{"content":' + _dumps(text)
                + b'},"logprobs":null,"finish_reason":null}]}\n\n')

    def finish(self, reason: str) -> bytes:
        return (self._head + b'{},"logprobs":null,"finish_reason":"' + reason.encode()
                + b'"}]}\n\n')

    def usage(self, usage: Usage) -> bytes:
        return self._id + b',"choices":[],"usage":' + _dumps(openai_usage(usage)) + b"}\n\n"


def data_url(url: str) -> tuple[str, str] | None:
    """(media type, base64 payload) of a `data:<type>;base64,<payload>` URL, else None."""
    if not url.startswith("data:"):
        return None
    head, sep, payload = url[5:].partition(",")
    media_type, _, encoding = head.partition(";")
    if not sep or encoding != "base64" or not media_type:
        return None
    return media_type, payload


def b64_text(payload: str, param: str) -> str:
    try:
        return b64decode(payload, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise Untranslatable(f"{param}: the data URL is not base64-encoded UTF-8 text.",
                             param=param) from None


def loads_object(body: bytes) -> dict[str, Any] | None:
    """A JSON object, or None for anything else (not JSON, not an object)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def header(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
