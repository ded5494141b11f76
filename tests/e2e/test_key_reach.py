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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import GatewayFactory
from tests.e2e.test_hardening_ingress import exchange
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is reachable?"}]}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("reach-certs")),
                      name="reach") as m:
        yield m


@pytest.fixture
def start(mock: MockUpstream, start_gateway: GatewayFactory, tmp_path: Path
          ) -> Callable[..., GatewayProcess]:
    """A gateway on this module's mock (reset first), with a tables file when one is given."""
    mock.behave()
    mock.reset()

    def started(config: str | None = None, **env: str) -> GatewayProcess:
        if config is not None:
            path = tmp_path / f"velox-{len(env)}-{abs(hash(config))}.toml"
            path.write_text(config)
            env["VELOX_CONFIG"] = str(path)
        return start_gateway(mock, VELOX_EGRESS_POOL_CONNECTIONS="1", **env)

    return started


def upstream_table(name: str, mock: MockUpstream, extra: str = "") -> str:
    return f"""
[[upstream]]
name = "{name}"
origin = "{mock.origin}"
api_key_env = "VELOX_UPSTREAM_API_KEY"
ca_file = "{mock.ca_file}"
{extra}
"""


def chat_calls(mock: MockUpstream) -> int:
    return int(mock.stats()["by_path"].get("/v1/chat/completions", 0))


# --- one credential per request -------------------------------------------------------------


@pytest.mark.parametrize("parser", ["native", "httptools"])
def test_two_authorization_fields_are_refused_on_both_parsers(
        mock: MockUpstream, start: Callable[..., GatewayProcess], parser: str) -> None:
    gw = start(VELOX_API_KEYS="sk-tenant-a-1234,sk-tenant-b-5678",
               VELOX_NATIVE="1" if parser == "native" else "0")
    body = orjson.dumps(CHAT)
    status, _, answer = exchange(gw, (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer sk-tenant-a-1234\r\nauthorization: Bearer sk-tenant-b-5678\r\n"
        b"content-length: %d\r\n\r\n%b") % (len(body), body))
    error = orjson.loads(answer)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error",
                                                        "authorization"), answer
    assert chat_calls(mock) == 0
    # One Authorization is served as before.
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-tenant-b-5678",
                           max_retries=0)
    closed_after_the_test(client)
    assert client.chat.completions.create(**CHAT).choices


def test_the_cache_partition_is_the_checked_key_not_an_api_key_beside_it(
        mock: MockUpstream, start: Callable[..., GatewayProcess]) -> None:
    gw = start(VELOX_API_KEYS="sk-tenant-a-1234,sk-tenant-b-5678",
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
    assert chat_calls(mock) == 2


# --- fallbacks ------------------------------------------------------------------------------

CHEAP_KEY, ANY_KEY = "vx-cheap-only-0123456789", "vx-any-route-0123456789"


def fallback_config(mock: MockUpstream) -> str:
    # Two upstreams on the one mock, told apart by x-velox-upstream; "cheap"'s allows one
    # request a minute, so its second request can only go to the fallback.
    return upstream_table("cheap-up", mock, "rpm = 1") + upstream_table("pro-up", mock) + f"""
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
        mock: MockUpstream, start: Callable[..., GatewayProcess]) -> None:
    gw = start(fallback_config(mock))
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
    with openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CHEAP_KEY,
                       max_retries=0) as sdk, pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(**body)
    assert [r["model"] for r in mock.requests() if r["method"] == "POST"] == ["cheap"]
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
        start: Callable[..., GatewayProcess]) -> None:
    import asyncio

    gw = start(tpm_config(10_000))
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
        start: Callable[..., GatewayProcess]) -> None:
    gw = start(tpm_config(5_000))
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


# --- forwarded paths --------------------------------------------------------------------------

KEYS = {"models": "vx-models-only-m-0123456789", "forward": "vx-models-forward-0123456789",
        "plain": "vx-plain-rpm-0123456789"}


def reach_config(mock: MockUpstream) -> str:
    # "m" goes to the OpenAI-kind upstream; everything else ("*") to an Azure one, which is
    # what a client's own deployment path would have reached with the gateway's Azure key.
    return upstream_table("default", mock) + upstream_table("azure", mock, """
kind = "azure"
api_version = "2024-10-21"
warmup_path = "/openai/models?api-version=2024-10-21"
""") + f"""
[[route]]
model = "m"
targets = [{{ upstream = "default" }}]

[[route]]
model = "*"
targets = [{{ upstream = "azure" }}]

[[key]]
name = "models"
sha256 = "{sha(KEYS['models'])}"
models = ["m"]

[[key]]
name = "forward"
sha256 = "{sha(KEYS['forward'])}"
models = ["m"]
forward = true

[[key]]
name = "plain"
sha256 = "{sha(KEYS['plain'])}"
rpm = 100
"""


def keyed(gw: GatewayProcess, key: str, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[key]}", **kw.pop("headers", {})}
    return httpx.request(method, gw.base_url + path, headers=headers, timeout=20, **kw)


def posts(mock: MockUpstream) -> list[dict[str, Any]]:
    return [r for r in mock.requests() if r["method"] == "POST"]


def key_stats(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    status, body = gw.admin_get("/stats")
    assert status == 200
    return {k["name"]: k for k in json.loads(body)["keys"]}


@pytest.fixture
def reach(mock: MockUpstream, start: Callable[..., GatewayProcess]) -> GatewayProcess:
    return start(reach_config(mock))



def test_an_azure_deployment_path_from_a_client_is_refused(
        mock: MockUpstream, reach: GatewayProcess) -> None:
    answer = keyed(reach, "models", "POST",
                   "/v1/deployments/secret-dep/chat/completions?api-version=2024-10-21",
                   json=CHAT)
    assert answer.status_code == 404 and "deployment" in answer.json()["error"]["message"]
    # It reached the deployment with the gateway's Azure key before.
    assert not [r for r in mock.requests() if r["deployment"] == "secret-dep"]


def test_an_encoded_model_path_is_the_model_call_it_spells(
        mock: MockUpstream, reach: GatewayProcess) -> None:
    encoded = "/v1/chat/c%6Fmpletions"
    denied = keyed(reach, "models", "POST", encoded, json={**CHAT, "model": "o1-pro"})
    assert denied.status_code == 403, denied.text
    assert denied.json()["error"]["code"] == "model_not_allowed"
    assert not posts(mock)  # forwarded as it was, with the denied model, before
    served = keyed(reach, "models", "POST", encoded, json=CHAT)
    assert served.status_code == 200 and served.json()["object"] == "chat.completion"
    assert [r["path"] for r in posts(mock)] == ["/v1/chat/completions"]
    # A percent sign that would decode into structure is refused.
    odd = keyed(reach, "models", "POST", "/v1/chat/completions%3Bx", json=CHAT)
    assert (odd.status_code, odd.json()["error"]["code"]) == (400, "invalid_path")


def test_a_key_with_models_reaches_only_what_can_be_checked(
        mock: MockUpstream, reach: GatewayProcess) -> None:
    models = openai.OpenAI(base_url=reach.base_url + "/v1", api_key=KEYS["models"],
                           max_retries=0)
    closed_after_the_test(models)
    # Forwards (no model read): refused, through the SDK's own exception.
    with pytest.raises(openai.PermissionDeniedError, match="forward = true"):
        models.files.list()
    with pytest.raises(openai.PermissionDeniedError):
        models.batches.create(input_file_id="file-1", endpoint="/v1/chat/completions",
                              completion_window="24h")
    # The gateway's own model list is no forward.
    assert [m.id for m in models.models.list()] == ["m"]
    # Model-bearing endpoints are read: JSON, and a multipart form as the SDK sends it.
    with pytest.raises(openai.PermissionDeniedError, match="o1-pro"):
        models.images.generate(model="o1-pro", prompt="a cat")
    with pytest.raises(openai.PermissionDeniedError, match="default"):
        models.moderations.create(input="hello")  # no model: the catch-all, not allowed
    with pytest.raises(openai.PermissionDeniedError, match="o1-pro"):
        models.audio.transcriptions.create(model="o1-pro", file=("a.wav", b"RIFF" * 64))
    assert not posts(mock)
    # Allowed models pass on to the upstream (which serves no audio: its 404 comes back).
    with pytest.raises(openai.NotFoundError):
        models.audio.transcriptions.create(model="m", file=("a.wav", b"RIFF" * 64))
    with pytest.raises(openai.NotFoundError):
        models.images.generate(model="m", prompt="a cat")
    assert [r["path"] for r in posts(mock)] == ["/v1/audio/transcriptions",
                                                   "/v1/images/generations"]
    refused = key_stats(reach)["models"]["refused"]
    assert (refused["forward"], refused["model"]) == (2, 3)


def test_forwards_are_taken_by_keys_that_allow_them_and_counted(
        mock: MockUpstream, reach: GatewayProcess) -> None:
    before = key_stats(reach)
    for key in ("forward", "plain"):
        answer = keyed(reach, key, "GET", "/v1/files?purpose=batch")
        assert answer.status_code == 404  # the mock's answer: it reached the upstream
    assert [r["path"] for r in mock.requests() if r["method"] == "GET"
            and "/files" in r["path"]] == ["/openai/files?purpose=batch&api-version=2024-10-21"
                                           ] * 2
    after = key_stats(reach)
    for key in ("forward", "plain"):
        assert after[key]["requests"] == before[key]["requests"] + 1
