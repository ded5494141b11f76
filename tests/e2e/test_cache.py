"""The response cache and in-flight coalescing, end to end: real Velox processes (two workers
unless a test needs one), the bundled mock upstream over HTTP/2 + TLS with its request log, the
official openai SDK (and httpx or a raw socket where a test needs headers or a disconnect).

The mock's per-request control headers (x-mock-status, x-mock-latency-ms, x-mock-fault) are not
part of the cache key, so a test can make one request of a key fail or slow down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import CLIENT_KEY, UPSTREAM_KEY, client_for, wait_for
from tests.e2e.test_hardening_ingress import read_response
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

MESSAGES = [{"role": "user", "content": "Tell me about caches."}]
CHAT = {"model": "gpt-4o-mini", "messages": MESSAGES}


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    certdir = tmp_path_factory.mktemp("cache-certs")
    with MockUpstream(tls=True, certdir=str(certdir), name="cache") as m:
        yield m


@pytest.fixture
def upstream(mock: MockUpstream) -> MockUpstream:
    mock.behave()
    mock.reset()
    return mock


@pytest.fixture
def gateways() -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    yield started
    for gw in started:
        gw.stop()


def start(gateways: list[GatewayProcess], mock: MockUpstream, tmp_path: Path,
          **env: str) -> GatewayProcess:
    settings = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin,
        "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "1",
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_ACCESS_LOG": "0",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        "VELOX_CACHE": "1",
    }
    settings.update(env)
    gw = GatewayProcess(settings, log_path=tmp_path / f"velox-{len(gateways)}.log")
    gateways.append(gw)
    return gw.start(wait_ready=True)


def calls(mock: MockUpstream, path: str = "/v1/chat/completions") -> int:
    return int(mock.stats()["by_path"].get(path, 0))


def stats(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.admin_get("/stats")
    assert status == 200
    return json.loads(body)["cache"]  # type: ignore[no-any-return]


def chat(client: openai.OpenAI, headers: dict[str, str] | None = None,
         **body: Any) -> tuple[Any, httpx.Headers]:
    """One chat call through the SDK: (the parsed ChatCompletion, the response headers)."""
    raw = client.chat.completions.with_raw_response.create(
        **{**CHAT, **body}, extra_headers=headers or {})
    return raw.parse(), raw.headers


def test_repeated_chat_is_answered_from_the_cache(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)
    client = client_for(gw)
    first, h1 = chat(client)
    second, h2 = chat(client)
    assert h1["x-velox-cache"] == "miss" and "age" not in h1
    assert h2["x-velox-cache"] == "hit" and int(h2["age"]) >= 0
    # The same answer (the mock gives every call its own id), parsed by the unchanged SDK.
    assert second.model_dump() == first.model_dump()
    assert second.choices[0].message.content == first.choices[0].message.content
    assert calls(upstream) == 1
    # The hit was served by the other worker too: one cache for the gateway.
    for _ in range(6):
        assert chat(client)[1]["x-velox-cache"] == "hit"
    assert calls(upstream) == 1
    # Byte for byte, whichever the key order and whitespace of the request body.
    with httpx.Client(base_url=gw.base_url, timeout=20,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        reordered = b'{ "messages": [{"content": "Tell me about caches.", "role": "user"}],\n' \
                    b'  "model": "gpt-4o-mini", "user": "someone-else" }'
        r = http.post("/v1/chat/completions", content=reordered,
                      headers={"content-type": "application/json"})
    assert r.headers["x-velox-cache"] == "hit" and r.json() == first.model_dump(mode="json",
                                                                                exclude_unset=True)
    # Completions and embeddings are cached too; the SDK reads the hits as usual.
    for _ in range(2):
        emb = client.embeddings.with_raw_response.create(model="text-embedding-3-small",
                                                         input=["a", "bb"])
        vectors = [d.embedding for d in emb.parse().data]
    assert emb.headers["x-velox-cache"] == "hit" and len(vectors) == 2
    for _ in range(2):
        comp = client.completions.with_raw_response.create(model="gpt-4o-mini", prompt="x")
        assert comp.parse().choices[0].text
    assert comp.headers["x-velox-cache"] == "hit"
    assert calls(upstream, "/v1/embeddings") == 1 and calls(upstream, "/v1/completions") == 1
    doc = stats(gw)
    assert doc["hits"] == 10 and doc["misses"] == 3 and doc["entries"] == 3
    assert doc["hit_rate"] == round(10 / 13, 4) and doc["bytes"] > 0
    assert doc["latency_hit"]["count"] == 10
    _status, metrics = gw.admin_get("/metrics")
    assert b"velox_cache_hits_total 10.0" in metrics
    assert b"velox_cache_entries 3.0" in metrics


def test_streamed_answer_is_replayed_and_the_sdk_reads_every_chunk(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)
    client = client_for(gw)
    runs = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(**CHAT, stream=True)
        chunks = list(raw.parse())
        runs.append((raw.headers, chunks))
        # The entry is stored as the upstream's stream ends, beside the client reading its
        # last event: wait for the store (a busy host may still be making it).
        wait_for(lambda: stats(gw)["stores"] >= 1, timeout=10)
    (h1, miss), (h2, hit) = runs
    assert h1["x-velox-cache"] == "miss" and h2["x-velox-cache"] == "hit"
    assert h2["content-type"].startswith("text/event-stream")
    assert len(miss) == 8 and [c.model_dump() for c in hit] == [c.model_dump() for c in miss]
    text = "".join(c.choices[0].delta.content or "" for c in hit)
    assert text and hit[-1].choices[0].finish_reason == "stop"
    assert calls(upstream) == 1
    # A streamed and a whole answer of the same prompt are different entries.
    assert chat(client)[1]["x-velox-cache"] == "miss"
    # The raw replay ends with data: [DONE], chunked.
    with httpx.Client(base_url=gw.base_url, timeout=20,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.headers["transfer-encoding"] == "chunked"
    assert r.text.rstrip().endswith("data: [DONE]") and r.headers["x-velox-cache"] == "hit"


def test_two_gateway_keys_never_share_an_entry(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_API_KEYS="sk-tenant-a-1234,sk-tenant-b-5678")
    a = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-tenant-a-1234", max_retries=0)
    closed_after_the_test(a)
    b = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-tenant-b-5678", max_retries=0)
    closed_after_the_test(b)
    answer_a, ha = chat(a)
    answer_b, hb = chat(b)
    assert ha["x-velox-cache"] == "miss" and hb["x-velox-cache"] == "miss"
    assert answer_a.id != answer_b.id and calls(upstream) == 2
    assert chat(a)[0].id == answer_a.id and chat(b)[0].id == answer_b.id
    assert calls(upstream) == 2


def test_no_store_no_cache_and_max_age(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)
    client = client_for(gw)
    # no-store: neither looked up nor stored.
    _, h = chat(client, {"Cache-Control": "no-store"})
    assert h["x-velox-cache"] == "bypass"
    stored, h = chat(client)
    assert h["x-velox-cache"] == "miss" and calls(upstream) == 2
    _, h = chat(client, {"Cache-Control": "no-store"})
    assert h["x-velox-cache"] == "bypass" and calls(upstream) == 3
    # no-cache: not looked up, and the fresh answer replaces the stored one.
    fresh, h = chat(client, {"Cache-Control": "no-cache"})
    assert h["x-velox-cache"] == "miss" and fresh.id != stored.id and calls(upstream) == 4
    again, h = chat(client)
    assert h["x-velox-cache"] == "hit" and again.id == fresh.id
    # max-age: only entries at most N seconds old.
    time.sleep(1.2)
    old, h = chat(client, {"Cache-Control": "max-age=60"})
    assert h["x-velox-cache"] == "hit" and old.id == fresh.id and int(h["age"]) >= 1
    newer, h = chat(client, {"Cache-Control": "max-age=0"})
    assert h["x-velox-cache"] == "miss" and newer.id != fresh.id and calls(upstream) == 5
    latest, h = chat(client)
    assert h["x-velox-cache"] == "hit" and latest.id == newer.id and int(h["age"]) == 0
    doc = stats(gw)
    assert doc["bypasses"] == 2 and doc["misses"] == 3 and doc["hits"] == 3


def test_errors_and_broken_streams_are_never_stored(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)
    client = client_for(gw)
    for status in (503, 429, 400):
        with pytest.raises(openai.APIStatusError) as info:
            chat(client, {"x-mock-status": str(status)})
        assert info.value.status_code == status
        assert info.value.response.headers["x-velox-cache"] == "miss"
    _, h = chat(client)
    assert h["x-velox-cache"] == "miss"  # none of the errors was stored
    # The whole upstream failing (the mock's behaviour endpoint) is not stored either.
    upstream.behave(status=503)
    with pytest.raises(openai.InternalServerError):
        chat(client, messages=[{"role": "user", "content": "other"}])
    upstream.behave()
    _, h = chat(client, messages=[{"role": "user", "content": "other"}])
    assert h["x-velox-cache"] == "miss"
    # A stream the upstream resets halfway: the SDK sees the failure; nothing is stored.
    for _ in range(2):
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            stream = client.chat.completions.create(
                **CHAT, stream=True, extra_headers={"x-mock-fault": "reset-mid-stream"})
            list(stream)
    raw = client.chat.completions.with_raw_response.create(**CHAT, stream=True)
    assert raw.headers["x-velox-cache"] == "miss" and len(list(raw.parse())) == 8
    assert stats(gw)["stores"] == 3


def test_an_entry_expires_after_its_ttl(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_CACHE_TTL_S="1")
    client = client_for(gw)
    first, _ = chat(client)
    second, h = chat(client)
    assert h["x-velox-cache"] == "hit" and second.id == first.id
    time.sleep(1.3)
    third, h = chat(client)
    assert h["x-velox-cache"] == "miss" and third.id != first.id and calls(upstream) == 2
    assert stats(gw)["expired"] >= 1


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _embed_many(base_url: str, bodies: list[dict[str, Any]], concurrency: int,
                      headers: dict[str, str] | None = None) -> list[int]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60,
                                 headers={"authorization": f"Bearer {CLIENT_KEY}",
                                          **(headers or {})}) as http:
        sem = asyncio.Semaphore(concurrency)

        async def one(body: dict[str, Any]) -> int:
            async with sem:
                r = await http.post("/v1/embeddings", json=body)
                return len(r.content) if r.status_code == 200 else -r.status_code

        return await asyncio.gather(*(one(b) for b in bodies))


def test_filling_far_past_the_bound_keeps_memory_within_it(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    bound = 1 << 20
    gw = start(gateways, upstream, tmp_path, VELOX_CACHE_MAX_BYTES=str(bound))

    def bodies(tag: str, n: int) -> list[dict[str, Any]]:
        return [{"model": "text-embedding-3-small",
                 "input": [f"{tag}-{i}-{j}" for j in range(600)]} for i in range(n)]

    # Warm up every code path with answers that are not stored, then measure.
    sizes = asyncio.run(_embed_many(gw.base_url, bodies("warm", 64), 16,
                                    {"cache-control": "no-store"}))
    assert min(sizes) > 0
    workers = [w["pid"] for w in json.loads(gw.admin_get("/stats")[1])["workers"]]
    before = sum(_rss_kib(pid) for pid in workers)
    sizes = asyncio.run(_embed_many(gw.base_url, bodies("fill", 400), 16))
    assert min(sizes) > 0
    filled = sum(sizes)
    assert filled > 20 * bound  # far past the bound
    grown_kib = sum(_rss_kib(pid) for pid in workers) - before
    doc = stats(gw)
    assert doc["bytes"] <= bound and doc["evictions"] > 0 and doc["stores"] >= 400
    # Each worker may touch all of the shared mapping (the bound) plus a little of its own.
    allowed_kib = len(workers) * (bound // 1024 + 6 * 1024)
    assert grown_kib < allowed_kib, (grown_kib, allowed_kib, filled)
    # The most recent answers are still there, the oldest are gone.
    fresh = asyncio.run(_embed_many(gw.base_url, bodies("fill", 400)[-2:], 2))
    assert min(fresh) > 0


async def _concurrent(base_url: str, n: int, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60,
                                 headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        return await asyncio.gather(*(http.post("/v1/chat/completions", json=body,
                                                headers=headers) for _ in range(n)))


def test_fifty_identical_concurrent_requests_cost_one_upstream_call(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)
    upstream.behave(latency_ms=1500)  # every request arrives while the first is in flight
    responses = asyncio.run(_concurrent(gw.base_url, 50, CHAT))
    assert [r.status_code for r in responses] == [200] * 50
    assert len({r.json()["id"] for r in responses}) == 1  # the one upstream answer, 50 times
    assert calls(upstream) == 1
    verdicts = sorted(r.headers["x-velox-cache"] for r in responses)
    assert verdicts == ["hit"] * 49 + ["miss"]
    doc = stats(gw)
    assert doc["misses"] == 1 and doc["coalesced"] + doc["hits"] == 49


def send_raw(gw: GatewayProcess, body: dict[str, Any], headers: str = "",
             key: str = CLIENT_KEY) -> socket.socket:
    """A chat request on a socket of its own (the test reads or closes it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((gw.host, gw.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                 b"authorization: Bearer " + key.encode() + b"\r\n"
                 + headers.encode() + b"content-type: application/json\r\n"
                 + b"content-length: %d\r\n\r\n" % len(data) + data)
    return sock


def waiting(gw: GatewayProcess) -> int:
    """Requests waiting for another's answer, in all workers (their control-channel state)."""
    workers = json.loads(gw.admin_get("/stats")[1])["workers"]
    return sum(w["state"]["cache"]["followers"] + w["state"]["cache"]["remote_waits"]
               for w in workers if isinstance(w["state"], dict))


def test_a_leaving_leader_does_not_cancel_the_answer_others_wait_for(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    for workers in ("1", "2"):  # followers in the leader's worker, and in the other one
        gw = start(gateways, upstream, tmp_path, VELOX_WORKERS=workers)
        upstream.reset()
        body = {**CHAT, "messages": [{"role": "user", "content": f"leaving {workers}"}]}
        leader = send_raw(gw, body, "x-mock-latency-ms: 4000\r\n")
        wait_for(lambda: calls(upstream) == 1, timeout=10)  # the leader's call is upstream

        async def followers_then_leave() -> list[httpx.Response]:
            task = asyncio.ensure_future(_concurrent(gw.base_url, 6, body))
            deadline = time.monotonic() + 3
            while waiting(gw) < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert waiting(gw) == 6, "the followers did not arrive in time"
            leader.close()  # the leader's client disconnects while the others wait
            return await task

        responses = asyncio.run(followers_then_leave())
        assert [r.status_code for r in responses] == [200] * 6
        assert {r.headers["x-velox-cache"] for r in responses} == {"hit"}
        assert calls(upstream) == 1
        assert upstream.stats()["streams_cancelled"] == 0
        gw.stop()


def _cache_state(gw: GatewayProcess) -> dict[int, dict[str, int]]:
    """Each worker's cache state (flights, followers, remote_waits) by pid."""
    workers = json.loads(gw.admin_get("/stats")[1])["workers"]
    return {w["pid"]: w["state"]["cache"] for w in workers if isinstance(w["state"], dict)}


def test_a_follower_in_another_worker_goes_on_soon_after_its_leaders_worker_dies(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    """The leader's worker is SIGKILLed mid-call: a follower waiting in the other worker is
    sent on its own within moments (the marker's owner is gone), not after the old hold of the
    request timeout (600 s by default)."""
    gw = start(gateways, upstream, tmp_path)
    body = {**CHAT, "messages": [{"role": "user", "content": "a leader that dies"}]}
    sockets = [send_raw(gw, body, "x-mock-latency-ms: 60000\r\n")]
    try:
        wait_for(lambda: calls(upstream) == 1, timeout=10)  # the leader's call is upstream
        leaders = [pid for pid, s in _cache_state(gw).items() if s["flights"] == 1]
        assert len(leaders) == 1
        leader_pid = leaders[0]
        # Identical requests until one lands in the other worker (SO_REUSEPORT spreads
        # connections by their ports; 24 tries all landing in one of two workers: 2^-24).
        follower = None
        for n in range(1, 25):
            sock = send_raw(gw, body)
            sockets.append(sock)
            wait_for(lambda: waiting(gw) == n, timeout=10)
            if any(s["remote_waits"] for pid, s in _cache_state(gw).items()
                   if pid != leader_pid):
                follower = sock
                break
        assert follower is not None, "no follower reached the other worker"
        assert calls(upstream) == 1
        os.kill(leader_pid, signal.SIGKILL)
        started = time.monotonic()
        follower.settimeout(30)
        status, headers, answer = read_response(follower)
        took = time.monotonic() - started
    finally:
        for sock in sockets:
            sock.close()
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"]
    assert headers[b"x-velox-cache"] == b"miss"  # sent upstream on its own
    assert took < 15, took  # far below the old hold (600 s); normally milliseconds
    assert calls(upstream) == 2
    assert stats(gw)["sent_alone"] >= 1


def test_a_follower_whose_leader_fails_is_sent_alone(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path)

    async def leader_and_followers() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=60, headers={
                "authorization": f"Bearer {CLIENT_KEY}"}) as http:
            leader = asyncio.ensure_future(http.post(
                "/v1/chat/completions", json=CHAT,
                headers={"x-mock-status": "503", "x-mock-latency-ms": "1500"}))
            await asyncio.sleep(0.5)  # the leader is upstream now
            followers = await _concurrent(gw.base_url, 5, CHAT)
            return await leader, followers

    leader, followers = asyncio.run(leader_and_followers())
    assert leader.status_code == 503
    assert [r.status_code for r in followers] == [200] * 5
    # Each follower went upstream on its own (miss), or, in the other worker, found the answer
    # one of those stored just before it gave up waiting (hit): never the leader's 503.
    alone = [r for r in followers if r.headers["x-velox-cache"] == "miss"]
    assert {r.headers["x-velox-cache"] for r in followers} <= {"miss", "hit"} and alone
    assert calls(upstream) == 1 + len(alone)
    assert stats(gw)["sent_alone"] == len(alone)


def test_a_streaming_follower_gets_the_events_so_far_then_the_rest_live(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1")
    slow = {"x-mock-chunk-delay-ms": "150"}
    client = client_for(gw)

    async def two_streams() -> tuple[list[Any], list[Any], str]:
        aclient = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY,
                                     max_retries=0, timeout=30)
        first = await aclient.chat.completions.create(**CHAT, stream=True, extra_headers=slow)
        got_first = [await first.__anext__()]
        await asyncio.sleep(0.4)  # a few events later, an identical request arrives
        raw = await aclient.chat.completions.with_raw_response.create(**CHAT, stream=True)
        second = [c async for c in raw.parse()]
        got_first += [c async for c in first]
        await aclient.close()
        return got_first, second, raw.headers["x-velox-cache"]

    first, second, verdict = asyncio.run(two_streams())
    assert verdict == "hit" and len(first) == len(second) == 8
    assert [c.model_dump() for c in second] == [c.model_dump() for c in first]
    assert calls(upstream) == 1
    assert stats(gw)["coalesced"] == 1
    # And the recorded stream is now a hit.
    raw = client.chat.completions.with_raw_response.create(**CHAT, stream=True)
    assert raw.headers["x-velox-cache"] == "hit" and len(list(raw.parse())) == 8


def test_per_route_opt_in_and_responses_bypass(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    config = tmp_path / "velox.toml"
    config.write_text(
        f'[[upstream]]\nname = "mock"\norigin = "{upstream.origin}"\n'
        f'ca_file = "{upstream.ca_file}"\napi_key_env = "MOCK_KEY"\n'
        '[[route]]\nmodel = "gpt-4o-mini"\ntargets = [{ upstream = "mock" }]\ncache = true\n'
        '[[route]]\nmodel = "*"\ntargets = [{ upstream = "mock" }]\n')
    gw = start(gateways, upstream, tmp_path, VELOX_CACHE="0", VELOX_CONFIG=str(config),
               MOCK_KEY=UPSTREAM_KEY)
    client = client_for(gw)
    assert chat(client)[1]["x-velox-cache"] == "miss"
    assert chat(client)[1]["x-velox-cache"] == "hit"
    for _ in range(2):  # a route without `cache = true`: no header, always upstream
        _, h = chat(client, model="gpt-4o")
        assert "x-velox-cache" not in h
    assert calls(upstream) == 3
    # /v1/responses keeps state upstream (previous_response_id): never served from the cache.
    for _ in range(2):
        raw = client.responses.with_raw_response.create(model="gpt-4o-mini", input="hi")
        assert raw.headers["x-velox-cache"] == "bypass" and raw.parse().output_text
    assert calls(upstream, "/v1/responses") == 2
