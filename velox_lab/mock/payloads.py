"""OpenAI-shaped response bodies for the mock upstream (pure functions, no I/O).

Each builder takes the parsed request JSON plus a few knobs and returns either one JSON body
(`bytes`) or the list of server-sent-event frames a streaming call emits, one element per event,
so the shells can put each event in its own DATA frame / HTTP/1.1 chunk. Field names follow the
public OpenAI API reference closely enough for the official SDK to parse them; contents are
deterministic filler (token counts are rough character-based estimates).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

import orjson

_dumps = orjson.dumps
FINGERPRINT = "fp_velox_mock"
_WORDS = ("Hello", " from", " the", " Velox", " mock", " upstream", ".", " This", " reply",
          " is", " deterministic", " filler", " text", ",", " streamed", " in", " pieces", ".")
MODELS = ("gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-4.1-mini", "o4-mini",
          "text-embedding-3-small", "text-embedding-3-large")
MODELS_CREATED = 1_700_000_000
EMBEDDING_DIMENSIONS = 8

_pieces_cache: dict[int, tuple[str, ...]] = {}


def pieces(n: int) -> tuple[str, ...]:
    """`n` text pieces (n >= 1) cycling through a fixed word list; joined they form the reply."""
    cached = _pieces_cache.get(n)
    if cached is None:
        cached = tuple(_WORDS[i % len(_WORDS)] for i in range(max(1, n)))
        if len(_pieces_cache) < 256:
            _pieces_cache[n] = cached
    return cached


def _text_tokens(value: Any) -> int:
    """A rough token count: ~4 characters per token, as OpenAI's own rule of thumb."""
    if isinstance(value, str):
        return len(value) // 4 + 1
    if isinstance(value, list):
        total = 0
        for entry in value:  # the common shape, a list of messages, without recursion
            item = (entry.get("content") or entry.get("text") or "") if isinstance(entry, dict) \
                else entry
            total += len(item) // 4 + 1 if isinstance(item, str) else _text_tokens(item)
        return total
    if isinstance(value, dict):
        return _text_tokens(value.get("content") or value.get("text") or "")
    return 1


def sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _sse_event(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps(obj) + b"\n\n"


# A request with `prompt_cache_key` is answered as a prompt-cache hit (half its input read
# from the cache); one with `reasoning_effort` (chat) or `reasoning` (responses) as a
# reasoning model's, which thinks this many tokens before it answers (counted in the output).
REASONING_TOKENS = 5


def _parts(req: dict, prompt: int, reasoning: object) -> tuple[int, int]:
    """(cached input, reasoning) tokens the answer reports for `req`."""
    return (prompt // 2 if req.get("prompt_cache_key") else 0,
            REASONING_TOKENS if reasoning else 0)


def _chat_usage(req: dict, prompt: int, completion: int) -> dict:
    cached, reasoning = _parts(req, prompt, req.get("reasoning_effort"))
    return {
        "prompt_tokens": prompt, "completion_tokens": completion + reasoning,
        "total_tokens": prompt + completion + reasoning,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0},
    }


def _split_for_stream(chunks: int) -> tuple[str, ...]:
    # Events = first (role) + content pieces + last (finish_reason); fewer when chunks < 3.
    return pieces(max(1, chunks - 2))


def chat_completion(req: dict, model: str, uid: str, created: int, chunks: int) -> bytes:
    text_pieces = _split_for_stream(chunks)
    prompt = _text_tokens(req.get("messages"))
    return _dumps({
        "id": "chatcmpl-" + uid, "object": "chat.completion", "created": created,
        "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": "".join(text_pieces),
                                 "refusal": None, "annotations": []},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": _chat_usage(req, prompt, len(text_pieces)),
        "service_tier": "default", "system_fingerprint": FINGERPRINT,
    })


def chat_completion_stream(req: dict, model: str, uid: str, created: int,
                           chunks: int) -> list[bytes]:
    """`chunks` chat.completion.chunk events (+ a usage chunk if asked), then [DONE]."""
    chunks = max(1, chunks)
    with_usage = bool((req.get("stream_options") or {}).get("include_usage"))
    head = {"id": "chatcmpl-" + uid, "object": "chat.completion.chunk", "created": created,
            "model": model, "service_tier": "default", "system_fingerprint": FINGERPRINT}
    if with_usage:
        head["usage"] = None
    text_pieces = _split_for_stream(chunks)
    deltas: list[tuple[dict, str | None]]
    if chunks == 1:
        deltas = [({"role": "assistant", "content": text_pieces[0]}, "stop")]
    elif chunks == 2:
        deltas = [({"role": "assistant", "content": text_pieces[0]}, None), ({}, "stop")]
    else:
        deltas = [({"role": "assistant", "content": "", "refusal": None}, None)]
        deltas += [({"content": p}, None) for p in text_pieces]
        deltas.append(({}, "stop"))
    out = [sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]})
           for delta, finish in deltas]
    if with_usage:
        usage = _chat_usage(req, _text_tokens(req.get("messages")), len(text_pieces))
        out.append(sse({**head, "choices": [], "usage": usage}))
    out.append(SSE_DONE)
    return out


def completion(req: dict, model: str, uid: str, created: int, chunks: int) -> bytes:
    text_pieces = pieces(max(1, chunks - 1))
    prompt = _text_tokens(req.get("prompt"))
    return _dumps({
        "id": "cmpl-" + uid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"text": "".join(text_pieces), "index": 0, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(text_pieces),
                  "total_tokens": prompt + len(text_pieces)},
        "system_fingerprint": FINGERPRINT,
    })


def completion_stream(req: dict, model: str, uid: str, created: int,
                      chunks: int) -> list[bytes]:
    """`chunks` text_completion events (the last carries finish_reason), then [DONE]."""
    chunks = max(1, chunks)
    head = {"id": "cmpl-" + uid, "object": "text_completion", "created": created,
            "model": model, "system_fingerprint": FINGERPRINT}
    text_pieces = pieces(max(1, chunks - 1))
    if chunks > 1:
        items = [(p, None) for p in text_pieces] + [("", "stop")]
    else:
        items = [(text_pieces[0], "stop")]
    out = [sse({**head, "choices": [{"text": t, "index": 0, "logprobs": None,
                                     "finish_reason": f}]}) for t, f in items]
    if (req.get("stream_options") or {}).get("include_usage"):
        prompt = _text_tokens(req.get("prompt"))
        out.append(sse({**head, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": len(text_pieces),
            "total_tokens": prompt + len(text_pieces)}}))
    out.append(SSE_DONE)
    return out


def embedding_vector(item: Any, dimensions: int) -> list[float]:
    """A deterministic unit vector derived from the input's hash: the bytes of
    sha256(json(item) + counter as 4 big-endian bytes), counter 0, 1, ..., mapped to [-1, 1]
    and normalised. The same input always gets the same vector (call this to predict one)."""
    seed = _dumps(item)
    digest = b""
    counter = 0
    while len(digest) < dimensions:
        digest += hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        counter += 1
    raw = [(b - 127.5) / 127.5 for b in digest[:dimensions]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def embedding_inputs(value: Any) -> list[Any] | None:
    """Split `input` into items (string, list of strings, token list, list of token lists)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return [value]
        if all(isinstance(v, (str, list)) for v in value):
            return value
    return None


def embeddings(req: dict, model: str, items: list[Any]) -> bytes:
    dims = req.get("dimensions")
    dims = dims if isinstance(dims, int) and 0 < dims <= 4096 else EMBEDDING_DIMENSIONS
    as_base64 = req.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(items):
        vector: Any = embedding_vector(item, dims)
        if as_base64:  # little-endian float32, as the SDK decodes it
            vector = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(_text_tokens(i) if not isinstance(i, list) else len(i) for i in items)
    return _dumps({"object": "list", "data": data, "model": model,
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _response_object(req: dict, model: str, uid: str, created: int, status: str,
                     text: str | None) -> dict:
    output = []
    usage = None
    if text is not None:
        output = [{"type": "message", "id": "msg_" + uid, "status": "completed",
                   "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": [],
                                "logprobs": []}]}]
        prompt = _text_tokens(req.get("input")) + _text_tokens(req.get("instructions"))
        done = len(text.split(" "))
        cached, reasoning = _parts(req, prompt, req.get("reasoning"))
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": done + reasoning,
                 "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": prompt + done + reasoning}
    return {
        "id": "resp_" + uid, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": None, "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"), "model": model, "output": output,
        "parallel_tool_calls": True, "previous_response_id": req.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": True,
        "temperature": req.get("temperature", 1.0), "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "top_p": req.get("top_p", 1.0),
        "truncation": "disabled", "usage": usage, "user": None, "metadata": {},
    }


def response(req: dict, model: str, uid: str, created: int, chunks: int) -> bytes:
    text = "".join(pieces(chunks))
    return _dumps(_response_object(req, model, uid, created, "completed", text))


def response_stream(req: dict, model: str, uid: str, created: int,
                    chunks: int) -> list[bytes]:
    """Responses API events: created, in_progress, item/part added, `chunks` text deltas,
    text/part/item done, completed — each as `event:` + `data:` lines."""
    text_pieces = pieces(chunks)
    text = "".join(text_pieces)
    item_id = "msg_" + uid
    seq = iter(range(1 << 30))
    events: list[tuple[str, dict]] = []

    def add(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": next(seq), **fields}))

    pending = _response_object(req, model, uid, created, "in_progress", None)
    add("response.created", response=pending)
    add("response.in_progress", response=pending)
    item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant",
            "content": []}
    add("response.output_item.added", output_index=0, item=item)
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    add("response.content_part.added", **where,
        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    for piece in text_pieces:
        add("response.output_text.delta", **where, delta=piece, logprobs=[])
    add("response.output_text.done", **where, text=text, logprobs=[])
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    add("response.content_part.done", **where, part=part)
    add("response.output_item.done", output_index=0,
        item={**item, "status": "completed", "content": [part]})
    add("response.completed",
        response=_response_object(req, model, uid, created, "completed", text))
    return [_sse_event(kind, obj) for kind, obj in events]


def model_list() -> bytes:
    return _dumps({"object": "list", "data": [model_object(m) for m in MODELS]})


def model_object(model: str) -> dict:
    return {"id": model, "object": "model", "created": MODELS_CREATED,
            "owned_by": "openai" if not model.startswith("text-") else "openai-internal"}


_ERROR_KINDS = {
    400: ("invalid_request_error", None, "Bad request (injected by the mock upstream)."),
    401: ("invalid_request_error", "invalid_api_key",
          "Incorrect API key provided (injected by the mock upstream)."),
    403: ("permission_error", None, "You are not allowed to access this resource."),
    404: ("invalid_request_error", None, "The requested resource was not found."),
    408: ("timeout", None, "Request timed out."),
    409: ("invalid_request_error", None, "Conflict."),
    422: ("invalid_request_error", None, "Unprocessable entity."),
    429: ("requests", "rate_limit_exceeded",
          "Rate limit reached for requests (injected by the mock upstream). "
          "Please try again in 1s."),
    500: ("server_error", None,
          "The server had an error while processing your request. Sorry about that!"),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The server is overloaded or not ready yet."),
    504: ("server_error", None, "Gateway timeout."),
}


def error_body(status: int, message: str | None = None, *, etype: str | None = None,
               param: str | None = None, code: str | None = None) -> bytes:
    default_type, default_code, default_message = _ERROR_KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None,
                 f"Mock upstream returned HTTP {status}."))
    return _dumps({"error": {"message": message or default_message,
                             "type": etype or default_type, "param": param,
                             "code": code if code is not None else default_code}})


def azure_error_body(status: int, message: str) -> bytes:
    """Azure's own error shape (its gateway answers 401/404 this way, code as a string)."""
    return _dumps({"error": {"code": str(status), "message": message}})
