"""The Gemini translator, socket-free: canned requests and answers shaped as the Gemini API
reference shows them, translated answers read back by the openai SDK's own types."""

from __future__ import annotations

import base64
import struct

import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.providers.oaparse import Stream, completion, embeddings, sdk_error, translate_stream
from velox.providers import KINDS
from velox.providers.base import Untranslatable
from velox.providers.gemini import GeminiTranslator

T = GeminiTranslator("AIza-test-key")
USER = [{"role": "user", "content": "Hi"}]


def call(body: dict, model: str = "gemini-2.5-flash", stream: bool = False):
    c = T.chat({"model": "client-name", **body}, model, stream, [])
    return c, orjson.loads(c.body)


# --- requests ---------------------------------------------------------------------------


def test_path_and_key_header_never_query():
    c, _ = call({"messages": USER})
    assert c.method == b"POST" and c.path == b"/v1beta/models/gemini-2.5-flash:generateContent"
    assert (b"x-goog-api-key", b"AIza-test-key") in c.headers
    s, _ = call({"messages": USER}, stream=True)
    assert s.path == b"/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    assert b"key=" not in s.path and b"AIza" not in s.path
    t, _ = call({"messages": USER}, model="tunedModels/my-model")
    assert t.path == b"/v1beta/tunedModels/my-model:generateContent"
    prefixed = KINDS["gemini"](api_key="k", base_path="/google/").chat(
        {"messages": USER}, "gemini-2.5-flash", False, [])
    assert prefixed.path == b"/google/v1beta/models/gemini-2.5-flash:generateContent"


def test_system_roles_merged_and_images():
    _, req = call({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": "Look:"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg?x=1"}}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Thanks"}]})
    assert req["systemInstruction"] == {"parts": [{"text": "Be brief."},
                                                  {"text": "Answer in French."}]}
    assert req["contents"] == [
        {"role": "user", "parts": [
            {"text": "Look:"},
            {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
            {"fileData": {"fileUri": "https://example.com/cat.jpg?x=1",
                          "mimeType": "image/jpeg"}}]},
        {"role": "model", "parts": [{"text": "A cat."}]},
        {"role": "user", "parts": [{"text": "Thanks"}]}]


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "logprobs": True}, "logprobs"),
    ({"messages": USER, "logit_bias": {"50256": -100}}, "logit_bias"),
    ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format.type"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages[0].role"),
])
def test_untranslatable_refused_naming_field_and_kind(body, field):
    with pytest.raises(Untranslatable) as info:
        call(body)
    assert info.value.status == 400 and info.value.param == field
    assert "gemini" in info.value.message or "tool call" in info.value.message


def test_neutral_values_accepted():
    _, req = call({"messages": USER, "n": 1, "logprobs": False, "parallel_tool_calls": True,
                   "user": "u1", "metadata": {"team": "a"},
                   "stream_options": {"include_usage": True}})
    assert "generationConfig" not in req


def test_generation_config():
    _, req = call({"messages": USER, "max_completion_tokens": 77, "temperature": 0.2,
                   "top_p": 0.9, "stop": "END", "seed": 5, "presence_penalty": 0.5,
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "r", "schema": {"type": "object", "properties": {
                           "a": {"type": "integer"}}, "additionalProperties": False}}},
                   "reasoning_effort": "high"})
    assert req["generationConfig"] == {
        "maxOutputTokens": 77, "temperature": 0.2, "topP": 0.9, "seed": 5,
        "presencePenalty": 0.5, "stopSequences": ["END"],
        "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "object", "properties": {"a": {"type": "integer"}},
                               "additionalProperties": False},
        "thinkingConfig": {"thinkingBudget": 24576}}
    _, req = call({"messages": USER, "max_tokens": 5, "response_format": {"type": "json_object"},
                   "reasoning_effort": "low"}, model="gemini-3-pro-preview")
    assert req["generationConfig"] == {"maxOutputTokens": 5, "responseMimeType":
                                       "application/json",
                                       "thinkingConfig": {"thinkingLevel": "LOW"}}
    forced = GeminiTranslator("k", thinking="level").chat(
        {"messages": USER, "reasoning_effort": "none"}, "gemini-2.5-pro", False, [])
    assert orjson.loads(forced.body)["generationConfig"]["thinkingConfig"] == {
        "thinkingLevel": "MINIMAL"}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.mark.parametrize("choice, config", [
    ("auto", {"mode": "AUTO"}), ("none", {"mode": "NONE"}), ("required", {"mode": "ANY"}),
    ({"type": "function", "function": {"name": "get_weather"}},
     {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}),
])
def test_tools_and_tool_choice(choice, config):
    _, req = call({"messages": USER, "tools": TOOLS, "tool_choice": choice})
    assert req["tools"] == [{"functionDeclarations": [{
        "name": "get_weather", "description": "Weather of a city",
        "parametersJsonSchema": TOOLS[0]["function"]["parameters"]}]}]
    assert req["toolConfig"] == {"functionCallingConfig": config}


def test_tool_conversation_keeps_ids_and_thought_signatures():
    """Gemini's id and thought signature leave in the OpenAI id and come back as they were;
    an id Velox minted is not sent to Gemini; the tool result gets its function's name."""
    answer = completion(T.chat_answer(200, [], orjson.dumps({"candidates": [{
        "content": {"role": "model", "parts": [
            {"functionCall": {"id": "g-1", "name": "get_weather", "args": {"city": "Oslo"}},
             "thoughtSignature": "c2lnLzE+Kw=="},
            {"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}]},
        "finishReason": "STOP"}]}), "client-name"))
    first, second = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.choices[0].message.content is None
    assert first.id == "g-1__sig__c2lnLzE+Kw==" and second.id.startswith("call_vx")
    assert orjson.loads(first.function.arguments) == {"city": "Oslo"}
    _, req = call({"messages": [
        *USER, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.id, "content": '{"temp": 3}'},
        {"role": "tool", "tool_call_id": second.id, "content": "sunny"}], "tools": TOOLS})
    assert req["contents"][1:] == [
        {"role": "model", "parts": [
            {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}, "id": "g-1"},
             "thoughtSignature": "c2lnLzE+Kw=="},
            {"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "get_weather", "response": {"temp": 3},
                                  "id": "g-1"}},
            {"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}}]}]


# --- answers ----------------------------------------------------------------------------

REFERENCE_ANSWER = {  # as the generateContent reference shows one, thoughts and cache included
    "candidates": [{"content": {"parts": [{"text": "thinking...", "thought": True},
                                          {"text": "Hello"}, {"text": " there"}],
                                "role": "model"},
                    "finishReason": "STOP", "index": 0,
                    "safetyRatings": [{"category": "HARM_CATEGORY_HARASSMENT",
                                       "probability": "NEGLIGIBLE"}]}],
    "usageMetadata": {"promptTokenCount": 120, "candidatesTokenCount": 9,
                      "totalTokenCount": 150, "cachedContentTokenCount": 100,
                      "thoughtsTokenCount": 21},
    "modelVersion": "gemini-2.5-flash", "responseId": "abc"}


def test_answer_text_usage_and_model_name():
    answer = T.chat_answer(200, [], orjson.dumps(REFERENCE_ANSWER), "my-alias")
    out = completion(answer)
    assert out.model == "my-alias" and out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-") and out.created > 0
    assert out.choices[0].message.content == "Hello there"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == 120 and out.usage.completion_tokens == 30
    assert out.usage.total_tokens == 150
    assert out.usage.prompt_tokens_details.cached_tokens == 100
    assert out.usage.completion_tokens_details.reasoning_tokens == 21
    assert answer.usage.input == 120 and answer.usage.reasoning == 21


@pytest.mark.parametrize("reason, finish", [
    ("MAX_TOKENS", "length"), ("SAFETY", "content_filter"), ("RECITATION", "content_filter"),
    ("PROHIBITED_CONTENT", "content_filter"), ("OTHER", "stop"), (None, "stop")])
def test_finish_reasons(reason, finish):
    candidate = {"content": {"parts": [{"text": "x"}], "role": "model"}}
    if reason:
        candidate["finishReason"] = reason
    out = completion(T.chat_answer(200, [], orjson.dumps({"candidates": [candidate]}), "m"))
    assert out.choices[0].finish_reason == finish


def test_blocked_prompt_is_content_filter():
    out = completion(T.chat_answer(200, [], orjson.dumps({
        "promptFeedback": {"blockReason": "SAFETY"},
        "usageMetadata": {"promptTokenCount": 4, "totalTokenCount": 4}}), "m"))
    assert out.choices[0].finish_reason == "content_filter"
    assert out.choices[0].message.content is None and out.usage.prompt_tokens == 4


@pytest.mark.parametrize("status, name, ours, cls", [
    (400, "INVALID_ARGUMENT", 400, openai.BadRequestError),
    (400, "FAILED_PRECONDITION", 400, openai.BadRequestError),
    (401, "UNAUTHENTICATED", 401, openai.AuthenticationError),
    (403, "PERMISSION_DENIED", 403, openai.PermissionDeniedError),
    (404, "NOT_FOUND", 404, openai.NotFoundError),
    (429, "RESOURCE_EXHAUSTED", 429, openai.RateLimitError),
    (500, "INTERNAL", 500, openai.InternalServerError),
    (503, "UNAVAILABLE", 503, openai.InternalServerError),
    (504, "DEADLINE_EXCEEDED", 504, openai.InternalServerError),
    (499, "CANCELLED", 502, openai.InternalServerError),
    (418, "", 418, openai.APIStatusError),
])
def test_errors_in_openai_shape_raise_the_sdk_class(status, name, ours, cls):
    body = {"error": {"code": status, "message": f"upstream says {name}", "status": name}}
    if name == "RESOURCE_EXHAUSTED":
        body["error"]["details"] = [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                     "retryDelay": "37s"}]
    answer = T.chat_answer(status, [], orjson.dumps(body), "m")
    assert answer.status == ours
    exc = sdk_error(answer)
    assert type(exc) is cls and exc.status_code == ours
    assert exc.message == f"upstream says {name}" and exc.code == (name or None)
    assert dict(answer.headers).get(b"retry-after") == (b"37" if ours == 429 else None)


def test_error_body_not_json_keeps_status_and_text():
    answer = T.chat_answer(502, [], b"<html>Bad Gateway</html>", "m")
    assert answer.status == 502 and b"Bad Gateway" in answer.body
    answer = T.chat_answer(200, [], b"{oops", "m")
    assert answer.status == 502 and sdk_error(answer).code == "upstream_protocol_error"


# --- streaming ----------------------------------------------------------------------------

def sse(*events) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)


TEXT_STREAM = sse(
    {"candidates": [{"content": {"parts": [{"text": "Héllo"}], "role": "model"}, "index": 0}]},
    {"candidates": [{"content": {"parts": [{"text": "mm", "thought": True}],
                                 "role": "model"}, "index": 0}]},
    {"candidates": [{"content": {"parts": [{"text": " wörld 🌍"}], "role": "model"},
                     "index": 0}]},
    {"candidates": [{"content": {"parts": [{"text": "!"}], "role": "model"},
                     "finishReason": "STOP", "index": 0}],
     "usageMetadata": {"promptTokenCount": 8, "candidatesTokenCount": 5,
                       "thoughtsTokenCount": 2, "totalTokenCount": 15}})
TOOL_STREAM = sse(
    {"candidates": [{"content": {"parts": [
        {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}},
         "thoughtSignature": "U0lH"}], "role": "model"}, "index": 0}]},
    {"candidates": [{"content": {"parts": [
        {"functionCall": {"id": "c2", "name": "get_weather", "args": {"city": "Bergen"}}}],
        "role": "model"}, "finishReason": "STOP", "index": 0}],
     "usageMetadata": {"promptTokenCount": 8, "candidatesTokenCount": 5,
                       "totalTokenCount": 13}})


def run(raw: bytes, pieces: list[int] | None = None, include_usage: bool = True) -> Stream:
    return translate_stream(T, raw, pieces, include_usage)


def test_stream_text_usage_done():
    s = run(TEXT_STREAM)
    assert s.text == "Héllo wörld 🌍!" and s.finish == "stop" and s.done and not s.error
    assert s.chunks[0].model == "client-name"
    assert s.usage.prompt_tokens == 8 and s.usage.completion_tokens == 7
    assert s.usage.completion_tokens_details.reasoning_tokens == 2
    assert all(c.usage is None for c in s.chunks[:-1])
    plain = run(TEXT_STREAM, include_usage=False)
    assert plain.usage is None and plain.done and plain.text == s.text


def test_stream_first_text_leaves_at_once():
    """The first text event gives its chunk on the feed that completes it, not later."""
    first = TEXT_STREAM.split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    stream = T.chat_stream("m", False)
    assert stream.feed(first[:-1]) == b""
    assert Stream(stream.feed(first[-1:])).text == "Héllo"


def test_stream_tool_calls():
    s = run(TOOL_STREAM)
    assert s.finish == "tool_calls" and s.done
    assert [(c["name"], orjson.loads(c["arguments"])) for c in s.calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    assert s.calls[0]["id"].startswith("call_vx") and s.calls[0]["id"].endswith("__sig__U0lH")
    assert s.calls[1]["id"] == "c2"


def test_stream_mid_error_and_truncation():
    error = {"error": {"code": 503, "message": "The model is overloaded.",
                       "status": "UNAVAILABLE"}}
    s = run(TEXT_STREAM.split(b"\r\n\r\n")[0] + b"\r\n\r\n" + sse(error))
    assert s.text == "Héllo" and not s.done
    assert s.error["message"] == "The model is overloaded." and s.error["code"] == "UNAVAILABLE"
    for cut_at in (len(TEXT_STREAM) // 2, len(TEXT_STREAM) - 10):  # mid-answer; last event
        cut = run(TEXT_STREAM[:cut_at])
        assert not cut.done and cut.error["code"] == "upstream_truncated"


@settings(max_examples=150, deadline=None)
@given(raw=st.sampled_from([TEXT_STREAM, TOOL_STREAM]), data=st.data())
def test_any_split_gives_the_same_chunks(raw, data):
    whole = run(raw)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    pieces = [b - a for a, b in zip([0, *cuts], cuts, strict=False)]
    split = run(raw, pieces)
    assert split.normalised() == whole.normalised()
    assert split.text == whole.text and split.done
    assert [(c["name"], c["arguments"]) for c in split.calls] == [
        (c["name"], c["arguments"]) for c in whole.calls]


# --- embeddings ---------------------------------------------------------------------------


def test_embeddings_request_and_answer():
    c = T.embeddings({"model": "x", "input": ["a", "b"], "dimensions": 4}, "text-embedding-004",
                     [])
    assert c.path == b"/v1beta/models/text-embedding-004:batchEmbedContents"
    assert orjson.loads(c.body) == {"requests": [
        {"model": "models/text-embedding-004", "content": {"parts": [{"text": "a"}]},
         "outputDimensionality": 4},
        {"model": "models/text-embedding-004", "content": {"parts": [{"text": "b"}]},
         "outputDimensionality": 4}]}
    upstream = orjson.dumps({"embeddings": [{"values": [0.5, -0.25]}, {"values": [1.0, 0.0]}]})
    out = embeddings(T.embeddings_answer(200, [], upstream, "emb"))
    assert [d.embedding for d in out.data] == [[0.5, -0.25], [1.0, 0.0]]
    assert out.model == "emb" and [d.index for d in out.data] == [0, 1]
    packed = orjson.loads(T.embeddings_answer(200, [], upstream, "emb",
                                              encoding_format="base64").body)
    raw = base64.b64decode(packed["data"][0]["embedding"])  # as the SDK decodes it
    assert struct.unpack("<2f", raw) == (0.5, -0.25)
    with pytest.raises(Untranslatable):
        T.embeddings({"model": "x", "input": [[1, 2, 3]]}, "text-embedding-004", [])
