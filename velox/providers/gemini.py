"""OpenAI chat completions and embeddings <-> the Gemini API (upstream kind "gemini").

Requests: `POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent?alt=sse` and
`:batchEmbedContents`, the key in `x-goog-api-key` (never in the query string, where access
logs and proxies would keep it). What maps to what (the docs page has the tables):

- system/developer messages -> `systemInstruction`; user -> role "user"; assistant -> role
  "model"; consecutive messages of one role are merged into one content (Gemini wants turns to
  alternate); tool results -> `functionResponse` parts of a "user" content, named from the
  assistant tool call they answer.
- images: data: URLs -> `inlineData` (base64 passed through, never decoded); https URLs ->
  `fileData` (Gemini fetches them); anything else is refused.
- tools -> `functionDeclarations` with `parametersJsonSchema` (the JSON Schema as the client
  wrote it: no lossy conversion to the OpenAPI subset `parameters` takes); tool_choice ->
  `toolConfig.functionCallingConfig` (auto AUTO, none NONE, required ANY, a named function ANY
  + allowedFunctionNames).
- Tool call ids: Gemini's `functionCall.id` when it gives one, else a minted `call_vx...` id.
  Gemini 3 also puts a `thoughtSignature` on function-call parts that must come back with the
  next turn or the call fails; it travels inside the OpenAI tool call id
  (`<id>__sig__<signature>`), which clients echo unchanged, so multi-turn tool conversations
  round-trip through any OpenAI client.
- generationConfig: maxOutputTokens, temperature, topP, stopSequences, seed, presencePenalty,
  frequencyPenalty; response_format json_object -> responseMimeType application/json,
  json_schema -> + responseJsonSchema; reasoning_effort -> thinkingConfig (thinkingLevel for
  Gemini 3 and later, thinkingBudget for 2.x: `thinking` setting, or chosen by model name).

Answers: text (thought parts left out), function calls as tool_calls (arguments as the JSON
string OpenAI clients expect), finishReason -> finish_reason, usageMetadata -> usage (thoughts
are reasoning tokens, part of completion_tokens as OpenAI counts them). Errors come in Google's
shape `{"error": {"code", "message", "status"}}`; `status` picks the OpenAI status.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson

from velox.providers import oaishape as oa
from velox.providers.base import (
    Answer,
    Headers,
    Stream,
    Translator,
    Untranslatable,
    UpstreamCall,
    Usage,
)
from velox.providers.sse import Splitter, fields

KIND = "gemini"
SIGNATURE_MARK = "__sig__"  # separates a tool call id from the thought signature it carries
MINTED_PREFIX = "call_vx"  # ids Velox made up: never sent to Gemini as functionCall ids

_TRANSLATED = frozenset((
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
    "presence_penalty", "frequency_penalty", "tools", "tool_choice", "response_format",
    "reasoning_effort",
    # Accepted, not sent: Gemini has no end-user id or request metadata (documented).
    "user", "metadata",
))

FINISH = {
    "STOP": "stop", "MAX_TOKENS": "length",
    "SAFETY": "content_filter", "RECITATION": "content_filter", "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter", "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter", "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "IMAGE_RECITATION": "content_filter", "MODEL_ARMOR": "content_filter",
}  # anything else (LANGUAGE, OTHER, MALFORMED_FUNCTION_CALL, ...) ends as "stop"

# google.rpc.Code names -> the HTTP status the OpenAI SDK turns into the same exception class.
STATUS = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409, "ABORTED": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
    "INTERNAL": 500, "UNKNOWN": 500, "DATA_LOSS": 500, "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}

# reasoning_effort -> thinkingLevel (Gemini 3+: thinking cannot be switched off, MINIMAL is
# the least) and -> thinkingBudget in tokens (2.x: 0 switches it off; 24576 is 2.5 Flash's
# ceiling, so "high" is valid on every 2.5 model).
THINKING_LEVEL = {"none": "MINIMAL", "minimal": "MINIMAL", "low": "LOW", "medium": "MEDIUM",
                  "high": "HIGH", "xhigh": "HIGH"}
THINKING_BUDGET = {"none": 0, "minimal": 512, "low": 1024, "medium": 8192, "high": 24576,
                   "xhigh": 24576}


def _thinking_style(model: str) -> str:
    name = model.rsplit("/", 1)[-1]
    return "budget" if name.startswith(("gemini-1", "gemini-2")) else "level"


class GeminiTranslator:
    kind = KIND

    def __init__(self, api_key: str, thinking: str | None = None, base_path: str = "") -> None:
        """`thinking`: "level" or "budget" forces how reasoning_effort is sent; None picks by
        model name (gemini-1.x/2.x budget, later level). `base_path`: the upstream URL's path
        (before /v1beta)."""
        if thinking not in (None, "level", "budget"):
            raise ValueError("thinking must be 'level' or 'budget'")
        self.thinking = thinking
        self._prefix = base_path.rstrip("/").encode() + b"/v1beta/"
        self._headers: Headers = [(b"x-goog-api-key", api_key.encode()),
                                  (b"content-type", b"application/json")]

    # --- chat ---------------------------------------------------------------------------

    def chat(self, body: dict[str, Any], model: str, stream: bool,
             client_headers: Headers) -> UpstreamCall:
        messages = oa.chat_messages(body, KIND, _TRANSLATED)
        system, contents = _contents(messages)
        request: dict[str, Any] = {"contents": contents}
        if system:
            request["systemInstruction"] = {"parts": [{"text": t} for t in system]}
        if body.get("tools"):
            request["tools"] = [{"functionDeclarations": [
                _declaration(name, description, schema)
                for name, description, schema in oa.functions(body["tools"], KIND)]}]
        choice = oa.tool_choice(body.get("tool_choice"), KIND)
        if choice is not None:
            request["toolConfig"] = {"functionCallingConfig": _calling_config(choice)}
        config = self._generation_config(body, model)
        if config:
            request["generationConfig"] = config
        verb = b":streamGenerateContent?alt=sse" if stream else b":generateContent"
        return UpstreamCall(b"POST", self._prefix + _model_path(model) + verb,
                            self._headers, orjson.dumps(request))

    def _generation_config(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        config: dict[str, Any] = {}
        limit = oa.max_tokens(body)
        if limit is not None:
            config["maxOutputTokens"] = limit
        for ours, theirs in (("temperature", "temperature"), ("top_p", "topP"),
                             ("seed", "seed"), ("presence_penalty", "presencePenalty"),
                             ("frequency_penalty", "frequencyPenalty")):
            if body.get(ours) is not None:
                config[theirs] = body[ours]
        stop = oa.stop_list(body.get("stop"))
        if stop:
            config["stopSequences"] = stop
        form, schema, _ = oa.response_format(body.get("response_format"), KIND)
        if form != "text":
            config["responseMimeType"] = "application/json"
            if schema is not None:
                config["responseJsonSchema"] = schema
        effort = body.get("reasoning_effort")
        if effort is not None:
            if effort not in THINKING_LEVEL:
                raise oa.refuse("reasoning_effort", KIND, f"unknown effort {effort!r}")
            if (self.thinking or _thinking_style(model)) == "level":
                config["thinkingConfig"] = {"thinkingLevel": THINKING_LEVEL[effort]}
            else:
                config["thinkingConfig"] = {"thinkingBudget": THINKING_BUDGET[effort]}
        return config

    def chat_answer(self, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
        if not 200 <= status < 300:
            return error_answer(status, headers, body)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return oa.error_answer(502, "The Gemini upstream answered with invalid JSON.",
                                   "upstream_protocol_error")
        usage = usage_of(data.get("usageMetadata"))
        candidates = data.get("candidates") or []
        if not candidates:
            # The prompt itself was blocked (promptFeedback.blockReason): nothing generated.
            return oa.chat_answer(client_model, None, [], "content_filter", usage)
        candidate = candidates[0]
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for part in (candidate.get("content") or {}).get("parts") or ():
            if "functionCall" in part:
                calls.append(oa.tool_call_json(*_call_fields(part)))
            elif isinstance(part.get("text"), str) and not part.get("thought"):
                texts.append(part["text"])
        finish = oa.finish_reason(FINISH, candidate.get("finishReason"), bool(calls))
        text = "".join(texts) if texts or not (calls or finish == "content_filter") else None
        return oa.chat_answer(client_model, text, calls, finish, usage)

    def chat_stream(self, client_model: str, include_usage: bool) -> GeminiStream:
        return GeminiStream(client_model, include_usage)

    # --- embeddings -----------------------------------------------------------------------

    def embeddings(self, body: dict[str, Any], model: str,
                   client_headers: Headers) -> UpstreamCall:
        items = oa.embedding_texts(body, KIND)
        name = _model_path(model).decode()
        extra: dict[str, Any] = {}
        if body.get("dimensions") is not None:
            extra["outputDimensionality"] = body["dimensions"]
        request = {"requests": [{"model": name, "content": {"parts": [{"text": text}]},
                                 **extra} for text in items]}
        return UpstreamCall(b"POST", self._prefix + name.encode() + b":batchEmbedContents",
                            self._headers, orjson.dumps(request))

    def embeddings_answer(self, status: int, headers: Headers, body: bytes,
                          client_model: str, encoding_format: str = "float") -> Answer:
        """`encoding_format` is the client request's ("base64": little-endian float32, as
        OpenAI encodes them)."""
        if not 200 <= status < 300:
            return error_answer(status, headers, body)
        try:
            data = orjson.loads(body)
            vectors = [e["values"] for e in data["embeddings"]]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return oa.error_answer(502, "The Gemini upstream answered with an unexpected "
                                   "embeddings body.", "upstream_protocol_error")
        tokens = (data.get("usageMetadata") or {}).get("promptTokenCount")
        return oa.embeddings_answer(vectors, client_model, encoding_format, int(tokens or 0))


# --- request pieces ---------------------------------------------------------------------------


def _model_path(model: str) -> bytes:
    # "gemini-2.5-flash" and "models/gemini-2.5-flash" both name models/...; a tuned model
    # ("tunedModels/x") keeps its own collection.
    name = model if "/" in model else "models/" + model
    return quote(name, safe="/").encode()


def _declaration(name: str, description: str | None, schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "parametersJsonSchema": schema}
    if description:
        out["description"] = description
    return out


def _calling_config(choice: str | tuple[str, str]) -> dict[str, Any]:
    if isinstance(choice, tuple):
        return {"mode": "ANY", "allowedFunctionNames": [choice[1]]}
    return {"mode": {"auto": "AUTO", "none": "NONE", "required": "ANY"}[choice]}


def _contents(messages: list[Any]) -> tuple[list[str], list[dict[str, Any]]]:
    names = oa.tool_names(messages)
    system: list[str] = []
    turns = oa.Turns("parts")
    for role, where, message in oa.each_message(messages, KIND):
        if role in ("system", "developer"):
            system.append(oa.text_of(message.get("content"), where, KIND))
        elif role == "user":
            turns.add("user", [_part(p) for p in oa.parts_of(message.get("content"), where,
                                                              KIND)])
        elif role == "assistant":
            turns.add("model", _assistant_parts(message, where))
        else:
            turns.add("user", [_function_response(message, where, names)])
    return system, turns.list


def _part(piece: str | oa.Image) -> dict[str, Any]:
    if isinstance(piece, str):
        return {"text": piece}
    if piece.data is not None:
        return {"inlineData": {"mimeType": piece.mime, "data": piece.data}}
    data: dict[str, Any] = {"fileUri": piece.url}
    if piece.mime:
        data["mimeType"] = piece.mime
    return {"fileData": data}


def _assistant_parts(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    parts = [_part(p) for p in oa.parts_of(message.get("content"), where, KIND) if p != ""]
    for j, call in enumerate(message.get("tool_calls") or ()):
        call_id, name, args = oa.tool_call_parts(call, f"{where}.tool_calls[{j}]")
        own_id, signature = split_id(call_id)
        function: dict[str, Any] = {"name": name, "args": args}
        if own_id:
            function["id"] = own_id
        part: dict[str, Any] = {"functionCall": function}
        if signature:
            part["thoughtSignature"] = signature
        parts.append(part)
    return parts


def _function_response(message: dict[str, Any], where: str,
                       names: dict[str, str]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    name = names.get(call_id) if isinstance(call_id, str) else None
    if name is None:
        raise Untranslatable(f"'{where}.tool_call_id' names no tool call of an earlier "
                             "assistant message (Gemini needs the function's name).",
                             param=f"{where}.tool_call_id")
    text = oa.text_of(message.get("content"), where, KIND)
    result: Any = None
    if text.lstrip().startswith("{"):
        try:
            result = orjson.loads(text)
        except orjson.JSONDecodeError:
            result = None
    response: dict[str, Any] = {"name": name, "response": result if isinstance(result, dict)
                                else {"result": text}}
    own_id, _ = split_id(call_id)
    if own_id:
        response["id"] = own_id
    return {"functionResponse": response}


def split_id(call_id: str | None) -> tuple[str, str]:
    """(the id to send Gemini, "" for ids Velox minted; the thought signature or "")."""
    if not call_id:
        return "", ""
    own, _, signature = call_id.partition(SIGNATURE_MARK)
    return ("" if own.startswith(MINTED_PREFIX) else own), signature


def _call_fields(part: dict[str, Any]) -> tuple[str, str, str]:
    """(OpenAI tool call id, name, arguments JSON string) of one functionCall part."""
    call = part["functionCall"]
    call_id = call.get("id") or MINTED_PREFIX + os.urandom(8).hex()
    if part.get("thoughtSignature"):
        call_id += SIGNATURE_MARK + part["thoughtSignature"]
    return call_id, call.get("name") or "", orjson.dumps(call.get("args") or {}).decode()


# --- answer pieces --------------------------------------------------------------------------


def usage_of(meta: dict[str, Any] | None) -> Usage:
    if not meta:
        return Usage()
    thoughts = meta.get("thoughtsTokenCount") or 0
    return Usage(input=(meta.get("promptTokenCount") or 0)
                 + (meta.get("toolUsePromptTokenCount") or 0),
                 output=(meta.get("candidatesTokenCount") or 0) + thoughts,
                 cached_input=meta.get("cachedContentTokenCount") or 0,
                 reasoning=thoughts)


def _google_error(body: bytes) -> tuple[str, str, dict[str, Any]]:
    """(status name, message, the error object) of a Google error body, however malformed."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "", body[:500].decode("utf-8", "replace"), {}
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return "", "", {}
    return str(error.get("status") or ""), str(error.get("message") or ""), error


def _retry_after(error: dict[str, Any]) -> int | None:
    # RESOURCE_EXHAUSTED carries google.rpc.RetryInfo {"retryDelay": "37s"} (or "1.5s").
    for detail in error.get("details") or ():
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return max(1, round(float(delay[:-1])))
            except ValueError:
                return None
    return None


def error_answer(status: int, headers: Headers, body: bytes) -> Answer:
    """A Gemini error answer in OpenAI's shape, its message and status name kept."""
    name, message, error = _google_error(body)
    mapped = STATUS.get(name, status if status >= 400 else 502)
    if mapped == 499:  # CANCELLED: no OpenAI status means it; a failed upstream call
        mapped = 502
    return oa.error_answer(mapped, message or f"The Gemini upstream answered HTTP {status}.",
                           name or None, _retry_after(error) if mapped == 429 else None)


# --- streaming ----------------------------------------------------------------------------------

# States of one streamed answer. Every event may carry text, function calls, a finishReason and
# usageMetadata together; they are handled in that order.
#   state      event                        -> output                          next state
#   OPEN       text part                    -> text chunk (role on the first)  OPEN
#   OPEN       functionCall part            -> tool_call chunk, whole args     OPEN
#   OPEN       finishReason                 -> finish chunk                    FINISHED
#   OPEN       {"error": ...}               -> OpenAI error event              FAILED
#   FINISHED   usageMetadata only           -> (usage kept)                    FINISHED
#   any        end(), FINISHED, nothing held -> usage chunk if asked, [DONE]   -
#   any        end(), OPEN or an event cut  -> error event (truncated), no [DONE]
#   FAILED     anything                     -> nothing                         FAILED
OPEN, FINISHED, FAILED = oa.OPEN, oa.FINISHED, oa.FAILED


class GeminiStream(oa.StreamBase):
    __slots__ = ("_sse", "_calls")
    provider = "Gemini"

    def __init__(self, client_model: str, include_usage: bool) -> None:
        super().__init__(client_model, include_usage)
        self._sse = Splitter()
        self._calls = 0

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for block in self._sse.feed(data):
            self._block(block, out)
        return b"".join(out)

    def _block(self, block: bytes, out: list[bytes]) -> None:
        payload = fields(block)[1]
        if payload and self._state != FAILED:  # comment-only blocks carry nothing
            self._event(payload, out)

    def _event(self, payload: bytes, out: list[bytes]) -> None:
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._fail(out, 502, "The Gemini upstream sent an event that is not JSON.",
                       "upstream_protocol_error")
            return
        if not isinstance(event, dict) or "error" in event:
            name, message, _ = _google_error(payload)
            self._fail(out, STATUS.get(name, 502), message or "The Gemini upstream failed.",
                       name or None)
            return
        if event.get("usageMetadata"):
            self.usage = usage_of(event["usageMetadata"])
        if self._state != OPEN:
            return
        candidates = event.get("candidates")
        if not candidates:
            if (event.get("promptFeedback") or {}).get("blockReason"):
                out.append(self._writer.finish("content_filter"))
                self._state = FINISHED
            return
        writer = self._writer
        candidate = candidates[0]
        for part in (candidate.get("content") or {}).get("parts") or ():
            if "functionCall" in part:
                call_id, name, arguments = _call_fields(part)
                out.append(writer.tool_call(self._calls, call_id, name, arguments))
                self._calls += 1
            elif isinstance(part.get("text"), str) and part["text"] and not part.get("thought"):
                out.append(writer.text(part["text"]))
        if candidate.get("finishReason"):
            reason = oa.finish_reason(FINISH, candidate["finishReason"], self._calls > 0)
            out.append(writer.finish(reason))
            self._state = FINISHED

    def end(self) -> bytes:
        out: list[bytes] = []
        for block in self._sse.close():  # an event whose last line end was a lone CR
            self._block(block, out)
        return b"".join(out) + self._ending(not self._sse.pending().strip())


if TYPE_CHECKING:  # mypy holds both classes to the contracts the egress edge calls
    _translator: Translator = GeminiTranslator("")
    _stream: Stream = GeminiStream("", False)
