"""The OpenAI side of the translators: reading a chat request, writing answers and chunks.

Every non-OpenAI translator reads the same OpenAI chat.completions request and writes the same
OpenAI answer shapes; this module holds those halves once, so a provider module only maps its
own fields. Reading refuses, with `Untranslatable` (a 400 naming the field and the upstream
kind), whatever the provider cannot express, before anything is sent.
"""

from __future__ import annotations

import base64
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from velox.core.errors import VeloxError, to_response
from velox.providers.base import Answer, Headers, Untranslatable, Usage
from velox.providers.chat import openai_usage

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_DONE = b"data: [DONE]\n\n"

# Parameters every non-OpenAI kind accepts without sending them anywhere: they shape the
# answer on Velox's side (`stream`, `stream_options`), or say what the answer already is.
_HANDLED = frozenset(("model", "messages", "stream", "stream_options"))
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    # A parameter at its default asks for nothing: accepted (SDKs and frameworks send these).
    "n": (1,), "logprobs": (False,), "modalities": (["text"],), "store": (False,),
    "service_tier": ("auto", "default"), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "parallel_tool_calls": (True,),
}


def refuse(field: str, kind: str, why: str = "") -> Untranslatable:
    detail = f": {why}" if why else ""
    return Untranslatable(f"'{field}' cannot be sent to a {kind} upstream{detail}.", param=field)


def check_fields(body: dict[str, Any], kind: str, translated: frozenset[str]) -> None:
    """Refuse every field that is neither translated nor at a value that asks for nothing."""
    for name, value in body.items():
        if value is None or name in translated or name in _HANDLED:
            continue
        if value in _NEUTRAL_VALUES.get(name, ()):
            continue
        raise refuse(name, kind, "the upstream has no equivalent")


def chat_messages(body: dict[str, Any], kind: str, translated: frozenset[str]) -> list[Any]:
    """A chat request's messages, once every field was found translatable."""
    check_fields(body, kind, translated)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("'messages' must be a non-empty list.", param="messages")
    return messages


# --- request parts ----------------------------------------------------------------------


@dataclass(slots=True)
class Image:
    """An image part: inline (`data` is base64, as the data: URL carried it) or a URL."""

    mime: str
    data: str | None = None
    url: str | None = None


def text_of(content: Any, where: str, kind: str) -> str:
    """A message whose parts may only be text (system, developer, tool)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts = []
    for i, part in enumerate(_parts(content, where)):
        if part.get("type") != "text":
            raise refuse(f"{where}.content[{i}].type", kind,
                         f"only text parts are accepted here, not {part.get('type')!r}")
        parts.append(_text_field(part, f"{where}.content[{i}]"))
    return "".join(parts)


def parts_of(content: Any, where: str, kind: str) -> list[str | Image]:
    """A user/assistant message's content as text pieces and images, in order."""
    if isinstance(content, str):
        return [content]
    if content is None:
        return []
    out: list[str | Image] = []
    for i, part in enumerate(_parts(content, where)):
        kind_of = part.get("type")
        here = f"{where}.content[{i}]"
        if kind_of == "text":
            out.append(_text_field(part, here))
        elif kind_of == "image_url":
            out.append(_image(part.get("image_url"), here, kind))
        elif kind_of == "refusal":
            out.append(_text_field(part, here, "refusal"))
        else:
            raise refuse(f"{here}.type", kind, f"content parts of type {kind_of!r} are not "
                         "translated")
    return out


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise Untranslatable(f"'{where}.content' must be a string or a list of parts.",
                             param=f"{where}.content")
    return content


def _text_field(part: dict[str, Any], where: str, name: str = "text") -> str:
    text = part.get(name)
    if not isinstance(text, str):
        raise Untranslatable(f"'{where}.{name}' must be a string.", param=f"{where}.{name}")
    return text


_MIME_BY_SUFFIX = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                   "gif": "image/gif", "webp": "image/webp", "heic": "image/heic",
                   "heif": "image/heif"}


def _image(value: Any, where: str, kind: str) -> Image:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise Untranslatable(f"'{where}.image_url.url' must be a string.",
                             param=f"{where}.image_url.url")
    if url.startswith("data:"):
        head, comma, data = url[5:].partition(",")
        mime, _, encoding = head.partition(";")
        if not comma or encoding != "base64" or not mime:
            raise Untranslatable(f"'{where}.image_url.url' must be a base64 data: URL "
                                 "(data:<mime type>;base64,<data>).",
                                 param=f"{where}.image_url.url")
        return Image(mime=mime.lower(), data=data)
    if url.startswith("https://"):
        suffix = url.rsplit("?", 1)[0].rsplit(".", 1)[-1].lower()
        return Image(mime=_MIME_BY_SUFFIX.get(suffix, ""), url=url)
    raise refuse(f"{where}.image_url.url", kind, "images are accepted as data: URLs or "
                 "https URLs")


_ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))


def each_message(messages: list[Any], kind: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(role, where, message) of each message; an unknown role (the deprecated "function"
    included) is refused."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise refuse(f"{where}.role", kind, f"role {role!r} is not translated")
        yield role, where, message


class Turns:
    """A provider's conversation built from OpenAI messages: items of consecutive messages of
    one role merged into one turn (Gemini and Converse want roles to alternate)."""

    __slots__ = ("key", "list")

    def __init__(self, key: str) -> None:
        self.key = key  # where a turn keeps its items: "parts", "content"
        self.list: list[dict[str, Any]] = []

    def add(self, role: str, items: list[dict[str, Any]]) -> None:
        if not items:
            return
        if self.list and self.list[-1]["role"] == role:
            self.list[-1][self.key].extend(items)
        else:
            self.list.append({"role": role, self.key: items})


def tool_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call id -> function name, from every assistant message's tool_calls (a tool
    result names only the id; providers that want the name get it from here)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict):
                fn = call.get("function") or {}
                if isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
                    names[call["id"]] = fn["name"]
    return names


def tool_call_parts(call: Any, where: str) -> tuple[str, str, Any]:
    """(id, name, arguments parsed) of one assistant tool call."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Untranslatable(f"'{where}.function.name' is required.",
                             param=f"{where}.function.name")
    raw = fn.get("arguments") or "{}"
    try:
        args = orjson.loads(raw) if isinstance(raw, str) else raw
    except orjson.JSONDecodeError:
        raise Untranslatable(f"'{where}.function.arguments' is not valid JSON.",
                             param=f"{where}.function.arguments") from None
    call_id = call.get("id")
    return (call_id if isinstance(call_id, str) else ""), fn["name"], args


def functions(tools: Any, kind: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(name, description, JSON schema of the parameters) of each function tool."""
    if not isinstance(tools, list):
        raise Untranslatable("'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise refuse(f"tools[{i}].type", kind, "only function tools are translated")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Untranslatable(f"'tools[{i}].function.name' is required.",
                                 param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        out.append((fn["name"], fn.get("description"),
                    params if isinstance(params, dict) else {"type": "object",
                                                            "properties": {}}))
    return out


def tool_choice(value: Any, kind: str) -> str | tuple[str, str] | None:
    """'auto', 'none', 'required', ('function', name), or None when not given."""
    if value is None:
        return None
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        if isinstance(name, str):
            return ("function", name)
    raise refuse("tool_choice", kind, "expected 'auto', 'none', 'required' or a named "
                 "function")


def response_format(value: Any, kind: str) -> tuple[str, dict[str, Any] | None, str | None]:
    """('text'|'json_object'|'json_schema', schema, name)."""
    if value is None:
        return "text", None, None
    kind_of = value.get("type") if isinstance(value, dict) else None
    if kind_of in ("text", "json_object"):
        return kind_of, None, None
    if kind_of == "json_schema":
        spec = value.get("json_schema")
        if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
            name = spec.get("name")
            return kind_of, spec["schema"], name if isinstance(name, str) else None
        raise Untranslatable("'response_format.json_schema.schema' is required.",
                             param="response_format.json_schema.schema")
    raise refuse("response_format.type", kind, f"{kind_of!r} is not translated")


def stop_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise Untranslatable("'stop' must be a string or a list of strings.", param="stop")


def embedding_texts(body: dict[str, Any], kind: str) -> list[str]:
    """An embeddings request's `input` as a list of strings (token arrays are refused: no
    provider but OpenAI embeds tokens of OpenAI's tokenizer)."""
    check_fields(body, kind, frozenset(("input", "dimensions", "encoding_format", "user")))
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise refuse("input", kind, "the input must be a string or a list of strings (token "
                     "arrays cannot be embedded)")
    return texts


def max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise Untranslatable("'max_tokens' must be a positive integer.", param="max_tokens")
    return value


# --- answers ------------------------------------------------------------------------------


def finish_reason(table: dict[str, str], reason: str | None, called: bool) -> str:
    """A provider's stop reason through its table (unknown or none: "stop"); a stop with tool
    calls in the answer is "tool_calls", as OpenAI reports it."""
    mapped = table.get(reason, "stop") if reason else "stop"
    return "tool_calls" if called and mapped == "stop" else mapped


def completion_id() -> str:
    # 24 hex digits of randomness: unique without a shared counter across workers.
    return "chatcmpl-" + os.urandom(12).hex()


# One usage shape for every translator (cache writes included where the provider reports them).
usage_json = openai_usage


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_answer(client_model: str, text: str | None, calls: list[dict[str, Any]],
                finish: str, usage: Usage) -> Answer:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    body = orjson.dumps({
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
        "model": client_model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish}],
        "usage": usage_json(usage),
    })
    return Answer(200, JSON_HEADERS, body, usage)


def embeddings_answer(vectors: list[list[float]], client_model: str, encoding_format: str,
                      tokens: int) -> Answer:
    """The OpenAI embeddings answer; "base64" packs little-endian float32, as OpenAI does."""
    data = []
    for index, vector in enumerate(vectors):
        value: Any = vector
        if encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    body = orjson.dumps({"object": "list", "data": data, "model": client_model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    return Answer(200, JSON_HEADERS, body, Usage(input=tokens))


class ChunkWriter:
    """Writes one answer's `chat.completion.chunk` events (bytes ready for the client)."""

    __slots__ = ("_head", "_started", "include_usage")

    def __init__(self, client_model: str, include_usage: bool) -> None:
        # The fields every chunk repeats, encoded once: each chunk is head + its own tail.
        self._head = orjson.dumps({"id": completion_id(), "object": "chat.completion.chunk",
                                   "created": int(time.time()),
                                   "model": client_model})[:-1]
        self._started = False
        self.include_usage = include_usage

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        if not self._started:
            self._started = True
            delta = {"role": "assistant", **delta}
        tail = orjson.dumps({"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]})
        extra = b',"usage":null' if self.include_usage else b""
        return b"data: " + self._head + extra + b"," + tail[1:] + b"\n\n"

    def text(self, text: str) -> bytes:
        return self._chunk({"content": text})

    def tool_call(self, index: int, call_id: str, name: str, arguments: str) -> bytes:
        """The first delta of a tool call: index, id, name (and arguments known so far)."""
        return self._chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name,
                                                         "arguments": arguments}}]})

    def arguments(self, index: int, fragment: str) -> bytes:
        return self._chunk({"tool_calls": [{"index": index,
                                            "function": {"arguments": fragment}}]})

    def finish(self, reason: str) -> bytes:
        return self._chunk({}, reason)

    def end(self, usage: Usage | None) -> bytes:
        """After the finish chunk: the usage chunk when asked for, then [DONE]."""
        if not self.include_usage:
            return SSE_DONE
        tail = orjson.dumps({"choices": [], "usage": usage_json(usage or Usage())})
        return b"data: " + self._head + b"," + tail[1:] + b"\n\n" + SSE_DONE


# --- errors --------------------------------------------------------------------------------

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "invalid_request_error",
                   409: "invalid_request_error", 413: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error"}


class UpstreamAPIError(VeloxError):
    """A provider's own error, told in OpenAI's shape (status chosen so the OpenAI SDK raises
    the same class: 400 BadRequestError, 401, 403, 404, 429 RateLimitError, 5xx)."""

    def __init__(self, status: int, message: str, code: str | None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message or f"The upstream answered HTTP {status}.",
                         retry_after_s=retry_after_s)
        self.status = status
        self.type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500
                                        else "invalid_request_error")
        self.code = code


def error_answer(status: int, message: str, code: str | None,
                 retry_after_s: int | None = None) -> Answer:
    response = to_response(UpstreamAPIError(status, message, code, retry_after_s))
    return Answer(response.status, list(response.headers), response.body)


def error_event(status: int, message: str, code: str | None) -> bytes:
    """A mid-stream provider error as the OpenAI error event (no [DONE] follows)."""
    return b"data: " + to_response(UpstreamAPIError(status, message, code)).body + b"\n\n"


# --- the common part of streamed answers ---------------------------------------------------

OPEN, FINISHED, FAILED = range(3)  # the states every streamed answer shares


class StreamBase:
    """What every translated stream shares: the chunk writer, the usage, the three states, and
    how the client's stream ends (usage chunk and [DONE] only after a whole answer; otherwise
    one error event and no [DONE])."""

    __slots__ = ("usage", "_writer", "_state")
    provider = "the"  # named in the truncation error

    def __init__(self, client_model: str, include_usage: bool) -> None:
        self.usage: Usage | None = None
        self._writer = ChunkWriter(client_model, include_usage)
        self._state = OPEN

    def _fail(self, out: list[bytes], status: int, message: str, code: str | None) -> None:
        out.append(error_event(status, message, code))
        self._state = FAILED

    def _ending(self, whole: bool) -> bytes:
        """`whole`: nothing of an unfinished event or frame is held."""
        if self._state == FINISHED and whole:
            return self._writer.end(self.usage)
        if self._state == FAILED:
            return b""
        self._state = FAILED
        return error_event(502, f"The {self.provider} upstream's stream ended before the "
                           "answer was complete.", "upstream_truncated")
