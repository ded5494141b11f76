"""The response cache's Redis tier (velox.cache.redis): two real Velox hosts (separate
processes, two workers each, two ports) sharing one real redis-server and VELOX_CACHE=1, the
bundled mock upstream over HTTP/2 + TLS, the official openai SDK.

VELOX_CACHE_REDIS_TIMEOUT_MS is raised to 3 s here so a loaded 2-core box does not turn a
shared answer into a timeout miss (the default is a few ms; 500 ms was overrun at load 20, the
worker's first lookup opening its connection too); the Redis-down test does not depend on it:
a killed Redis refuses at once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import UPSTREAM_KEY, client_for, wait_for, worker_rows
from tests.e2e.test_cache import calls, send_raw, start
from tests.e2e.test_cache import stats as cache_stats
from velox_lab.launch import GatewayProcess, RedisProcess
from velox_lab.mock import MockUpstream


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    certdir = tmp_path_factory.mktemp("cache-redis-certs")
    with MockUpstream(tls=True, certdir=str(certdir), name="cache-redis") as m:
        yield m


@pytest.fixture
def upstream(mock: MockUpstream) -> MockUpstream:
    mock.behave()
    mock.reset()
    return mock


@pytest.fixture
def hosts(upstream: MockUpstream, redis_server: RedisProcess,
          tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for _ in range(2):  # test_cache's gateway (two workers, VELOX_CACHE=1), plus Redis
            start(started, upstream, tmp_path, VELOX_REDIS_URL=redis_server.url,
                  VELOX_CACHE_REDIS_TIMEOUT_MS="3000", VELOX_SHUTDOWN_GRACE_S="2")
        yield started
    finally:
        for gw in started:
            gw.stop()


def chat(client: openai.OpenAI, prompt: str,
         headers: dict[str, str] | None = None) -> tuple[Any, httpx.Headers]:
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": prompt}],
        extra_headers=headers or {})
    return raw.parse(), raw.headers


def stored_in_redis(gw: GatewayProcess, n: int) -> None:
    """Writes to Redis are fire and forget: wait (bounded) until `n` have been acknowledged."""
    wait_for(lambda: cache_stats(gw)["redis_stores"] >= n, timeout=10)


def counted(gw: GatewayProcess, name: str, n: int) -> dict[str, Any] | None:
    """The gateway's cache counters once `name` reached `n` and a Redis hit is counted."""
    doc = cache_stats(gw)
    return doc if doc[name] >= n and doc["redis_hits"] >= 1 else None


def test_an_answer_from_one_host_is_a_hit_on_the_other(
        upstream: MockUpstream, hosts: list[GatewayProcess], redis_server: RedisProcess) -> None:
    a, b = hosts
    ca, cb = client_for(a), client_for(b)
    first, h1 = chat(ca, "shared across hosts")
    assert h1["x-velox-cache"] == "miss"
    stored_in_redis(a, 1)
    # The key in Redis: the prefix and the hex of the 32-byte cache key, with a TTL.
    keys = redis_server.command("KEYS", "velox:cache:*")
    assert keys.count(b"velox:cache:") == 1 and len(keys.split(b"velox:cache:")[1]) >= 64
    second, h2 = chat(cb, "shared across hosts")
    assert h2["x-velox-cache"] == "hit" and int(h2["age"]) >= 0, \
        (cache_stats(b), [ln for ln in b.log().splitlines() if "velox.cache" in ln][-5:])
    assert second.model_dump() == first.model_dump()  # the mock gives every call its own id
    assert calls(upstream) == 1
    # The counters reach /stats a moment after the answer (a busy host: later): wait for them.
    doc = wait_for(lambda: counted(b, "hits", 1), timeout=10)
    assert doc["redis_hits"] == 1 and doc["hits"] == 1 and doc["misses"] == 0
    # The copy is now in B's local store: later hits there do not ask Redis (local in front).
    for _ in range(3):
        assert chat(cb, "shared across hosts")[1]["x-velox-cache"] == "hit"
    doc = wait_for(lambda: counted(b, "hits", 4), timeout=10)
    assert doc["hits"] == 4 and doc["redis_hits"] == 1 and doc["redis_misses"] == 0
    assert doc["entries"] == 1
    # A's own hits are local too.
    assert chat(ca, "shared across hosts")[1]["x-velox-cache"] == "hit"
    assert cache_stats(a)["redis_hits"] == 0
    assert calls(upstream) == 1
    _status, metrics = b.admin_get("/metrics")
    assert b"velox_cache_redis_hits_total 1.0" in metrics
    # Streamed answers are shared too: stored whole on A, replayed as an event stream on B,
    # which the SDK reads chunk by chunk.
    runs = []
    for client in (ca, cb):
        with client.chat.completions.with_streaming_response.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "streamed"}],
                stream=True) as response:
            text = "".join(c.choices[0].delta.content or "" for c in response.parse()
                           if c.choices)
            runs.append((response.headers["x-velox-cache"], text))
        if client is ca:
            stored_in_redis(a, 2)
    assert runs[0][0] == "miss" and runs[1] == ("hit", runs[0][1]) and runs[0][1]
    assert calls(upstream) == 2 and cache_stats(b)["redis_hits"] == 2


def test_age_and_max_age_hold_across_hosts(
        upstream: MockUpstream, hosts: list[GatewayProcess]) -> None:
    a, b = hosts
    ca, cb = client_for(a), client_for(b)
    chat(ca, "aged one")
    chat(ca, "aged two")
    stored_in_redis(a, 2)
    time.sleep(1.2)  # the entries are now more than a second old
    # B gets A's entry with its age (from the time A stored it, carried in the value).
    _, h = chat(cb, "aged one", {"cache-control": "max-age=3600"})
    assert h["x-velox-cache"] == "hit" and int(h["age"]) >= 1
    # Too old for this client: Redis's entry is not used, the request goes upstream.
    _, h = chat(cb, "aged two", {"cache-control": "max-age=0"})
    assert h["x-velox-cache"] == "miss"
    assert calls(upstream) == 3
    doc = cache_stats(b)
    assert doc["redis_hits"] == 1 and doc["redis_misses"] == 1 and doc["misses"] == 1


def test_redis_killed_then_restarted(
        upstream: MockUpstream, hosts: list[GatewayProcess], redis_server: RedisProcess) -> None:
    a, b = hosts
    ca, cb = client_for(a, timeout=10), client_for(b, timeout=10)
    chat(ca, "before the outage")
    stored_in_redis(a, 1)
    redis_server.kill()  # SIGKILL by PID
    # Every request still gets its answer: misses go upstream, local hits stay hits.
    for i in range(4):
        _, h = chat(cb, f"during the outage {i}")
        assert h["x-velox-cache"] == "miss"
        _, h = chat(cb, f"during the outage {i}")
        assert h["x-velox-cache"] == "hit"
        _, h = chat(ca, "before the outage")
        assert h["x-velox-cache"] == "hit"
    assert calls(upstream) == 5
    doc = cache_stats(b)
    assert doc["redis_errors"] >= 1 and doc["redis_hits"] == 0
    assert doc["misses"] == 4 and doc["hits"] == 4
    _status, metrics = b.admin_get("/metrics")
    assert b"velox_cache_redis_errors_total" in metrics
    # Logged once per outage per worker, not once per request.
    assert b.log().count("cache's Redis at") <= 2

    redis_server.start()  # same port, empty (no persistence)
    # Sharing comes back once each host retries (a second after its last failure): a fresh
    # prompt answered on A becomes a hit on B. Bounded: 40 tries, about 10 s at most.
    shared = False
    for i in range(40):
        before = cache_stats(a)["redis_stores"]
        _, h = chat(ca, f"after the outage {i}")
        assert h["x-velox-cache"] == "miss"
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline and cache_stats(a)["redis_stores"] == before:
            time.sleep(0.02)
        if cache_stats(a)["redis_stores"] > before:
            _, h = chat(cb, f"after the outage {i}")
            assert h["x-velox-cache"] == "hit"
            shared = True
            break
    assert shared, "the hosts did not share answers again after Redis came back"
    assert "reachable again" in a.log()


PAR_KEY = "vx-par-cache-0123456789"


def worker_state(gw: GatewayProcess) -> dict[str, Any]:
    (worker,) = worker_rows(gw)
    return worker["state"]  # type: ignore[no-any-return]


def test_a_keyed_client_leaving_while_its_request_waits_for_redis(
        upstream: MockUpstream, redis_server: RedisProcess, tmp_path: Path) -> None:
    """A `[[key]]` client with max_parallel leaves while its request waits for Redis's answer
    (Redis stopped with SIGSTOP: the lookup waits until it is continued): the key's place comes
    back at once, the request is never sent upstream nor answered, its body is freed; and the
    key's places all work again afterwards."""
    config = tmp_path / "velox.toml"
    config.write_text(
        f'[[upstream]]\nname = "mock"\norigin = "{upstream.origin}"\n'
        f'ca_file = "{upstream.ca_file}"\napi_key_env = "MOCK_KEY"\n'
        '[[route]]\nmodel = "gpt-4o-mini"\ntargets = [{ upstream = "mock" }]\ncache = true\n'
        f'[[key]]\nname = "par"\nsha256 = "{hashlib.sha256(PAR_KEY.encode()).hexdigest()}"\n'
        'max_parallel = 2\n')
    started: list[GatewayProcess] = []
    redis = redis_server.proc
    assert redis is not None
    try:
        gw = start(started, upstream, tmp_path, VELOX_WORKERS="1", VELOX_CONFIG=str(config),
                   MOCK_KEY=UPSTREAM_KEY, VELOX_REDIS_URL=redis_server.url,
                   VELOX_CACHE_REDIS_TIMEOUT_MS="8000")
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=PAR_KEY, max_retries=0,
                               timeout=20)
        closed_after_the_test(client)
        chat(client, "warm up")  # the worker's Redis connection is open now
        answered = json.loads(gw.admin_get("/stats")[1])["requests"]["total"]
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            body = {"model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "leaves while Redis is asked"}]}
            sock = send_raw(gw, body, key=PAR_KEY)
            wait_for(lambda: worker_state(gw)["cache"]["redis_waits"] == 1, timeout=10)
            assert key_active(gw) == 1
            sock.close()
            wait_for(lambda: worker_state(gw)["cache"]["redis_waits"] == 0, timeout=10)
            assert key_active(gw) == 0  # given back when the client left, not at the timeout
            assert worker_state(gw)["cache"]["redis_lookups"] == 1  # the lookup itself runs on
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        wait_for(lambda: worker_state(gw)["cache"]["redis_lookups"] == 0, timeout=10)
        state = worker_state(gw)
        assert state["in_flight"] == 0
        assert state["arena"] is None or state["arena"]["live_bodies"] == 0
        assert calls(upstream) == 1  # the warm-up only: the one that left never went upstream
        # The one that left is counted once (its access-log line says 499).
        assert json.loads(gw.admin_get("/stats")[1])["requests"]["total"] == answered + 1
        assert key_active(gw) == 0
        # Both of the key's places are free: two requests at once are both admitted.
        slow = {"x-mock-latency-ms": "500"}
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda i: chat(client, f"after {i}", slow), range(2)))
        assert [h["x-velox-cache"] for _, h in done] == ["miss", "miss"]
        assert key_active(gw) == 0
    finally:
        for gw in started:
            gw.stop()


def key_active(gw: GatewayProcess) -> int:
    (row,) = [k for k in json.loads(gw.admin_get("/stats")[1])["keys"] if k["name"] == "par"]
    return row["active"]  # type: ignore[no-any-return]


class WrongRedis:
    """A TCP server on 127.0.0.1 that reads RESP commands and answers `+OK` to every one (a
    proxy or a server that is not Redis): replies of the wrong shape for MGET, EVALSHA,
    SCRIPT LOAD. Counts the commands it answered."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.commands = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        import threading

        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: Any) -> None:
        buf = b""
        with conn:
            while not self.stopped:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                n, buf = _complete_commands(buf)
                if n:
                    self.commands += n
                    conn.sendall(b"+OK\r\n" * n)

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()


def _complete_commands(buf: bytes) -> tuple[int, bytes]:
    """How many whole RESP commands (arrays of bulk strings) start `buf`, and the rest."""
    n = 0
    while buf.startswith(b"*"):
        end = buf.find(b"\r\n")
        if end < 0:
            break
        pos, parts, whole = end + 2, int(buf[1:end]), True
        for _ in range(parts):
            end = buf.find(b"\r\n", pos)
            if end < 0 or buf[pos:pos + 1] != b"$":
                whole = False
                break
            size = int(buf[pos + 1:end])
            pos = end + 2 + size + 2
            if pos > len(buf):
                whole = False
                break
        if not whole:
            break
        n, buf = n + 1, buf[pos:]
    return n, buf


def test_a_server_answering_ok_to_everything_counts_as_redis_down(
        upstream: MockUpstream, tmp_path: Path) -> None:
    """Every reply of the wrong shape marks the tier down like a connection error, logged
    once per worker, and every request is still answered (from the upstream, then the local
    store); the lease refresher likewise falls back to the host's own limits, logged once.
    Before: each cache lookup raised TypeError in a task nobody awaited (a traceback per
    call) and the tier was never marked down."""
    fake = WrongRedis()
    started: list[GatewayProcess] = []
    try:
        gw = start(started, upstream, tmp_path, VELOX_REDIS_URL=fake.url,
                   VELOX_CACHE_REDIS_TIMEOUT_MS="500", VELOX_SHUTDOWN_GRACE_S="2")
        client = client_for(gw)
        for i in range(40):  # distinct prompts: each a local miss that asks Redis
            answer, _headers = chat(client, f"wrong redis {i % 20}")
            assert answer.choices[0].message.content
        assert fake.commands > 0  # the gateway did talk to it
        doc = cache_stats(gw)
        assert doc["redis_errors"] >= 1 and doc["redis_hits"] == 0, doc
        _status, body = gw.admin_get("/stats")
        assert json.loads(body)["redis"]["up"] == 0
        gw.stop()
        log = gw.log()
        assert "Traceback" not in log and "TypeError" not in log, log[-3000:]
        assert "exception was never retrieved" not in log
        tier = [line for line in log.splitlines() if "the cache's Redis" in line
                and "unreachable" in line]
        assert 1 <= len(tier) <= 2 and all("ReplyShapeError" in line for line in tier), tier
        leases = [line for line in log.splitlines() if "velox.cluster" in line
                  and "unreachable" in line]
        assert len(leases) == 1 and "ReplyShapeError" in leases[0], leases
    finally:
        for g in started:
            g.stop()
        fake.stop()
