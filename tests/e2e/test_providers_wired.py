"""Anthropic, Gemini and Bedrock upstreams behind the OpenAI API, through a real gateway.

Real processes: one Velox with two workers and a VELOX_CONFIG file whose upstreams are of kind
`anthropic`, `gemini` and `bedrock`, all pointing at the bundled mock (HTTP/2 + TLS), which
speaks each provider's API (and was checked with each provider's own SDK, tests/mock/). The
client is the official openai SDK with its defaults (no max_tokens). For each kind: plain and
streamed chat (with and without include_usage), a two-turn tool conversation non-streamed and
streamed, an image part, JSON mode, every error status mapped to the SDK's exception class, a
mid-stream provider error, requests the kind cannot express refused with a 400 before any call
(the mock's request log shows none), the tokens counted from the provider's usage and the
access log line; embeddings to Gemini and Bedrock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.e2e.conftest import client_for, gateway_env, wait_for
from tests.e2e.test_config_file import run_velox
from tests.e2e.test_routing import _fire, admin_stats, start, start_mock, write_config
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream, fingerprint

KINDS = ("anthropic", "gemini", "bedrock")
# The provider's model each kind's main route sends to (the mock answers by model name).
MODELS = {"anthropic": "claude-sonnet-4", "gemini": "gemini-3-pro", "bedrock": "m-1"}
ENV = {"ANTHROPIC_KEY": "sk-ant-test-0123456789", "GEMINI_KEY": "AIza-test-0123456789",
       "AWS_KEY_ID": "AKIAIOSFODNN7EXAMPLE", "AWS_SECRET": "wJalrXUtnFEMI-test-secret"}
# (route suffix, provider model, openai SDK exception class, status the client sees)
ERRORS = {
    "anthropic": [("400", "claude-error-400", openai.BadRequestError, 400),
                  ("401", "claude-error-401", openai.AuthenticationError, 401),
                  ("403", "claude-error-403", openai.PermissionDeniedError, 403),
                  ("404", "claude-error-404", openai.NotFoundError, 404),
                  ("429", "claude-error-429", openai.RateLimitError, 429),
                  ("500", "claude-error-500", openai.InternalServerError, 500),
                  ("529", "claude-error-529", openai.InternalServerError, 503)],
    "gemini": [(n, "error-" + n, cls, status) for n, cls, status in (
        ("RESOURCE_EXHAUSTED", openai.RateLimitError, 429),
        ("INVALID_ARGUMENT", openai.BadRequestError, 400),
        ("PERMISSION_DENIED", openai.PermissionDeniedError, 403),
        ("NOT_FOUND", openai.NotFoundError, 404),
        ("UNAVAILABLE", openai.InternalServerError, 503))],
    "bedrock": [(n, "error-" + n, cls, status) for n, cls, status in (
        ("ThrottlingException", openai.RateLimitError, 429),
        ("ValidationException", openai.BadRequestError, 400),
        ("AccessDeniedException", openai.PermissionDeniedError, 403),
        ("ResourceNotFoundException", openai.NotFoundError, 404),
        ("ModelNotReadyException", openai.InternalServerError, 503))],
}
MIDSTREAM = {"anthropic": "claude-stream-error", "gemini": "midstream-UNAVAILABLE",
             "bedrock": "midstream-ThrottlingException"}
EMBED = {"gemini": "text-embedding-004", "bedrock": "cohere.embed-english-v3"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
HI = [{"role": "user", "content": "Hi"}]


def upstream(name: str, kind: str, mock: MockUpstream) -> str:
    lines = ["[[upstream]]", f'name = "{name}"', f'kind = "{kind}"', f'origin = "{mock.origin}"',
             f'ca_file = "{mock.ca_file}"']
    if kind == "anthropic":
        lines.append('api_key_env = "ANTHROPIC_KEY"')
    elif kind == "gemini":
        lines.append('api_key_env = "GEMINI_KEY"')
    else:
        lines += ['aws_region = "us-east-1"', 'aws_access_key_id_env = "AWS_KEY_ID"',
                  'aws_secret_access_key_env = "AWS_SECRET"']
    return "\n".join(lines) + "\n"


def route(model: str, upstream_name: str, upstream_model: str) -> str:
    return (f'[[route]]\nmodel = "{model}"\n'
            f'targets = [{{ upstream = "{upstream_name}", model = "{upstream_model}" }}]\n')


def config(mock: MockUpstream) -> str:
    # No retries (an error test must see its own error) and breakers that do not open on the
    # error tests' 5xx; the error routes have upstreams of their own all the same.
    text = "[retry]\nattempts = 1\n[breaker]\nfailures = 255\n"
    for kind in KINDS:
        text += upstream(kind, kind, mock) + upstream(kind + "-errors", kind, mock)
        text += route(kind, kind, MODELS[kind])
        text += route(kind + "-mid", kind + "-errors", MIDSTREAM[kind])
        for suffix, provider_model, _cls, _status in ERRORS[kind]:
            text += route(f"{kind}-err-{suffix}", kind + "-errors", provider_model)
        if kind in EMBED:
            text += route(kind + "-embed", kind, EMBED[kind])
    text += route("anthropic-cached", "anthropic", MODELS["anthropic"]) + "cache = true\n"
    text += route("anthropic-short", "anthropic", MODELS["anthropic"])
    return text + "default_max_tokens = 1\n"


@pytest.fixture(scope="module")
def mock(logged_mock: MockUpstream) -> MockUpstream:
    return logged_mock


@pytest.fixture(scope="module")
def gw(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    where = tmp_path_factory.mktemp("providers")
    path = where / "velox.toml"
    path.write_text(config(mock))
    with GatewayProcess(gateway_env(mock, VELOX_CONFIG=str(path), **ENV),
                        log_path=where / "velox.log") as process:
        yield process


@pytest.fixture
def client(gw: GatewayProcess) -> openai.OpenAI:
    return client_for(gw)


def model_calls(mock: MockUpstream) -> list[dict[str, Any]]:
    """The mock's logged requests that were model calls (not warm-ups or probes)."""
    return [r for r in mock.requests(1000) if r.get("method", "POST") == "POST"
            and not str(r.get("path", "")).startswith("/_mock")]


def streamed(stream: Any) -> tuple[str, list[Any], dict[int, dict[str, str]]]:
    """(text, chunks, tool calls by index) of an SDK stream."""
    text, chunks, calls = [], [], {}
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
    return "".join(text), chunks, calls


@pytest.mark.parametrize("kind", KINDS)
def test_plain_and_streamed_chat(client: openai.OpenAI, mock: MockUpstream, kind: str) -> None:
    out = client.chat.completions.create(model=kind, messages=HI)
    assert out.choices[0].message.content == "Hello from the Velox mock upstream"
    assert out.model == kind and out.object == "chat.completion"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens > 0
    # Streamed without include_usage (the SDK's default): no usage chunk reaches the client,
    # though the gateway asked the provider's stream for it to count the tokens.
    text, chunks, _ = streamed(client.chat.completions.create(model=kind, messages=HI,
                                                              stream=True))
    assert text == out.choices[0].message.content
    assert all(c.usage is None for c in chunks) and all(c.model == kind for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    text, chunks, _ = streamed(client.chat.completions.create(
        model=kind, messages=HI, stream=True, stream_options={"include_usage": True}))
    assert text == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0


def test_max_tokens_defaults_of_upstream_and_route(mock: MockUpstream,
                                                   client: openai.OpenAI) -> None:
    """The SDK sends no max_tokens; the Messages API needs one: the upstream's default (4096,
    more than the mock's answer) unless the route sets its own (1: cut at once)."""
    out = client.chat.completions.create(model="anthropic", messages=HI)
    assert out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model="anthropic-short", messages=HI)
    assert out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(model="anthropic-short", messages=HI, max_tokens=50)
    assert out.choices[0].finish_reason == "stop"  # the client's own limit wins


def test_a_cached_route_serves_the_translated_answer(mock: MockUpstream, gw: GatewayProcess
                                                     ) -> None:
    """The cache keeps what the client received (OpenAI's shape), not the provider's bytes."""
    import httpx

    mock.reset()
    body = {"model": "anthropic-cached", "messages": [{"role": "user", "content": "cache me"}]}
    with httpx.Client(base_url=gw.base_url, timeout=20) as http:
        first = http.post("/v1/chat/completions", json=body)
        second = wait_for(lambda: (r := http.post("/v1/chat/completions", json=body)).headers
                          .get("x-velox-cache") == "hit" and r)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json() and first.json()["object"] == "chat.completion"
    assert len(model_calls(mock)) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_two_turn_tool_conversation(client: openai.OpenAI, kind: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model=kind, messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    [call] = message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "mock"}
    turn = [*messages, message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "3 degrees"}]
    second = client.chat.completions.create(model=kind, messages=turn, tools=TOOLS)
    answered(second.choices[0].finish_reason, second.choices[0].message.content, "3 degrees",
             kind)
    # Streamed: the call's id, name and arguments reassembled from the deltas carry the
    # second turn as well.
    _, chunks, calls = streamed(client.chat.completions.create(
        model=kind, messages=messages, tools=TOOLS, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    got = calls[0]
    assert got["name"] == "get_weather" and json.loads(got["arguments"]) == {"city": "mock"}
    turn = [*messages, {"role": "assistant", "tool_calls": [{
        "id": got["id"], "type": "function",
        "function": {"name": got["name"], "arguments": got["arguments"]}}]},
        {"role": "tool", "tool_call_id": got["id"], "content": "4 degrees"}]
    text, chunks, _ = streamed(client.chat.completions.create(
        model=kind, messages=turn, tools=TOOLS, stream=True))
    answered(chunks[-1].choices[0].finish_reason, text, "4 degrees", kind)


def answered(finish: str | None, text: str | None, result: str, kind: str) -> None:
    """The model's answer after a tool result: the mocks call the tool again unless the last
    turn is that tool's result (matched by id: Bedrock's toolUseId, Gemini's function name
    and thought signature); Gemini's and Bedrock's quote the result, Anthropic's answers
    its filler text."""
    assert finish == "stop" and text
    if kind != "anthropic":
        assert result in text


@pytest.mark.parametrize("kind", KINDS)
def test_image_part_and_json_modes(client: openai.OpenAI, kind: str) -> None:
    out = client.chat.completions.create(model=kind, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": PNG}}]}])
    assert (out.choices[0].message.content or "").endswith("I see 1 image.")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    out = client.chat.completions.create(
        model=kind, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert json.loads(out.choices[0].message.content or "") == {"n": 1}
    out = client.chat.completions.create(
        model=kind, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("kind, suffix, cls, status", [
    (kind, suffix, cls, status) for kind in KINDS for suffix, _m, cls, status in ERRORS[kind]])
def test_errors_raise_the_sdk_classes(client: openai.OpenAI, kind: str, suffix: str,
                                      cls: type[openai.APIStatusError], status: int) -> None:
    with pytest.raises(cls) as caught:
        client.chat.completions.create(model=f"{kind}-err-{suffix}", messages=HI)
    assert caught.value.status_code == status and caught.value.message
    body = caught.value.body
    assert isinstance(body, dict) and body.get("message")  # the OpenAI error shape, kept
    if status == 429 and kind != "bedrock":  # AWS's throttling answer says no delay
        assert caught.value.response.headers.get("retry-after")


@pytest.mark.parametrize("kind", KINDS)
def test_mid_stream_error_ends_the_stream_without_done(gw: GatewayProcess, kind: str) -> None:
    import httpx

    body = {"model": kind + "-mid", "messages": HI, "stream": True}
    with httpx.Client(timeout=20) as http, http.stream(
            "POST", gw.base_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert b"[DONE]" not in raw
    assert b'"content"' in events[0]  # text arrived before the error
    error = orjson.loads(events[-1][6:])
    assert "error" in error and error["error"]["message"]
    # The SDK sees the text, then raises.
    client = client_for(gw)
    seen = []
    with pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(model=kind + "-mid", messages=HI,
                                                    stream=True):
            seen.append(chunk.choices[0].delta.content if chunk.choices else None)
    assert any(seen)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, None)])
def test_untranslatable_is_refused_before_any_call(client: openai.OpenAI, mock: MockUpstream,
                                                   kind: str, extra: dict[str, Any],
                                                   param: str | None) -> None:
    mock.reset()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": kind, "messages": HI, **extra})
    assert kind in caught.value.message  # names the upstream kind
    if param is not None:
        assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == param
    assert model_calls(mock) == []


@pytest.mark.parametrize("kind", ["gemini", "bedrock"])
def test_embeddings(client: openai.OpenAI, kind: str) -> None:
    out = client.embeddings.create(model=kind + "-embed", input=["a", "bb"])
    assert len(out.data) == 2 and len(out.data[0].embedding) > 0
    assert out.model == kind + "-embed"


@pytest.mark.parametrize("kind", KINDS)
def test_usage_is_counted_and_logged(gw: GatewayProcess, client: openai.OpenAI,
                                     kind: str) -> None:
    def counted() -> tuple[int, int]:
        rows = admin_stats(gw)["tokens"]
        return next(((r["input"], r["output"]) for r in rows if r["route"] == kind), (0, 0))

    before = counted()
    out = client.chat.completions.create(model=kind, messages=HI)
    assert out.usage is not None
    want = (before[0] + out.usage.prompt_tokens, before[1] + out.usage.completion_tokens)
    assert wait_for(lambda: counted() == want), (counted(), want)
    usage = {"input": out.usage.prompt_tokens, "output": out.usage.completion_tokens,
             "exact": True}

    def mine() -> list[dict]:
        lines = [json.loads(line) for line in gw.log().splitlines()
                 if line.startswith("{") and '"log":"access"' in line]
        return [a for a in lines if a.get("model") == kind and a["status"] == 200]

    # The access-log line is written by the log thread, after the books: wait for it.
    assert wait_for(lambda: any(a["usage"] == usage for a in mine())), mine()[-3:]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_without_include_usage_is_counted(gw: GatewayProcess, client: openai.OpenAI,
                                                   kind: str) -> None:
    """The provider's stream reports usage whether or not the client asked: the same request
    streamed with include_usage (its usage seen) and without (none seen) counts the same."""
    def counted() -> tuple[int, int]:
        rows = admin_stats(gw)["tokens"]
        return next(((r["input"], r["output"]) for r in rows if r["route"] == kind), (0, 0))

    messages = [{"role": "user", "content": "count me " * 20}]
    before = counted()
    _, chunks, _ = streamed(client.chat.completions.create(
        model=kind, messages=messages, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None
    once = (before[0] + usage.prompt_tokens, before[1] + usage.completion_tokens)
    assert wait_for(lambda: counted() == once), (counted(), once)
    _, chunks, _ = streamed(client.chat.completions.create(model=kind, messages=messages,
                                                           stream=True))
    assert all(c.usage is None for c in chunks)
    twice = (once[0] + usage.prompt_tokens, once[1] + usage.completion_tokens)
    assert wait_for(lambda: counted() == twice), (counted(), twice)


def test_credentials_are_the_kinds_own(mock: MockUpstream, client: openai.OpenAI) -> None:
    mock.reset()
    for kind in KINDS:
        client.chat.completions.create(model=kind, messages=HI)
    calls = {r["path"].split("/")[1]: r for r in model_calls(mock)}
    assert calls["v1"]["auth"] == {"kind": "x-api-key",
                                   "key_sha256": fingerprint(ENV["ANTHROPIC_KEY"])}
    assert ["anthropic-version", "2023-06-01"] in calls["v1"]["headers"]
    assert calls["v1beta"]["auth"] == {"kind": "x-goog-api-key",
                                       "key_sha256": fingerprint(ENV["GEMINI_KEY"])}
    assert ENV["GEMINI_KEY"] not in calls["v1beta"]["path"]  # never in the query
    assert calls["model"]["auth"] == {"kind": "sigv4",
                                      "key_sha256": fingerprint(ENV["AWS_KEY_ID"])}
    # None of the client's own headers (its key, the SDK's x-stainless-*) went upstream.
    for call in calls.values():
        assert not any(name.startswith("x-stainless") for name, _ in call["headers"])


def test_config_errors_name_file_table_and_key(tmp_path: Path, mock: MockUpstream) -> None:
    """A kind's missing setting, another kind's setting and an unknown kind stop start-up."""
    cases = {
        'kind = "anthropic"\n': "api_key_env",
        'kind = "bedrock"\naws_region = "us-east-1"\naws_access_key_id_env = "AWS_KEY_ID"\n':
            "aws_secret_access_key_env",
        'kind = "gemini"\napi_key_env = "GEMINI_KEY"\nanthropic_version = "2023-06-01"\n':
            "anthropic_version",
        'kind = "claude"\n': "kind",
    }
    for number, (body, key) in enumerate(cases.items()):
        path = tmp_path / f"bad{number}.toml"
        path.write_text(f'[[upstream]]\nname = "u"\norigin = "{mock.origin}"\n{body}')
        gw = GatewayProcess(gateway_env(mock, VELOX_CONFIG=str(path), **ENV),
                            log_path=tmp_path / f"bad{number}.log")
        with pytest.raises(RuntimeError):
            gw.start(timeout=30)
        log = gw.log()
        gw.stop()
        assert f"bad{number}.toml" in log and "[[upstream]] #1" in log and key in log, log


def test_failover_from_openai_to_anthropic_under_load(tmp_path: Path) -> None:
    """A route over an OpenAI target and an Anthropic one; the OpenAI mock is SIGKILLed with
    64 calls in flight: every call is answered 200 in OpenAI's shape, those that were on the
    dead upstream sent again to the Anthropic one, translated."""
    certdir = str(tmp_path / "certs")
    oa, claude = start_mock("oa", certdir), start_mock("claude", certdir)
    try:
        text = upstream("claude", "anthropic", claude) + (
            f'[[upstream]]\nname = "oa"\norigin = "{oa.origin}"\napi_key_env = "OA_KEY"\n'
            f'ca_file = "{oa.ca_file}"\n'
            '[[route]]\nmodel = "m"\ntargets = [{ upstream = "oa" }, '
            '{ upstream = "claude", model = "claude-sonnet-4" }]\n'
            "[breaker]\nfailures = 3\nopen_s = 30\n")
        gw = start(tmp_path, write_config(tmp_path, text), OA_KEY="sk-oa-0123456789", **ENV)
        try:
            async def scenario() -> list[Any]:
                done: list[Any] = []
                load = asyncio.create_task(_fire(gw.base_url, 800, concurrency=64,
                                                 deadline_s=180, out=done))
                deadline = time.monotonic() + 60
                while len(done) < 200 and not load.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                os.kill(oa.pid, signal.SIGKILL)
                assert 200 <= len(done) < 700, len(done)  # killed mid-load
                return await load

            responses = asyncio.run(scenario())
            # Every call the Anthropic mock got was in its API (retries included).
            paths = Counter(r["path"] for r in claude.requests(1000) if r["method"] == "POST")
            assert set(paths) == {"/v1/messages"}, paths
        finally:
            gw.stop()
    finally:
        oa.stop()
        claude.stop()
    assert len(responses) == 800
    assert Counter(r.status_code for r in responses) == Counter({200: 800})
    for r in responses:
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "m"
        assert body["choices"][0]["message"]["content"] == "Hello from the Velox mock upstream"
    answered_by = Counter((r.headers["x-velox-upstream"], r.headers["x-velox-attempts"] != "1")
                          for r in responses)
    assert answered_by[("oa", False)] > 0 and answered_by[("claude", False)] > 0, answered_by
    assert answered_by[("claude", True)] > 0, answered_by  # failed on OpenAI, sent again


def test_doctor_checks_each_kind(tmp_path: Path, mock: MockUpstream) -> None:
    """`velox doctor` makes each translated upstream's translator as the gateway does and
    reaches it with its own credential header; a wrong AWS secret variable is named."""
    path = tmp_path / "velox.toml"
    path.write_text(config(mock))
    code, out, _ = run_velox(["doctor"], {"VELOX_CONFIG": str(path), **ENV}, tmp_path)
    assert code == 0, out
    for kind in KINDS:
        assert re.search(rf"PASS +upstream-kind\[{kind}\] +kind = '{kind}'", out), out
        assert re.search(rf"PASS +upstream-warmup\[{kind}\]", out), out
    for secret in ENV.values():
        assert secret not in out
    code, out, _ = run_velox(["doctor"], {"VELOX_CONFIG": str(path), **ENV, "AWS_SECRET": ""},
                             tmp_path)
    assert code == 1 and "aws_secret_access_key_env: the environment variable AWS_SECRET" in out
