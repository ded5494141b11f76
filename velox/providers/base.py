"""Contracts of the provider translators: sans-IO, no sockets, fed bytes, giving bytes.

A translator is made once per upstream target (its settings: API version, default max_tokens,
credentials) and turns one client request in the client's API into the upstream's call, and the
upstream's answer (whole, or as a stream fed in whatever pieces reads deliver) back into the
client's API. Untranslatable requests raise `Untranslatable` before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from velox.core.errors import BadRequest

Headers = list[tuple[bytes, bytes]]


class Untranslatable(BadRequest):
    """The request uses something the upstream kind cannot express (400, names field and kind)."""

    code = "unsupported_parameter"


@dataclass(slots=True)
class Usage:
    """What one answer used, in OpenAI's terms (cached and reasoning tokens are parts of
    input and output respectively, as OpenAI reports them)."""

    input: int = 0
    output: int = 0
    cached_input: int = 0  # part of input read from the provider's prompt cache
    cache_write: int = 0  # part of input written to the provider's prompt cache (Anthropic)
    reasoning: int = 0  # part of output spent thinking


@dataclass(slots=True)
class UpstreamCall:
    """What to send upstream for one client request."""

    method: bytes
    path: bytes  # origin-form, query included
    headers: Headers  # the upstream's own headers (credential, version, content-type)
    body: bytes


@dataclass(slots=True)
class Answer:
    """A complete answer in the client's API."""

    status: int
    headers: Headers  # content-type and anything the client's API defines (retry-after...)
    body: bytes
    usage: Usage | None = None


class Stream(Protocol):
    """One streamed answer being translated: feed it every piece of the upstream's body as it
    arrives (any split: mid-line, mid-frame, mid-UTF-8), get the client's bytes to send now."""

    usage: Usage | None  # set once the upstream has reported it

    def feed(self, data: bytes) -> bytes: ...

    def end(self) -> bytes:
        """The upstream's body ended: whatever completes the client's stream (for OpenAI
        clients `data: [DONE]` only if the stream ended well; a truncated upstream stream ends
        with an error event and no [DONE])."""
        ...


class Translator(Protocol):
    """One upstream kind's translation for one target, OpenAI API on the client side."""

    kind: str

    def chat(self, body: dict[str, Any], model: str, stream: bool,
             client_headers: Headers) -> UpstreamCall:
        """An OpenAI chat.completions request (parsed) for upstream model `model`."""
        ...

    def chat_answer(self, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
        """The upstream's complete answer (success or error) as an OpenAI answer."""
        ...

    def chat_stream(self, client_model: str, include_usage: bool) -> Stream:
        """A streamed 2xx answer: upstream bytes -> `chat.completion.chunk` SSE."""
        ...

    def embeddings(self, body: dict[str, Any], model: str,
                   client_headers: Headers) -> UpstreamCall: ...

    def embeddings_answer(self, status: int, headers: Headers, body: bytes,
                          client_model: str) -> Answer: ...
