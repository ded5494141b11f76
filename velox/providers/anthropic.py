"""Upstream kind "anthropic": OpenAI chat completions <-> the Anthropic Messages API.

Request (`chat`): an OpenAI chat request becomes `POST /v1/messages` with the key as `x-api-key`,
`anthropic-version` (per target, default 2023-06-01) and the client's `anthropic-beta`, if any.
System and developer messages go to `system`; user and assistant content to blocks (images from
`data:` and https URLs, PDFs from `data:` file parts); assistant `tool_calls` to `tool_use` blocks
and `tool` messages to `tool_result` blocks, ids kept, so a tool conversation round-trips. The
parameters are translated one by one (`_PARAMS`); a parameter or content the Messages API cannot
express raises `Untranslatable` (400 naming the field and the kind) before anything is sent, and
so does any parameter this module does not know. `max_tokens`, which Anthropic requires, comes
from `max_completion_tokens`/`max_tokens` or the target's `default_max_tokens`.

`reasoning_effort` becomes a thinking budget (`THINKING_BUDGET`); thinking counts toward
`max_tokens` on both APIs, so the budget must leave room under a client's limit, and without one
the default output is added on top of the budget. `response_format` `json_schema` becomes
`output_config.format`; `json_object` (no schema to give) becomes one forced tool whose input is
the JSON object, turned back into the message text on the way back (`JSON_TOOL`).

Answer (`chat_answer`, `AnthropicStream`): text, tool calls (arguments as a JSON string), thinking
as `reasoning_content` (and `thinking_blocks` with their signatures, which a client sends back
on its assistant message to continue a tool conversation with thinking), `finish_reason` from
`FINISH`, usage with the cached and reasoning parts (Anthropic's `input_tokens` excludes cache
reads and writes; OpenAI's `prompt_tokens` includes them). Errors keep the provider's message
with the status the OpenAI SDK maps to the same class (`ERROR_STATUS`; 529 overloaded -> 503).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from . import sse
from .base import Answer, Headers, Untranslatable, UpstreamCall, Usage
from .chat import DONE as END
from .chat import (
    JSON_HEADERS,
    Chunks,
    ProviderError,
    b64_text,
    completion,
    data_url,
    error_answer,
    error_event,
    header,
    loads_object,
    refuse,
)

KIND = "anthropic"
DEFAULT_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
# reasoning_effort -> budget_tokens. Anthropic's minimum budget is 1024; each step about
# doubles or quadruples the one below, the top one is near the 32k most answers stay under.
THINKING_BUDGET = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 16384,
                   "xhigh": 32768}
# stop_reason -> finish_reason. pause_turn (a server tool's long turn paused) has no OpenAI
# counterpart: the answer so far is complete in itself, so "stop".
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop",
          "max_tokens": "length", "model_context_window_exceeded": "length",
          "tool_use": "tool_calls", "refusal": "content_filter"}
# error.type -> the status an OpenAI client gets (its SDK picks the exception class by status).
ERROR_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                "billing_error": 402, "permission_error": 403, "not_found_error": 404,
                "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
                "timeout_error": 504, "overloaded_error": 503}
IMAGE_TYPES = frozenset(("image/jpeg", "image/png", "image/gif", "image/webp"))
JSON_TOOL = "velox_json_object"
_JSON_TOOL_DEF = {"name": JSON_TOOL, "description": "Give the answer as this tool's input: one "
                  "JSON object.", "input_schema": {"type": "object"}}

_dumps = orjson.dumps
_loads = orjson.loads


def _refuse(param: str, what: str) -> Untranslatable:
    return refuse(KIND, param, what)


# --- request: messages ----------------------------------------------------------------------


def _text_parts(content: Any, param: str) -> list[dict[str, Any]]:
    """System, developer, assistant and tool content: a string or text parts only."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise Untranslatable(f"{param}: expected a string or a list of parts.", param=param)
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks.append(_text_block(part))
        elif kind == "refusal":
            blocks.append({"type": "text", "text": part.get("refusal") or ""})
        else:
            raise _refuse(f"{param}[{j}]", f"a content part of type {kind!r} here")
    return blocks


def _text_block(part: dict[str, Any]) -> dict[str, Any]:
    block = {"type": "text", "text": part.get("text") or ""}
    if part.get("cache_control") is not None:  # the prompt-cache marker clients put on parts
        block["cache_control"] = part["cache_control"]
    return block


def _image_block(part: dict[str, Any], param: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise Untranslatable(f"{param}: image_url.url is required.", param=param)
    inline = data_url(url)
    if inline is not None:
        if inline[0] not in IMAGE_TYPES:
            raise _refuse(param, f"an image of type {inline[0]!r} (jpeg, png, gif, webp are)")
        source = {"type": "base64", "media_type": inline[0], "data": inline[1]}
    elif url.startswith(("https://", "http://")):
        source = {"type": "url", "url": url}
    else:
        raise _refuse(param, "an image URL that is neither data: nor http(s):")
    return {"type": "image", "source": source}


def _file_block(part: dict[str, Any], param: str) -> dict[str, Any]:
    file = part.get("file")
    if not isinstance(file, dict):
        file = {}
    inline = data_url(file.get("file_data") or "")
    if inline is None:
        raise _refuse(param, "a file part without file_data as a data: URL (file_id)")
    if inline[0] == "application/pdf":
        source = {"type": "base64", "media_type": "application/pdf", "data": inline[1]}
    elif inline[0] == "text/plain":
        source = {"type": "text", "media_type": "text/plain",
                  "data": b64_text(inline[1], param)}
    else:
        raise _refuse(param, f"a file of type {inline[0]!r} (application/pdf, text/plain are)")
    block: dict[str, Any] = {"type": "document", "source": source}
    if file.get("filename"):
        block["title"] = file["filename"]
    return block


def _user_content(content: Any, param: str) -> list[dict[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable(f"{param}: expected a string or a list of parts.", param=param)
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{param}[{j}]"
        if kind == "text":
            blocks.append(_text_block(part))
        elif kind == "image_url":
            blocks.append(_image_block(part, where))
        elif kind == "file":
            blocks.append(_file_block(part, where))
        elif kind == "input_audio":
            raise _refuse(where, "an audio part ('input_audio')")
        else:
            raise _refuse(where, f"a content part of unknown type {kind!r}")
    return blocks


def _tool_use(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise _refuse(param, "a tool call that is not a function call")
    arguments = function.get("arguments") or "{}"
    try:
        value = _loads(arguments)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise Untranslatable(f"{param}.function.arguments: must be a JSON object, as the "
                             f"upstream kind '{KIND}' takes tool input.", param=param)
    return {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
            "input": value}


def _assistant(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    blocks.extend(  # thinking given back from an earlier answer
        {k: v for k, v in block.items() if k != "index"}
        for block in message.get("thinking_blocks") or ()
        if isinstance(block, dict) and block.get("type") in ("thinking", "redacted_thinking"))
    if message.get("content") is not None:
        blocks += _text_parts(message["content"], param + ".content")
    for k, call in enumerate(message.get("tool_calls") or ()):
        blocks.append(_tool_use(call, f"{param}.tool_calls[{k}]"))
    if message.get("function_call") is not None:
        raise _refuse(param + ".function_call", "a legacy function_call (use tool_calls)")
    return blocks


def _tool_result(message: dict[str, Any], param: str) -> dict[str, Any]:
    content = message.get("content")
    return {"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
            "content": content if isinstance(content, str)
            else _text_parts(content, param + ".content")}


def translate_messages(messages: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, Messages turns) of an OpenAI `messages` list; consecutive messages of
    one role (tool results and the user text after them) become one turn, as Anthropic reads
    them."""
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("messages: a non-empty list is required.", param="messages")
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            system += _text_parts(message.get("content"), param + ".content")
            continue
        if role == "user":
            turn_role, content = "user", _user_content(message.get("content"),
                                                       param + ".content")
        elif role == "assistant":
            turn_role, content = "assistant", _assistant(message, param)
            if not content:
                continue  # nothing said (no text, no tool call): nothing to send
        elif role == "tool":
            turn_role, content = "user", [_tool_result(message, param)]
        else:
            raise _refuse(param + ".role", f"a message of role {role!r}")
        if turns and turns[-1]["role"] == turn_role:
            last = turns[-1]
            if isinstance(last["content"], str):
                last["content"] = [{"type": "text", "text": last["content"]}]
            last["content"] += ([{"type": "text", "text": content}]
                                if isinstance(content, str) else content)
        else:
            turns.append({"role": turn_role, "content": content})
    return system, turns


# --- request: parameters --------------------------------------------------------------------


class _Request:
    """The Messages request being built, and what later parameters need to know."""

    __slots__ = ("out", "max_tokens", "effort", "json_object", "parallel")

    def __init__(self, model: str) -> None:
        self.out: dict[str, Any] = {"model": model}
        self.max_tokens: int | None = None
        self.effort: str | None = None
        self.json_object = False
        self.parallel = True


def _max_tokens(req: _Request, value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Untranslatable(f"{name}: must be a positive integer.", param=name)
    req.max_tokens = value


def _temperature(req: _Request, value: Any, name: str) -> None:
    if isinstance(value, (int, float)) and value > 1:
        raise _refuse(name, f"a temperature of {value} (its range is 0 to 1)")
    req.out["temperature"] = value


def _copy_as(target: str) -> Callable[[_Request, Any, str], None]:
    def copy(req: _Request, value: Any, name: str) -> None:
        req.out[target] = value
    return copy


def _stop(req: _Request, value: Any, name: str) -> None:
    req.out["stop_sequences"] = [value] if isinstance(value, str) else list(value)


def _tools(req: _Request, value: Any, name: str) -> None:
    tools = []
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise _refuse(f"{name}[{k}]", f"a tool of type {tool.get('type')!r}")
        out = {"name": function.get("name"),
               "input_schema": function.get("parameters") or {"type": "object",
                                                              "properties": {}}}
        if function.get("description"):
            out["description"] = function["description"]
        if function.get("strict"):
            out["strict"] = True
        tools.append(out)
    if tools:
        req.out["tools"] = tools


def _tool_choice(req: _Request, value: Any, name: str) -> None:
    if value in ("auto", "none"):
        req.out["tool_choice"] = {"type": value}
    elif value == "required":
        req.out["tool_choice"] = {"type": "any"}
    elif isinstance(value, dict) and value.get("type") == "function":
        req.out["tool_choice"] = {"type": "tool",
                                  "name": (value.get("function") or {}).get("name")}
    else:
        raise _refuse(name, f"tool_choice {value!r}")


def _parallel(req: _Request, value: Any, name: str) -> None:
    req.parallel = bool(value)


def _response_format(req: _Request, value: Any, name: str) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise Untranslatable(f"{name}.json_schema.schema: a JSON schema object is "
                                 "required.", param=name)
        req.out["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
    elif kind == "json_object":
        req.json_object = True
    elif kind != "text":
        raise _refuse(name, f"a response_format of type {kind!r}")


def _effort(req: _Request, value: Any, name: str) -> None:
    if value != "none" and value not in THINKING_BUDGET:
        raise _refuse(name, f"reasoning_effort {value!r}")
    req.effort = value


def _user(req: _Request, value: Any, name: str) -> None:
    req.out["metadata"] = {"user_id": value}


def _refused(what: str) -> Callable[[_Request, Any, str], None]:
    def check(req: _Request, value: Any, name: str) -> None:
        raise _refuse(name, what)
    return check


def _only(default: Any, what: str) -> Callable[[_Request, Any, str], None]:
    """A parameter accepted at its no-effect value only (n=1, logprobs false, ...)."""
    def check(req: _Request, value: Any, name: str) -> None:
        if value != default:
            raise _refuse(name, what)
    return check


def _ignored(req: _Request, value: Any, name: str) -> None:
    return None


def _text_only(req: _Request, value: Any, name: str) -> None:
    if any(m != "text" for m in value):
        raise _refuse(name, "an output modality other than text")


# OpenAI parameter -> what it becomes. Ignored ones have no effect on the answer (seed is a best
# effort on OpenAI too; store, metadata and prompt_cache_key concern OpenAI's own storage and
# cache); top_k and thinking are Anthropic's own, accepted from clients that add them.
_PARAMS: dict[str, Callable[[_Request, Any, str], None]] = {
    "max_completion_tokens": _max_tokens, "max_tokens": _max_tokens,
    "temperature": _temperature, "top_p": _copy_as("top_p"), "stop": _stop,
    "tools": _tools, "tool_choice": _tool_choice, "parallel_tool_calls": _parallel,
    "response_format": _response_format, "reasoning_effort": _effort,
    "user": _user, "safety_identifier": _user,
    "top_k": _copy_as("top_k"), "thinking": _copy_as("thinking"),
    "n": _only(1, "n other than 1 (one choice per answer)"),
    "logprobs": _only(False, "logprobs"),
    "top_logprobs": _only(0, "top_logprobs"),
    "presence_penalty": _only(0, "a presence_penalty"),
    "frequency_penalty": _only(0, "a frequency_penalty"),
    "logit_bias": _only({}, "a logit_bias"),
    "modalities": _text_only,
    "audio": _refused("audio output"),
    "prediction": _refused("a predicted output"),
    "web_search_options": _refused("web_search_options"),
    "functions": _refused("legacy functions (use tools)"),
    "function_call": _refused("a legacy function_call (use tool_choice)"),
    "verbosity": _refused("verbosity"),
    "seed": _ignored, "store": _ignored, "metadata": _ignored, "service_tier": _ignored,
    "prompt_cache_key": _ignored, "stream_options": _ignored,
    "model": _ignored, "messages": _ignored, "stream": _ignored,
}


def _finish_request(req: _Request, default_max_tokens: int) -> None:
    out = req.out
    budget = THINKING_BUDGET.get(req.effort or "none")
    if budget is not None:
        if req.max_tokens is None:
            req.max_tokens = default_max_tokens + budget
        elif req.max_tokens <= budget:
            budget = req.max_tokens - 1
            if budget < THINKING_BUDGET["minimal"]:
                raise _refuse("max_completion_tokens", "reasoning_effort with at most "
                              f"{THINKING_BUDGET['minimal']} output tokens (the smallest "
                              "thinking budget)")
        out["thinking"] = {"type": "enabled", "budget_tokens": budget}
    out["max_tokens"] = req.max_tokens or default_max_tokens
    if req.json_object:
        if "tools" in out:
            raise _refuse("response_format", "json_object together with tools")
        if "thinking" in out:
            raise _refuse("response_format", "json_object together with thinking")
        out["tools"] = [_JSON_TOOL_DEF]
        out["tool_choice"] = {"type": "tool", "name": JSON_TOOL}
    if not req.parallel and "tools" in out:
        choice = out.setdefault("tool_choice", {"type": "auto"})
        if choice["type"] != "none":
            choice["disable_parallel_tool_use"] = True


# --- answers ----------------------------------------------------------------------------------


def usage_of(usage: dict[str, Any]) -> Usage:
    """Anthropic usage -> OpenAI's terms: cache reads and writes are parts of the input."""
    read = usage.get("cache_read_input_tokens") or 0
    write = usage.get("cache_creation_input_tokens") or 0
    details = usage.get("output_tokens_details") or {}
    return Usage(input=(usage.get("input_tokens") or 0) + read + write,
                 output=usage.get("output_tokens") or 0, cached_input=read,
                 cache_write=write, reasoning=details.get("thinking_tokens") or 0)


def error_of(status: int, headers: Headers, body: bytes) -> ProviderError:
    """An Anthropic error answer (or error event) as the error an OpenAI client gets."""
    parsed = loads_object(body)
    error = parsed.get("error") if parsed is not None else None
    # An unknown type (or none) keeps the upstream's status; an error event inside a 200
    # stream with an unknown type is a 500.
    kept = 503 if status == 529 else status if status >= 400 else 500
    if isinstance(error, dict):
        type_ = str(error.get("type") or "api_error")
        message = str(error.get("message") or "")
        mapped = ERROR_STATUS.get(type_, kept)
    else:
        type_ = "api_error"
        message = f"The upstream (kind '{KIND}') answered HTTP {status} without an error body."
        mapped = kept
    retry_after = header(headers, b"retry-after")
    extra = ((b"retry-after", retry_after),) if retry_after is not None else ()
    return ProviderError(mapped, type_, message, headers=extra)


def _message(content: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """(OpenAI message, whether the JSON tool answered) of the answer's content blocks."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    thinking: list[dict[str, Any]] = []
    json_answer = False
    for block in content:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_use":
            if block.get("name") == JSON_TOOL:
                texts.append(_dumps(block.get("input") or {}).decode())
                json_answer = True
            else:
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": _dumps(block.get("input") or {})
                                           .decode()}})
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
            thinking.append(block)
        elif kind == "redacted_thinking":
            thinking.append(block)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None,
                               "refusal": None, "annotations": []}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(reasoning)
        message["thinking_blocks"] = thinking
    return message, json_answer


# --- the stream ---------------------------------------------------------------------------------

# States of AnthropicStream (`_state`) and the events that move it:
#
#   state     message_start  block_start        block_delta          block_stop  message_delta  message_stop  error
#   START     -> OPEN        FAILED             FAILED               FAILED      FAILED         FAILED        FAILED
#   OPEN      FAILED         -> TEXT/TOOL/JSON/ FAILED               OPEN        -> FINISHED    -> DONE       FAILED
#                               THINKING/OTHER
#   TEXT      FAILED         (as OPEN)          content delta        -> OPEN     -> FINISHED    -> DONE       FAILED
#   TOOL      FAILED         (as OPEN)          arguments delta      -> OPEN     -> FINISHED    -> DONE       FAILED
#   JSON      FAILED         (as OPEN)          content delta        -> OPEN     -> FINISHED    -> DONE       FAILED
#   THINKING  FAILED         (as OPEN)          reasoning delta      thinking_   -> FINISHED    -> DONE       FAILED
#                                                                    blocks, OPEN
#   OTHER     FAILED         (as OPEN)          dropped              -> OPEN     -> FINISHED    -> DONE       FAILED
#   FINISHED  FAILED         FAILED             FAILED               FAILED      FINISHED       -> DONE       FAILED
#
# `ping` and unknown events are dropped in every state; DONE and FAILED take nothing more. A
# delta's kind decides what it writes (text_delta anywhere is text), the state only tells tool
# arguments from the JSON tool's text. A text delta leaves as soon as it is read.
START, OPEN, TEXT, TOOL, JSON, THINKING, OTHER, FINISHED, DONE, FAILED = range(10)
_BLOCK_STATE = {"text": TEXT, "tool_use": TOOL, "thinking": THINKING}


class AnthropicStream:
    """Anthropic Messages events -> `chat.completion.chunk` events (see the table above)."""

    __slots__ = ("usage", "_split", "_chunks", "_model", "_include_usage", "_state", "_tools",
                 "_thinking", "_signature", "_thinking_blocks", "_json", "_finish", "_raw")

    def __init__(self, client_model: str, include_usage: bool) -> None:
        self.usage: Usage | None = None
        self._split = sse.Splitter()
        self._chunks: Chunks | None = None
        self._model = client_model
        self._include_usage = include_usage
        self._state = START
        self._tools = -1  # index of the current tool call
        self._thinking: list[str] = []
        self._signature = ""
        self._thinking_blocks = 0
        self._json = False  # the JSON tool answered
        self._finish = "stop"
        self._raw: dict[str, Any] = {}  # Anthropic's usage numbers as last reported

    def feed(self, data: bytes) -> bytes:
        if self._state >= DONE:
            return b""
        # The common read holds one whole event (the upstream writes one per DATA frame): no
        # splitter, no list, no join (~1.5 us of the ~3 an event cost; bench_providers).
        one = self._split.one(data)
        if one is not None:
            return self._event(*one)
        out = []
        for block in self._split.feed(data):
            piece = self._event(*sse.fields(block))
            if piece:
                out.append(piece)
            if self._state >= DONE:
                break
        return b"".join(out)

    def _event(self, name: bytes, payload: bytes) -> bytes:
        handler = _HANDLERS.get(name)
        if handler is None or self._state >= DONE:
            return b""  # ping (dropped unread), and events newer than this translator
        try:
            return handler(self, _loads(payload))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return self._fail(ProviderError(
                502, "api_error", f"The upstream (kind '{KIND}') sent a malformed "
                f"{name.decode('latin-1')} event."))

    def end(self) -> bytes:
        if self._state >= DONE:
            return b""
        return self._fail(ProviderError(502, "api_error", f"The upstream (kind '{KIND}') "
                                        "stream ended before message_stop."))

    def _fail(self, exc: ProviderError) -> bytes:
        self._state = FAILED
        return error_event(exc)

    def _protocol(self, event: str) -> bytes:
        return self._fail(ProviderError(502, "api_error", f"The upstream (kind '{KIND}') sent "
                                        f"{event} out of order."))

    # -- handlers (one per event name) ----------------------------------------------------

    def _message_start(self, ev: dict[str, Any]) -> bytes:
        if self._state != START:
            return self._protocol("message_start")
        message = ev["message"]
        self._raw = dict(message.get("usage") or {})
        self._chunks = Chunks(message["id"], int(time.time()), self._model)
        self._state = OPEN
        return self._chunks.delta({"role": "assistant", "content": ""})

    def _block_start(self, ev: dict[str, Any]) -> bytes:
        if not OPEN <= self._state <= OTHER:
            return self._protocol("content_block_start")
        block = ev["content_block"]
        kind = block.get("type")
        state = _BLOCK_STATE.get(kind, OTHER)
        assert self._chunks is not None
        if state == TOOL and block.get("name") == JSON_TOOL:
            self._state = JSON
            self._json = True
            return b""
        self._state = state
        if state == TEXT:
            return self._chunks.content(block["text"]) if block.get("text") else b""
        if state == TOOL:
            self._tools += 1
            given = block.get("input")
            call = {"index": self._tools, "id": block["id"], "type": "function",
                    "function": {"name": block["name"],
                                 "arguments": _dumps(given).decode() if given else ""}}
            return self._chunks.delta({"tool_calls": [call]})
        if state == THINKING:
            self._thinking = [block.get("thinking") or ""]
            self._signature = block.get("signature") or ""
            return (self._chunks.delta({"reasoning_content": block["thinking"]})
                    if block.get("thinking") else b"")
        if kind == "redacted_thinking":
            return self._thinking_block({"type": "redacted_thinking", "data": block["data"]})
        return b""

    def _block_delta(self, ev: dict[str, Any]) -> bytes:
        if not OPEN <= self._state <= OTHER:
            return self._protocol("content_block_delta")
        delta = ev["delta"]
        kind = delta.get("type")
        chunks = self._chunks
        assert chunks is not None
        if kind == "text_delta":
            return chunks.content(delta["text"])
        if kind == "input_json_delta":
            fragment = delta["partial_json"]
            if not fragment:
                return b""
            if self._state == JSON:
                return chunks.content(fragment)
            if self._state == TOOL:
                return chunks.delta({"tool_calls": [{"index": self._tools,
                                                     "function": {"arguments": fragment}}]})
            return b""
        if kind == "thinking_delta":
            self._thinking.append(delta["thinking"])
            return chunks.delta({"reasoning_content": delta["thinking"]})
        if kind == "signature_delta":
            self._signature = delta["signature"]
        return b""  # citations_delta and kinds newer than this translator

    def _block_stop(self, ev: dict[str, Any]) -> bytes:
        if not OPEN <= self._state <= OTHER:
            return self._protocol("content_block_stop")
        state, self._state = self._state, OPEN
        if state == THINKING:
            return self._thinking_block({"type": "thinking",
                                         "thinking": "".join(self._thinking),
                                         "signature": self._signature})
        return b""

    def _thinking_block(self, block: dict[str, Any]) -> bytes:
        # `index` lets the OpenAI SDK's stream accumulator keep several blocks apart.
        block["index"] = self._thinking_blocks
        self._thinking_blocks += 1
        assert self._chunks is not None
        return self._chunks.delta({"thinking_blocks": [block]})

    def _message_delta(self, ev: dict[str, Any]) -> bytes:
        if not OPEN <= self._state <= FINISHED:
            return self._protocol("message_delta")
        # Usage numbers here are cumulative: they replace, and absent ones keep their value.
        self._raw.update((k, v) for k, v in (ev.get("usage") or {}).items() if v is not None)
        reason = (ev.get("delta") or {}).get("stop_reason")
        if self._state == FINISHED or reason is None:
            return b""
        self._state = FINISHED
        finish = FINISH.get(reason, "stop")
        self._finish = "stop" if self._json and finish == "tool_calls" else finish
        assert self._chunks is not None
        return self._chunks.finish(self._finish)

    def _message_stop(self, ev: dict[str, Any]) -> bytes:
        if not OPEN <= self._state <= FINISHED:
            return self._protocol("message_stop")
        assert self._chunks is not None
        out = b"" if self._state == FINISHED else self._chunks.finish(self._finish)
        self._state = DONE
        self.usage = usage_of(self._raw)
        if self._include_usage:
            out += self._chunks.usage(self.usage)
        return out + END

    def _error(self, ev: dict[str, Any]) -> bytes:
        return self._fail(error_of(200, [], _dumps(ev)))


_HANDLERS: dict[bytes, Callable[[AnthropicStream, dict[str, Any]], bytes]] = {
    b"message_start": AnthropicStream._message_start,
    b"content_block_start": AnthropicStream._block_start,
    b"content_block_delta": AnthropicStream._block_delta,
    b"content_block_stop": AnthropicStream._block_stop,
    b"message_delta": AnthropicStream._message_delta,
    b"message_stop": AnthropicStream._message_stop,
    b"error": AnthropicStream._error,
}


# --- the translator -----------------------------------------------------------------------------


class AnthropicTranslator:
    """One `kind = "anthropic"` target: its key, API version and default output limit."""

    kind = KIND
    __slots__ = ("_headers", "_path", "default_max_tokens", "version")

    def __init__(self, api_key: str, *, version: str = DEFAULT_VERSION,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, base_path: str = "") -> None:
        self.version = version
        self.default_max_tokens = default_max_tokens
        self._path = base_path.rstrip("/").encode() + b"/v1/messages"
        # Encoded once per target; the key lives only in this header list (never in a repr).
        self._headers: Headers = [(b"content-type", b"application/json"),
                                  (b"x-api-key", api_key.encode()),
                                  (b"anthropic-version", version.encode())]

    def __repr__(self) -> str:
        return f"AnthropicTranslator(version={self.version!r})"

    def _upstream_headers(self, client_headers: Headers) -> Headers:
        beta = header(client_headers, b"anthropic-beta")
        return self._headers if beta is None else [*self._headers, (b"anthropic-beta", beta)]

    def chat(self, body: dict[str, Any], model: str, stream: bool,
             client_headers: Headers) -> UpstreamCall:
        req = _Request(model)
        for name, value in body.items():
            if value is None:
                continue  # an explicit null is the parameter's absence
            handler = _PARAMS.get(name)
            if handler is None:
                raise _refuse(name, "the parameter")
            handler(req, value, name)
        system, req.out["messages"] = translate_messages(body.get("messages"))
        if system:
            req.out["system"] = system
        _finish_request(req, self.default_max_tokens)
        if stream:
            req.out["stream"] = True
        return UpstreamCall(b"POST", self._path, self._upstream_headers(client_headers),
                            _dumps(req.out))

    def chat_answer(self, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
        if status >= 300:
            return error_answer(error_of(status, headers, body))
        answer = loads_object(body)
        if answer is None or not isinstance(answer.get("content"), list):
            return error_answer(ProviderError(502, "api_error", f"The upstream (kind '{KIND}') "
                                              "answered with a body that is not a message."))
        message, json_answer = _message(answer["content"])
        finish = FINISH.get(answer.get("stop_reason") or "end_turn", "stop")
        if json_answer and finish == "tool_calls":
            finish = "stop"
        usage = usage_of(answer.get("usage") or {})
        body = completion(str(answer.get("id")), int(time.time()), client_model, message,
                          finish, usage)
        return Answer(200, JSON_HEADERS, body, usage)

    def chat_stream(self, client_model: str, include_usage: bool) -> AnthropicStream:
        return AnthropicStream(client_model, include_usage)

    def messages(self, body: bytes, client_headers: Headers, count_tokens: bool = False
                 ) -> UpstreamCall:
        """A Messages API request forwarded as it is: the body untouched (the same object),
        the client's credential replaced by this target's, its anthropic-version kept."""
        version = header(client_headers, b"anthropic-version")
        headers = self._upstream_headers(client_headers)
        if version is not None:
            headers = [h if h[0] != b"anthropic-version" else (h[0], version) for h in headers]
        path = self._path + b"/count_tokens" if count_tokens else self._path
        return UpstreamCall(b"POST", path, headers, body)

    def embeddings(self, body: dict[str, Any], model: str,
                   client_headers: Headers) -> UpstreamCall:
        raise _refuse("model", "an embeddings request (the Messages API has no embeddings)")

    def embeddings_answer(self, status: int, headers: Headers, body: bytes,
                          client_model: str) -> Answer:
        raise _refuse("model", "an embeddings request (the Messages API has no embeddings)")

