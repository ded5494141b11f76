"""The mock upstream's Gemini and Bedrock faces: request in, `Plan` out (pure, no I/O).

Gemini API: `POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent?alt=sse`
(SSE, CRLF line endings as Google sends them), `:batchEmbedContents`; the key must come as
`x-goog-api-key` (403 PERMISSION_DENIED otherwise, as Google answers unregistered callers).

Bedrock: `POST /model/{modelId}/converse`, `/converse-stream` (AWS event-stream frames, one
frame per part), `/invoke` (Cohere Embed bodies); the SigV4 `Authorization` header and
`x-amz-date` must be present and well formed (403 with AWS's error types otherwise; the
signature itself is not recomputed: the mock does not know the secret).

Behaviour, for both (so a test chooses by model name, which survives any gateway in between):
- model `error-<NAME>`: that provider error (Gemini: a google.rpc status name such as
  RESOURCE_EXHAUSTED; Bedrock: an exception name such as ThrottlingException), with the
  provider's status and error body; `x-mock-status` does the same by HTTP status.
- model `midstream-<NAME>`: a streamed answer that sends two text pieces, then that error as
  the provider sends errors mid-stream.
- model `length-...` / `filter-...`: the answer stops for max tokens / a content filter.
- Gemini model `cached-...`: an implicit prompt-cache hit, half the prompt reported as
  `cachedContentTokenCount` (a part of promptTokenCount, as Gemini counts it).
- tools declared and the last turn is not a tool result (or a tool is required): the answer
  calls the first declared (or the named) function; after a tool result it answers with text
  quoting the result. Gemini function calls carry a thought signature that must come back on
  the next turn (400 otherwise, as Gemini 3 does); Bedrock checks every toolResult answers a
  toolUse of the conversation.
- JSON mode (responseMimeType / outputConfig.textFormat): the text is a JSON object following
  the schema's properties.
- the text names how many images the last user turn carried.
"""

from __future__ import annotations

import itertools
import re
from typing import Any
from urllib.parse import unquote

import orjson

from . import eventstream, payloads
from .behaviour import Plan

_counter = itertools.count(1)
_JSON = b"application/json"
GEMINI_SIGNATURE = "bW9jay10aG91Z2h0LXNpZ25hdHVyZQ=="  # base64 of "mock-thought-signature"


# --- shared -----------------------------------------------------------------------------------


def _tokens(value: Any) -> int:
    """A rough token count of any JSON value: ~4 characters per token."""
    return len(orjson.dumps(value)) // 4 + 1


def _json_text(schema: Any) -> str:
    """A JSON object following `schema`'s properties (types only), for JSON mode."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return orjson.dumps({"answer": "mock"}).decode()
    sample = {"string": "mock", "integer": 1, "number": 1.5, "boolean": True, "array": [],
              "object": {}}
    out = {}
    for name, spec in props.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        out[name] = sample.get(str(kind).lower(), "mock")
    return orjson.dumps(out).decode()


def _reply(images: int, chunks: int) -> list[str]:
    pieces = list(payloads.pieces(max(1, chunks - 2)))
    if images:
        pieces.append(f" I see {images} image{'s' if images > 1 else ''}.")
    return pieces


def _args_for(schema: Any) -> dict[str, Any]:
    return orjson.loads(_json_text(schema)) if isinstance(schema, dict) else {}


def _field(obj: dict[str, Any], camel: str) -> Any:
    """A field by its JSON name or its proto name: Google's JSON mapping accepts both, and the
    google-genai SDK sends function declarations with snake_case keys."""
    value = obj.get(camel)
    if value is None:
        value = obj.get(re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), camel))
    return value


def _ids() -> str:
    return f"{next(_counter):012x}"


def _plan(status: int, headers: tuple, body: bytes | None = None,
          parts: list[bytes] | None = None, dynamic: list | None = None) -> Plan:
    return Plan(status, headers, dynamic or [], body=body, parts=parts, stream=parts is not None)


# --- Gemini -------------------------------------------------------------------------------------

GEMINI_STATUS = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "INTERNAL": 500,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499,
}
_GEMINI_NAME_BY_STATUS = {v: k for k, v in reversed(GEMINI_STATUS.items())}
_GEMINI_HEADERS = ((b"content-type", b"application/json; charset=UTF-8"),
                   (b"server", b"scaffolding on HTTPServer2"))
_GEMINI_SSE = ((b"content-type", b"text/event-stream"), (b"server", b"scaffolding on HTTPServer2"))
_GEMINI_PATH = re.compile(rb"/v1(?:beta)?/((?:models|tunedModels)/[^:/]+):([A-Za-z]+)")


def gemini_error_body(name: str, message: str | None = None) -> tuple[int, bytes]:
    status = GEMINI_STATUS.get(name, 500)
    error: dict[str, Any] = {"code": status, "message": message or f"Mock {name} error.",
                             "status": name}
    if name == "RESOURCE_EXHAUSTED":
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                             "retryDelay": "2s"}]
    return status, orjson.dumps({"error": error})


def _gemini_error(name: str, message: str | None = None) -> Plan:
    status, body = gemini_error_body(name, message)
    return _plan(status, _GEMINI_HEADERS, body)


def gemini(path: bytes, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
           chunks: int, status: int) -> Plan | None:
    """A Gemini API call, or None when the path is not one."""
    match = _GEMINI_PATH.fullmatch(path)
    if match is None:
        return None
    model = unquote(match.group(1).decode()).partition("/")[2]
    verb = match.group(2).decode()
    if not any(n == b"x-goog-api-key" and v.strip() for n, v in headers):
        return _gemini_error("PERMISSION_DENIED", "Method doesn't allow unregistered callers "
                             "(callers without established identity). Please use API Key or "
                             "other form of API consumer identity to call this API.")
    if status >= 400:
        return _gemini_error(_GEMINI_NAME_BY_STATUS.get(status, "INTERNAL"))
    if model.startswith("error-"):
        return _gemini_error(model[6:])
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _gemini_error("INVALID_ARGUMENT", "Invalid JSON payload received.")
    if not isinstance(req, dict):
        return _gemini_error("INVALID_ARGUMENT", "Invalid JSON payload received.")
    if verb == "batchEmbedContents":
        plan = _gemini_embed(req)
    elif verb in ("generateContent", "streamGenerateContent"):
        plan = _gemini_generate(req, model, verb == "streamGenerateContent",
                                b"alt=sse" in query.split(b"&"), chunks)
    else:
        return _gemini_error("NOT_FOUND", f"Method {verb} is not found.")
    plan.model = model
    return plan


def _gemini_check(contents: Any) -> str | None:
    """What a real Gemini would refuse in this conversation, or None."""
    if not isinstance(contents, list) or not contents:
        return "* GenerateContentRequest.contents: contents is not specified"
    called: dict[str, str | None] = {}
    for content in contents:
        for part in content.get("parts") or ():
            call = part.get("functionCall")
            if call is not None:
                if content.get("role") != "model":
                    return "functionCall parts belong to model turns."
                if not part.get("thoughtSignature"):
                    return ("Function call is missing a thought_signature in functionCall "
                            "parts. This is required for tools to work correctly.")
                called[call.get("name")] = call.get("id")
            answer = part.get("functionResponse")
            if answer is not None:
                if answer.get("name") not in called:
                    return "functionResponse names a function that was not called."
                if answer.get("id") != called[answer.get("name")]:
                    return "functionResponse id does not match its functionCall id."
    return None


def _gemini_generate(req: dict[str, Any], model: str, stream: bool, sse: bool,
                     chunks: int) -> Plan:
    contents = req.get("contents")
    problem = _gemini_check(contents)
    if problem is not None:
        return _gemini_error("INVALID_ARGUMENT", problem)
    last = contents[-1].get("parts") or []
    answered = [p["functionResponse"] for p in last if "functionResponse" in p]
    images = sum(1 for p in last if "inlineData" in p or "fileData" in p)
    config = _field(req, "generationConfig") or {}
    declarations = [d for tool in req.get("tools") or () for d in
                    _field(tool, "functionDeclarations") or ()]
    calling = _field(_field(req, "toolConfig") or {}, "functionCallingConfig") or {}
    parts: list[dict[str, Any]]
    if declarations and calling.get("mode") != "NONE" and not answered:
        allowed = _field(calling, "allowedFunctionNames") or [declarations[0]["name"]]
        chosen = next(d for d in declarations if d["name"] == allowed[0])
        schema = _field(chosen, "parametersJsonSchema") or chosen.get("parameters")
        parts = [{"functionCall": {"id": "fc_" + _ids(), "name": chosen["name"],
                                   "args": _args_for(schema)},
                  "thoughtSignature": GEMINI_SIGNATURE}]
    elif answered:
        parts = [{"text": "The tool said: " + orjson.dumps(answered[0].get("response"))
                  .decode()}]
    elif _field(config, "responseMimeType") == "application/json":
        parts = [{"text": _json_text(_field(config, "responseJsonSchema")
                                     or _field(config, "responseSchema"))}]
    else:
        parts = [{"text": t} for t in _reply(images, chunks)]
    finish = ("MAX_TOKENS" if model.startswith("length-") else
              "SAFETY" if model.startswith("filter-") else "STOP")
    thoughts = 7 if _field(config, "thinkingConfig") else 0
    usage = {"promptTokenCount": _tokens(contents), "candidatesTokenCount": len(parts),
             "totalTokenCount": _tokens(contents) + len(parts) + thoughts}
    if model.startswith("cached-"):
        usage["cachedContentTokenCount"] = usage["promptTokenCount"] // 2
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    version = model
    if not stream:
        whole = [{"text": "".join(p["text"] for p in parts)}] if "text" in parts[0] else parts
        return _plan(200, _GEMINI_HEADERS, orjson.dumps({
            "candidates": [{"content": {"parts": whole, "role": "model"},
                            "finishReason": finish, "index": 0}],
            "usageMetadata": usage, "modelVersion": version, "responseId": "mock" + _ids()}))
    events = []
    for i, part in enumerate(parts):
        candidate: dict[str, Any] = {"content": {"parts": [part], "role": "model"}, "index": 0}
        event: dict[str, Any] = {"candidates": [candidate], "modelVersion": version}
        if i == len(parts) - 1 and not model.startswith("midstream-"):
            candidate["finishReason"] = finish
            event["usageMetadata"] = usage
        events.append(event)
    if model.startswith("midstream-"):
        events = events[:2]
        events.append(orjson.loads(gemini_error_body(model[10:])[1]))
    if not sse:  # without alt=sse Google streams one JSON array
        return _plan(200, _GEMINI_HEADERS, parts=[orjson.dumps(events)])
    return _plan(200, _GEMINI_SSE, parts=[b"data: " + orjson.dumps(e) + b"\r\n\r\n"
                                          for e in events])


def _gemini_embed(req: dict[str, Any]) -> Plan:
    requests = req.get("requests")
    if not isinstance(requests, list) or not requests:
        return _gemini_error("INVALID_ARGUMENT", "* BatchEmbedContentsRequest.requests: "
                             "at least one request is required")
    vectors = []
    for item in requests:
        text = "".join(p.get("text", "") for p in (item.get("content") or {}).get("parts") or ())
        dims = item.get("outputDimensionality") or payloads.EMBEDDING_DIMENSIONS
        vectors.append({"values": payloads.embedding_vector(text, dims)})
    return _plan(200, _GEMINI_HEADERS, orjson.dumps({"embeddings": vectors}))


# --- Bedrock ------------------------------------------------------------------------------------

BEDROCK_STATUS = {
    "ValidationException": 400, "AccessDeniedException": 403,
    "ResourceNotFoundException": 404, "ModelTimeoutException": 408,
    "ModelErrorException": 424, "ThrottlingException": 429, "ModelNotReadyException": 429,
    "ServiceQuotaExceededException": 400, "InternalServerException": 500,
    "ServiceUnavailableException": 503, "UnrecognizedClientException": 403,
    "MissingAuthenticationTokenException": 403, "IncompleteSignatureException": 403,
}
_BEDROCK_NAME_BY_STATUS = {400: "ValidationException", 403: "AccessDeniedException",
                           404: "ResourceNotFoundException", 408: "ModelTimeoutException",
                           424: "ModelErrorException", 429: "ThrottlingException",
                           500: "InternalServerException", 503: "ServiceUnavailableException"}
_BEDROCK_PATH = re.compile(rb"/model/([^/]+)/(converse|converse-stream|invoke)")
_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=[A-Z0-9]{16,128}/\d{8}/[a-z0-9-]+/bedrock/aws4_request, "
    r"SignedHeaders=([a-z0-9;-]+), Signature=[0-9a-f]{64}")
_AMZ_DATE = re.compile(r"\d{8}T\d{6}Z")
_ES_TYPE = b"application/vnd.amazon.eventstream"


def _bedrock_error(name: str, message: str | None = None) -> Plan:
    status = BEDROCK_STATUS.get(name, 500)
    return _plan(status, ((b"content-type", b"application/json"),
                          (b"x-amzn-errortype", f"{name}:http://internal.amazon.com/coral/"
                           "com.amazon.bedrock/".encode())),
                 orjson.dumps({"message": message or f"Mock {name}."}),
                 dynamic=[(b"x-amzn-requestid", _ids().encode())])


def check_sigv4(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why the SigV4 headers are not well formed (the exception name), or None."""
    found = {n.lower(): v.decode("latin-1") for n, v in headers
             if n.lower() in (b"authorization", b"x-amz-date")}
    auth = found.get(b"authorization")
    if auth is None:
        return "MissingAuthenticationTokenException"
    match = _AUTHORIZATION.fullmatch(auth)
    if match is None or not _AMZ_DATE.fullmatch(found.get(b"x-amz-date", "")):
        return "IncompleteSignatureException"
    signed = match.group(1).split(";")
    if "host" not in signed or "x-amz-date" not in signed:
        return "IncompleteSignatureException"
    return None


def bedrock(path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, chunks: int,
            status: int) -> Plan | None:
    """A Bedrock runtime call, or None when the path is not one."""
    match = _BEDROCK_PATH.fullmatch(path)
    if match is None:
        return None
    model = unquote(match.group(1).decode())
    operation = match.group(2).decode()
    problem = check_sigv4(headers)
    if problem is not None:
        return _bedrock_error(problem, "Missing Authentication Token" if problem.startswith(
            "Missing") else "Authorization header requires a well-formed SigV4 signature.")
    if status >= 400:
        return _bedrock_error(_BEDROCK_NAME_BY_STATUS.get(status, "InternalServerException"))
    if model.startswith("error-"):
        return _bedrock_error(model[6:])
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _bedrock_error("ValidationException", "Malformed input request.")
    if not isinstance(req, dict):
        return _bedrock_error("ValidationException", "Malformed input request.")
    if operation == "invoke":
        plan = _bedrock_embed(req)
    else:
        plan = _converse(req, model, operation == "converse-stream", chunks)
    plan.model = model
    return plan


def _bedrock_check(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "A conversation must start with a user message."
    used: set[str] = set()
    for i, message in enumerate(messages):
        if i and message.get("role") == messages[i - 1].get("role"):
            return "A conversation must alternate between user and assistant roles."
        for block in message.get("content") or ():
            if "toolUse" in block:
                used.add(block["toolUse"].get("toolUseId"))
            if "toolResult" in block and block["toolResult"].get("toolUseId") not in used:
                return (f"The toolResult blocks at messages.{i}.content contain toolUseId that "
                        "does not match a toolUse block.")
            if "text" in block and not block["text"].strip():
                return "The text field in the ContentBlock object is blank."
    return None


def _converse(req: dict[str, Any], model: str, stream: bool, chunks: int) -> Plan:
    messages = req.get("messages")
    problem = _bedrock_check(messages)
    if problem is not None:
        return _bedrock_error("ValidationException", problem)
    last = messages[-1].get("content") or []
    results = [b["toolResult"] for b in last if "toolResult" in b]
    images = sum(1 for b in last if "image" in b)
    tools = [t["toolSpec"] for t in (req.get("toolConfig") or {}).get("tools") or ()
             if "toolSpec" in t]
    choice = (req.get("toolConfig") or {}).get("toolChoice") or {}
    text_format = (req.get("outputConfig") or {}).get("textFormat")
    blocks: list[dict[str, Any]]
    if tools and not results:
        name = (choice.get("tool") or {}).get("name") or tools[0]["name"]
        spec = next(t for t in tools if t["name"] == name)
        blocks = [{"toolUse": {"toolUseId": "tooluse_" + _ids(), "name": name,
                               "input": _args_for((spec.get("inputSchema") or {}).get("json"))}}]
        reason = "tool_use"
    else:
        if results:
            texts = ["The tool said: " + "".join(c.get("text", "") for c in
                                                 results[0].get("content") or ())]
        elif text_format:
            schema = orjson.loads(text_format["structure"]["jsonSchema"]["schema"])
            texts = [_json_text(schema)]
        else:
            texts = _reply(images, chunks)
        blocks = [{"text": t} for t in texts]
        reason = ("max_tokens" if model.startswith("length-") else
                  "guardrail_intervened" if model.startswith("filter-") else "end_turn")
    prompt = _tokens(messages) + _tokens(req.get("system") or "")
    usage = {"inputTokens": prompt, "outputTokens": len(blocks),
             "totalTokens": prompt + len(blocks)}
    request_id = [(b"x-amzn-requestid", _ids().encode())]
    if not stream:
        if "text" in blocks[0]:
            blocks = [{"text": "".join(b["text"] for b in blocks)}]
        return _plan(200, ((b"content-type", b"application/json"),), orjson.dumps({
            "output": {"message": {"role": "assistant", "content": blocks}},
            "stopReason": reason, "usage": usage, "metrics": {"latencyMs": 1}}),
            dynamic=request_id)
    frames = [eventstream.event("messageStart", {"role": "assistant"})]
    if "toolUse" in blocks[0]:
        use = blocks[0]["toolUse"]
        frames.append(eventstream.event("contentBlockStart", {
            "start": {"toolUse": {"toolUseId": use["toolUseId"], "name": use["name"]}},
            "contentBlockIndex": 0}))
        args = orjson.dumps(use["input"]).decode()
        cut = len(args) // 2  # the input arrives as JSON fragments, as Bedrock streams it
        frames.extend(eventstream.event("contentBlockDelta", {
            "delta": {"toolUse": {"input": piece}}, "contentBlockIndex": 0})
            for piece in (args[:cut], args[cut:]))
    else:
        frames.extend(eventstream.event("contentBlockDelta", {
            "delta": {"text": block["text"]}, "contentBlockIndex": 0}) for block in blocks)
    if model.startswith("midstream-"):
        name = model[10:]
        frames = [*frames[:3], eventstream.exception(name[:1].lower() + name[1:],
                                                     f"Mock {name} mid-stream.")]
    else:
        frames.append(eventstream.event("contentBlockStop", {"contentBlockIndex": 0}))
        frames.append(eventstream.event("messageStop", {"stopReason": reason}))
        frames.append(eventstream.event("metadata", {"usage": usage,
                                                     "metrics": {"latencyMs": 1}}))
    return _plan(200, ((b"content-type", _ES_TYPE),), parts=frames, dynamic=request_id)


def _bedrock_embed(req: dict[str, Any]) -> Plan:
    texts = req.get("texts")
    if not isinstance(texts, list) or not texts or "input_type" not in req:
        return _bedrock_error("ValidationException", "Malformed input request: #: required "
                              "key [texts] and [input_type] not found")
    dims = req.get("output_dimension") or payloads.EMBEDDING_DIMENSIONS
    body = orjson.dumps({"id": "emb-" + _ids(), "response_type": "embeddings_floats",
                         "texts": texts,
                         "embeddings": [payloads.embedding_vector(t, dims) for t in texts]})
    tokens = sum(_tokens(t) for t in texts)
    return _plan(200, ((b"content-type", b"application/json"),), body,
                 dynamic=[(b"x-amzn-requestid", _ids().encode()),
                          (b"x-amzn-bedrock-input-token-count", b"%d" % tokens)])
