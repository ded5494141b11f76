"""The mock upstream over HTTP/2 + TLS, driven by httpx (h2 underneath), plus curl if present."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import ssl
import subprocess

import httpx
import pytest

from velox_lab.mock import MockUpstream

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()  # no callback blew up in the mock


@pytest.fixture
def fresh(mock):
    mock.reset()
    return mock


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def client(mock, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(http2=True, verify=ssl.create_default_context(cafile=mock.ca_file),
                             base_url=mock.origin,
                             timeout=10, **kw)


def test_chat_completion_over_h2(fresh):
    async def go():
        async with client(fresh) as c:
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"authorization": "Bearer sk-test"})
            return r
    r = run(go())
    assert r.http_version == "HTTP/2"
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "gpt-4o-mini"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])
    for name in ("x-request-id", "openai-processing-ms", "openai-version",
                 "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"):
        assert name in r.headers
    assert r.headers["content-type"] == "application/json"
    assert "connection" not in r.headers  # connection-specific headers are illegal in h2
    assert int(r.headers["content-length"]) == len(r.content)
    stats = fresh.stats()
    assert stats["requests"] == 1 and stats["h2_streams"] == 1
    assert stats["by_path"] == {"/v1/chat/completions": 1}
    assert stats["connections"] == 1 and stats["streams_completed"] == 1


def test_streaming_chat_chunks_and_done(fresh):
    async def go():
        async with client(fresh) as c, c.stream("POST", "/v1/chat/completions",
                            json={**CHAT, "stream": True,
                                  "stream_options": {"include_usage": True}},
                            headers={"x-mock-chunks": "5",
                                     "x-mock-chunk-delay-ms": "5"}) as r:
            assert r.http_version == "HTTP/2"
            assert r.headers["content-type"].startswith("text/event-stream")
            return [line async for line in r.aiter_lines() if line]
    lines = run(go())
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 5
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0


def test_embeddings_responses_models_and_errors(fresh):
    async def go():
        async with client(fresh) as c:
            emb = await c.post("/v1/embeddings", json={"model": "text-embedding-3-small",
                                                       "input": ["a", "b", "c"]})
            emb2 = await c.post("/v1/embeddings", json={"model": "text-embedding-3-small",
                                                        "input": "a"})
            resp = await c.post("/v1/responses", json={"model": "gpt-4o", "input": "hi"})
            models = await c.get("/v1/models")
            missing = await c.get("/v1/nope")
            bad = await c.post("/v1/chat/completions", content=b"{not json",
                               headers={"content-type": "application/json"})
            return emb, emb2, resp, models, missing, bad
    emb, emb2, resp, models, missing, bad = run(go())
    data = emb.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert all(len(d["embedding"]) == 8 for d in data)
    assert emb2.json()["data"][0]["embedding"] == data[0]["embedding"]  # deterministic
    out = resp.json()
    assert out["object"] == "response" and out["status"] == "completed"
    assert out["output"][0]["content"][0]["text"]
    assert {m["id"] for m in models.json()["data"]} >= {"gpt-4o", "gpt-4o-mini"}
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_request_log_records_headers_and_sha256(fresh):
    payload = json.dumps({**CHAT, "pad": "x" * 1000}).encode()

    async def go():
        async with client(fresh) as c:
            await c.post("/v1/chat/completions", content=payload,
                         headers={"content-type": "application/json",
                                  "authorization": "Bearer sk-secret", "x-trace": "abc"})
    run(go())
    [entry] = fresh.requests(limit=10)
    assert entry["protocol"] == "h2" and entry["method"] == "POST"
    assert entry["path"] == "/v1/chat/completions"
    assert entry["body_length"] == len(payload)
    assert entry["body_sha256"] == hashlib.sha256(payload).hexdigest()
    headers = dict(entry["headers"])
    assert headers["authorization"] == "Bearer sk-secret" and headers["x-trace"] == "abc"
    assert entry["stream"] is False and entry["cancelled"] is False


def test_16_mib_body_over_h2(fresh):
    payload = b'{"model": "gpt-4o", "messages": [], "pad": "' + b"a" * (16 << 20) + b'"}'

    async def go():
        async with client(fresh) as c:
            return await c.post("/v1/chat/completions", content=payload,
                                headers={"content-type": "application/json"})
    r = run(go())
    assert r.status_code == 200
    [entry] = fresh.requests(1)
    assert entry["body_length"] == len(payload) > 16_000_000
    assert entry["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert fresh.stats()["bytes_received"] == len(payload)


def test_200_concurrent_streams_on_one_connection(fresh):
    async def go():
        limits = httpx.Limits(max_connections=1)
        async with client(fresh, limits=limits) as c:
            rs = await asyncio.gather(*[
                c.post("/v1/chat/completions", json=CHAT,
                       headers={"x-mock-latency-ms": "50"}) for _ in range(200)])
            return rs
    rs = run(go())
    assert all(r.status_code == 200 and r.http_version == "HTTP/2" for r in rs)
    assert len({r.headers["x-request-id"] for r in rs}) == 200
    stats = fresh.stats()
    assert stats["h2_streams"] == 200 and stats["streams_completed"] == 200
    assert stats["connections"] == 1


def test_status_injection_and_latency(fresh):
    async def go():
        async with client(fresh) as c:
            r429 = await c.post("/v1/chat/completions", json=CHAT,
                                headers={"x-mock-status": "429"})
            r503 = await c.post("/v1/chat/completions", json=CHAT,
                                headers={"x-mock-status": "503"})
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            slow = await c.get("/v1/models", headers={"x-mock-latency-ms": "200"})
            return r429, r503, slow, loop.time() - t0
    r429, r503, slow, elapsed = run(go())
    assert r429.status_code == 429 and r429.headers["retry-after"] == "1"
    assert r429.json()["error"]["code"] == "rate_limit_exceeded"
    assert r503.status_code == 503 and r503.json()["error"]["type"] == "server_error"
    assert slow.status_code == 200 and elapsed >= 0.19


def test_slow_body_arrives_whole(fresh):
    async def go():
        async with client(fresh) as c:
            normal = await c.post("/v1/chat/completions", json=CHAT)
            slow = await c.post("/v1/chat/completions", json=CHAT,
                                headers={"x-mock-fault": "slow-body",
                                         "x-mock-chunk-delay-ms": "5"})
            return normal, slow
    normal, slow = run(go())
    assert slow.status_code == 200
    assert slow.json()["choices"] == normal.json()["choices"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_http2_over_tls(fresh):
    out = subprocess.run(
        ["curl", "-sS", "--http2", "--cacert", fresh.ca_file, "-o", "-", "-w",
         "\n%{http_version} %{http_code}", "-H", "content-type: application/json",
         "-d", json.dumps({**CHAT, "stream": True}), fresh.origin + "/v1/chat/completions"],
        capture_output=True, text=True, timeout=15, check=False)
    body, _, tail = out.stdout.rpartition("\n")
    assert tail == "2 200", out.stderr
    assert body.rstrip().endswith("data: [DONE]")
    assert body.count("chat.completion.chunk") == 8
