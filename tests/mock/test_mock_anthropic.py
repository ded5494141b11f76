"""The official Anthropic SDK pointed straight at the mock upstream over HTTP/2 + TLS: if the SDK
cannot parse what the mock sends (plain, streamed with pings, tools reassembled from
input_json_delta, thinking, cache usage, count_tokens, every error class), the mock is wrong."""

from __future__ import annotations

import ssl

import anthropic
import httpx2
import pytest

from tests.conftest import closed_after_the_test
from velox_lab.mock import MockUpstream, fingerprint
from velox_lab.mock.anthropic_api import fill

KEY = "sk-ant-mock-0123456789"
HI = [{"role": "user", "content": "Say hello"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer"},
                                           "metric": {"type": "boolean"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log), name="anthropic") as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()


def _http(mock: MockUpstream, versions: list[str]) -> httpx2.Client:
    client = httpx2.Client(http2=True, verify=ssl.create_default_context(cafile=mock.ca_file),
                           event_hooks={"response": [lambda r: versions.append(r.http_version)]})
    closed_after_the_test(client)
    return client


@pytest.fixture
def sdk(mock):
    """(client, versions): the SDK as its users build it, key given."""
    mock.reset()
    versions: list[str] = []
    client = anthropic.Anthropic(base_url=mock.origin, api_key=KEY,
                                 http_client=_http(mock, versions), max_retries=0, timeout=10)
    closed_after_the_test(client)
    yield client, versions
    client.close()


def test_create_plain_answer_over_h2(sdk, mock):
    client, versions = sdk
    msg = client.messages.create(model="claude-mock-1", max_tokens=100, messages=HI)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-mock-1"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    assert msg.usage.cache_read_input_tokens == 0 == msg.usage.cache_creation_input_tokens
    assert versions == ["HTTP/2"]
    [entry] = mock.requests()
    assert entry["path"] == "/v1/messages" and entry["model"] == "claude-mock-1"
    assert entry["auth"] == {"kind": "authorization", "key_sha256": fingerprint(KEY)}
    assert dict(entry["headers"])["anthropic-version"]


def test_claude_code_shape_x_api_key(mock):
    """Claude Code sends its key as x-api-key, no Authorization: the mock takes it so."""
    mock.reset()
    client = anthropic.Anthropic(base_url=mock.origin, api_key=KEY,
                                 default_headers={"x-api-key": KEY,
                                                  "Authorization": anthropic.Omit()},
                                 http_client=_http(mock, []), max_retries=0, timeout=10)
    closed_after_the_test(client)
    with client:
        assert client.messages.create(model="claude-x", max_tokens=50, messages=HI).content
    [entry] = mock.requests()
    assert entry["auth"] == {"kind": "x-api-key", "key_sha256": fingerprint(KEY)}


def test_stream_with_tools_and_thinking_reassembled_by_the_sdk(sdk, mock):
    client, _ = sdk
    with client.messages.stream(model="claude-x", max_tokens=4000, messages=HI,
                                tools=[WEATHER],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "input_json" in events and "thinking" in events and "signature" in events
    thinking, text, tool = final.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert text.type == "text" and text.text
    assert tool.type == "tool_use" and tool.name == "get_weather"
    assert tool.input == fill(WEATHER["input_schema"]) == {"city": "mock", "days": 1,
                                                           "metric": True}
    assert tool.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens_details.thinking_tokens > 0
    assert final.usage.output_tokens >= final.usage.output_tokens_details.thinking_tokens


def test_raw_stream_has_pings_and_one_event_per_frame(mock):
    mock.reset()
    with httpx2.Client(http2=True,
                       verify=ssl.create_default_context(cafile=mock.ca_file)) as http:
        with http.stream("POST", mock.origin + "/v1/messages",
                         headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                         json={"model": "claude-x", "max_tokens": 50, "messages": HI,
                               "stream": True}) as resp:
            pieces = list(resp.iter_raw())
    body = b"".join(pieces)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert body.count(b"event: ping\n") == 2
    names = [line[7:] for line in body.split(b"\n") if line.startswith(b"event: ")]
    assert names[:3] == [b"message_start", b"ping", b"content_block_start"]
    assert names[-2:] == [b"message_delta", b"message_stop"]


def test_two_turn_tool_conversation(sdk):
    client, _ = sdk
    first = client.messages.create(model="claude-x", max_tokens=200, messages=HI,
                                   tools=[WEATHER])
    tool = next(b for b in first.content if b.type == "tool_use")
    second = client.messages.create(
        model="claude-x", max_tokens=200, tools=[WEATHER],
        messages=[*HI, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                "content": "Sunny, 21 C"}]}])
    assert first.stop_reason == "tool_use"
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"


def test_tool_choice_none_and_forced(sdk):
    client, _ = sdk
    plain = client.messages.create(model="claude-x", max_tokens=200, messages=HI,
                                   tools=[WEATHER], tool_choice={"type": "none"})
    forced = client.messages.create(model="claude-x", max_tokens=200, messages=HI,
                                    tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"
    assert [b.type for b in forced.content] == ["tool_use"]


def test_stop_reasons_max_tokens_stop_sequence_refusal(sdk):
    client, _ = sdk
    short = client.messages.create(model="claude-x", max_tokens=2, messages=HI)
    stopped = client.messages.create(model="claude-x", max_tokens=100, messages=HI,
                                     stop_sequences=["mock"])
    refused = client.messages.create(model="claude-refusal", max_tokens=100, messages=HI)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "mock"
    assert "mock" not in stopped.content[0].text
    assert refused.stop_reason == "refusal"


def test_prompt_cache_written_then_read(sdk):
    client, _ = sdk
    system = [{"type": "text", "text": "You are terse. " * 200,
               "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model="claude-cache", max_tokens=50, system=system,
                                   messages=HI)
    second = client.messages.create(model="claude-cache", max_tokens=50, system=system,
                                    messages=HI)
    assert first.usage.cache_creation_input_tokens > 700
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == first.usage.input_tokens


def test_structured_output(sdk):
    client, _ = sdk
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    msg = client.messages.create(model="claude-x", max_tokens=100, messages=HI,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}})
    assert msg.content[0].text == '{"name":"mock","age":1}'


def test_count_tokens(sdk, mock):
    client, _ = sdk
    small = client.messages.count_tokens(model="claude-x", messages=HI)
    large = client.messages.count_tokens(model="claude-x",
                                         messages=[{"role": "user", "content": "x" * 4000}])
    assert 0 < small.input_tokens < large.input_tokens
    assert [e["path"] for e in mock.requests(2)] == ["/v1/messages/count_tokens"] * 2


ERRORS = [(400, anthropic.BadRequestError, "invalid_request_error"),
          (401, anthropic.AuthenticationError, "authentication_error"),
          (403, anthropic.PermissionDeniedError, "permission_error"),
          (404, anthropic.NotFoundError, "not_found_error"),
          (413, anthropic.ContentTooLargeError, "request_too_large"),
          (429, anthropic.RateLimitError, "rate_limit_error"),
          (500, anthropic.InternalServerError, "api_error"),
          (504, anthropic.GatewayTimeoutError, "timeout_error"),
          (529, anthropic.OverloadedError, "overloaded_error")]


@pytest.mark.parametrize("status, error, kind", ERRORS)
def test_errors_by_model_name_raise_the_sdk_classes(sdk, status, error, kind):
    client, _ = sdk
    with pytest.raises(error) as caught:
        client.messages.create(model=f"claude-error-{status}", max_tokens=10, messages=HI)
    assert caught.value.status_code == status and caught.value.type == kind
    assert caught.value.request_id and caught.value.request_id.startswith("req_")
    if status == 429:
        assert caught.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize("status, error, kind", [ERRORS[5], ERRORS[8]])
def test_errors_by_control_header_and_in_stream_calls(sdk, status, error, kind):
    client, _ = sdk
    with pytest.raises(error):
        client.messages.create(model="claude-x", max_tokens=10, messages=HI,
                               extra_headers={"x-mock-status": str(status)})
    with pytest.raises(error):
        with client.messages.stream(model=f"claude-error-{status}", max_tokens=10,
                                    messages=HI) as stream:
            list(stream)


def test_mid_stream_error_event(sdk):
    client, _ = sdk
    seen = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model="claude-stream-error", max_tokens=100,
                                    messages=HI) as stream:
            for event in stream:
                seen.append(event.type)
    assert caught.value.type == "overloaded_error"
    assert "text" in seen and "message_stop" not in seen


def test_credential_and_version_are_required(mock):
    with httpx2.Client(http2=True,
                       verify=ssl.create_default_context(cafile=mock.ca_file)) as http:
        body = {"model": "claude-x", "max_tokens": 10, "messages": HI}
        no_key = http.post(mock.origin + "/v1/messages", json=body,
                           headers={"anthropic-version": "2023-06-01"})
        no_version = http.post(mock.origin + "/v1/messages", json=body,
                               headers={"x-api-key": KEY})
        no_max = http.post(mock.origin + "/v1/messages", json={**body, "max_tokens": None},
                           headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert no_key.json()["type"] == "error"
    assert no_version.status_code == 400 and "anthropic-version" in no_version.text
    assert no_max.status_code == 400 and "max_tokens" in no_max.text
