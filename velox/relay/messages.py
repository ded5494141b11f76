"""The Anthropic Messages API in front: one exchange per `/v1/messages` (or count_tokens)
request, shaped per target when dispatch picks one.

* To an `anthropic` upstream, the fast path: the request goes as the client sent it (the body
  byte for byte apart from a route's model rename, the client's `anthropic-version` and
  `anthropic-beta` kept), only the credential replaced by the upstream's `x-api-key`; the answer
  and its event stream are relayed by the plain `Exchange` code, untouched.
* To any other upstream (OpenAI-compatible today; the others through their own translators once
  the egress edge has them): the body becomes a chat completions request
  (velox.providers.messages.messages_to_chat, parsed once per request, encoded per attempt with
  that target's model name), and the answer comes back in the Messages shape: a whole answer
  translated when it is complete, a stream event by event as it arrives
  (`ChatToMessagesStream`), errors in Anthropic's shape and statuses. A request chat completions
  cannot express is refused with a 400 naming the field before anything is sent.
  `count_tokens` is answered by the gateway from its own estimate (velox.relay.usage's
  `input_tokens`, bytes / 4), marked `x-velox-token-count: estimate`.

Translation sits in front of the `Exchange` code: what the cache records, what the meter reads
and what the client gets are the Messages bytes. Retries and breakers see the upstream's status
(503 and 529 are both failures, 4xx are not), and an attempt abandoned for a retry leaves no
translation state behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from velox.core.api import COUNT_TOKENS, client_api
from velox.core.errors import VeloxError, to_response
from velox.core.types import Headers, Request
from velox.providers import messages
from velox.providers.base import Translator
from velox.relay.exchange import Exchange, Failover
from velox.relay.usage import input_tokens

if TYPE_CHECKING:
    from velox.config.tables import UpstreamSpec

ANTHROPIC_VERSION = b"2023-06-01"  # sent when the client named none (Anthropic requires one)
_CHAT_PATH = b"/v1/chat/completions"
_X_API_KEY = b"x-api-key"
# The client's headers that mean something only to the Messages API.
_VERSION = b"anthropic-version"
_ANTHROPIC_ONLY = frozenset((b"anthropic-version", b"anthropic-beta",
                             b"anthropic-dangerous-direct-browser-access"))
# Headers of the upstream's answer that the translated answer replaces.
_REPLACED = frozenset((b"content-type", b"retry-after"))
_EVENT_STREAM = b"text/event-stream"
# The head of a Messages event stream read from another kind's stream (Bedrock's content-type
# is not an event stream's).
_SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                         (b"cache-control", b"no-cache")]


def _event_stream(headers: Headers) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.startswith(_EVENT_STREAM)
    return False


class MessagesExchange(Exchange):
    """An `Exchange` whose attempts may speak chat completions while its client speaks the
    Messages API (see the module docstring)."""

    __slots__ = ("api", "translated", "chat", "stream", "held", "has_version", "provider",
                 "wants_stream")

    front = True  # dispatch asks `target` on every attempt

    def __init__(self, request: Request, headers_base: Headers, passthrough: Headers,
                 keyless: bool, on_done: Callable[[Exchange, int], None],
                 dispatch: Failover | None = None) -> None:
        # One set of the names instead of a Python loop over the headers (~1 us a request).
        names = {h[0] for h in headers_base}
        base = headers_base
        if _X_API_KEY in names:
            base = [h for h in base if h[0] != _X_API_KEY]
            # The client's own key goes upstream only from a gateway without keys of its own,
            # and only to an upstream without one (dispatch's rule for Authorization).
            if keyless and not passthrough:
                passthrough = [h for h in headers_base if h[0] == _X_API_KEY][-1:]
        super().__init__(request, request.upstream_path, base, on_done, dispatch)
        self.passthrough = passthrough
        self.api = client_api(request.path)
        self.has_version = _VERSION in names
        self.translated = False
        self.chat: dict[str, Any] | None = None  # the chat request, parsed once
        # Set by `target` for each attempt, before anything reads them (~0.4 us a request
        # less than setting them here too): `stream`, the translated event stream; `held`, a
        # plain answer in pieces; `provider`, the attempt's translator when its upstream speaks
        # neither API (gemini, bedrock: the chat request goes through it, and its answers come
        # back through it); `wants_stream`.
        self.stream: messages.ChatToMessagesStream | messages.ChainedStream | None
        self.held: tuple[int, Headers, list[bytes]] | None
        self.provider: Translator | None
        self.wants_stream: bool

    # --- per attempt (velox.routing.dispatch) -----------------------------------------------

    def target(self, spec: UpstreamSpec, model: str, credential: Headers,
               translator: Translator | None = None) -> bool:
        """Shape this attempt for `spec` (its upstream model `model`; `translator`: the
        egress edge's for a kind of another API than OpenAI's); False when the gateway
        answered instead (count_tokens estimated, or a request refused before sending)."""
        self.stream = None
        self.held = None
        self.provider = None
        self.wants_stream = False
        if spec.kind == "anthropic":
            self.translated = False
            # The upstream's credential carries its configured anthropic-version: the client's
            # own, when it sent one, is the one kept (one such field upstream, never two).
            extra = credential or self.passthrough
            if self.has_version:
                extra = [h for h in extra if h[0] != _VERSION]
            elif not any(h[0] == _VERSION for h in extra):
                extra = [*extra, (_VERSION, ANTHROPIC_VERSION)]
            self.headers_out = self.headers_base + extra
            return True
        if self.api == COUNT_TOKENS:
            answer = messages.count_tokens_answer(input_tokens(self.request.body))
            self._answer_here(answer.status, answer.headers, answer.body)
            return False
        try:
            chat = self.chat
            if chat is None:
                chat = self.chat = messages.messages_to_chat(orjson.loads(self.request.body),
                                                             spec.kind)
            chat["model"] = model
            self.wants_stream = chat.get("stream") is True
            if translator is not None:
                self._through(translator, chat, model)
                return True
            self.body = orjson.dumps(chat)
        except VeloxError as exc:
            self.refuse(exc)
            return False
        self.translated = True
        self.path = spec.upstream_path(_CHAT_PATH, model)
        self.headers_out = [h for h in self.headers_base if h[0] not in _ANTHROPIC_ONLY] + (
            credential or [(b"authorization", b"Bearer " + h[1]) if h[0] == _X_API_KEY else h
                           for h in self.passthrough])
        return True

    def _through(self, translator: Translator, chat: dict[str, Any], model: str) -> None:
        """The chat request in the kind's API (its credential, none of the client's headers);
        raises Untranslatable before anything is sent."""
        call = translator.chat(chat, model, self.wants_stream, self.request.headers)
        self.translated = True
        self.provider = translator
        self.method, self.path, self.headers_out, self.body = (call.method, call.path,
                                                               call.headers, call.body)

    def _streamed(self, status: int, headers: Headers) -> bool:
        """A 2xx event stream: by its content-type, or for a translated kind (Bedrock's is
        AWS's binary event stream) by what was asked."""
        if status >= 300:
            return False
        return self.wants_stream if self.provider is not None else _event_stream(headers)

    def _answer_here(self, status: int, headers: Headers, body: bytes) -> None:
        self.finished = True
        self.started = True
        self.conn.respond(self.request, status, headers, body)  # its end gives the body back
        self._done(status, False, None)

    def reset_for_retry(self) -> None:
        super().reset_for_retry()
        self.stream = None
        self.held = None

    # --- egress -> client: translated attempts ------------------------------------------------

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        if not self.translated:
            super().on_response(status, headers, end_stream)
        elif self.finished:
            return
        elif end_stream:
            self._to_messages(status, headers, b"")
        elif self._streamed(status, headers):
            model = self.request.model or ""
            if self.provider is None:
                self.stream = messages.ChatToMessagesStream(model)
            else:  # the kind's own event stream, read through its translator
                self.stream = messages.ChainedStream(self.provider, model)
                headers = _SSE_HEADERS
            super().on_response(status, headers, False)
        else:
            self.held = (status, headers, [])

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if not self.translated:
            super().on_data(data, end_stream)
            return
        if self.finished:
            return
        stream = self.stream
        if stream is not None:
            out = stream.feed(data)
            if end_stream:
                out += stream.end()
            super().on_data(out, end_stream)
            return
        held = self.held
        if held is None:
            return
        held[2].append(data)
        if end_stream:
            self.held = None
            self._to_messages(held[0], held[1], b"".join(held[2]))

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        if not self.translated:
            super().on_answer(status, headers, body)
        elif self.finished:
            return
        elif self._streamed(status, headers):  # a whole event stream in one read
            self.on_response(status, headers, False)
            self.on_data(body, True)
        else:
            self._to_messages(status, headers, body)

    def _to_messages(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole chat answer (or error) as a Message (or Anthropic error)."""
        model = self.request.model or ""
        if self.provider is not None:
            answer = messages.provider_answer(self.provider, status, headers, body, model)
        elif status < 300:
            answer = messages.chat_to_messages(body, model)
        else:
            answer = messages.error_to_messages(status, body, headers)
        out = [h for h in headers if h[0] not in _REPLACED]
        out += answer.headers
        super().on_answer(answer.status, out, answer.body)

    def stream_error(self, exc: BaseException) -> bytes:
        """The `error` event that ends a broken Messages stream (the SDK raises APIError)."""
        made = to_response(exc)
        error = orjson.loads(made.body)["error"]
        return messages.error_event(made.status, error["message"])
