"""Each translator's upstream call sent for real (HTTP/2 + TLS) to the mock speaking that
provider, and the answer translated back and read by the openai SDK's types: plain, streamed
(fed as the socket delivers it), a two-turn tool conversation the mock checks as the provider
would (Gemini's thought signatures, Bedrock's toolUseIds), JSON mode, images, errors."""

from __future__ import annotations

import ssl
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest

from tests.providers.oaparse import Stream, completion, embeddings, sdk_error
from velox.providers.bedrock import BedrockTranslator
from velox.providers.gemini import GeminiTranslator

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"


@pytest.fixture(scope="module")
def mock(logged_mock):
    return logged_mock


@pytest.fixture(scope="module")
def http(mock):
    with httpx.Client(http2=True, base_url=mock.origin, timeout=10,
                      verify=ssl.create_default_context(cafile=mock.ca_file)) as client:
        yield client


@pytest.fixture(scope="module", params=["gemini", "bedrock"])
def kind(request, mock):
    if request.param == "gemini":
        return GeminiTranslator("AIza-test"), "gemini-3-pro"
    host = urlsplit(mock.origin).netloc
    return BedrockTranslator("us-east-1", "AKIAIOSFODNN7EXAMPLE", "secret", host=host), "m-1"


def send(http, call):
    response = http.post(call.path.decode(), content=call.body,
                         headers=[(k.decode(), v.decode()) for k, v in call.headers])
    assert response.http_version == "HTTP/2"
    return response


def chat(http, kind, body, model=None):
    translator, upstream_model = kind
    call = translator.chat({"model": "alias", **body}, model or upstream_model, False, [])
    r = send(http, call)
    return translator.chat_answer(r.status_code, list(r.headers.raw), r.content, "alias")


def chat_stream(http, kind, body, model=None, include_usage=True):
    translator, upstream_model = kind
    call = translator.chat({"model": "alias", **body}, model or upstream_model, True, [])
    stream = translator.chat_stream("alias", include_usage)
    out = []
    with http.stream("POST", call.path.decode(), content=call.body,
                     headers=[(k.decode(), v.decode()) for k, v in call.headers]) as r:
        assert r.status_code == 200
        for piece in r.iter_raw():
            out.append(stream.feed(piece))
    out.append(stream.end())
    return Stream(b"".join(out)), stream


def test_plain_and_streamed(http, kind, mock):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = completion(chat(http, kind, {"messages": messages}))
    assert out.choices[0].message.content == "Hello from the Velox mock upstream"
    assert out.model == "alias" and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
    s, raw = chat_stream(http, kind, {"messages": messages})
    assert s.text == out.choices[0].message.content and s.done and s.finish == "stop"
    entry = mock.requests(1)[0]
    assert entry["query"] == ("alt=sse" if isinstance(kind[0], GeminiTranslator) else "")
    assert entry["auth"]["kind"] == ("x-goog-api-key" if isinstance(kind[0], GeminiTranslator)
                                     else "sigv4")
    assert s.usage.total_tokens == raw.usage.input + raw.usage.output > 0


def test_two_turn_tool_conversation(http, kind):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = completion(chat(http, kind, {"messages": messages, "tools": TOOLS}))
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert orjson.loads(call.function.arguments) == {"city": "mock"}
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3 degrees"}]
    second = completion(chat(http, kind, {"messages": messages, "tools": TOOLS}))
    assert "3 degrees" in second.choices[0].message.content
    # The same conversation streamed: the tool call's id from the stream works as well.
    s, _ = chat_stream(http, kind, {"messages": messages[:1], "tools": TOOLS})
    assert s.finish == "tool_calls" and len(s.calls) == 1
    streamed = [{"role": "assistant", "tool_calls": [{
        "id": s.calls[0]["id"], "type": "function",
        "function": {"name": s.calls[0]["name"], "arguments": s.calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": s.calls[0]["id"], "content": "4 degrees"}]
    again, _ = chat_stream(http, kind, {"messages": messages[:1] + streamed, "tools": TOOLS})
    assert "4 degrees" in again.text and again.done


def test_image_and_json_schema(http, kind):
    out = completion(chat(http, kind, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": PNG}}]}]}))
    assert out.choices[0].message.content.endswith("I see 1 image.")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    out = completion(chat(http, kind, {"messages": [{"role": "user", "content": "JSON"}],
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "r",
                                                                           "schema": schema}}}))
    assert orjson.loads(out.choices[0].message.content) == {"n": 1}


@pytest.mark.parametrize("gemini_name, bedrock_name, cls", [
    ("RESOURCE_EXHAUSTED", "ThrottlingException", openai.RateLimitError),
    ("INVALID_ARGUMENT", "ValidationException", openai.BadRequestError),
    ("PERMISSION_DENIED", "AccessDeniedException", openai.PermissionDeniedError),
    ("NOT_FOUND", "ResourceNotFoundException", openai.NotFoundError),
    ("UNAVAILABLE", "ModelNotReadyException", openai.InternalServerError),
])
def test_errors(http, kind, gemini_name, bedrock_name, cls):
    name = gemini_name if isinstance(kind[0], GeminiTranslator) else bedrock_name
    exc = sdk_error(chat(http, kind, {"messages": [{"role": "user", "content": "x"}]},
                         model="error-" + name))
    assert type(exc) is cls and exc.code == name and exc.message


def test_mid_stream_error_event_and_no_done(http, kind):
    name = "UNAVAILABLE" if isinstance(kind[0], GeminiTranslator) else "ThrottlingException"
    s, _ = chat_stream(http, kind, {"messages": [{"role": "user", "content": "x"}]},
                       model="midstream-" + name)
    assert s.text and not s.done and s.error["code"] == name


def test_finish_reasons(http, kind):
    messages = {"messages": [{"role": "user", "content": "x"}]}
    assert completion(chat(http, kind, messages, model="length-1")).choices[0].finish_reason \
        == "length"
    s, _ = chat_stream(http, kind, messages, model="filter-1")
    assert s.finish == "content_filter"


def test_embeddings(http, kind):
    translator = kind[0]
    model = "text-embedding-004" if isinstance(translator, GeminiTranslator) else \
        "cohere.embed-english-v3"
    call = translator.embeddings({"model": "e", "input": ["a", "bb"]}, model, [])
    r = send(http, call)
    out = embeddings(translator.embeddings_answer(r.status_code, list(r.headers.raw),
                                                  r.content, "e"))
    assert len(out.data) == 2 and len(out.data[0].embedding) == 8 and out.model == "e"
