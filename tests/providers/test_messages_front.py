"""The Messages API in front, with the official Anthropic SDK as the client: its requests are
translated to OpenAI chat completions and sent over a real socket (HTTP/2 + TLS) to the bundled
mock, either as an OpenAI upstream or, through the anthropic translator, as an Anthropic one (the
second gives tool calls to stream); the answers come back in the Messages shape, which the SDK
parses with its own types, reassembling streamed tool input, or raises its own exception classes.
A transport inside the SDK's HTTP client plays the gateway's part (until the edge is wired)."""

from __future__ import annotations

import ssl

import anthropic
import httpx2
import orjson
import pytest

from tests.conftest import closed_after_the_test
from velox.core.errors import VeloxError, to_response
from velox.providers import KINDS, messages
from velox.providers.base import Usage
from velox.relay import usage as velox_usage
from velox_lab.mock import MockUpstream
from velox_lab.mock.anthropic_api import fill

HI = [{"role": "user", "content": "Say hello"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer"}},
                            "required": ["city"]}}


class Front(httpx2.BaseTransport):
    """Messages request in, chat completion to the mock (directly as an OpenAI upstream, or
    through the anthropic translator), Messages answer out."""

    def __init__(self, mock: MockUpstream, via_anthropic: bool = False) -> None:
        self.anthropic = KINDS["anthropic"](api_key="sk-ant-up") if via_anthropic else None
        self.http = httpx2.Client(http2=True, timeout=10,
                                  verify=ssl.create_default_context(cafile=mock.ca_file))
        self.origin = mock.origin
        self.chat: list[dict] = []  # the chat requests made
        self.usage: Usage | None = None

    def close(self) -> None:  # the SDK client's close() ends here: the mock's connection too
        self.http.close()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        raw = request.read()
        if request.url.path == "/v1/messages/count_tokens":
            answer = messages.count_tokens_answer(velox_usage.input_tokens(raw))
            return self._response(answer.status, answer.headers, answer.body)
        body = orjson.loads(raw)
        try:
            chat = messages.messages_to_chat(body)
        except VeloxError as exc:
            made = to_response(exc)
            answer = messages.error_to_messages(made.status, made.body, list(made.headers))
            return self._response(answer.status, answer.headers, answer.body)
        self.chat.append(chat)
        stream = bool(chat.get("stream"))
        controls = {k: v for k, v in request.headers.items() if k.startswith("x-mock-")}
        if self.anthropic is not None:
            call = self.anthropic.chat(chat, body["model"], stream, [])
            url, headers, content = (self.origin + call.path.decode(),
                                     [(k.decode(), v.decode()) for k, v in call.headers],
                                     call.body)
        else:
            url, headers, content = (self.origin + "/v1/chat/completions",
                                     [("authorization", "Bearer sk-up"),
                                      ("content-type", "application/json")],
                                     orjson.dumps(chat))
        with self.http.stream("POST", url, headers=[*headers, *controls.items()],
                              content=content) as resp:
            status, head = resp.status_code, [(k.encode(), v.encode())
                                              for k, v in resp.headers.items()]
            if status == 200 and stream:
                upstream = (self.anthropic.chat_stream(body["model"], True)
                            if self.anthropic else None)
                front = messages.ChatToMessagesStream(body["model"])
                out = []
                for piece in resp.iter_raw():
                    out.append(front.feed(upstream.feed(piece) if upstream else piece))
                out.append(front.feed(upstream.end()) if upstream else b"")
                out.append(front.end())
                self.usage = front.usage
                return self._response(200, [(b"content-type", b"text/event-stream")],
                                      b"".join(out))
            data = resp.read()
        if self.anthropic is not None:  # its answer in OpenAI's shape first
            translated = self.anthropic.chat_answer(status, head, data, body["model"])
            status, head, data = translated.status, translated.headers, translated.body
        if status >= 400:
            answer = messages.error_to_messages(status, data, head)
        else:
            answer = messages.chat_to_messages(data, body["model"])
            self.usage = answer.usage
        return self._response(answer.status, answer.headers, answer.body)

    @staticmethod
    def _response(status: int, headers: list, body: bytes) -> httpx2.Response:
        return httpx2.Response(status, headers=[(k.decode(), v.decode()) for k, v in headers],
                               content=body)


def _client(front: Front) -> anthropic.Anthropic:
    client = anthropic.Anthropic(api_key="sk-velox-key", base_url="http://velox.invalid",
                                 http_client=httpx2.Client(transport=front), max_retries=0)
    closed_after_the_test(client)
    return client


@pytest.fixture
def openai_up(mock):
    mock.reset()
    front = Front(mock)
    with _client(front) as client:
        yield client, front
    front.close()


@pytest.fixture
def anthropic_up(mock):
    mock.reset()
    front = Front(mock, via_anthropic=True)
    with _client(front) as client:
        yield client, front
    front.close()


def test_plain_message_from_an_openai_upstream(openai_up, mock):
    client, front = openai_up
    msg = client.messages.create(model="gpt-4o", max_tokens=200, messages=HI,
                                 system="Be brief.", stop_sequences=["END"],
                                 metadata={"user_id": "u-7"}, extra_body={"temperature": 0.5})
    assert msg.type == "message" and msg.model == "gpt-4o" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello from the Velox mock upstream"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens == 6
    assert front.chat[0] == {"model": "gpt-4o", "max_completion_tokens": 200,
                             "messages": [{"role": "system", "content": "Be brief."}, *HI],
                             "stop": ["END"], "user": "u-7", "temperature": 0.5}
    assert [e["path"] for e in mock.requests()] == ["/v1/chat/completions"]


def test_streamed_message_from_an_openai_upstream(openai_up):
    client, front = openai_up
    with client.messages.stream(model="gpt-4o", max_tokens=200, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == "Hello from the Velox mock upstream"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    assert front.chat[0]["stream_options"] == {"include_usage": True}
    assert front.usage.output == 6


def test_tools_streamed_input_reassembled_by_the_sdk(anthropic_up):
    client, front = anthropic_up
    with client.messages.stream(model="claude-front", max_tokens=500, messages=HI,
                                tools=[WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    text, tool = final.content
    assert text.text == "Calling the tool."
    assert tool.type == "tool_use" and tool.input == fill(WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"
    assert front.chat[0]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER["input_schema"]}}]


def test_two_turn_tool_conversation(anthropic_up):
    client, front = anthropic_up
    first = client.messages.create(model="c", max_tokens=500, messages=HI, tools=[WEATHER],
                                   tool_choice={"type": "any",
                                                "disable_parallel_tool_use": True})
    tool = first.content[-1]
    second = client.messages.create(model="c", max_tokens=500, tools=[WEATHER], messages=[
        *HI, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                      "content": "Sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert first.stop_reason == "tool_use" and second.stop_reason == "end_turn"
    assert front.chat[0]["tool_choice"] == "required"
    assert front.chat[0]["parallel_tool_calls"] is False
    assert front.chat[1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tool.id, "type": "function",
             "function": {"name": "get_weather", "arguments": orjson.dumps(tool.input).decode()}}]},
        {"role": "tool", "tool_call_id": tool.id, "content": "Sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]


def test_thinking_comes_back_as_thinking(anthropic_up):
    client, front = anthropic_up
    msg = client.messages.create(model="c", max_tokens=20000, messages=HI,
                                 thinking={"type": "enabled", "budget_tokens": 8000})
    assert front.chat[0]["reasoning_effort"] == "medium"
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.usage.output_tokens_details.thinking_tokens > 0
    with client.messages.stream(model="c", max_tokens=20000, messages=HI,
                                thinking={"type": "enabled", "budget_tokens": 2000}) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == msg.content[0].thinking


def test_count_tokens_from_the_estimate(openai_up, mock):
    client, _ = openai_up
    response = client.messages.with_raw_response.count_tokens(model="gpt-4o", messages=HI)
    assert response.headers["x-velox-token-count"] == "estimate"
    assert response.parse().input_tokens > 0
    assert mock.requests() == []


@pytest.mark.parametrize("status, error", [(400, anthropic.BadRequestError),
                                           (401, anthropic.AuthenticationError),
                                           (403, anthropic.PermissionDeniedError),
                                           (404, anthropic.NotFoundError),
                                           (429, anthropic.RateLimitError),
                                           (500, anthropic.InternalServerError),
                                           (503, anthropic.OverloadedError)])
def test_upstream_errors_raise_the_anthropic_sdk_classes(openai_up, status, error):
    client, _ = openai_up
    with pytest.raises(error) as caught:
        client.messages.create(model="gpt-4o", max_tokens=10, messages=HI,
                               extra_headers={"x-mock-status": str(status)})
    assert caught.value.type == messages.error_type(529 if status == 503 else status)
    assert caught.value.body["type"] == "error"
    if status == 429:
        assert caught.value.response.headers["retry-after"] == "1"


def test_mid_stream_error_through_both_translators(anthropic_up, mock):
    client, _ = anthropic_up
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model="claude-stream-error", max_tokens=50,
                                    messages=HI) as stream:
            list(stream)
    assert caught.value.type == "overloaded_error"


def test_refusals_and_checks_in_anthropic_shape(openai_up, mock):
    client, _ = openai_up
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="gpt-4o", max_tokens=10, messages=HI, tools=[
            {"type": "web_search_20250305", "name": "web_search"}])
    assert "tools[0]" in caught.value.message and "'openai'" in caught.value.message
    assert caught.value.type == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", body={"model": "gpt-4o", "messages": HI},
                    cast_to=object)
    assert "max_tokens" in caught.value.message
    assert mock.requests() == []
