"""Every OpenAI call works through Velox unchanged: the official SDK, sync and async, streaming."""

from __future__ import annotations

import asyncio
import hashlib

import orjson
import pytest

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import UPSTREAM_KEY, async_client_for, client_for, raw

MESSAGES = [{"role": "user", "content": "Say hello"}]


def last_upstream_request(mock: MockUpstream, path: str) -> dict:
    for entry in reversed(mock.requests(50)):
        if entry["path"] == path:
            return entry
    raise AssertionError(f"the upstream never received {path}")


def test_chat_completion(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    reply = client_for(gateway).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert reply.object == "chat.completion"
    assert reply.model == "gpt-4o-mini"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    seen = last_upstream_request(upstream, "/v1/chat/completions")
    assert seen["protocol"] == "h2"


def test_chat_completion_streaming(gateway: GatewayProcess) -> None:
    client = client_for(gateway)
    chunks = list(client.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-chunks": "12"}))
    # The mock sends 12 events: the role, 10 content deltas, then the finish reason.
    assert len(chunks) == 12
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) == 10
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_is_relayed_as_server_sent_events_ending_in_done(gateway: GatewayProcess) -> None:
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True}
    with raw(gateway).stream("POST", "/v1/chat/completions", json=body,
                             headers={"x-mock-chunks": "3"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["transfer-encoding"] == "chunked"
        text = b"".join(response.iter_raw()).decode()
    events = [line for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 4


def test_async_client_sync_and_stream(gateway: GatewayProcess) -> None:
    async def run() -> tuple[str, int]:
        client = async_client_for(gateway)
        reply, stream = await asyncio.gather(
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES),
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True),
        )
        count = 0
        async for chunk in stream:
            count += chunk.object == "chat.completion.chunk"
        await client.close()
        return reply.choices[0].message.content or "", count

    content, count = asyncio.run(run())
    assert content and count == 8


def test_many_concurrent_async_calls_each_get_one_answer(gateway: GatewayProcess) -> None:
    async def run() -> list[str]:
        client = async_client_for(gateway)
        replies = await asyncio.gather(*[
            client.chat.completions.create(model=f"m-{i}", messages=MESSAGES) for i in range(200)])
        await client.close()
        return [r.model for r in replies]

    assert asyncio.run(run()) == [f"m-{i}" for i in range(200)]


def test_completions_embeddings_models_responses(gateway: GatewayProcess) -> None:
    client = client_for(gateway)
    completion = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi")
    assert completion.object == "text_completion" and completion.choices[0].text
    streamed = list(client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi",
                                              stream=True))
    assert streamed and all(c.object == "text_completion" for c in streamed)

    embeddings = client.embeddings.create(model="text-embedding-3-small", input=["a", "b", "c"])
    assert [e.index for e in embeddings.data] == [0, 1, 2]
    assert all(len(e.embedding) > 0 for e in embeddings.data)

    models = client.models.list()
    assert len(models.data) > 0

    response = client.responses.create(model="gpt-4o", input="Hello")
    assert response.output_text
    events = [e.type for e in client.responses.create(model="gpt-4o", input="Hi", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events


def test_body_is_forwarded_byte_for_byte(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    # Odd spacing, key order and unicode escapes would not survive a re-serialisation.
    body = (b'{ "messages": [{"role":"user","content":"caf\\u00e9 \xe2\x98\x95"}] ,'
            b'"model":"gpt-4o" }')
    response = raw(gateway).post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 200
    seen = last_upstream_request(upstream, "/v1/chat/completions")
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert seen["body_length"] == len(body)


def test_root_path_is_the_raw_producer_interface(gateway: GatewayProcess,
                                                 upstream: MockUpstream) -> None:
    body = orjson.dumps({"model": "gpt-4o", "input": "from a producer"})
    response = raw(gateway).post("/", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["object"] == "response"
    assert last_upstream_request(upstream, "/v1/responses")["body_sha256"] == \
        hashlib.sha256(body).hexdigest()


def test_other_v1_paths_are_forwarded_unchecked(gateway: GatewayProcess,
                                                upstream: MockUpstream) -> None:
    response = raw(gateway).post("/v1/fine_tuning/jobs?dry=1", content=b"not even json",
                                 headers={"content-type": "text/plain"})
    # The mock does not serve fine-tuning: its own 404 comes back unchanged.
    assert response.status_code == 404
    assert last_upstream_request(upstream, "/v1/fine_tuning/jobs?dry=1")["body_length"] == 13
    # Moderations name a model, so their body is read (and must be JSON or a form).
    response = raw(gateway).post("/v1/moderations?dry=1", content=b"not even json",
                                 headers={"content-type": "text/plain"})
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


def test_useful_headers_pass_and_hop_by_hop_do_not(gateway: GatewayProcess) -> None:
    raw_reply = client_for(gateway).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES)
    headers = raw_reply.headers
    assert headers["x-request-id"]
    assert headers["openai-processing-ms"]
    assert headers["x-ratelimit-limit-requests"]
    assert headers["content-type"].startswith("application/json")
    timing = headers["server-timing"]
    assert [part.split(";")[0] for part in timing.split(", ")] == \
        ["ring", "parse", "ratelimit", "upstream"]
    assert "keep-alive" not in headers


def test_gateway_key_replaces_the_clients_upstream(gateway: GatewayProcess,
                                                   upstream: MockUpstream) -> None:
    client_for(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    seen = dict(last_upstream_request(upstream, "/v1/chat/completions")["headers"])
    assert seen["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert seen["x-stainless-lang"] == "python"  # the SDK's own headers pass through
    assert "connection" not in seen and "host" not in seen


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes(gateway: GatewayProcess, path: str) -> None:
    response = raw(gateway).get(path)
    assert response.status_code == 200 and response.json()["status"] in ("ok", "ready")


def test_large_body_is_forwarded_intact(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    # Far larger than the upstream's initial stream window: sent as WINDOW_UPDATEs arrive.
    text = "".join(chr(0x41 + i % 26) for i in range(64)) * (8 * 1024 * 1024 // 64)
    body = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]})
    response = raw(gateway).post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 200
    seen = last_upstream_request(upstream, "/v1/chat/completions")
    assert seen["body_length"] == len(body)
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_large_streaming_call_is_relayed(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    # Over VELOX_PARSE_OFF_LOOP_BYTES: model and stream come from the scanner thread.
    content = "word " * (400 * 1024 // 5)
    chunks = list(client_for(gateway).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": content}], stream=True,
        extra_headers={"x-mock-chunks": "6"}))
    assert len(chunks) == 6 and chunks[-1].choices[0].finish_reason == "stop"
    seen = last_upstream_request(upstream, "/v1/chat/completions")
    assert seen["body_length"] > 400 * 1024
