"""Upstream kind "openai": the identity translator (OpenAI, Azure OpenAI, vLLM, Ollama, ...).

The pass-through path must cost nothing: the egress edge tests `identity` and sends the client's
bytes as they are, never calling `chat`. The methods exist so that every kind can be called the
same way where a request was parsed anyway (a retry that crosses kinds, the Messages API in
front): `chat` serialises the body it is given, answers are handed back untouched (no parse, no
copy) and a stream's bytes pass through `feed` as they came. Usage is read by the gateway's own
meter on this path (velox.relay.usage), so `Stream.usage` stays None.
"""

from __future__ import annotations

from typing import Any

import orjson

from .base import Answer, Headers, UpstreamCall, Usage

KIND = "openai"
_CHAT = b"/v1/chat/completions"
_EMBEDDINGS = b"/v1/embeddings"


class PassThrough:
    """A stream that is already in the client's API."""

    __slots__ = ("usage",)

    def __init__(self) -> None:
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> bytes:
        return data

    def end(self) -> bytes:
        return b""  # the upstream's own [DONE] (or its absence) already went through


class OpenAITranslator:
    kind = KIND
    identity = True
    __slots__ = ("_headers", "_prefix")

    def __init__(self, api_key: str = "", *, base_path: str = "") -> None:
        self._prefix = base_path.rstrip("/").encode()
        self._headers: Headers = [(b"content-type", b"application/json")]
        if api_key:
            self._headers.append((b"authorization", b"Bearer " + api_key.encode()))

    def __repr__(self) -> str:
        return "OpenAITranslator()"

    def chat(self, body: dict[str, Any], model: str, stream: bool,
             client_headers: Headers) -> UpstreamCall:
        return UpstreamCall(b"POST", self._prefix + _CHAT, self._headers,
                            orjson.dumps({**body, "model": model, "stream": stream}))

    def chat_answer(self, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
        return Answer(status, headers, body)

    def chat_stream(self, client_model: str, include_usage: bool) -> PassThrough:
        return PassThrough()

    def embeddings(self, body: dict[str, Any], model: str,
                   client_headers: Headers) -> UpstreamCall:
        return UpstreamCall(b"POST", self._prefix + _EMBEDDINGS, self._headers,
                            orjson.dumps({**body, "model": model}))

    def embeddings_answer(self, status: int, headers: Headers, body: bytes,
                          client_model: str) -> Answer:
        return Answer(status, headers, body)
