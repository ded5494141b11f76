"""Embeddings batching between tenants, end to end: one Velox process (one worker, so every
member of a group meets in one place), the bundled mock (HTTP/2 + TLS) with its request log,
the official openai SDK as the clients, two gateway keys, the access log on.

What is checked: a merged call goes upstream with one member's headers on behalf of all, so
clients that send different `OpenAI-Organization` / `OpenAI-Project` headers are never merged;
each member's share of a merged call's tokens goes into its own key's books (none into the
books of no key); the access log has exactly one line per request, batched members included,
each with its key and its own usage."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import wait_for
from velox.launch import GatewayProcess, free_port
from velox.mock import MockUpstream

UP_KEY = "sk-upstream-tenants-0123456789"
KEYS = {"team-a": "vx-team-a-0123456789abcdef", "team-b": "vx-team-b-0123456789abcdef"}
EMBED = "/v1/embeddings"
# Each request of a test has one input for one tenant and SPREAD inputs for the other, fewer
# requests than SPREAD: whatever crossed over, the inputs each tenant's calls carried could
# not add up to its own (k one-input members = SPREAD x j members is impossible for k < SPREAD).
REQUESTS = 24
SPREAD = 30


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    certdir = str(tmp_path_factory.mktemp("tenants-certs"))
    with MockUpstream(tls=True, certdir=certdir, name="tenants") as started:
        yield started


@pytest.fixture(scope="module")
def gateway(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    keys = "".join(f'\n[[key]]\nname = "{name}"\n'
                   f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
                   for name, key in KEYS.items())
    config = tmp / "velox.toml"
    config.write_text(f"""
[[upstream]]
name = "own"
origin = "{mock.origin}"
ca_file = "{mock.ca_file}"
api_key_env = "UP_KEY"

[[route]]
model = "emb"
targets = [{{ upstream = "own" }}]
batch = {{ max_requests = 64, max_wait_ms = 200 }}
{keys}""")
    env = {"VELOX_CONFIG": str(config), "UP_KEY": UP_KEY, "VELOX_WORKERS": "1",
           "VELOX_RATE_LIMIT_RPM": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
           "VELOX_ACCESS_LOG": "1", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}
    with GatewayProcess(env, log_path=tmp / "velox.log") as gw:
        yield gw


@pytest.fixture
def fresh(mock: MockUpstream) -> MockUpstream:
    # Every call takes 300 ms upstream: requests arriving meanwhile wait and merge.
    mock.behave(latency_ms=300)
    mock.reset()
    return mock


def stats(gw: GatewayProcess) -> dict[str, Any]:
    return json.loads(gw.admin_get("/stats")[1])  # type: ignore[no-any-return]


def client(gw: GatewayProcess, team: str, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=KEYS[team], max_retries=0,
                              timeout=60, **options)


def embed(c: openai.AsyncOpenAI, inputs: list[str], user: str) -> Any:
    return c.embeddings.with_raw_response.create(model="emb", input=inputs, user=user,
                                                 encoding_format="float")


def inputs_for(tag: str, n: int, size: int) -> list[list[str]]:
    return [[f"{tag} {i} item {j}" for j in range(size)] for i in range(n)]


def calls(mock: MockUpstream) -> list[dict[str, Any]]:
    return [r for r in mock.requests(1000) if r["path"] == EMBED]


def header(call: dict[str, Any], name: str) -> str | None:
    return next((v for n, v in call["headers"] if n == name), None)


def test_members_with_different_organization_or_project_are_never_merged(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    """One key, two organizations (then two projects of one organization): the members of
    each upstream call all sent the header that call carries."""
    for name, values in (("openai-organization", ("org-alpha", "org-beta")),
                         ("openai-project", ("proj-alpha", "proj-beta"))):
        fresh.reset()
        option = "organization" if name == "openai-organization" else "project"
        sizes = {values[0]: 1, values[1]: SPREAD}

        async def run() -> list[Any]:
            clients = {v: client(gateway, "team-a", **{option: v}) for v in values}
            jobs = [embed(clients[v], [f"{v} {i} item {j}" for j in range(sizes[v])], "orgs")
                    for i in range(REQUESTS) for v in values]
            return await asyncio.gather(*jobs)

        raws = asyncio.run(run())
        assert all(len(raw.parse().data) in (1, SPREAD) for raw in raws)
        carried: dict[str | None, int] = {}
        for call in calls(fresh):
            assert call["status"] == 200
            value = header(call, name)
            carried[value] = carried.get(value, 0) + call["inputs"]
        # Each value's calls carried exactly that tenant's inputs: nothing crossed over.
        assert carried == {values[0]: REQUESTS, values[1]: REQUESTS * SPREAD}, carried
        # ... and they were batched: fewer calls than requests for each.
        per_value = [header(c, name) for c in calls(fresh)]
        assert all(per_value.count(v) < REQUESTS for v in values), per_value


def test_each_member_books_its_own_tokens_and_has_its_own_access_log_line(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    before = stats(gateway)
    books_before = {(row["key"], row["route"]): row["input"] for row in before["tokens"]}
    log_before = gateway.log().count('"log":"access"')

    async def run() -> dict[str, list[Any]]:
        clients = {team: client(gateway, team) for team in KEYS}
        jobs = {team: [embed(clients[team], items, "books")
                       for items in inputs_for(team, REQUESTS, 1 if team == "team-a" else 3)]
                for team in KEYS}
        done = await asyncio.gather(*(j for team in KEYS for j in jobs[team]))
        return {"team-a": list(done[:REQUESTS]), "team-b": list(done[REQUESTS:])}

    raws = asyncio.run(run())
    merged = [raw for team in KEYS for raw in raws[team] if "x-velox-batch" in raw.headers]
    assert merged, "nothing was batched"
    # Both keys' requests shared calls (the route sends the gateway's own key upstream).
    assert len(calls(fresh)) < 2 * REQUESTS
    used = {team: sum(raw.parse().usage.prompt_tokens for raw in raws[team]) for team in KEYS}
    assert all(used.values())
    total = 2 * REQUESTS
    # The access log: one line per request, batched members included (each written once the
    # answer is: wait on the counter, then read the lines).
    wait_for(lambda: stats(gateway)["requests"]["total"] - before["requests"]["total"] == total,
             timeout=30)
    wait_for(lambda: stats(gateway)["access_log"]["lines"] - before["access_log"]["lines"]
             == total, timeout=30)
    lines = [json.loads(line) for line in gateway.log().splitlines()
             if '"log":"access"' in line][log_before:]
    assert len(lines) == total
    assert all(line["path"] == EMBED and line["status"] == 200 for line in lines)
    for team in KEYS:
        mine = [line for line in lines if line["key"] == team]
        assert len(mine) == REQUESTS
        assert sum(line["usage"]["input"] for line in mine) == used[team]
    # The token books: each key's share under its own name, nothing under no key.
    after = stats(gateway)
    books = {(row["key"], row["route"]): row["input"] for row in after["tokens"]}
    for team in KEYS:
        assert books.get((team, "emb"), 0) - books_before.get((team, "emb"), 0) == used[team]
    assert books.get(("-", "emb"), 0) == books_before.get(("-", "emb"), 0)
