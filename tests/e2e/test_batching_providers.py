"""Embeddings batching on Gemini and Bedrock routes, end to end.

One Velox with ONE worker (batching is per worker, so what merges is decided by the rules) and a
VELOX_CONFIG whose batching routes reach a `gemini` upstream (the merged call is one
`:batchEmbedContents`) and a `bedrock` one (one Cohere Embed `/invoke` with every member's
texts), both on the bundled mock over HTTP/2 + TLS. Clients are the openai SDK, several at
once from two processes' worth of connections; while one call is in flight (the mock holds
each call 300 ms) the others gather. What it proves: fewer upstream calls than requests, each
client gets exactly its own vectors (the mock's deterministic function of each text), and
each member its share of the usage the provider reported (Bedrock reports the input tokens
in a header; the shares add up to it exactly). Gemini's batchEmbedContents reports no usage:
its members report none either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.test_providers_wired import ENV, upstream
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream
from velox_lab.mock.payloads import EMBEDDING_DIMENSIONS, embedding_vector
from velox_lab.mock.providers import _tokens

MODELS = {"gemini": "text-embedding-004", "bedrock": "cohere.embed-english-v3"}
PATHS = {"gemini": ":batchEmbedContents", "bedrock": "/invoke"}
CLIENTS = 6
PER_CLIENT = 8


@pytest.fixture(scope="module")
def gw(logged_mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    where = tmp_path_factory.mktemp("batching-providers")
    text = "".join(upstream(kind, kind, logged_mock) + f"""
[[route]]
model = "{kind}-emb"
targets = [{{ upstream = "{kind}", model = "{MODELS[kind]}" }}]
batch = {{ max_requests = 32, max_wait_ms = 1000 }}
""" for kind in MODELS)
    path = where / "velox.toml"
    path.write_text(text)
    env = {"VELOX_CONFIG": str(path), "VELOX_WORKERS": "1", "VELOX_RATE_LIMIT_RPM": "0",
           "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
           **ENV}
    with GatewayProcess(env, log_path=Path(where) / "velox.log") as process:
        yield process


def provider_calls(logged_mock: MockUpstream, kind: str) -> list[dict[str, Any]]:
    return [r for r in logged_mock.requests(1000) if r["path"].endswith(PATHS[kind])]


@pytest.mark.parametrize("kind", list(MODELS))
def test_concurrent_clients_share_calls_and_get_their_own_vectors(
        gw: GatewayProcess, logged_mock: MockUpstream, kind: str) -> None:
    texts = [[f"{kind} client {c} text {i} " + "x" * ((c * 7 + i) % 23)
              for i in range(PER_CLIENT)] for c in range(CLIENTS)]

    async def client_run(items: list[str]) -> list[Any]:
        # Each client its own SDK instance and connection pool.
        async with openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="sk-unused",
                                      max_retries=0, timeout=60) as client:
            return await asyncio.gather(*[client.embeddings.create(
                model=f"{kind}-emb", input=t, encoding_format="float") for t in items])

    async def run() -> list[list[Any]]:
        return await asyncio.wait_for(
            asyncio.gather(*[client_run(items) for items in texts]), timeout=120)

    logged_mock.reset()
    logged_mock.behave(latency_ms=300)  # while one call is in flight the others gather
    try:
        answers = asyncio.run(run())
    finally:
        logged_mock.behave()
    calls = provider_calls(logged_mock, kind)
    requests = CLIENTS * PER_CLIENT
    assert calls and all(r["status"] == 200 for r in calls)
    assert len(calls) <= requests // 3, len(calls)  # merged: far fewer calls than requests
    shares = []
    for items, got in zip(texts, answers, strict=True):
        for text, answer in zip(items, got, strict=True):
            assert len(answer.data) == 1 and answer.data[0].index == 0
            assert list(answer.data[0].embedding) == embedding_vector(text,
                                                                      EMBEDDING_DIMENSIONS)
            assert answer.model == f"{kind}-emb"
            shares.append(answer.usage.prompt_tokens)
    if kind == "bedrock":
        # Every member has its share, and the shares add up to the provider's counts.
        assert all(s > 0 for s in shares)
        assert sum(shares) == sum(_tokens(t) for items in texts for t in items)
    else:
        assert shares == [0] * requests


def test_a_merged_bedrock_call_over_coheres_limit_goes_member_by_member(
        gw: GatewayProcess, logged_mock: MockUpstream) -> None:
    """Cohere Embed takes 96 texts a call: a merged call of more is refused before sending,
    and its members are sent one by one (each within the limit): every client still gets its
    own vectors."""
    texts = [[f"member {c} text {i}" for i in range(40)] for c in range(4)]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="sk-unused",
                                      max_retries=0, timeout=60) as client:
            first = asyncio.create_task(client.embeddings.create(
                model="bedrock-emb", input="first", encoding_format="float"))
            while not provider_calls(logged_mock, "bedrock"):  # in flight: the next ones gather
                await asyncio.sleep(0.05)
            rest = await asyncio.gather(*[client.embeddings.create(
                model="bedrock-emb", input=items, encoding_format="float") for items in texts])
            await first
            return rest

    logged_mock.reset()
    logged_mock.behave(latency_ms=500)
    try:
        answers = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        logged_mock.behave()
    for items, answer in zip(texts, answers, strict=True):
        assert [list(d.embedding) for d in answer.data] == [
            embedding_vector(t, EMBEDDING_DIMENSIONS) for t in items]
    assert all(r["status"] == 200 for r in provider_calls(logged_mock, "bedrock"))
