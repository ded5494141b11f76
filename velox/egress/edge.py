"""The edge of egress: where a request in the OpenAI API becomes a call in its target's API.

Routing chooses a target per attempt (velox.routing.dispatch); when the target's upstream is of
a translated kind (`anthropic`, `gemini`, `bedrock`: config.tables.TRANSLATED_KINDS), dispatch
asks `Edge.attempt` for that attempt's `Translation`: the upstream call (method, path, headers
with the kind's credential, body) and the object the relay feeds the answer through. Each
attempt is translated on its own, so a retry or a fallback may cross kinds: an OpenAI target
that fails before the commit point is retried on an Anthropic one, translated.

The OpenAI and Azure kinds have no translator here (`Edge.translators[u]` is None): their
requests go out as the client sent them and the relay does one attribute test per event.

A request the target's API cannot express (`n > 1`, logprobs, an audio part, an endpoint the
kind lacks) raises `Untranslatable` (400, naming the field and the kind) before anything is
sent: the caller refuses the request with it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from velox.config.tables import TRANSLATED_KINDS, UpstreamSpec
from velox.providers import KINDS
from velox.providers.base import Answer, Headers, Stream, Translator, Untranslatable, Usage
from velox.providers.chat import (
    JSON_HEADERS,
    SSE_HEADERS,
    ProviderError,
    error_answer,
    error_event,
)

if TYPE_CHECKING:
    from velox.core.types import Request

log = logging.getLogger("velox.edge")

CHAT = b"/v1/chat/completions"
EMBEDDINGS = b"/v1/embeddings"


def translator_for(spec: UpstreamSpec) -> Translator | None:
    """The translator of one upstream (made once, at start-up), None for OpenAI's own API."""
    if spec.kind not in TRANSLATED_KINDS:
        return None
    settings: dict[str, Any]
    if spec.kind == "anthropic":
        settings = {"api_key": spec.api_key, "version": spec.anthropic_version,
                    "default_max_tokens": spec.default_max_tokens}
    elif spec.kind == "gemini":
        settings = {"api_key": spec.api_key, "thinking": spec.thinking or None}
    else:  # bedrock: SigV4 signs the host the pool connects to
        settings = {"aws_region": spec.aws_region, "aws_access_key_id": spec.aws_access_key_id,
                    "aws_secret_access_key": spec.aws_secret_access_key,
                    "aws_session_token": spec.aws_session_token or None,
                    "host": spec.authority, "embed_input_type": spec.embed_input_type}
    return KINDS[spec.kind](**settings)


class Edge:
    """One worker's translators, by upstream index (None where nothing is translated)."""

    __slots__ = ("translators",)

    def __init__(self, upstreams: tuple[UpstreamSpec, ...]) -> None:
        self.translators = tuple(translator_for(spec) for spec in upstreams)

    def attempt(self, u: int, request: Request, model: str, meter: Any,
                max_tokens: int = 0) -> Translation:
        """The translation of `request` for upstream `u` (its model named `model`;
        `max_tokens`: the route's default output limit, 0 for none); raises Untranslatable
        before anything is sent."""
        translator = self.translators[u]
        assert translator is not None
        return Translation(translator, request, model, meter, max_tokens)


class Translation:
    """One attempt's call in the target's API and its answer back in OpenAI's (the relay's
    `edge`): `head` when the status arrives, then `feed`/`end` for a stream or `answer` for
    a whole body."""

    __slots__ = ("translator", "client_model", "embeddings", "stream", "include_usage",
                 "call", "decoder", "upstream_headers", "meter", "priced")

    def __init__(self, translator: Translator, request: Request, model: str,
                 meter: Any, max_tokens: int = 0) -> None:
        self.translator = translator
        self.client_model = request.model or model
        path = request.upstream_path.partition(b"?")[0]
        kind = translator.kind
        if path not in (CHAT, EMBEDDINGS):
            raise Untranslatable(f"{path.decode('latin-1')}: this endpoint cannot be sent to an "
                                 f"upstream of kind '{kind}' (chat completions and embeddings "
                                 "can).", param="model")
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):  # unreachable for a body the parse stage accepted
            raise Untranslatable("The body must be a JSON object.", param=None)
        headers = request.headers
        self.upstream_headers: Headers = []
        self.embeddings = path == EMBEDDINGS
        self.decoder: Stream | None = None
        if self.embeddings:
            self.stream = self.include_usage = False
            self.call = translator.embeddings(body, model, headers)
            return
        if max_tokens and kind == "anthropic" and body.get("max_tokens") is None and \
                body.get("max_completion_tokens") is None:
            body["max_completion_tokens"] = max_tokens  # the route's default over the upstream's
        self.stream = body.get("stream") is True
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        # Every provider's stream reports its usage, so the meter need not ask for a usage
        # chunk and strip it (velox.relay.usage) as it does for OpenAI upstreams: the numbers
        # are handed to it at the end (`end`). An earlier OpenAI attempt may have set `strip`.
        self.meter = meter if self.stream and not self.include_usage else None
        # A priced meter (velox.spend.wire) is told every part (cached, cache writes,
        # reasoning) beside the numbers.
        self.priced = meter if self.meter is not None and hasattr(meter, "told") else None
        if self.meter is not None and getattr(meter, "ask", False):
            meter.strip = False
        self.call = translator.chat(body, model, self.stream, headers)

    def head(self, status: int, headers: Headers) -> Headers:
        """The head the client's answer starts with: a streamed 2xx becomes an event stream at
        once; anything else is translated whole (`answer`, which reads the upstream's head
        kept here: Retry-After, Bedrock's error type)."""
        self.upstream_headers = headers
        if self.stream and status < 300:
            self.decoder = self.translator.chat_stream(self.client_model, self.include_usage)
            return SSE_HEADERS
        return JSON_HEADERS

    def answer(self, status: int, body: bytes) -> Answer:
        headers, model = self.upstream_headers, self.client_model
        try:
            if self.embeddings:
                return self.translator.embeddings_answer(status, headers, body, model)
            return self.translator.chat_answer(status, headers, body, model)
        except Exception:  # a translator's bug must cost one answer (a 502), never a hang
            log.exception("the %s answer could not be translated", self.translator.kind)
            return error_answer(self._untranslated())

    def feed(self, data: bytes) -> bytes:
        decoder = self.decoder
        assert decoder is not None
        try:
            return decoder.feed(data)
        except Exception:
            log.exception("the %s stream could not be translated", self.translator.kind)
            self.decoder = _Ended()  # nothing more of this stream reaches the client
            return error_event(self._untranslated())

    def _untranslated(self) -> ProviderError:
        return ProviderError(502, "api_error", f"The answer of the upstream (kind "
                             f"'{self.translator.kind}') could not be translated.")

    def end(self) -> bytes:
        """The upstream's stream ended: the client's last events; the usage to the meter
        when the client did not ask for it in the stream."""
        assert self.decoder is not None
        out = self.decoder.end()
        usage, meter = self.decoder.usage, self.meter
        if usage is not None and meter is not None:
            meter.input, meter.output, meter.exact = usage.input, usage.output, True
            if self.priced is not None:
                self.priced.told(usage)
        return out


class _Ended:
    """A translated stream cut short after its error event: the rest is dropped."""

    __slots__ = ("usage",)

    def __init__(self) -> None:
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> bytes:
        return b""

    def end(self) -> bytes:
        return b""
