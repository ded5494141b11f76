"""OpenAI chat completions and embeddings <-> Amazon Bedrock (upstream kind "bedrock").

Chat goes to the Converse API (`POST /model/{modelId}/converse`, `/converse-stream`), whose
streamed answer is the AWS binary event stream (decoded incrementally by botocore's
`EventStreamBuffer`, so frames split anywhere are whole again before they are read). Every call
is signed with AWS Signature Version 4 by botocore's signer, for service "bedrock" in the
target's region, from credentials the configuration names by environment variable.

botocore is an optional extra (`pip install 'velox[bedrock]'`): importing this module without
it raises ImportError saying so.

What maps to what (the docs page has the tables):
- system/developer messages -> `system` text blocks; user/assistant -> messages (consecutive
  messages of one role merged: Converse wants roles to alternate); tool results -> `toolResult`
  blocks in a user message; assistant tool_calls -> `toolUse` blocks, ids kept (an id outside
  Bedrock's `[a-zA-Z0-9_-]{1,64}`, e.g. one another provider minted, is mapped to a stable
  hash, the same for the call and its result).
- images: data: URLs -> `image` blocks (png, jpeg, gif, webp; the base64 goes through as is);
  https URLs are refused: Converse takes only bytes or S3 locations.
- tools -> `toolConfig.tools[].toolSpec` (inputSchema.json); tool_choice auto {auto}, required
  {any}, a named function {tool}; "none" drops the tools (refused when the conversation holds
  tool calls, which Converse cannot read without them).
- max_tokens, temperature, top_p, stop -> `inferenceConfig`; response_format json_schema ->
  `outputConfig.textFormat` (json_object as the schema {"type": "object"}); reasoning_effort
  low/medium/high -> `outputConfig.effort`; user and metadata -> `requestMetadata`.

Embeddings: Cohere Embed through InvokeModel (`POST /model/{modelId}/invoke`), because it takes
a list of texts (up to 96) in one call as OpenAI's `input` does; Titan takes one text per call,
which would turn one client request into N upstream calls. Token usage comes from the
`x-amzn-bedrock-input-token-count` header InvokeModel answers with.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson

try:
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    from botocore.eventstream import EventStreamBuffer, ParserError
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("The bedrock upstream kind needs botocore, an optional extra: "
                      "pip install 'velox[bedrock]'") from exc

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

KIND = "bedrock"
SIGNING_NAME = "bedrock"  # the service name SigV4 signs for (bedrock-runtime's signingName)
COHERE_MAX_TEXTS = 96  # Cohere Embed's limit per call on Bedrock

_TRANSLATED = frozenset((
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "tools",
    "tool_choice", "response_format", "reasoning_effort", "user", "metadata",
))

FINISH = {
    "end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
    "max_tokens": "length", "model_context_window_exceeded": "length",
    "guardrail_intervened": "content_filter", "content_filtered": "content_filter",
}  # malformed_model_output, malformed_tool_use: "stop"

# Error codes (x-amzn-errortype, or the stream's :exception-type) -> OpenAI status.
STATUS = {
    "ThrottlingException": 429, "ServiceQuotaExceededException": 429,
    "ValidationException": 400, "ModelNotReadyException": 503,
    "AccessDeniedException": 403, "ResourceNotFoundException": 404,
    "ServiceUnavailableException": 503, "InternalServerException": 500,
    # The model did not answer in time: an upstream timeout, retryable as Velox's own 504.
    "ModelTimeoutException": 504,
    # The model failed while answering (AWS says 424): an upstream failure.
    "ModelErrorException": 502, "ModelStreamErrorException": 502,
    # Velox's own AWS credentials were refused: the SDK's AuthenticationError.
    "UnrecognizedClientException": 401, "InvalidSignatureException": 401,
    "ExpiredTokenException": 401, "IncompleteSignatureException": 401,
    "MissingAuthenticationTokenException": 401,
}

_IMAGE_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg",
                  "image/gif": "gif", "image/webp": "webp"}
_TOOL_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EFFORTS = frozenset(("low", "medium", "high"))


class BedrockTranslator:
    kind = KIND

    def __init__(self, region: str, access_key_id: str, secret_access_key: str,
                 session_token: str | None = None, host: str | None = None,
                 embed_input_type: str = "search_document", base_path: str = "") -> None:
        """`host`: the endpoint the egress connects to (signed, so it must be the one sent);
        `embed_input_type`: Cohere's input_type for embeddings (OpenAI has no such field);
        `base_path`: the upstream URL's path (before /model)."""
        self.region = region
        self._prefix = base_path.rstrip("/").encode()
        self.host = host or f"bedrock-runtime.{region}.amazonaws.com"
        self.embed_input_type = embed_input_type
        self._signer = SigV4Auth(Credentials(access_key_id, secret_access_key, session_token),
                                 SIGNING_NAME, region)


    def sign(self, path: bytes, body: bytes, accept: bytes = b"application/json") -> Headers:
        """SigV4 headers for a POST of `body` to `path` on this target's host."""
        request = AWSRequest(method="POST", url=f"https://{self.host}{path.decode()}",
                             data=body, headers={"Content-Type": "application/json",
                                                 "Accept": accept.decode()})
        self._signer.add_auth(request)
        return [(name.lower().encode(), value.encode() if isinstance(value, str) else value)
                for name, value in request.headers.items()]

    def _call(self, path: bytes, request: dict[str, Any],
              accept: bytes = b"application/json") -> UpstreamCall:
        body = orjson.dumps(request)
        path = self._prefix + path
        return UpstreamCall(b"POST", path, self.sign(path, body, accept), body)

    # --- chat ---------------------------------------------------------------------------

    def chat(self, body: dict[str, Any], model: str, stream: bool,
             client_headers: Headers) -> UpstreamCall:
        messages = oa.chat_messages(body, KIND, _TRANSLATED)
        system, turns, has_tools = _messages(messages)
        request: dict[str, Any] = {"messages": turns}
        if system:
            request["system"] = [{"text": t} for t in system]
        tool_config = _tool_config(body, has_tools)
        if tool_config:
            request["toolConfig"] = tool_config
        inference = _inference(body)
        if inference:
            request["inferenceConfig"] = inference
        output = _output_config(body)
        if output:
            request["outputConfig"] = output
        metadata = _metadata(body)
        if metadata:
            request["requestMetadata"] = metadata
        verb = b"/converse-stream" if stream else b"/converse"
        accept = b"application/vnd.amazon.eventstream" if stream else b"application/json"
        return self._call(_model_path(model) + verb, request, accept)

    def chat_answer(self, status: int, headers: Headers, body: bytes,
                    client_model: str) -> Answer:
        if not 200 <= status < 300:
            return error_answer(status, headers, body)
        try:
            data = orjson.loads(body)
            blocks = data["output"]["message"]["content"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return oa.error_answer(502, "The Bedrock upstream answered with an unexpected "
                                   "body.", "upstream_protocol_error")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in blocks:
            if isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif "toolUse" in block:
                use = block["toolUse"]
                calls.append(oa.tool_call_json(use.get("toolUseId") or "", use.get("name") or "",
                                               orjson.dumps(use.get("input") or {}).decode()))
        finish = oa.finish_reason(FINISH, data.get("stopReason"), bool(calls))
        text = "".join(texts) if texts or not calls else None
        return oa.chat_answer(client_model, text, calls, finish, usage_of(data.get("usage")))

    def chat_stream(self, client_model: str, include_usage: bool) -> BedrockStream:
        return BedrockStream(client_model, include_usage)

    # --- embeddings (Cohere Embed via InvokeModel) ------------------------------------------

    def embeddings(self, body: dict[str, Any], model: str,
                   client_headers: Headers) -> UpstreamCall:
        texts = oa.embedding_texts(body, KIND)
        if len(texts) > COHERE_MAX_TEXTS:
            raise oa.refuse("input", KIND, f"at most {COHERE_MAX_TEXTS} inputs per request "
                            "(Cohere Embed's limit)")
        request: dict[str, Any] = {"texts": texts, "input_type": self.embed_input_type}
        if body.get("dimensions") is not None:
            request["output_dimension"] = body["dimensions"]
        return self._call(_model_path(model) + b"/invoke", request)

    def embeddings_answer(self, status: int, headers: Headers, body: bytes,
                          client_model: str, encoding_format: str = "float") -> Answer:
        if not 200 <= status < 300:
            return error_answer(status, headers, body)
        try:
            vectors = orjson.loads(body)["embeddings"]
            if isinstance(vectors, dict):  # asked with embedding_types: {"float": [...]}
                vectors = vectors["float"]
            if not isinstance(vectors, list):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return oa.error_answer(502, "The Bedrock upstream answered with an unexpected "
                                   "embeddings body.", "upstream_protocol_error")
        tokens = _header(headers, b"x-amzn-bedrock-input-token-count")
        return oa.embeddings_answer(vectors, client_model, encoding_format,
                                    int(tokens) if tokens and tokens.isdigit() else 0)


def from_settings(*, aws_region: str, aws_access_key_id: str, aws_secret_access_key: str,
                  aws_session_token: str | None = None, api_key: str = "",
                  **settings: Any) -> BedrockTranslator:
    """The translator of one `kind = "bedrock"` target from its settings, the credentials
    already read by the configuration from the variables `aws_access_key_id_env`,
    `aws_secret_access_key_env` and `aws_session_token_env` name (the environment is read in
    one place only). `api_key` is not used: Bedrock calls are signed instead."""
    if not aws_access_key_id or not aws_secret_access_key:
        raise ValueError("a bedrock target needs an access key id and a secret access key")
    return BedrockTranslator(aws_region, aws_access_key_id, aws_secret_access_key,
                             aws_session_token or None, **settings)


# --- request pieces ---------------------------------------------------------------------------


def _model_path(model: str) -> bytes:
    # A model id ("anthropic.claude-...:0") or an ARN: one path segment, ':' and '/' escaped.
    return b"/model/" + quote(model, safe="").encode()


def tool_id(call_id: str) -> str:
    """The toolUseId Bedrock accepts for an OpenAI tool call id (stable for equal ids)."""
    if _TOOL_ID.fullmatch(call_id):
        return call_id
    return "t" + hashlib.sha256(call_id.encode()).hexdigest()[:40]


def _messages(messages: list[Any]) -> tuple[list[str], list[dict[str, Any]], bool]:
    system: list[str] = []
    turns = oa.Turns("content")
    has_tools = False
    for role, where, message in oa.each_message(messages, KIND):
        if role in ("system", "developer"):
            text = oa.text_of(message.get("content"), where, KIND)
            if text:
                system.append(text)
        elif role == "user":
            turns.add("user", _blocks(message.get("content"), where))
        elif role == "assistant":
            blocks = _blocks(message.get("content"), where)
            for j, call in enumerate(message.get("tool_calls") or ()):
                blocks.append(_tool_use(call, f"{where}.tool_calls[{j}]"))
                has_tools = True
            turns.add("assistant", blocks)
        else:
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise Untranslatable(f"'{where}.tool_call_id' is required.",
                                     param=f"{where}.tool_call_id")
            text = oa.text_of(message.get("content"), where, KIND)
            turns.add("user", [{"toolResult": {"toolUseId": tool_id(call_id),
                                               "content": [{"text": text}]}}])
            has_tools = True
    return system, turns.list, has_tools


def _tool_use(call: Any, where: str) -> dict[str, Any]:
    call_id, name, args = oa.tool_call_parts(call, where)
    if not call_id:
        raise Untranslatable(f"'{where}.id' is required.", param=f"{where}.id")
    return {"toolUse": {"toolUseId": tool_id(call_id), "name": name, "input": args}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for i, piece in enumerate(oa.parts_of(content, where, KIND)):
        if isinstance(piece, str):
            if piece:  # Converse refuses blank text blocks
                blocks.append({"text": piece})
            continue
        field = f"{where}.content[{i}].image_url.url"
        if piece.data is None:
            raise oa.refuse(field, KIND, "Converse takes images as bytes only: send the image "
                            "as a data: URL")
        fmt = _IMAGE_FORMATS.get(piece.mime)
        if fmt is None:
            raise oa.refuse(field, KIND, f"image type {piece.mime!r} is not one of png, jpeg, "
                            "gif, webp")
        blocks.append({"image": {"format": fmt, "source": {"bytes": piece.data}}})
    return blocks


def _tool_config(body: dict[str, Any], has_tools: bool) -> dict[str, Any] | None:
    choice = oa.tool_choice(body.get("tool_choice"), KIND)
    if choice == "none":
        if has_tools:
            raise oa.refuse("tool_choice", KIND, "'none' cannot be expressed while the "
                            "conversation holds tool calls (Converse needs the tools to read "
                            "them, and has no way to forbid calling them)")
        return None
    if not body.get("tools"):
        return None
    config: dict[str, Any] = {"tools": [
        {"toolSpec": {"name": name, "inputSchema": {"json": schema},
                      **({"description": description} if description else {})}}
        for name, description, schema in oa.functions(body["tools"], KIND)]}
    if choice == "required":
        config["toolChoice"] = {"any": {}}
    elif isinstance(choice, tuple):
        config["toolChoice"] = {"tool": {"name": choice[1]}}
    elif choice == "auto":
        config["toolChoice"] = {"auto": {}}
    return config


def _inference(body: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    limit = oa.max_tokens(body)
    if limit is not None:
        config["maxTokens"] = limit
    if body.get("temperature") is not None:
        config["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        config["topP"] = body["top_p"]
    stop = oa.stop_list(body.get("stop"))
    if stop:
        config["stopSequences"] = stop
    return config


def _output_config(body: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    form, schema, name = oa.response_format(body.get("response_format"), KIND)
    if form != "text":
        spec: dict[str, Any] = {"schema": orjson.dumps(schema or {"type": "object"}).decode()}
        if name:
            spec["name"] = name
        config["textFormat"] = {"type": "json_schema", "structure": {"jsonSchema": spec}}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise oa.refuse("reasoning_effort", KIND, "Converse's effort takes low, medium "
                            "or high")
        config["effort"] = effort
    return config


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Untranslatable("'metadata' must map strings to strings.", param="metadata")
    out = dict(metadata)
    if isinstance(body.get("user"), str):
        out["user"] = body["user"]
    return out


# --- answer pieces --------------------------------------------------------------------------


def usage_of(usage: dict[str, Any] | None) -> Usage:
    # Converse reports cache reads and writes beside inputTokens (Anthropic's convention);
    # OpenAI's prompt_tokens include the cached part, so they are added back.
    if not usage:
        return Usage()
    read = usage.get("cacheReadInputTokens") or 0
    write = usage.get("cacheWriteInputTokens") or 0
    return Usage(input=(usage.get("inputTokens") or 0) + read + write,
                 output=usage.get("outputTokens") or 0, cached_input=read, cache_write=write)


def _header(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _error_code(headers: Headers, data: dict[str, Any]) -> str:
    raw = _header(headers, b"x-amzn-errortype")
    code = raw.decode("latin-1").split(":", 1)[0] if raw else ""
    if not code:
        code = str(data.get("__type") or data.get("code") or "")
    return code.rsplit("#", 1)[-1]


def error_answer(status: int, headers: Headers, body: bytes) -> Answer:
    """A Bedrock error answer in OpenAI's shape, the exception name kept as the code."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    code = _error_code(headers, data)
    message = str(data.get("message") or data.get("Message") or "")
    mapped = STATUS.get(code, status if status >= 400 else 502)
    return oa.error_answer(mapped, message or f"The Bedrock upstream answered HTTP {status}.",
                           code or None)


# --- streaming ----------------------------------------------------------------------------------

# States of one streamed answer (frames are whole: EventStreamBuffer keeps partial ones).
#   state     frame                                 -> output                        next
#   OPEN      messageStart                          -> nothing (role goes with text) OPEN
#   OPEN      contentBlockStart toolUse             -> tool_call chunk (id, name)    OPEN
#   OPEN      contentBlockDelta text                -> text chunk                    OPEN
#   OPEN      contentBlockDelta toolUse.input       -> arguments fragment            OPEN
#   OPEN      contentBlockDelta reasoningContent    -> nothing                       OPEN
#   OPEN      contentBlockStop                      -> nothing                       OPEN
#   OPEN      messageStop                           -> finish chunk                  STOPPED
#   STOPPED   metadata                              -> (usage kept)                  STOPPED
#   any       :message-type exception, bad frame    -> OpenAI error event            FAILED
#   STOPPED   end(), no partial frame held          -> usage chunk if asked, [DONE]
#   OPEN      end(), or a partial frame held        -> error event (truncated)
OPEN, STOPPED, FAILED = oa.OPEN, oa.FINISHED, oa.FAILED


class BedrockStream(oa.StreamBase):
    __slots__ = ("_frames", "_tools", "_held")
    provider = "Bedrock"

    def __init__(self, client_model: str, include_usage: bool) -> None:
        super().__init__(client_model, include_usage)
        self._frames = EventStreamBuffer()
        self._tools: dict[int, int] = {}  # contentBlockIndex -> OpenAI tool call index
        self._held = 0  # bytes fed and not yet part of a whole frame

    def feed(self, data: bytes) -> bytes:
        if self._state == FAILED:
            return b""
        self._frames.add_data(data)
        self._held += len(data)
        out: list[bytes] = []
        try:
            for message in self._frames:
                self._held -= message.prelude.total_length
                self._frame(message.headers, message.payload, out)
                if self._state == FAILED:
                    break
        except ParserError as exc:
            self._fail(out, 502, f"The Bedrock upstream sent a broken event-stream frame "
                       f"({type(exc).__name__}).", "upstream_protocol_error")
        return b"".join(out)

    def _frame(self, headers: dict[str, Any], payload: bytes, out: list[bytes]) -> None:
        try:
            event = orjson.loads(payload) if payload else {}
        except orjson.JSONDecodeError:
            event = {}
        kind = headers.get(":message-type")
        if kind != "event":
            name = str(headers.get(":exception-type") or headers.get(":error-code") or "")
            code = name[:1].upper() + name[1:]  # throttlingException -> ThrottlingException
            message = str(event.get("message") or headers.get(":error-message")
                          or "The Bedrock upstream failed mid-stream.")
            self._fail(out, STATUS.get(code, 502), message, code or None)
            return
        event_type = headers.get(":event-type")
        if event_type == "metadata":
            self.usage = usage_of(event.get("usage"))
        elif self._state != OPEN:
            return
        elif event_type == "contentBlockDelta":
            self._delta(event, out)
        elif event_type == "contentBlockStart":
            use = (event.get("start") or {}).get("toolUse")
            if use:
                index = len(self._tools)
                self._tools[event.get("contentBlockIndex", -1)] = index
                out.append(self._writer.tool_call(index, use.get("toolUseId") or "",
                                                  use.get("name") or "", ""))
        elif event_type == "messageStop":
            reason = oa.finish_reason(FINISH, event.get("stopReason"), bool(self._tools))
            out.append(self._writer.finish(reason))
            self._state = STOPPED

    def _delta(self, event: dict[str, Any], out: list[bytes]) -> None:
        delta = event.get("delta") or {}
        text = delta.get("text")
        if isinstance(text, str):
            if text:
                out.append(self._writer.text(text))
            return
        use = delta.get("toolUse")
        if use and use.get("input"):
            index = self._tools.get(event.get("contentBlockIndex", -1))
            if index is not None:
                out.append(self._writer.arguments(index, use["input"]))

    def end(self) -> bytes:
        return self._ending(not self._held)


if TYPE_CHECKING:  # mypy holds both classes to the contracts the egress edge calls
    _translator: Translator = BedrockTranslator("", "", "")
    _stream: Stream = BedrockStream("", False)
