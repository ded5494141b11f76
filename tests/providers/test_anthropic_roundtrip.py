"""The anthropic translator between the official OpenAI SDK and the Anthropic mock over a real
socket (HTTP/2 + TLS): the SDK builds its request as it always does, the translator turns it into
a Messages call that goes to the mock, and the mock's answer comes back translated to the SDK,
which parses it with its own types and raises its own exceptions. A transport inside the SDK's
HTTP client does the translating (the gateway's egress edge will, once wired)."""

from __future__ import annotations

import ssl

import httpx2
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conftest import closed_after_the_test
from velox.providers import KINDS
from velox.providers.base import Untranslatable
from velox_lab.mock import MockUpstream, fingerprint
from velox_lab.mock.anthropic_api import fill

KEY = "sk-ant-roundtrip-0123"
HI = [{"role": "user", "content": "Say hello"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                  "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                              "parameters": WEATHER_PARAMS}}]


class Translating(httpx2.BaseTransport):
    """OpenAI request in, translated Messages call to the mock, translated answer out."""

    def __init__(self, mock: MockUpstream, model: str = "claude-mock-1") -> None:
        self.translator = KINDS["anthropic"](api_key=KEY)
        self.model = model
        self.upstream = httpx2.Client(
            http2=True, verify=ssl.create_default_context(cafile=mock.ca_file), timeout=10)
        self.origin = mock.origin
        self.sent: list[dict] = []  # the Messages bodies that went upstream
        self.chunks: list[bytes] = []  # every translated piece of the last stream

    def close(self) -> None:  # the SDK client's close() ends here: the mock's connection too
        self.upstream.close()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = orjson.loads(request.read())
        stream = bool(body.get("stream"))
        headers = [(k.lower().encode(), v.encode()) for k, v in request.headers.items()]
        try:
            call = self.translator.chat(body, self.model, stream, headers)
        except Untranslatable as exc:
            from velox.core.errors import to_response

            refused = to_response(exc)
            return httpx2.Response(refused.status, headers=list(refused.headers),
                                   content=refused.body)
        self.sent.append(orjson.loads(call.body))
        upstream_headers = [(k.decode(), v.decode()) for k, v in call.headers]
        with self.upstream.stream(call.method.decode(), self.origin + call.path.decode(),
                                  headers=upstream_headers, content=call.body) as resp:
            status = resp.status_code
            raw = [(k.lower().encode(), v.encode()) for k, v in resp.headers.items()]
            if status != 200 or not stream:
                answer = self.translator.chat_answer(status, raw, resp.read(), body["model"])
                self.last_usage = answer.usage
                return httpx2.Response(answer.status, headers=[
                    (k.decode(), v.decode()) for k, v in answer.headers], content=answer.body)
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            translated = self.translator.chat_stream(body["model"], include)
            self.chunks = [translated.feed(piece) for piece in resp.iter_raw()]
            self.chunks.append(translated.end())
            self.last_usage = translated.usage
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=b"".join(self.chunks))


@pytest.fixture
def rig(mock):
    mock.reset()
    transport = Translating(mock)
    client = openai.OpenAI(api_key="sk-velox-client", base_url="http://velox.invalid/v1",
                           http_client=httpx2.Client(transport=transport), max_retries=0)
    closed_after_the_test(client)
    yield client, transport
    client.close()
    transport.close()


def _chunks(transport: Translating) -> list[ChatCompletionChunk]:
    events = b"".join(transport.chunks).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return [ChatCompletionChunk.model_validate(orjson.loads(e[6:])) for e in events[:-2]]


def test_plain_chat(rig, mock):
    client, transport = rig
    out = client.chat.completions.create(model="claude-via-velox", messages=[
        {"role": "system", "content": "Be brief."}, *HI])
    assert out.object == "chat.completion" and out.model == "claude-via-velox"
    assert out.choices[0].message.content == "Hello from the Velox mock upstream"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    [sent] = transport.sent
    assert sent["system"] == [{"type": "text", "text": "Be brief."}]
    assert sent["max_tokens"] == 4096 and sent["model"] == "claude-mock-1"
    [entry] = mock.requests()
    assert entry["auth"] == {"kind": "x-api-key", "key_sha256": fingerprint(KEY)}
    assert dict(entry["headers"])["anthropic-version"] == "2023-06-01"
    assert transport.last_usage.output == 6
    ChatCompletion.model_validate(out.model_dump())


def test_streamed_chat_with_and_without_usage(rig):
    client, transport = rig
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=HI, stream=True) if c.choices)
    assert text == "Hello from the Velox mock upstream"
    chunks = _chunks(transport)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("msg_mock")

    with_usage = list(client.chat.completions.create(
        model="m", messages=HI, stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 6
    assert with_usage[-1].usage.prompt_tokens == transport.last_usage.input > 0


def test_tool_conversation_non_streamed(rig):
    client, transport = rig
    first = client.chat.completions.create(model="m", messages=HI, tools=WEATHER)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.id.startswith("toolu_")
    assert orjson.loads(call.function.arguments) == fill(WEATHER_PARAMS)
    assert first.choices[0].message.content == "Calling the tool."
    second = client.chat.completions.create(model="m", tools=WEATHER, messages=[
        *HI, first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    turns = transport.sent[1]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"][-1] == {"type": "tool_use", "id": call.id, "name": "get_weather",
                                       "input": fill(WEATHER_PARAMS)}
    assert turns[2]["content"] == [{"type": "tool_result", "tool_use_id": call.id,
                                    "content": "Sunny, 21 C"}]


def test_tool_call_streamed_reassembles_arguments(rig):
    client, transport = rig
    with client.chat.completions.stream(model="m", messages=HI, tools=WEATHER) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert orjson.loads(call.function.arguments) == fill(WEATHER_PARAMS)
    assert final.choices[0].finish_reason == "tool_calls"
    firsts = [c for c in _chunks(transport) if c.choices and c.choices[0].delta.tool_calls]
    assert firsts[0].choices[0].delta.tool_calls[0].id == call.id
    assert all(c.choices[0].delta.tool_calls[0].id is None for c in firsts[1:])
    assert len(firsts) >= 3  # the name first, then the argument fragments


def test_reasoning_effort_becomes_a_budget_and_thinking_comes_back(rig):
    client, transport = rig
    out = client.chat.completions.create(model="m", messages=HI, reasoning_effort="low")
    assert transport.sent[0]["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert transport.sent[0]["max_tokens"] == 4096 + 2048
    message = out.choices[0].message
    assert message.reasoning_content and message.thinking_blocks[0]["signature"]
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    streamed = list(client.chat.completions.create(model="m", messages=HI, stream=True,
                                                   reasoning_effort="low"))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in streamed if c.choices)
    assert reasoning == message.reasoning_content


def test_json_schema_and_json_object(rig):
    client, transport = rig
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}
    structured = client.chat.completions.create(model="m", messages=HI, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                               "strict": True}})
    assert orjson.loads(structured.choices[0].message.content) == {"name": "mock"}
    assert transport.sent[0]["output_config"] == {"format": {"type": "json_schema",
                                                             "schema": schema}}
    plain = client.chat.completions.create(model="m", messages=HI,
                                           response_format={"type": "json_object"})
    assert isinstance(orjson.loads(plain.choices[0].message.content), dict)
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=HI, stream=True, response_format={"type": "json_object"})
        if c.choices)
    assert orjson.loads(streamed) == orjson.loads(plain.choices[0].message.content)


def test_image_part_and_length_and_stop(rig):
    client, transport = rig
    pixel = "data:image/png;base64,iVBORw0KGgo="
    out = client.chat.completions.create(model="m", max_completion_tokens=2, stop=["never"],
                                         messages=[{"role": "user", "content": [
                                             {"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": pixel}}]}])
    assert out.choices[0].finish_reason == "length"
    sent = transport.sent[0]
    assert sent["max_tokens"] == 2 and sent["stop_sequences"] == ["never"]
    assert sent["messages"][0]["content"][1] == {
        "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                    "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("status, error", [(400, openai.BadRequestError),
                                           (401, openai.AuthenticationError),
                                           (403, openai.PermissionDeniedError),
                                           (404, openai.NotFoundError),
                                           (429, openai.RateLimitError),
                                           (500, openai.InternalServerError),
                                           (529, openai.InternalServerError)])
def test_errors_raise_the_openai_sdk_classes(mock, status, error):
    mock.reset()
    transport = Translating(mock, model=f"claude-error-{status}")
    client = openai.OpenAI(api_key="k", base_url="http://velox.invalid/v1", max_retries=0,
                           http_client=httpx2.Client(transport=transport))
    closed_after_the_test(client)
    with client, pytest.raises(error) as caught:
        client.chat.completions.create(model="m", messages=HI)
    expected = 503 if status == 529 else status
    assert caught.value.status_code == expected
    assert caught.value.body["type"] == {400: "invalid_request_error",
                                         401: "authentication_error",
                                         403: "permission_error", 404: "not_found_error",
                                         429: "rate_limit_error", 500: "api_error",
                                         529: "overloaded_error"}[status]
    if status == 429:
        assert caught.value.response.headers["retry-after"] == "1"
    transport.close()


def test_mid_stream_error_ends_without_done(mock):
    mock.reset()
    transport = Translating(mock, model="claude-stream-error")
    client = openai.OpenAI(api_key="k", base_url="http://velox.invalid/v1", max_retries=0,
                           http_client=httpx2.Client(transport=transport))
    closed_after_the_test(client)
    seen = []
    with client, pytest.raises(openai.APIError) as caught:
        for chunk in client.chat.completions.create(model="m", messages=HI, stream=True):
            seen.append(chunk.choices[0].delta.content)
    assert "Overloaded" in str(caught.value)
    assert b"[DONE]" not in b"".join(transport.chunks)
    assert seen[-1] == "Hello"
    transport.close()


@pytest.mark.parametrize("extra, field", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}]},
     "messages[0].content[0]")])
def test_untranslatable_is_refused_before_anything_is_sent(rig, mock, extra, field):
    client, transport = rig
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": "m", "messages": HI, **extra})
    assert caught.value.body["param"] == field
    assert caught.value.body["code"] == "unsupported_parameter"
    assert "'anthropic'" in caught.value.message
    assert transport.sent == [] and mock.requests() == []
