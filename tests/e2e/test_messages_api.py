"""The Anthropic Messages API in front, end to end: a real Velox (two workers, a VELOX_CONFIG
file) between the official Anthropic SDK and the bundled mock over HTTP/2 + TLS, which speaks
both OpenAI's chat completions (an `openai` upstream) and the Messages API (an `anthropic`
upstream). What it proves:

* to an OpenAI-compatible upstream, plain and streamed Messages calls are translated both ways
  (the mock sees a chat completion, the SDK parses a Message and its event stream), and
  count_tokens is answered from the gateway's estimate with a header saying so;
* to an Anthropic upstream, calls go through untouched apart from the credential: the request
  Claude Code sends reaches the mock byte for byte, tool input streamed as input_json_delta is
  reassembled by the SDK, count_tokens is forwarded;
* gateway keys work with x-api-key and with Bearer, errors Velox makes on this path raise the
  SDK's own classes (401, 404, 400, 429 from a key's rpm, 529 overloaded from an upstream 503),
  and the access log counts the exact tokens of both paths.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import wait_for
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream, fingerprint

KEY = "sk-front-key-0123456789"
SLOW_KEY = "sk-front-slow-0123456789"  # rpm 1
UPSTREAM_KEYS = {"KEY_OA": "sk-oa-upstream-0123456789", "KEY_AN": "sk-ant-upstream-0123456789"}
HI = [{"role": "user", "content": "Say hello"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer"}},
                            "required": ["city"]}}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("front-certs"))) as m:
        yield m


@pytest.fixture(scope="module")
def gw(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("front")
    upstreams = "".join(
        f'[[upstream]]\nname = "{name}"\norigin = "{mock.origin}"\n'
        f'api_key_env = "KEY_{name.upper()}"\nca_file = "{mock.ca_file}"\n{extra}\n'
        for name, extra in (("oa", ""), ("an", 'kind = "anthropic"\n')))
    config = tmp / "velox.toml"
    config.write_text(upstreams + f"""
[[route]]
model = "gpt-front"
targets = [{{ upstream = "oa", model = "gpt-4o-mini" }}]

[[route]]
model = "claude-front"
targets = [{{ upstream = "an" }}]

[[route]]
model = "claude-broken"
targets = [{{ upstream = "an", model = "claude-stream-error" }}]

[[route]]
model = "claude-cached"
targets = [{{ upstream = "an" }}]
cache = true

[retry]
attempts = 1  # the error cases end as they are, not by a retry

[breaker]
failures = 255

[[key]]
name = "front"
sha256 = "{_sha(KEY)}"

[[key]]
name = "slow"
sha256 = "{_sha(SLOW_KEY)}"
rpm = 1
""")
    env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
           "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_TOKEN_ACCOUNTING": "1",
           "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **UPSTREAM_KEYS}
    with GatewayProcess(env, log_path=Path(tmp) / "velox.log") as gateway:
        yield gateway


def sdk(gw: GatewayProcess, key: str = KEY, **kw: Any) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0, timeout=20,
                                 **kw)
    closed_after_the_test(client)
    return client


def last_request(mock: MockUpstream) -> dict[str, Any]:
    return mock.requests(limit=1)[-1]


def access_lines(gw: GatewayProcess, path: str) -> list[dict[str, Any]]:
    return [r for line in gw.log().splitlines() if line.startswith('{"time"')
            for r in [orjson.loads(line)] if r["path"] == path]


# --- to an OpenAI-compatible upstream: translated -------------------------------------------


def test_plain_call_is_translated_to_chat_completions(gw: GatewayProcess,
                                                      mock: MockUpstream) -> None:
    message = sdk(gw).messages.create(model="gpt-front", max_tokens=64, messages=HI,
                                      system="Be brief.")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "gpt-front"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    seen = last_request(mock)
    assert seen["path"] == "/v1/chat/completions" and seen["model"] == "gpt-4o-mini"
    # The upstream's own key as a bearer token; the client's gateway key never goes upstream.
    assert seen["auth"] == {"kind": "authorization",
                            "key_sha256": fingerprint(UPSTREAM_KEYS["KEY_OA"])}
    assert not any(n in ("x-api-key", "anthropic-version") for n, _ in seen["headers"])


def test_stream_is_translated_event_by_event(gw: GatewayProcess, mock: MockUpstream) -> None:
    client = sdk(gw)
    with client.messages.stream(model="gpt-front", max_tokens=64, messages=HI) as stream:
        deltas = [e.delta.text for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = stream.get_final_message()
    assert len(deltas) > 1 and final.content[0].text == "".join(deltas)
    assert final.usage.output_tokens > 0 and final.stop_reason == "end_turn"
    assert last_request(mock)["stream"] is True


def test_count_tokens_to_an_openai_upstream_is_estimated(gw: GatewayProcess,
                                                         mock: MockUpstream) -> None:
    mock.reset()
    raw = sdk(gw).messages.with_raw_response.count_tokens(model="gpt-front", messages=HI)
    assert raw.headers["x-velox-token-count"] == "estimate"
    assert raw.parse().input_tokens > 0
    assert mock.requests() == []  # nothing was sent upstream


def test_untranslatable_request_is_refused_before_sending(gw: GatewayProcess,
                                                          mock: MockUpstream) -> None:
    mock.reset()
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk(gw).messages.create(model="gpt-front", max_tokens=64, messages=HI,
                                extra_body={"mcp_servers": [
                                    {"type": "url", "url": "https://x.example", "name": "x"}]})
    assert "mcp_servers" in str(caught.value) and "openai" in str(caught.value)
    assert mock.requests() == []


# --- to an Anthropic upstream: forwarded as it is -------------------------------------------


def test_plain_call_passes_through(gw: GatewayProcess, mock: MockUpstream) -> None:
    message = sdk(gw).messages.create(model="claude-front", max_tokens=64, messages=HI)
    assert message.content[0].type == "text" and message.content[0].text
    seen = last_request(mock)
    assert seen["path"] == "/v1/messages"
    assert seen["auth"] == {"kind": "x-api-key",
                            "key_sha256": fingerprint(UPSTREAM_KEYS["KEY_AN"])}


def test_tool_input_streamed_is_reassembled_by_the_sdk(gw: GatewayProcess) -> None:
    client = sdk(gw)
    with client.messages.stream(model="claude-front", max_tokens=256, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]
                                ) as stream:
        partial = [e.delta.partial_json for e in stream
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    tool = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(tool) == 1
    assert tool[0].name == "get_weather"
    assert tool[0].input == json.loads("".join(partial)) == {"city": "mock", "days": 1}


def test_claude_code_request_reaches_the_upstream_byte_for_byte(gw: GatewayProcess,
                                                                mock: MockUpstream) -> None:
    body = orjson.dumps({
        "model": "claude-front", "max_tokens": 512, "stream": True,
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER], "metadata": {"user_id": "user_abc"},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}]})
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "content-type": "application/json", "x-app": "cli"}
    with httpx.Client(base_url=gw.base_url, timeout=20) as client:
        answer = client.post("/v1/messages", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    events = [line[7:] for line in answer.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    seen = last_request(mock)
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
    sent = dict(seen["headers"])
    assert sent["x-api-key"] == UPSTREAM_KEYS["KEY_AN"]
    assert sent["anthropic-version"] == "2023-06-01"
    assert sent["anthropic-beta"] == headers["anthropic-beta"]
    assert sent["x-app"] == "cli"
    assert KEY not in json.dumps(seen["headers"])


def test_count_tokens_to_an_anthropic_upstream_is_forwarded(gw: GatewayProcess,
                                                            mock: MockUpstream) -> None:
    raw = sdk(gw).messages.with_raw_response.count_tokens(model="claude-front", messages=HI)
    assert "x-velox-token-count" not in raw.headers
    assert raw.parse().input_tokens > 0
    assert last_request(mock)["path"] == "/v1/messages/count_tokens"


# --- keys, errors, accounting ----------------------------------------------------------------


def test_bearer_key_is_accepted_like_x_api_key(gw: GatewayProcess) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, auth_token=KEY, max_retries=0,
                                 timeout=20)
    closed_after_the_test(client)
    assert client.messages.create(model="claude-front", max_tokens=16, messages=HI).content


def test_errors_raise_the_sdks_own_classes(gw: GatewayProcess) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        sdk(gw, key="sk-wrong-0123456789").messages.create(model="claude-front",
                                                            max_tokens=16, messages=HI)
    assert auth.value.body["type"] == "error"
    assert auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk(gw).messages.create(model="no-such-model", max_tokens=16, messages=HI)
    # The upstream's 503 (OpenAI side, translated) and 529 (Anthropic side, as it is).
    for model, status in (("gpt-front", "503"), ("claude-front", "529")):
        with pytest.raises(anthropic.OverloadedError):
            sdk(gw).messages.create(model=model, max_tokens=16, messages=HI,
                                    extra_headers={"x-mock-status": status})
    with pytest.raises(anthropic.RateLimitError):
        sdk(gw).messages.create(model="gpt-front", max_tokens=16, messages=HI,
                                extra_headers={"x-mock-status": "429"})
    slow = sdk(gw, key=SLOW_KEY)
    slow.messages.create(model="claude-front", max_tokens=16, messages=HI)
    with pytest.raises(anthropic.RateLimitError) as limited:
        slow.messages.create(model="claude-front", max_tokens=16, messages=HI)
    assert limited.value.response.headers.get("retry-after")


def test_anthropics_own_checks_come_first(gw: GatewayProcess, mock: MockUpstream) -> None:
    mock.reset()
    with httpx.Client(base_url=gw.base_url, timeout=20, headers={"x-api-key": KEY}) as client:
        answer = client.post("/v1/messages", json={"model": "claude-front", "messages": HI})
    assert answer.status_code == 400
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in answer.json()["error"]["message"]
    assert mock.requests() == []


def test_access_log_counts_exact_tokens_on_both_paths(gw: GatewayProcess) -> None:
    client = sdk(gw)
    plain = client.messages.create(model="claude-front", max_tokens=32, messages=HI)
    with client.messages.stream(model="claude-front", max_tokens=32, messages=HI) as stream:
        streamed = stream.get_final_message()
    translated = client.messages.create(model="gpt-front", max_tokens=32, messages=HI)

    def used(message: Any) -> tuple[int, int]:
        u = message.usage
        return (u.input_tokens + (u.cache_read_input_tokens or 0)
                + (u.cache_creation_input_tokens or 0), u.output_tokens)

    wanted = [used(plain), used(streamed), used(translated)]

    def logged() -> list[tuple[int, int]] | None:
        lines = [r for r in access_lines(gw, "/v1/messages") if r["status"] == 200
                 and r["usage"] and r["usage"]["exact"] and r["key"] == "front"]
        got = [(r["usage"]["input"], r["usage"]["output"]) for r in lines]
        return got if all(w in got for w in wanted) else None

    assert wait_for(logged)
    assert KEY not in gw.log()


def test_cache_serves_messages_and_keeps_apis_apart(gw: GatewayProcess,
                                                   mock: MockUpstream) -> None:
    mock.reset()
    client = sdk(gw)
    first = client.messages.with_raw_response.create(model="claude-cached", max_tokens=16,
                                                     messages=HI)
    second = client.messages.with_raw_response.create(model="claude-cached", max_tokens=16,
                                                      messages=HI)
    assert second.headers.get("x-velox-cache") == "hit"
    assert second.parse().content[0].text == first.parse().content[0].text
    assert len(mock.requests()) == 1
    # The same model and body on the chat path is another API: not the Messages answer.
    with httpx.Client(base_url=gw.base_url, timeout=20,
                      headers={"authorization": f"Bearer {KEY}"}) as raw:
        chat = raw.post("/v1/chat/completions", json={"model": "claude-cached",
                                                      "max_tokens": 16, "messages": HI})
    assert chat.headers.get("x-velox-cache") != "hit"
    assert len(mock.requests()) == 2


def test_a_stream_broken_midway_ends_with_an_error_event(gw: GatewayProcess) -> None:
    """Past the commit point nothing is retried: the Messages stream ends with an `error`
    event (the SDK raises), whether the upstream sent one (Anthropic, relayed as it is) or its
    connection broke (OpenAI side, translated: the gateway writes the event)."""
    client = sdk(gw)
    for model, headers in (("claude-broken", {}),
                           ("gpt-front", {"x-mock-fault": "reset-mid-stream",
                                          "x-mock-chunks": "8"})):
        texts: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(
                model=model, max_tokens=64, messages=HI, extra_headers=headers) as stream:
            texts.extend(e.delta.text for e in stream if e.type == "content_block_delta")
        assert texts, model  # the answer had started before it broke
        assert caught.value.body["type"] == "error", model
