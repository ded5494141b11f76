"""The requests every target is sent, so each one does exactly the same work.

A short OpenAI chat completion request (about 400 bytes, like the ceilings that set the
project's goals), POSTed to /v1/chat/completions, streamed or not. Long-lived streams (for the
"many concurrent streams" run) are asked of the mock with its per-request control headers; the
LiteLLM target cannot forward those, so its config maps the model name `STREAM_SLOW_MODEL` to
the same headers (see litellm.py).
"""

from __future__ import annotations

import json

PATH = "/v1/chat/completions"
MODEL = "gpt-4o-mini"
STREAM_SLOW_MODEL = "bench-slow-stream"
API_KEY = "sk-bench-not-a-secret"  # the mock accepts anything; nothing real is ever sent

_MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
    {"role": "user", "content": "In one sentence, what does an API gateway do for an "
                                "application that calls a large language model over HTTP?"},
]


def body(stream: bool = False, model: str = MODEL) -> bytes:
    doc: dict[str, object] = {"model": model, "messages": _MESSAGES, "temperature": 0.2,
                              "max_tokens": 64}
    if stream:
        doc["stream"] = True
    return json.dumps(doc, separators=(",", ":")).encode()


def slow_stream_headers(chunks: int, delay_ms: int) -> dict[str, str]:
    return {"x-mock-chunks": str(chunks), "x-mock-chunk-delay-ms": str(delay_ms)}


def http_request(host: str, port: int, payload: bytes, extra: dict[str, str] | None = None,
                 path: str = PATH) -> bytes:
    """One complete HTTP/1.1 keep-alive POST, ready to write."""
    lines = [
        f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
        f"Authorization: Bearer {API_KEY}", f"Content-Length: {len(payload)}",
    ]
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def static_response() -> str:
    """A chat completion like the mock's, for nginx's canned `return 200` (no single quotes)."""
    doc = {
        "id": "chatcmpl-static", "object": "chat.completion", "created": 1795383085,
        "model": MODEL, "system_fingerprint": "fp_static",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": "Hello from nginx."}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46},
    }
    return json.dumps(doc, separators=(",", ":"))
