"""The Anthropic Messages API in front of Gemini and Bedrock upstreams, end to end.

A real Velox (two workers, a VELOX_CONFIG file) between the official Anthropic SDK and the
bundled mock over HTTP/2 + TLS speaking the Gemini API and Bedrock Converse (the mock's answers
are parsed by `google-genai` and `boto3` in tests/mock/). A `/v1/messages` request routed to one
of them goes Messages -> chat completions -> the provider's API, and its answer comes back the
same way, streams included (Gemini's SSE and Bedrock's binary event stream become the Messages
event sequence). What it proves, for both kinds: plain calls with a system prompt, streams whose
text deltas make the final text, a two-turn tool conversation plain and streamed (input
reassembled by the SDK from input_json_delta), an image, every error class raised as the SDK's
own, a provider error mid-stream ending the stream with an `error` event, what cannot be
translated refused with a 400 before any upstream call, and the exact usage in the access log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import orjson
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import gateway_env, wait_for
from tests.e2e.test_providers_wired import PNG, model_calls, route, upstream
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

KINDS = ("gemini", "bedrock")
MODELS = {"gemini": "gemini-3-pro", "bedrock": "m-1"}
ENV = {"GEMINI_KEY": "AIza-test-0123456789", "AWS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
       "AWS_SECRET": "wJalrXUtnFEMI-test-secret"}
# Provider error -> the Anthropic SDK's class and the status it sees.
ERRORS = {
    "gemini": [("RESOURCE_EXHAUSTED", anthropic.RateLimitError, 429),
               ("INVALID_ARGUMENT", anthropic.BadRequestError, 400),
               ("UNAUTHENTICATED", anthropic.AuthenticationError, 401),
               ("PERMISSION_DENIED", anthropic.PermissionDeniedError, 403),
               ("NOT_FOUND", anthropic.NotFoundError, 404),
               ("INTERNAL", anthropic.InternalServerError, 500),
               ("UNAVAILABLE", anthropic.OverloadedError, 529)],
    "bedrock": [("ThrottlingException", anthropic.RateLimitError, 429),
                ("ValidationException", anthropic.BadRequestError, 400),
                ("UnrecognizedClientException", anthropic.AuthenticationError, 401),
                ("AccessDeniedException", anthropic.PermissionDeniedError, 403),
                ("ResourceNotFoundException", anthropic.NotFoundError, 404),
                ("InternalServerException", anthropic.InternalServerError, 500),
                ("ModelNotReadyException", anthropic.OverloadedError, 529)],
}
MIDSTREAM = {"gemini": "midstream-UNAVAILABLE", "bedrock": "midstream-ThrottlingException"}
PATHS = {"gemini": (":generateContent", ":streamGenerateContent?alt=sse"),
         "bedrock": ("/converse", "/converse-stream")}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
HI = [{"role": "user", "content": "Say hello"}]


def config(logged_mock: MockUpstream) -> str:
    text = "[retry]\nattempts = 1\n[breaker]\nfailures = 255\n"
    for kind in KINDS:
        text += upstream(kind, kind, logged_mock) + upstream(kind + "-errors", kind, logged_mock)
        text += route("m-" + kind, kind, MODELS[kind])
        text += route(f"m-{kind}-mid", kind + "-errors", MIDSTREAM[kind])
        for name, _cls, _status in ERRORS[kind]:
            text += route(f"m-{kind}-{name}", kind + "-errors", "error-" + name)
    return text


@pytest.fixture(scope="module")
def gw(logged_mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    where = tmp_path_factory.mktemp("messages-providers")
    path = where / "velox.toml"
    path.write_text(config(logged_mock))
    env = gateway_env(logged_mock, VELOX_CONFIG=str(path), VELOX_TOKEN_ACCOUNTING="1", **ENV)
    with GatewayProcess(env, log_path=where / "velox.log") as process:
        yield process


def sdk(gw: GatewayProcess) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="sk-unused-0123456789",
                                 max_retries=0, timeout=20)
    closed_after_the_test(client)
    return client


def last_call(logged_mock: MockUpstream) -> dict[str, Any]:
    return model_calls(logged_mock)[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_plain_call_with_a_system_prompt(gw: GatewayProcess, logged_mock: MockUpstream,
                                         kind: str) -> None:
    message = sdk(gw).messages.create(model="m-" + kind, max_tokens=64, messages=HI,
                                      system="Be brief.")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "m-" + kind
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    seen = last_call(logged_mock)
    assert seen["path"].endswith(PATHS[kind][0]) and MODELS[kind] in seen["path"]
    assert seen["auth"]["kind"] == ("x-goog-api-key" if kind == "gemini" else "sigv4")
    # Nothing of the Messages API's own headers goes to another provider.
    assert not any(n in ("x-api-key", "anthropic-version") for n, _ in seen["headers"])


@pytest.mark.parametrize("kind", KINDS)
def test_stream_becomes_the_messages_event_sequence(gw: GatewayProcess, logged_mock: MockUpstream,
                                                    kind: str) -> None:
    with sdk(gw).messages.stream(model="m-" + kind, max_tokens=64, messages=HI,
                                 system=[{"type": "text", "text": "Be brief."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds
    deltas = [e.delta.text for e in events
              if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert len(deltas) > 1 and final.content[0].text == "".join(deltas)
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert last_call(logged_mock)["path"].endswith(PATHS[kind][1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streamed", [False, True])
def test_two_turn_tool_conversation(gw: GatewayProcess, kind: str, streamed: bool) -> None:
    client = sdk(gw)
    turn: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = {"model": "m-" + kind, "max_tokens": 256, "tools": [WEATHER]}
    if streamed:
        with client.messages.stream(**ask, messages=turn) as stream:
            partial = [e.delta.partial_json for e in stream
                       if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
            first = stream.get_final_message()
        assert json.loads("".join(partial)) == {"city": "mock"}
    else:
        first = client.messages.create(**ask, messages=turn)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "mock"} and use.id
    turn += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                               for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "3 degrees"}]}]
    if streamed:
        with client.messages.stream(**ask, messages=turn) as stream:
            second = stream.get_final_message()
    else:
        second = client.messages.create(**ask, messages=turn)
    # The mocks answer a tool result only when it names their call (Gemini: the function's
    # name and its thought signature; Bedrock: the toolUseId), and then quote it.
    assert second.stop_reason == "end_turn"
    assert "3 degrees" in second.content[0].text


@pytest.mark.parametrize("kind", KINDS)
def test_an_image(gw: GatewayProcess, kind: str) -> None:
    media, _, data = PNG[5:].partition(";base64,")
    message = sdk(gw).messages.create(model="m-" + kind, max_tokens=64, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]}])
    assert message.content[0].text.endswith("I see 1 image.")


@pytest.mark.parametrize("kind, name, cls, status", [
    (kind, name, cls, status) for kind in KINDS for name, cls, status in ERRORS[kind]])
def test_errors_raise_the_sdks_own_classes(gw: GatewayProcess, kind: str, name: str,
                                           cls: type[anthropic.APIStatusError],
                                           status: int) -> None:
    with pytest.raises(cls) as caught:
        sdk(gw).messages.create(model=f"m-{kind}-{name}", max_tokens=16, messages=HI)
    assert caught.value.status_code == status
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["message"]  # the provider's message, kept
    if status == 429 and kind == "gemini":  # Google's RetryInfo; AWS says no delay
        assert caught.value.response.headers.get("retry-after")


@pytest.mark.parametrize("kind", KINDS)
def test_a_provider_error_mid_stream_ends_with_an_error_event(gw: GatewayProcess,
                                                              kind: str) -> None:
    texts: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught, sdk(gw).messages.stream(
            model=f"m-{kind}-mid", max_tokens=64, messages=HI) as stream:
        texts.extend(e.delta.text for e in stream if e.type == "content_block_delta")
    assert texts  # the text before the error arrived
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["message"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extra, field", [
    ({"top_k": 5}, "top_k"),
    ({"mcp_servers": [{"type": "url", "url": "https://x.example", "name": "x"}]},
     "mcp_servers")])
def test_untranslatable_is_refused_before_any_call(gw: GatewayProcess, logged_mock: MockUpstream,
                                                   kind: str, extra: dict[str, Any],
                                                   field: str) -> None:
    logged_mock.reset()
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk(gw).messages.create(model="m-" + kind, max_tokens=16, messages=HI,
                                extra_body=extra)
    assert field in str(caught.value) and kind in str(caught.value)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert model_calls(logged_mock) == []


@pytest.mark.parametrize("kind", KINDS)
def test_usage_in_the_access_log(gw: GatewayProcess, kind: str) -> None:
    client = sdk(gw)
    plain = client.messages.create(model="m-" + kind, max_tokens=32, messages=HI)
    with client.messages.stream(model="m-" + kind, max_tokens=32, messages=HI) as stream:
        streamed = stream.get_final_message()
    wanted = [(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0),
               m.usage.output_tokens) for m in (plain, streamed)]

    def logged() -> list[tuple[int, int]] | None:
        lines = [orjson.loads(line) for line in gw.log().splitlines()
                 if line.startswith('{"time"')]
        got = [(r["usage"]["input"], r["usage"]["output"]) for r in lines
               if r["path"] == "/v1/messages" and r["model"] == "m-" + kind
               and r["status"] == 200 and r["usage"] and r["usage"]["exact"]]
        return got if all(w in got for w in wanted) else None

    assert wait_for(logged)


def test_the_gateway_log_holds_no_provider_secret(gw: GatewayProcess) -> None:
    sdk(gw).messages.create(model="m-bedrock", max_tokens=16, messages=HI)
    text = gw.log()
    assert "/v1/messages" in text  # the access log is there to look in
    for secret in ENV.values():
        assert secret not in text
