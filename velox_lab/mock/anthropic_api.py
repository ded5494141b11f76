"""The mock upstream as the Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

Checked first, as Anthropic does: a credential (`x-api-key`, or `Authorization: Bearer`, which the
newer SDKs send) else 401 `authentication_error`; an `anthropic-version` header else 400; then the
body (`model`, `messages`, and `max_tokens` on /v1/messages). Errors are in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}, "request_id"}`) with Anthropic's statuses and
types (`ERROR_TYPES`; 429 carries `retry-after: 1`).

What the answer holds is decided by the request, deterministically:
* a model name containing `error-NNN` answers HTTP NNN (`claude-error-529` -> overloaded_error);
  `x-mock-status` does the same for any model. A model containing `stream-error` sends, when
  streamed, one text delta and then an `error` event (overloaded_error) and ends there.
  A model containing `refusal` stops with `refusal`.
* `thinking` of type enabled or adaptive: a thinking block (with its signature) comes first.
* `tools` with a `tool_choice` other than none, when the last user turn is not tool results (or
  when `tool_choice` is `any`/`tool`): a short text, then a `tool_use` of the named (else first)
  tool whose input fills the schema's properties (string "mock", integer 1, number 1.5, boolean
  true, array [], object {}); stop_reason tool_use. Otherwise text from the mock's filler words
  (`x-mock-chunks` sets how many deltas), cut by `max_tokens` (one token per piece: stop_reason
  max_tokens) or at the first of `stop_sequences` found in it (stop_reason stop_sequence).
* `output_config.format` json_schema: the text is the schema filled as above.
* image blocks in the last user turn: the text ends naming how many (" I see 1 image.").
* Usage: input ~ request bytes / 4. With `cache_control` on any block, the part of the request
  up to the last marked block is the cached prefix: written the first time this process sees it
  (`cache_creation_input_tokens`), read after that (`cache_read_input_tokens`); input_tokens is
  the rest, as Anthropic counts it. Thinking reports `output_tokens_details.thinking_tokens`.
Streams: message_start, a ping, each block as content_block_start / deltas / content_block_stop
(tool input as `input_json_delta` fragments, the first one empty, as Anthropic sends), a second
ping after the first block, message_delta (stop_reason, cumulative usage), message_stop; one
event per DATA frame / chunk.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Any

import orjson

from . import behaviour, payloads

_dumps = orjson.dumps
_JSON = ((b"content-type", b"application/json"),)
_SSE = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))
_RETRY = ((b"retry-after", b"1"),)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
               529: "overloaded_error"}
_MESSAGES = {429: "Number of requests has exceeded your rate limit (injected by the mock).",
             529: "Overloaded", 401: "invalid x-api-key"}
_MODEL_ERROR = re.compile(r"error-(\d{3})")
_CACHE_SIZE = 1024  # cached prefixes remembered per process
_cache: OrderedDict[bytes, None] = OrderedDict()


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_plan(status: int, message: str | None = None, latency_ms: int = 0) -> behaviour.Plan:
    request_id, _, _ = behaviour._ids()
    body = _dumps({"type": "error",
                   "error": {"type": error_type(status),
                             "message": message or _MESSAGES.get(status) or
                             f"Mock Anthropic upstream returned HTTP {status}."},
                   "request_id": request_id.decode()})
    return behaviour.Plan(status, _JSON + (_RETRY if status == 429 else ()),
                          [(b"request-id", request_id)], body=body)


def _credential(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"x-api-key" and value.strip():
            return True
        if name == b"authorization" and value[:7].lower() == b"bearer " and value[7:].strip():
            return True
    return False


def plan(method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
         latency_ms: int, chunks: int, status: int) -> behaviour.Plan:
    count = path in (b"/v1/messages/count_tokens", b"/v1/messages/count_tokens/")
    if method != b"POST" or not (count or path in (b"/v1/messages", b"/v1/messages/")):
        return error_plan(404, f"Not found: {method.decode('latin-1')} "
                          f"{path.decode('latin-1')}")
    if not _credential(headers):
        return error_plan(401, "x-api-key header is required")
    if not any(name == b"anthropic-version" and value for name, value in headers):
        return error_plan(400, "anthropic-version: header is required")
    if status >= 400:
        return error_plan(status)
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return error_plan(400, "There was an issue with the JSON body of your request.")
    problem = _check(req, count)
    if problem is not None:
        return error_plan(400, problem)
    model = req["model"]
    named = _MODEL_ERROR.search(model)
    if named is not None and int(named.group(1)) >= 400:
        return error_plan(int(named.group(1)))
    request_id, uid, _ = behaviour._ids()
    if count:
        result = behaviour.Plan(200, _JSON, [(b"request-id", request_id)],
                                body=_dumps({"input_tokens": -(-len(body) // 4)}))
    else:
        answer, pieces = _answer(req, body, "msg_mock" + uid, chunks)
        if req.get("stream") is True:
            result = behaviour.Plan(200, _SSE, [(b"request-id", request_id)],
                                    parts=_events(answer, pieces, "stream-error" in model),
                                    stream=True)
        else:
            result = behaviour.Plan(200, _JSON, [(b"request-id", request_id)],
                                    body=_dumps(answer))
    result.model = model
    return result


def _check(req: Any, count: bool) -> str | None:
    if not isinstance(req, dict):
        return "The request body must be a JSON object."
    if not isinstance(req.get("model"), str) or not req["model"]:
        return "model: Field required"
    if not isinstance(req.get("messages"), list):
        return "messages: Field required"
    if not count:
        max_tokens = req.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return "max_tokens: Field required"
    return None


# --- the answer ---------------------------------------------------------------------------


def fill(schema: Any) -> Any:
    """A value of the schema's type (objects: every property filled)."""
    if not isinstance(schema, dict):
        return "mock"
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if not props:
            return {"result": "mock"}
        return {name: fill(sub) for name, sub in props.items()}
    return {"string": "mock", "integer": 1, "number": 1.5, "boolean": True, "array": [],
            "null": None}.get(kind, "mock")


def _wants_tool(req: dict[str, Any]) -> dict[str, Any] | None:
    tools = [t for t in req.get("tools") or () if isinstance(t, dict) and t.get("name")]
    choice = req.get("tool_choice") or {"type": "auto"}
    if not tools or choice.get("type") == "none":
        return None
    if choice.get("type") == "tool":
        return next((t for t in tools if t["name"] == choice.get("name")), tools[0])
    if choice.get("type") == "any":
        return tools[0]
    last = req["messages"][-1] if req["messages"] else {}
    content = last.get("content") if isinstance(last, dict) else None
    answered = isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
    return None if answered else tools[0]


def _text(req: dict[str, Any], chunks: int) -> tuple[list[str], str, str | None]:
    """(text pieces, stop_reason, stop_sequence) of a plain answer."""
    fmt = (req.get("output_config") or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        whole = _dumps(fill(fmt.get("schema"))).decode()
        pieces = [whole[i:i + 8] for i in range(0, len(whole), 8)]
    else:
        pieces = list(payloads.pieces(max(1, chunks - 2)))
        images = _images(req)
        if images:  # as the Gemini and Bedrock faces do: the image blocks arrived
            pieces.append(f" I see {images} image{'s' if images > 1 else ''}.")
    if "refusal" in req["model"]:
        return ["I can't help with that."], "refusal", None
    whole = "".join(pieces)
    for stop in req.get("stop_sequences") or ():
        at = whole.find(stop) if stop else -1
        if at >= 0:
            return _cut(pieces, at), "stop_sequence", stop
    if len(pieces) > req["max_tokens"]:
        return pieces[:req["max_tokens"]], "max_tokens", None
    return pieces, "end_turn", None


def _images(req: dict[str, Any]) -> int:
    """How many image blocks the last user turn carried."""
    turns = [m for m in req.get("messages") or () if isinstance(m, dict)
             and m.get("role") == "user"]
    content = turns[-1].get("content") if turns else None
    if not isinstance(content, list):
        return 0
    return sum(1 for block in content if isinstance(block, dict) and block.get("type") == "image")


def _cut(pieces: list[str], at: int) -> list[str]:
    out, seen = [], 0
    for piece in pieces:
        if seen + len(piece) >= at:
            if at > seen:
                out.append(piece[:at - seen])
            break
        out.append(piece)
        seen += len(piece)
    return out


def _cached_prefix(req: dict[str, Any]) -> bytes | None:
    """The request up to its last block marked with cache_control (tools, system, messages,
    in Anthropic's prefix order), or None without a marker."""
    parts: list[Any] = [*(req.get("tools") or ())]
    system = req.get("system")
    parts += system if isinstance(system, list) else [system]
    for message in req["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        parts += content if isinstance(content, list) else [content]
    last = max((i for i, p in enumerate(parts) if isinstance(p, dict)
                and p.get("cache_control")), default=-1)
    return _dumps(parts[:last + 1]) if last >= 0 else None


def _usage(req: dict[str, Any], body: bytes, output: int, thinking: int) -> dict[str, Any]:
    total = -(-len(body) // 4)
    read = write = 0
    prefix = _cached_prefix(req)
    if prefix is not None:
        tokens = min(total, -(-len(prefix) // 4))
        key = hashlib.sha256(req["model"].encode() + b"\0" + prefix).digest()
        if key in _cache:
            _cache.move_to_end(key)
            read = tokens
        else:
            _cache[key] = None
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
            write = tokens
    usage: dict[str, Any] = {"input_tokens": total - read - write,
                             "cache_creation_input_tokens": write,
                             "cache_read_input_tokens": read, "output_tokens": output,
                             "service_tier": "standard"}
    if thinking:
        usage["output_tokens_details"] = {"thinking_tokens": thinking}
    return usage


def _answer(req: dict[str, Any], body: bytes, msg_id: str,
            chunks: int) -> tuple[dict[str, Any], list[str]]:
    """The message, and the pieces its text block is streamed in."""
    pieces: list[str] = []
    content: list[dict[str, Any]] = []
    thinking_tokens = 0
    if (req.get("thinking") or {}).get("type") in ("enabled", "adaptive"):
        thought = "The user wants a short answer; the mock gives its filler."
        content.append({"type": "thinking", "thinking": thought,
                        "signature": "mock-sig-" + hashlib.sha256(thought.encode())
                        .hexdigest()[:32]})
        thinking_tokens = len(thought.split())
    tool = _wants_tool(req)
    stop_sequence = None
    if tool is not None:
        if (req.get("tool_choice") or {}).get("type", "auto") == "auto":
            content.append({"type": "text", "text": "Calling the tool."})
        content.append({"type": "tool_use", "id": "toolu_mock" + msg_id[8:],
                        "name": tool["name"], "input": fill(tool.get("input_schema"))})
        stop_reason, output = "tool_use", 12
    else:
        pieces, stop_reason, stop_sequence = _text(req, chunks)
        content.append({"type": "text", "text": "".join(pieces)})
        output = len(pieces)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": req["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(req, body, output + thinking_tokens, thinking_tokens)}, pieces


# --- the stream ---------------------------------------------------------------------------


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps({"type": kind, **obj}) + b"\n\n"


_PING = _event("ping", {})


def _block_events(index: int, block: dict[str, Any], pieces: list[str]) -> list[bytes]:
    kind = block["type"]
    where = {"index": index}
    if kind == "text":
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in pieces or [block["text"]]]
    elif kind == "tool_use":
        start = {**block, "input": {}}
        whole = _dumps(block["input"]).decode()
        third = max(1, -(-len(whole) // 3))
        deltas = [{"type": "input_json_delta", "partial_json": ""}] + [
            {"type": "input_json_delta", "partial_json": whole[i:i + third]}
            for i in range(0, len(whole), third)]
    else:  # thinking
        start = {"type": "thinking", "thinking": "", "signature": ""}
        words = block["thinking"].split(" ")
        deltas = [{"type": "thinking_delta", "thinking": w if not i else " " + w}
                  for i, w in enumerate(words)]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    return ([_event("content_block_start", {**where, "content_block": start})]
            + [_event("content_block_delta", {**where, "delta": d}) for d in deltas]
            + [_event("content_block_stop", where)])


def _events(answer: dict[str, Any], pieces: list[str], fail: bool) -> list[bytes]:
    usage = answer["usage"]
    start_usage = {k: usage[k] for k in ("input_tokens", "cache_creation_input_tokens",
                                         "cache_read_input_tokens")}
    start = {**answer, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**start_usage, "output_tokens": 1, "service_tier": "standard"}}
    out = [_event("message_start", {"message": start}), _PING]
    for index, block in enumerate(answer["content"]):
        events = _block_events(index, block, pieces)
        if fail:
            # The start, one delta, then the overload Anthropic reports inside a 200 stream.
            return out + events[:2] + [_event("error", {"error": {
                "type": "overloaded_error", "message": "Overloaded"}})]
        out += events
        if index == 0:
            out.append(_PING)
    out.append(_event("message_delta", {
        "delta": {"stop_reason": answer["stop_reason"],
                  "stop_sequence": answer["stop_sequence"]},
        "usage": {k: v for k, v in usage.items() if k != "service_tier"}}))
    out.append(_event("message_stop", {}))
    return out
