"""The Anthropic Messages API in front: Messages requests <-> OpenAI chat completions.

For a `/v1/messages` request routed to an upstream that does not speak the Messages API (OpenAI-
compatible, and through its translator Gemini or Bedrock). To an `anthropic` upstream nothing here
runs: the request is forwarded as it is (`AnthropicTranslator.messages`).

* `check(body)`: what Anthropic itself checks first (`model`, `max_tokens`, `messages`).
* `messages_to_chat(body)`: the request as an OpenAI chat request. `system` becomes a system
  message; `tool_result` blocks become `tool` messages (placed before the rest of their user
  turn, as OpenAI wants them right after the assistant's tool calls); `tool_use` blocks become
  `tool_calls` (input as a JSON string); images and PDFs become `image_url` and `file` parts.
  Earlier turns' thinking blocks are left out, as Anthropic itself leaves them out of the
  context. `cache_control` markers are left out (OpenAI-compatible upstreams cache on their
  own). Parameters are mapped one by one (`_PARAMS`); what chat completions cannot express is
  refused with a 400 naming the field, before anything is sent.
* `chat_to_messages(answer, client_model)`: an OpenAI answer as a Message (`FINISH` maps the
  stop reason; usage in Anthropic's terms: `input_tokens` without the cached part).
* `ChatToMessagesStream`: chunk events -> `message_start`, per block `content_block_start`,
  `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`),
  `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`.
* `error_to_messages(status, body)`: any OpenAI-shaped error (the upstream's, or one Velox made
  with velox.core.errors) in Anthropic's shape and statuses, so the Anthropic SDK raises its own
  classes (503 -> 529 overloaded_error).
* `count_tokens_answer(tokens)`: `count_tokens` answered from the gateway's own estimate (the
  caller passes velox.relay.usage's), marked with `x-velox-token-count: estimate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from velox.core.errors import MissingParameter, to_response

from . import sse
from .base import Answer, Headers, Stream, Translator, Untranslatable, Usage
from .chat import JSON_HEADERS, header, loads_object, refuse

_dumps = orjson.dumps
_loads = orjson.loads
# finish_reason -> stop_reason. OpenAI does not say which stop sequence ended an answer, so
# a "stop" is always end_turn.
FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
          "function_call": "tool_use", "content_filter": "refusal"}
# status -> Anthropic error type; statuses without one: api_error (5xx), invalid_request_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               402: "billing_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}
# Anthropic's thinking budget -> reasoning_effort, the inverse of the anthropic kind's table.
_EFFORTS = ((4096, "low"), (16384, "medium"))
_OUTPUT_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh",
                  "max": "xhigh"}


def check(body: Any, count_tokens: bool = False) -> None:
    """Anthropic's own first checks, as 400s (converted to its shape by error_to_messages);
    count_tokens takes no `max_tokens`."""
    if not isinstance(body, dict):
        raise Untranslatable("The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise MissingParameter("model: Field required", param="model")
    max_tokens = body.get("max_tokens")
    if count_tokens:
        pass
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise MissingParameter("max_tokens: Field required (a positive integer)",
                               param="max_tokens")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise MissingParameter("messages: Field required (a non-empty list)", param="messages")


# --- request ------------------------------------------------------------------------------------


class _Chat:
    __slots__ = ("kind", "out", "messages")

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.messages: list[dict[str, Any]] = []
        self.out: dict[str, Any] = {"model": model, "messages": self.messages}


def _text_of(content: Any, param: str, chat: _Chat) -> str:
    """System and tool-result content: a string or text blocks only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable(f"{param}: expected a string or a list of blocks.", param=param)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise refuse(chat.kind, f"{param}[{j}]", f"a {kind!r} block here")
        texts.append(block.get("text") or "")
    return "\n\n".join(texts) if param == "system" else "".join(texts)


def _part(block: dict[str, Any], param: str, chat: _Chat) -> dict[str, Any]:
    kind = block.get("type")
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    if kind == "text":
        return {"type": "text", "text": block.get("text") or ""}
    if kind == "image" and source.get("type") == "base64":
        return {"type": "image_url", "image_url": {
            "url": f"data:{source.get('media_type')};base64,{source.get('data')}"}}
    if kind == "image" and source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    if kind == "document" and source.get("type") == "base64":
        return {"type": "file", "file": {
            "filename": block.get("title") or "document.pdf",
            "file_data": f"data:{source.get('media_type')};base64,{source.get('data')}"}}
    if kind == "document" and source.get("type") == "text":
        return {"type": "text", "text": source.get("data") or ""}
    what = f"a {kind!r} block" + (f" with a {source.get('type')!r} source" if source else "")
    raise refuse(chat.kind, param, what)


def _user(content: Any, param: str, chat: _Chat) -> None:
    if isinstance(content, str):
        chat.messages.append({"role": "user", "content": content})
        return
    parts = []
    for j, block in enumerate(content if isinstance(content, list) else ()):
        where = f"{param}[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            chat.messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                  "content": _text_of(block.get("content") or "",
                                                      where + ".content", chat)})
        elif isinstance(block, dict):
            parts.append(_part(block, where, chat))
        else:
            raise Untranslatable(f"{where}: a content block must be an object.", param=where)
    if parts:
        chat.messages.append({"role": "user", "content": parts})


def _assistant(content: Any, param: str, chat: _Chat) -> None:
    if isinstance(content, str):
        chat.messages.append({"role": "assistant", "content": content})
        return
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content if isinstance(content, list) else ()):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": _dumps(block.get("input") or {}).decode()}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise refuse(chat.kind, f"{param}[{j}]", f"a {kind!r} block")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if texts or calls:
        chat.messages.append(message)


def _system(chat: _Chat, value: Any, name: str) -> None:
    chat.messages.insert(0, {"role": "system", "content": _text_of(value, name, chat)})


def _copy_as(target: str) -> Callable[[_Chat, Any, str], None]:
    def copy(chat: _Chat, value: Any, name: str) -> None:
        chat.out[target] = value
    return copy


def _metadata(chat: _Chat, value: Any, name: str) -> None:
    if isinstance(value, dict) and value.get("user_id"):
        chat.out["user"] = value["user_id"]


def _stream(chat: _Chat, value: Any, name: str) -> None:
    if value:
        chat.out["stream"] = True
        # The usage closes Anthropic's stream (message_delta): the upstream must send it.
        chat.out["stream_options"] = {"include_usage": True}


def _tools(chat: _Chat, value: Any, name: str) -> None:
    tools = []
    for k, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise refuse(chat.kind, f"{name}[{k}]", f"the server tool {kind!r}")
        function = {"name": tool.get("name"),
                    "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict"):
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    if tools:
        chat.out["tools"] = tools


def _tool_choice(chat: _Chat, value: Any, name: str) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        chat.out["tool_choice"] = kind
    elif kind == "any":
        chat.out["tool_choice"] = "required"
    elif kind == "tool":
        chat.out["tool_choice"] = {"type": "function", "function": {"name": value.get("name")}}
    else:
        raise refuse(chat.kind, name, f"tool_choice {value!r}")
    if isinstance(value, dict) and value.get("disable_parallel_tool_use"):
        chat.out["parallel_tool_calls"] = False


def _thinking(chat: _Chat, value: Any, name: str) -> None:
    if isinstance(value, dict) and value.get("type") == "enabled":
        budget = value.get("budget_tokens") or 0
        chat.out["reasoning_effort"] = next((e for top, e in _EFFORTS if budget < top), "high")
    # adaptive: the model decides, as an OpenAI model without reasoning_effort; disabled: none.


def _output_config(chat: _Chat, value: Any, name: str) -> None:
    fmt = value.get("format") if isinstance(value, dict) else None
    if isinstance(fmt, dict):
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise refuse(chat.kind, name + ".format", f"an output format {fmt.get('type')!r}")
        chat.out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt["schema"], "strict": True}}
    effort = value.get("effort") if isinstance(value, dict) else None
    if effort is not None:
        if effort not in _OUTPUT_EFFORT:
            raise refuse(chat.kind, name + ".effort", f"effort {effort!r}")
        chat.out["reasoning_effort"] = _OUTPUT_EFFORT[effort]


def _refused(what: str) -> Callable[[_Chat, Any, str], None]:
    def check_(chat: _Chat, value: Any, name: str) -> None:
        raise refuse(chat.kind, name, what)
    return check_


def _ignored(chat: _Chat, value: Any, name: str) -> None:
    return None


# Messages parameter -> what it becomes. top_k has no OpenAI name; it is passed on as it is
# (vLLM and others take it; OpenAI itself answers 400). service_tier only picks Anthropic's
# capacity pool.
_PARAMS: dict[str, Callable[[_Chat, Any, str], None]] = {
    "system": _system, "max_tokens": _copy_as("max_completion_tokens"),
    "temperature": _copy_as("temperature"), "top_p": _copy_as("top_p"),
    "top_k": _copy_as("top_k"), "stop_sequences": _copy_as("stop"), "stream": _stream,
    "metadata": _metadata, "tools": _tools, "tool_choice": _tool_choice,
    "thinking": _thinking, "output_config": _output_config,
    "service_tier": _ignored, "model": _ignored, "messages": _ignored,
    "container": _refused("a container"), "mcp_servers": _refused("MCP servers"),
    "context_management": _refused("context management"),
}


def messages_to_chat(body: dict[str, Any], kind: str = "openai") -> dict[str, Any]:
    """A checked Messages request as an OpenAI chat request (`kind`: the upstream kind that
    refusals name)."""
    check(body)
    chat = _Chat(kind, body["model"])
    for i, message in enumerate(body["messages"]):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            _user(message.get("content"), param + ".content", chat)
        elif role == "assistant":
            _assistant(message.get("content"), param + ".content", chat)
        else:
            raise Untranslatable(f"{param}.role: must be user or assistant.",
                                 param=param + ".role")
    for name, value in body.items():
        if value is None:
            continue
        handler = _PARAMS.get(name)
        if handler is None:
            raise refuse(kind, name, "the parameter")
        handler(chat, value, name)
    return chat.out


# --- answers ------------------------------------------------------------------------------------


def _usage(usage: Any) -> tuple[Usage, dict[str, Any]]:
    """(Usage in OpenAI's terms, Anthropic's usage object) of an OpenAI usage object."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    # Written to the provider's prompt cache: reported by the translators of providers that
    # have such writes (Bedrock, Anthropic), a part of prompt_tokens as the cached reads are.
    written = details.get("cache_write_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    out = Usage(input=prompt, output=usage.get("completion_tokens") or 0, cached_input=cached,
                cache_write=written, reasoning=reasoning)
    shaped: dict[str, Any] = {"input_tokens": prompt - cached - written,
                              "output_tokens": out.output,
                              "cache_read_input_tokens": cached,
                              "cache_creation_input_tokens": written}
    if reasoning:
        shaped["output_tokens_details"] = {"thinking_tokens": reasoning}
    return out, shaped


def _tool_input(arguments: Any) -> dict[str, Any]:
    try:
        value = _loads(arguments or "{}")
    except (orjson.JSONDecodeError, TypeError):
        value = None
    if not isinstance(value, dict):
        raise _BadAnswer("tool call arguments that are not a JSON object")
    return value


class _BadAnswer(Exception):
    pass


def _bad_answer(what: str) -> Answer:
    return error_to_messages(502, _dumps({"error": {
        "message": f"The upstream answered with {what}.", "type": "api_error"}}))


def chat_to_messages(answer_json: bytes, client_model: str) -> Answer:
    """A 2xx OpenAI chat answer as a Message (errors go through error_to_messages)."""
    answer = loads_object(answer_json)
    choices = answer.get("choices") if answer is not None else None
    if not choices or not isinstance(choices[0], dict):
        return _bad_answer("a body that is not a chat completion")
    message = choices[0].get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    try:
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"),
                            "name": function.get("name"),
                            "input": _tool_input(function.get("arguments"))})
    except _BadAnswer as exc:
        return _bad_answer(str(exc))
    usage, shaped = _usage(answer.get("usage") if answer is not None else None)
    body = {"id": "msg_" + str((answer or {}).get("id") or ""), "type": "message",
            "role": "assistant", "model": client_model, "content": content,
            "stop_reason": FINISH.get(choices[0].get("finish_reason") or "stop", "end_turn"),
            "stop_sequence": None, "usage": shaped}
    return Answer(200, JSON_HEADERS, _dumps(body), usage)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_to_messages(status: int, openai_error_body: bytes,
                      headers: Headers | None = None) -> Answer:
    """An OpenAI-shaped error in Anthropic's shape and statuses (a retry-after kept)."""
    parsed = loads_object(openai_error_body)
    error = parsed.get("error") if parsed is not None else None
    message = error.get("message") if isinstance(error, dict) else None
    status = 529 if status == 503 else status
    body = _dumps({"type": "error", "error": {
        "type": error_type(status),
        "message": message if isinstance(message, str) and message
        else f"The upstream answered HTTP {status}."}})
    retry_after = header(headers or [], b"retry-after")
    out = list(JSON_HEADERS)
    if retry_after is not None:
        out.append((b"retry-after", retry_after))
    return Answer(status, out, body)


def gateway_error(exc: BaseException) -> Answer:
    """An error Velox makes itself (velox.core.errors, the one mapping) in Anthropic's shape:
    the same message and status (503 -> 529), and every header the error carries (retry-after,
    allow, the key's x-ratelimit-*)."""
    made = to_response(exc)
    answer = error_to_messages(made.status, made.body)
    answer.headers = [*JSON_HEADERS, *(h for h in made.headers if h[0] != b"content-type")]
    return answer


def error_event(status: int, message: str, type_: Any = None) -> bytes:
    """The `error` event that ends a broken Messages stream; an Anthropic error type given by
    the upstream (a chained anthropic translator keeps it) wins over the status's."""
    known = type_ if type_ in ERROR_TYPES.values() else None
    return sse.event(b"error", _dumps({"type": "error", "error": {
        "type": known or error_type(529 if status == 503 else status), "message": message}}))


def count_tokens_answer(tokens: int) -> Answer:
    return Answer(200, [*JSON_HEADERS, (b"x-velox-token-count", b"estimate")],
                  b'{"input_tokens":%d}' % tokens)


# --- the stream ---------------------------------------------------------------------------------

# States of ChatToMessagesStream and what moves them (a chunk may carry several of these):
#
#   state     first chunk     reasoning delta    content delta      tool_calls delta     finish      [DONE]
#   START     message_start   -                  -                  -                    -           -
#             -> NONE
#   NONE      -               open thinking      open text          open tool_use        -> ENDING   -> DONE
#   THINKING  -               thinking_delta     stop, open text    stop, open tool_use  stop,ENDING stop, DONE
#   TEXT      -               stop, open think.  text_delta         stop, open tool_use  stop,ENDING stop, DONE
#   TOOL      -               stop, open think.  stop, open text    new index: stop, open  stop,ENDING stop, DONE
#                                                                   same: input_json_delta
#   ENDING    (only a usage chunk is read)                                                           -> DONE
#
# DONE writes message_delta (stop_reason, usage) and message_stop. An error chunk, or the end of
# the body in any state before ENDING, writes an `error` event: FAILED. DONE and FAILED read
# nothing more.
START, NONE, THINKING, TEXT, TOOL, ENDING, DONE, FAILED = range(8)


class ChatToMessagesStream:
    """OpenAI `chat.completion.chunk` events -> the Messages event sequence."""

    __slots__ = ("usage", "_split", "_model", "_state", "_block", "_tool", "_stop", "_raw")

    def __init__(self, client_model: str) -> None:
        self.usage: Usage | None = None
        self._split = sse.Splitter()
        self._model = client_model
        self._state = START
        self._block = -1  # index of the open (or last) content block
        self._tool: Any = None  # the OpenAI index of the open tool call
        self._stop = "end_turn"
        self._raw: Any = None  # the upstream's usage object

    def feed(self, data: bytes) -> bytes:
        if self._state >= DONE:
            return b""
        out: list[bytes] = []
        for block in self._split.feed(data):
            payload = sse.fields(block)[1]
            if payload == b"[DONE]":
                out.append(self._finish())
            elif payload:
                try:
                    self._chunk(_loads(payload), out)
                except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
                    out.append(self._fail(502, "The upstream sent a malformed chunk."))
            if self._state >= DONE:
                break
        return b"".join(out)

    def end(self) -> bytes:
        if self._state >= DONE:
            return b""
        if self._state == ENDING:  # finished, only [DONE] missing: some servers omit it
            return self._finish()
        return self._fail(502, "The upstream stream ended before the answer did.")

    def _fail(self, status: int, message: str) -> bytes:
        self._state = FAILED
        return error_event(status, message)

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            self._state = FAILED
            out.append(error_event(500, str(error.get("message") or "Upstream error."),
                                   error.get("type")))
            return
        if self._state == START:
            self._state = NONE
            out.append(sse.event(b"message_start", _dumps({"type": "message_start", "message": {
                "id": "msg_" + str(chunk.get("id") or ""), "type": "message",
                "role": "assistant", "model": self._model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}})))
        if chunk.get("usage"):
            self._raw = chunk["usage"]
        choices = chunk.get("choices")
        if not choices or self._state == ENDING:
            return
        choice = choices[0]
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if self._state != THINKING:
                self._open(out, THINKING, {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if delta.get("content"):
            if self._state != TEXT:
                self._open(out, TEXT, {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            self._tool_delta(call, out)
        if choice.get("finish_reason"):
            self._stop = FINISH.get(choice["finish_reason"], "end_turn")
            self._close(out)
            self._state = ENDING

    def _tool_delta(self, call: dict[str, Any], out: list[bytes]) -> None:
        if self._state != TOOL or call.get("index") != self._tool:
            function = call.get("function") or {}
            self._tool = call.get("index")
            self._open(out, TOOL, {"type": "tool_use", "id": call.get("id"),
                                   "name": function.get("name"), "input": {}})
        arguments = (call.get("function") or {}).get("arguments")
        if arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    def _open(self, out: list[bytes], state: int, block: dict[str, Any]) -> None:
        self._close(out)
        self._state = state
        self._block += 1
        out.append(sse.event(b"content_block_start", _dumps({
            "type": "content_block_start", "index": self._block, "content_block": block})))

    def _close(self, out: list[bytes]) -> None:
        if self._state in (THINKING, TEXT, TOOL):
            out.append(b'event: content_block_stop\ndata: {"type":"content_block_stop",'
                       b'"index":%d}\n\n' % self._block)
            self._state = NONE

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
                b'"delta":' % self._block + _dumps(delta) + b"}\n\n")

    def _finish(self) -> bytes:
        if self._state == START:
            return self._fail(502, "The upstream stream ended before it began.")
        out: list[bytes] = []
        self._close(out)
        self._state = DONE
        self.usage, shaped = _usage(self._raw)
        shaped.pop("cache_creation_input_tokens")
        out.append(sse.event(b"message_delta", _dumps({
            "type": "message_delta", "delta": {"stop_reason": self._stop, "stop_sequence": None},
            "usage": shaped})))
        out.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        return b"".join(out)


# --- chained: the Messages API in front of a translated kind (gemini, bedrock) ------------------
#
# Messages -> chat (messages_to_chat) -> the kind's call (Translator.chat), and back: the kind's
# answer -> chat (Translator.chat_answer / chat_stream) -> Messages (chat_to_messages /
# ChatToMessagesStream). Every field the two halves carry survives the chain; what OpenAI's
# API has no word for is lost on the way, and the docs list it: a stop sequence ends as
# end_turn (the provider does not say which one either, except Bedrock's stop_sequence reason),
# top_k, PDF documents and disable_parallel_tool_use are refused by the kind's half with a 400.


def provider_answer(translator: Translator, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
    """A translated kind's whole answer (success or error) as a Message or Anthropic error."""
    chat = translator.chat_answer(status, headers, body, client_model)
    if chat.status < 300:
        return chat_to_messages(chat.body, client_model)
    return error_to_messages(chat.status, chat.body, chat.headers)


class ChainedStream:
    """A translated kind's event stream -> chat chunks -> the Messages event sequence. The
    kind's half is asked for the usage chunk: message_delta carries the usage."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, translator: Translator, client_model: str) -> None:
        self._inner: Stream = translator.chat_stream(client_model, True)
        self._outer = ChatToMessagesStream(client_model)

    @property
    def usage(self) -> Usage | None:
        return self._outer.usage

    def feed(self, data: bytes) -> bytes:
        chunks = self._inner.feed(data)
        return self._outer.feed(chunks) if chunks else b""

    def end(self) -> bytes:
        chunks = self._inner.end()
        out = self._outer.feed(chunks) if chunks else b""
        return out + self._outer.end()
