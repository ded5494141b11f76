"""What the mock upstream answers: request in, `Plan` out (pure; no I/O, no event loop).

`plan_request` routes an OpenAI-style request, applies the per-request control headers
(`x-mock-latency-ms`, `x-mock-latency-per-input-us`, `x-mock-status`, `x-mock-chunks`,
`x-mock-chunk-delay-ms`, `x-mock-fault`) on top of the process defaults, and returns a `Plan`:
status, headers, the body (one piece) or its parts (one DATA frame / HTTP/1.1 chunk each), delays
and an optional fault. The HTTP/1.1 and HTTP/2 shells only execute plans, so both protocols
behave identically by construction.

Azure OpenAI paths are answered too: POST `/openai/deployments/{d}/chat/completions`,
`/completions`, `/embeddings` and `/openai/responses`, GET `/openai/models`. They need an
`api-key` header (401 with Azure's error body otherwise, checked first, as Azure does) and an
`api-version` query parameter (404 "Resource not found" otherwise, Azure's answer to a missing
or unknown version). The body's `model` is optional there; the answer names the body's model, or
the deployment when the body has none.

Gemini (`/v1beta/models/...`) and Bedrock (`/model/...`) calls are answered by
`mock.providers` in those providers' shapes (its docstring tells how).

The Anthropic Messages API (POST `/v1/messages`, `/v1/messages/count_tokens`) is answered by
mock.anthropic_api, in Anthropic's shapes.

Latency: the response headers wait `latency_ms` plus, for embeddings, `latency_per_input_us`
per input item (a batch of 100 inputs costs more than one, as with a real embedding model).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from urllib.parse import unquote

import orjson

from . import payloads

FAULTS = frozenset(("reset", "reset-mid-stream", "goaway", "close", "hang", "slow-body"))
SLOW_BODY_DEFAULT_DELAY = 0.01  # seconds between pieces when no chunk delay is configured
RATE_LIMIT = 10000


@dataclass(slots=True)
class Defaults:
    """Process-wide defaults (from the command line) that control headers override."""

    latency_ms: int = 0
    chunks: int = 8
    chunk_delay_ms: int = 0
    latency_per_input_us: int = 0


class Plan:
    """A planned response. `body` xor `parts` is set (`parts` for streams and slow bodies)."""

    __slots__ = ("status", "static", "dynamic", "body", "parts", "content_length", "latency",
                 "part_delay", "fault", "stream", "model", "deployment", "inputs")

    def __init__(self, status: int, static: tuple[tuple[bytes, bytes], ...],
                 dynamic: list[tuple[bytes, bytes]], body: bytes | None = None,
                 parts: list[bytes] | None = None, stream: bool = False) -> None:
        self.status = status
        self.static = static  # constant headers: hashable, so encodings can be cached
        self.dynamic = dynamic  # per-response headers (request id, remaining quota)
        self.body = body
        self.parts = parts
        self.content_length: int | None = len(body) if body is not None else None
        self.latency = 0.0  # seconds before the response headers
        self.part_delay = 0.0  # seconds between parts
        self.fault: str | None = None
        self.stream = stream
        self.model: str | None = None  # the request body's model, for the request log
        self.deployment: str | None = None  # Azure: the deployment named in the path
        self.inputs = 0  # embeddings: input items (for the per-input latency)

    @property
    def simple(self) -> bool:
        """True when the whole response can be written at once, right now."""
        return self.body is not None and self.fault is None and not self.latency


_counter = itertools.count(1)
_salt = b"%08x" % (os.getpid() & 0xFFFFFFFF)


def reseed() -> None:
    """Make ids unique per process (call in a forked worker)."""
    global _salt  # noqa: PLW0603 - the per-process part of every id this module makes
    _salt = b"%08x" % (os.getpid() & 0xFFFFFFFF)


_static_cache: dict[tuple, tuple[tuple[bytes, bytes], ...]] = {}


def _static(content_type: bytes, latency_ms: int, extra: tuple = ()) -> tuple:
    key = (content_type, latency_ms, extra)
    headers = _static_cache.get(key)
    if headers is None:
        headers = ((b"content-type", content_type),
                   (b"openai-version", b"2020-10-01"),
                   (b"openai-organization", b"velox-mock"),
                   (b"openai-processing-ms", b"%d" % max(1, latency_ms)),
                   (b"x-ratelimit-limit-requests", b"%d" % RATE_LIMIT),
                   (b"x-ratelimit-limit-tokens", b"30000000"), *extra)
        if len(_static_cache) < 1024:
            _static_cache[key] = headers
    return headers


_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_RATE_LIMITED = ((b"retry-after", b"1"), (b"x-ratelimit-reset-requests", b"1s"))


def _ids() -> tuple[bytes, str, int]:
    n = next(_counter)
    request_id = b"req_%s%024x" % (_salt, n)
    return request_id, f"{_salt.decode()}{n:x}", n


def error_plan(status: int, message: str | None = None, latency_ms: int = 0, *,
               code: str | None = None, param: str | None = None) -> Plan:
    request_id, _, n = _ids()
    remaining = b"0" if status == 429 else b"%d" % (RATE_LIMIT - 1 - n % RATE_LIMIT)
    extra = _RATE_LIMITED if status == 429 else ()
    return Plan(status, _static(_JSON, latency_ms, extra),
                [(b"x-request-id", request_id), (b"x-ratelimit-remaining-requests", remaining)],
                body=payloads.error_body(status, message, code=code, param=param))


def _control_int(controls: dict[bytes, bytes], name: bytes, default: int, low: int,
                 high: int) -> int:
    raw = controls.get(name)
    if raw is None:
        return default
    value = int(raw)  # ValueError is reported to the client as a 400 by the caller
    if not low <= value <= high:
        raise ValueError(f"{name.decode()} must be between {low} and {high}")
    return value


def _split(data: bytes, count: int) -> list[bytes]:
    count = max(1, min(count, len(data)))
    size = -(-len(data) // count)
    return [data[i:i + size] for i in range(0, len(data), size)] or [data]


def plan_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes, defaults: Defaults) -> Plan:
    controls: dict[bytes, bytes] | None = None
    for name, value in headers:
        if name[:7] == b"x-mock-":
            if controls is None:
                controls = {}
            controls[name] = value
    latency_ms, chunks, delay_ms = defaults.latency_ms, defaults.chunks, defaults.chunk_delay_ms
    per_input_us = defaults.latency_per_input_us
    status = 0
    fault = None
    if controls is not None:
        try:
            latency_ms = _control_int(controls, b"x-mock-latency-ms", latency_ms, 0, 3_600_000)
            per_input_us = _control_int(controls, b"x-mock-latency-per-input-us", per_input_us,
                                        0, 10_000_000)
            chunks = _control_int(controls, b"x-mock-chunks", chunks, 1, 100_000)
            delay_ms = _control_int(controls, b"x-mock-chunk-delay-ms", delay_ms, 0, 3_600_000)
            status = _control_int(controls, b"x-mock-status", 0, 200, 599)
            if status in (204, 304):  # bodiless statuses would need special framing
                raise ValueError("x-mock-status 204 and 304 are not supported")
        except ValueError as exc:
            return error_plan(400, f"Invalid mock control header: {exc}", code="mock_control")
        raw_fault = controls.get(b"x-mock-fault")
        if raw_fault is not None:
            fault = raw_fault.decode("latin-1").strip().lower()
            if fault not in FAULTS:
                return error_plan(400, f"Unknown x-mock-fault {fault!r}; expected one of "
                                  + ", ".join(sorted(FAULTS)), code="mock_control")
    head = method == b"HEAD"  # answered like GET, minus the body (length still announced)
    path, _, query = target.partition(b"?")
    if method == b"POST" and path.startswith(_PROVIDER_PREFIXES):
        plan = _provider(path, query, headers, body, chunks, status) or _not_found(
            method, path, latency_ms)
    elif path[:8] == b"/openai/":
        plan = _azure(b"GET" if head else method, path, query, headers, body, latency_ms,
                      chunks, status)
    elif path[:12] == b"/v1/messages":
        plan = anthropic_api.plan(method, path, headers, body, latency_ms, chunks, status)
    else:
        plan = _route(b"GET" if head else method, path, body, latency_ms, chunks, status)
    if head and plan.body is not None:
        plan.body = b""
    plan.latency = latency_ms / 1000.0
    if plan.inputs and per_input_us:
        plan.latency += plan.inputs * per_input_us / 1e6
    plan.part_delay = delay_ms / 1000.0
    if fault is not None:
        plan.fault = fault
        if fault in ("slow-body", "reset-mid-stream"):
            whole = plan.body if plan.body is not None else b"".join(plan.parts or ())
            if fault == "slow-body":
                plan.parts = _split(whole, max(4, 2 * len(plan.parts or ())))
                plan.part_delay = plan.part_delay or SLOW_BODY_DEFAULT_DELAY
            elif plan.body is not None:
                plan.parts = _split(whole, 4)
            plan.body = None
    return plan


# Gemini's /v1beta/models/... and Bedrock's /model/...: answered in those providers' shapes.
_PROVIDER_PREFIXES = (b"/v1beta/", b"/model/", b"/v1/models/")


def _provider(path: bytes, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              chunks: int, status: int) -> Plan | None:
    from . import providers  # it builds on Plan: imported once this module is complete

    if path[:7] == b"/model/":
        return providers.bedrock(path, headers, body, chunks, status)
    return providers.gemini(path, query, headers, body, chunks, status)


def _route(method: bytes, path: bytes, body: bytes, latency_ms: int, chunks: int,
           status: int) -> Plan:
    if method == b"POST":
        builder = _POST_ROUTES.get(path)
        if builder is None:
            return _not_found(method, path, latency_ms)
        return _post(builder, body, latency_ms, chunks, status, None)
    if method == b"GET" and path.startswith(b"/v1/models"):
        if status >= 400:
            return error_plan(status, latency_ms=latency_ms)
        if path in (b"/v1/models", b"/v1/models/"):
            content = payloads.model_list()
        elif path.count(b"/") == 3:
            content = orjson.dumps(payloads.model_object(path[11:].decode("utf-8", "replace")))
        else:
            return _not_found(method, path, latency_ms)
        return _ok(content, latency_ms, status or 200)
    return _not_found(method, path, latency_ms)


def _post(builder, body: bytes, latency_ms: int, chunks: int, status: int,
          deployment: str | None) -> Plan:
    """A model call: parse the body, check the model (Azure: the deployment stands in)."""
    if status >= 400:
        return error_plan(status, latency_ms=latency_ms)
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return error_plan(400, "We could not parse the JSON body of your request. (HINT: "
                          "This likely means you aren't using your HTTP library correctly."
                          ")", latency_ms)
    if not isinstance(req, dict):
        return error_plan(400, "The request body must be a JSON object.", latency_ms)
    model = req.get("model")
    named = model if isinstance(model, str) and model else None
    if named is None and deployment is None:
        return error_plan(400, "you must provide a model parameter", latency_ms,
                          param="model")
    plan = builder(req, named or deployment, latency_ms, chunks, status or 200)
    plan.model = named
    plan.deployment = deployment
    return plan


_AZURE_OPERATIONS = frozenset((b"chat/completions", b"completions", b"embeddings"))
_AZURE_DEPLOYMENTS = b"/openai/deployments/"


def _azure(method: bytes, path: bytes, query: bytes, headers: list[tuple[bytes, bytes]],
           body: bytes, latency_ms: int, chunks: int, status: int) -> Plan:
    if not any(name == b"api-key" and value.strip() for name, value in headers):
        return _azure_error(401, "Access denied due to invalid subscription key or wrong API "
                            "endpoint. Make sure to provide a valid key for an active "
                            "subscription and use a correct regional API endpoint for your "
                            "resource.", latency_ms)
    if not any(p.partition(b"=")[0] == b"api-version" and p.partition(b"=")[2]
               for p in query.split(b"&")):
        return _azure_error(404, "Resource not found", latency_ms)
    if method == b"POST" and path.startswith(_AZURE_DEPLOYMENTS):
        deployment, _, operation = path[len(_AZURE_DEPLOYMENTS):].partition(b"/")
        builder = _POST_ROUTES.get(b"/v1/" + operation) if operation in _AZURE_OPERATIONS \
            else None
        if builder is not None and deployment:
            return _post(builder, body, latency_ms, chunks, status,
                         unquote(deployment.decode("latin-1")))
    elif method == b"POST" and path == b"/openai/responses":
        return _post(_responses, body, latency_ms, chunks, status, None)
    elif method == b"GET" and path in (b"/openai/models", b"/openai/models/"):
        if status >= 400:
            return error_plan(status, latency_ms=latency_ms)
        return _ok(payloads.model_list(), latency_ms, status or 200)
    return _azure_error(404, "Resource not found", latency_ms)


def _azure_error(status: int, message: str, latency_ms: int) -> Plan:
    request_id, _, _ = _ids()
    return Plan(status, _static(_JSON, latency_ms), [(b"apim-request-id", request_id)],
                body=payloads.azure_error_body(status, message))


def _not_found(method: bytes, path: bytes, latency_ms: int) -> Plan:
    return error_plan(404, f"Invalid URL ({method.decode('latin-1')} "
                      f"{path.decode('latin-1')})", latency_ms)


def _ok(content: bytes, latency_ms: int, status: int) -> Plan:
    request_id, _, n = _ids()
    return Plan(status, _static(_JSON, latency_ms),
                [(b"x-request-id", request_id),
                 (b"x-ratelimit-remaining-requests", b"%d" % (RATE_LIMIT - 1 - n % RATE_LIMIT))],
                body=content)


def _generated(req: dict, model: str, latency_ms: int, chunks: int, status: int,
               whole, streamed) -> Plan:
    request_id, uid, n = _ids()
    dynamic = [(b"x-request-id", request_id),
               (b"x-ratelimit-remaining-requests", b"%d" % (RATE_LIMIT - 1 - n % RATE_LIMIT))]
    created = int(time.time())
    if req.get("stream") is True:
        return Plan(status, _static(_SSE, latency_ms), dynamic,
                    parts=streamed(req, model, uid, created, chunks), stream=True)
    return Plan(status, _static(_JSON, latency_ms), dynamic,
                body=whole(req, model, uid, created, chunks))


def _chat(req: dict, model: str, latency_ms: int, chunks: int, status: int) -> Plan:
    if not isinstance(req.get("messages"), list):
        return error_plan(400, "'messages' is a required property", latency_ms,
                          param="messages")
    return _generated(req, model, latency_ms, chunks, status, payloads.chat_completion,
                      payloads.chat_completion_stream)


def _completions(req: dict, model: str, latency_ms: int, chunks: int, status: int) -> Plan:
    return _generated(req, model, latency_ms, chunks, status, payloads.completion,
                      payloads.completion_stream)


def _responses(req: dict, model: str, latency_ms: int, chunks: int, status: int) -> Plan:
    return _generated(req, model, latency_ms, chunks, status, payloads.response,
                      payloads.response_stream)


def _embeddings(req: dict, model: str, latency_ms: int, chunks: int, status: int) -> Plan:
    items = payloads.embedding_inputs(req.get("input"))
    if items is None:
        return error_plan(400, "'input' must be a non-empty string or array", latency_ms,
                          param="input")
    bad = next((i for i, item in enumerate(items) if not item), None)
    if bad is not None:
        # OpenAI refuses a whole call when one input is empty (a "" string or an empty token
        # list): one bad input in a merged batch fails every input of it, as upstream.
        plan = error_plan(400, f"'$.input[{bad}]' is invalid: an input must not be empty.",
                          latency_ms, param="input")
        plan.inputs = len(items)
        return plan
    plan = _ok(payloads.embeddings(req, model, items), latency_ms, status)
    plan.inputs = len(items)
    return plan


_POST_ROUTES = {
    b"/v1/chat/completions": _chat,
    b"/v1/completions": _completions,
    b"/v1/responses": _responses,
    b"/v1/embeddings": _embeddings,
}


# The Anthropic Messages API (its own module; imported last: it uses Plan and _ids from here).
from . import anthropic_api  # noqa: E402
