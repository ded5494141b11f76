"""Embeddings batching end to end: real Velox, the bundled mock (HTTP/2 + TLS), the SDK.

One Velox process with ONE worker (batching is per worker; one worker makes every group's
members meet in the same place, so what merges is decided by the rules, not by how the kernel
spread the connections) and a VELOX_CONFIG file with batching routes. Vectors are checked
against the mock's deterministic function of each input (`payloads.embedding_vector`), and
what reached the upstream is read from the mock's request log (`inputs` per call).

Between tenants (a second gateway, two `[[key]]`s, the access log on): clients that send
different `OpenAI-Organization` / `OpenAI-Project` headers are never merged, each member's
share of a merged call's tokens goes into its own key's books, and the access log has exactly
one line per request, batched members included.

To make requests wait in a group, a "blocker" of the same group is sent first and held by the
mock (its behaviour is a long latency while the blocker arrives, normal again once it is
there: a latency header of its own would put it in another group, since forwarded headers are
part of the group): while it is in flight, the group's next requests wait and merge. Each
test uses its own `user` (part of the group) so tests never share a group.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import struct
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import CLIENT_KEY, wait_for, worker_rows
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream
from velox_lab.mock.payloads import EMBEDDING_DIMENSIONS, embedding_vector
from velox_lab.mock.state import fingerprint

T = TypeVar("T")

UP_KEY = "sk-upstream-batching-0123456789"
EMBED = "/v1/embeddings"


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    certdir = str(tmp_path_factory.mktemp("batching-certs"))
    with MockUpstream(tls=True, certdir=certdir, name="emb") as started:
        yield started


@pytest.fixture(scope="module")
def gateway(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("batching")
    common = f'origin = "{mock.origin}"\nca_file = "{mock.ca_file}"\nconnections = 2\n'
    config = tmp / "velox.toml"
    config.write_text(f"""
[[upstream]]
name = "own"
{common}api_key_env = "UP_KEY"

[[upstream]]
name = "pass"
{common}

[[route]]
model = "emb"
targets = [{{ upstream = "own" }}]
batch = {{ max_requests = 32, max_wait_ms = 1000 }}

[[route]]
model = "emb4"
targets = [{{ upstream = "own" }}]
batch = {{ max_requests = 4, max_wait_ms = 5000 }}

[[route]]
model = "emb-short"
targets = [{{ upstream = "own" }}]
batch = {{ max_requests = 32, max_wait_ms = 200 }}

[[route]]
model = "emb3"
targets = [{{ upstream = "own" }}]
batch = {{ max_requests = 3, max_wait_ms = 5000 }}

[[route]]
model = "emb-pass"
targets = [{{ upstream = "pass" }}]
batch = {{ max_requests = 2, max_wait_ms = 5000 }}
""")
    with GatewayProcess(one_worker(config), log_path=tmp / "velox.log") as gw:  # ready
        yield gw


def one_worker(config: Path, access_log: bool = False) -> dict[str, str]:
    """The settings of this module's gateways: one worker, the config file, no rate limit."""
    return {"VELOX_CONFIG": str(config), "UP_KEY": UP_KEY, "VELOX_WORKERS": "1",
            "VELOX_RATE_LIMIT_RPM": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
            "VELOX_ACCESS_LOG": "1" if access_log else "0",
            "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}


def keyed_config(path: Path, mock: MockUpstream, route: str, batch: str,
                 keys: dict[str, str], key_options: str = "") -> Path:
    """A config file: the upstream "own" (the gateway's key), one batching route and one
    `[[key]]` per name (with key_options)."""
    blocks = "".join(f'\n[[key]]\nname = "{name}"\n'
                     f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n{key_options}'
                     for name, key in keys.items())
    path.write_text(f"""
[[upstream]]
name = "own"
origin = "{mock.origin}"
ca_file = "{mock.ca_file}"
api_key_env = "UP_KEY"

[[route]]
model = "{route}"
targets = [{{ upstream = "own" }}]
batch = {batch}
{blocks}""")
    return path


# The SDK clients made inside the running loop: `run` closes them before the loop ends (left
# to the garbage collector, their close would be scheduled on a closed loop).
_open: list[openai.AsyncOpenAI] = []


def client(gw: GatewayProcess, key: str = CLIENT_KEY, options: dict[str, str] | None = None,
           **headers: str) -> openai.AsyncOpenAI:
    """An SDK client; options: the SDK's own (organization, project), which it sends as the
    OpenAI-Organization / OpenAI-Project headers."""
    c = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0,
                           timeout=30, default_headers=headers or None, **(options or {}))
    _open.append(c)
    return c


def arun(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), closing every client made meanwhile inside the loop."""
    async def closing() -> T:
        try:
            return await main
        finally:
            while _open:
                await _open.pop().close()

    return asyncio.run(closing())


def stats(gw: GatewayProcess) -> dict:
    return httpx.get(f"{gw.admin_url}/stats", timeout=10).json()


def batch_stats(gw: GatewayProcess) -> dict:
    return stats(gw)["batches"]["embeddings"]


def calls(mock: MockUpstream) -> list[dict]:
    """The mock's embeddings calls since its last reset, oldest first."""
    return [r for r in mock.requests(1000) if r["path"] == EMBED]


def tokens(text: str) -> int:
    """The mock's usage for one string input (payloads._text_tokens)."""
    return len(text) // 4 + 1


def vector(data: Any) -> list[float]:
    return list(data.embedding)


async def arrived(mock: MockUpstream, count: int) -> None:
    """Until the mock has received `count` embeddings calls since its reset (bounded, 30 s;
    polled without holding up the client tasks)."""
    for _ in range(600):
        if mock.stats()["by_path"].get(EMBED, 0) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the mock did not receive the call in time")


async def blocker(gw: GatewayProcess, mock: MockUpstream, model: str, user: str,
                  latency_ms: int = 3000, key: str = CLIENT_KEY) -> Any:
    """A slow call of the group (model, user): it goes out at once, and while it is in flight
    the group's next requests wait. The mock holds it latency_ms (its behaviour while the
    blocker arrives, normal again once it is there). Returns the task; await it before the
    test ends."""
    calls_before = mock.stats()["by_path"].get(EMBED, 0)
    mock.behave(latency_ms=latency_ms)
    c = client(gw, key)
    task = asyncio.create_task(c.embeddings.create(model=model, input="blocker", user=user,
                                                   encoding_format="float"))
    try:
        await arrived(mock, calls_before + 1)
    finally:
        mock.behave()
    return task


@pytest.fixture
def fresh(mock: MockUpstream, gateway: GatewayProcess) -> MockUpstream:
    mock.behave()
    mock.reset()
    return mock


# --- the acceptance load ---------------------------------------------------------------------


def test_256_concurrent_single_inputs_take_a_tenth_of_the_calls(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    texts = [f"input number {i} " + "x" * (i % 37) for i in range(256)]
    before = batch_stats(gateway)

    async def run() -> list[Any]:
        # Every call takes 300 ms upstream, so while one is in flight the others gather.
        c = client(gateway, **{"x-mock-latency-ms": "300"})
        jobs = [c.embeddings.create(model="emb", input=t, encoding_format="float",
                                    user="load") for t in texts]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

    answers = arun(run())
    seen = calls(fresh)
    assert sum(r["inputs"] for r in seen) == 256 and all(r["status"] == 200 for r in seen)
    assert len(seen) <= 256 // 10, [r["inputs"] for r in seen]
    for text, answer in zip(texts, answers, strict=True):
        assert len(answer.data) == 1 and answer.data[0].index == 0
        assert vector(answer.data[0]) == embedding_vector(text, EMBEDDING_DIMENSIONS)
        assert answer.model == "emb"
    # The mock's usage is additive per input, so the upstream's totals over every call are
    # the sum of the per-input counts; the members' shares must add up to exactly that.
    upstream_total = sum(tokens(t) for t in texts)
    assert sum(a.usage.prompt_tokens for a in answers) == upstream_total
    assert sum(a.usage.total_tokens for a in answers) == upstream_total
    after = batch_stats(gateway)
    assert after["total_batches"] - before["total_batches"] == len(seen)
    assert after["requests"] - before["requests"] == 256
    assert after["avg_batch_size"] > before["avg_batch_size"]
    assert after["split_retries"] == before["split_retries"]
    assert after["total_batches"] == after["immediate_batches"] + after["full_batches"] + \
        after["timeout_batches"]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(
                   httpx.get(f"{gateway.admin_url}/metrics", timeout=10).text)
               for s in family.samples}
    assert samples[("velox_embeddings_batch_calls_total", ())] == after["total_batches"]
    assert samples[("velox_embeddings_batch_requests_total", ())] == after["requests"]
    assert samples[("velox_embeddings_batch_left_total", (("reason", "full"),))] == \
        after["full_batches"]


def test_multi_input_members_keep_their_order_and_get_their_share(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    inputs = [["alpha", "b", "gamma gamma gamma"], ["one"], ["d" * 40, "e", "f" * 9, "g", "h"],
              ["last one"]]

    async def run() -> tuple[Any, list[Any]]:
        first = await blocker(gateway, fresh, "emb4", "order")
        c = client(gateway)
        raws = await asyncio.gather(*[c.embeddings.with_raw_response.create(
            model="emb4", input=items, user="order", encoding_format="float")
            for items in inputs])
        return await first, raws

    _, raws = arun(run())
    seen = calls(fresh)
    assert [r["inputs"] for r in seen] == [1, sum(map(len, inputs))]  # blocker, then ONE call
    shares = []
    for items, raw in zip(inputs, raws, strict=True):
        assert raw.headers["x-velox-batch"] == "4"
        answer = raw.parse()
        assert [d.index for d in answer.data] == list(range(len(items)))
        assert [vector(d) for d in answer.data] == [
            embedding_vector(t, EMBEDDING_DIMENSIONS) for t in items]
        shares.append(answer.usage.prompt_tokens)
    assert sum(shares) == sum(tokens(t) for items in inputs for t in items)
    # In proportion to the input size (characters): the 3rd member's is the largest share.
    assert max(shares) == shares[2]


def test_one_bad_input_fails_only_its_own_request(gateway: GatewayProcess,
                                                  fresh: MockUpstream) -> None:
    texts = ["fine one", "", "fine two", "fine three"]  # "" is refused by OpenAI (and the mock)
    before = batch_stats(gateway)

    async def run() -> tuple[Any, list[Any]]:
        first = await blocker(gateway, fresh, "emb4", "bad")
        c = client(gateway)
        results = await asyncio.gather(*[c.embeddings.create(
            model="emb4", input=t, user="bad", encoding_format="float") for t in texts],
            return_exceptions=True)
        return await first, results

    _, results = arun(run())
    for text, result in zip(texts, results, strict=True):
        if text:
            assert vector(result.data[0]) == embedding_vector(text, EMBEDDING_DIMENSIONS)
        else:
            assert isinstance(result, openai.BadRequestError), result
            assert result.status_code == 400 and result.body["param"] == "input"
    seen = calls(fresh)
    # The blocker; the merged call of 4, refused as a whole; each member again alone.
    assert [(r["inputs"], r["status"]) for r in seen[:2]] == [(1, 200), (4, 400)]
    assert sorted((r["inputs"], r["status"]) for r in seen[2:]) == [(1, 200)] * 3 + [(1, 400)]
    assert batch_stats(gateway)["split_retries"] - before["split_retries"] == 4


def test_any_other_failure_reaches_every_member_as_it_would_alone(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    """A 401 of the merged call (not retried, not a 400): every member gets the upstream's
    401 and body, as it would have alone; nothing is sent again."""
    before = batch_stats(gateway)

    async def run() -> tuple[Any, list[Any]]:
        first = await blocker(gateway, fresh, "emb4", "denied")
        fresh.behave(status=401)  # for the merged call (the blocker is upstream already)
        c = client(gateway)
        results = await asyncio.gather(*[c.embeddings.create(
            model="emb4", input=f"denied {i}", user="denied", encoding_format="float")
            for i in range(4)], return_exceptions=True)
        return await first, results

    _, results = arun(run())
    assert all(isinstance(r, openai.AuthenticationError) for r in results), results
    assert {r.body["code"] for r in results} == {"invalid_api_key"}  # the upstream's body
    seen = calls(fresh)
    # The blocker, then ONE call for the four (the mock answers x-mock-status before it
    # reads the body, so its log counts no inputs for it).
    assert [r["status"] for r in seen] == [200, 401]
    assert batch_stats(gateway)["split_retries"] == before["split_retries"]


def test_a_lone_request_leaves_at_once(gateway: GatewayProcess, fresh: MockUpstream) -> None:
    """max_wait_ms is 5 s on this route: a lone request that waited for it would leave on the
    timer. It must leave at once, alone, its body unchanged."""
    before = batch_stats(gateway)
    c = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0,
                      timeout=30)
    closed_after_the_test(c)
    raw = c.embeddings.with_raw_response.create(model="emb4", input="all alone", user="lone",
                                                encoding_format="float")
    answer = raw.parse()
    assert vector(answer.data[0]) == embedding_vector("all alone", EMBEDDING_DIMENSIONS)
    assert "x-velox-batch" not in raw.headers  # its own call, not a merged one
    seen = calls(fresh)
    assert [r["inputs"] for r in seen] == [1]
    after = batch_stats(gateway)
    assert after["immediate_batches"] - before["immediate_batches"] == 1
    assert after["timeout_batches"] == before["timeout_batches"]
    assert after["full_batches"] == before["full_batches"]


def test_different_parameters_and_callers_are_never_merged(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    variants: list[dict[str, Any]] = [
        {"encoding_format": "float"}, {"encoding_format": "base64"},
        {"encoding_format": "float", "dimensions": 4},
        {"encoding_format": "float", "user": "other-user"},
    ]

    async def run() -> list[Any]:
        c = client(gateway, **{"x-mock-latency-ms": "800"})
        jobs = []
        for i, variant in enumerate(variants):  # two of each, all at once
            params = {"user": "params", **variant}
            jobs += [c.embeddings.with_raw_response.create(model="emb-short",
                                                           input=f"v{i}-{j}", **params)
                     for j in range(2)]
        return await asyncio.gather(*jobs)

    raws = arun(run())
    # Members of one call share its upstream x-request-id: requests with different
    # parameters must never share one (two of the same kind may).
    by_call: dict[str, set[int]] = {}
    for n, raw in enumerate(raws):
        by_call.setdefault(raw.headers["x-request-id"], set()).add(n // 2)
    assert all(len(kinds) == 1 for kinds in by_call.values()), by_call
    seen = calls(fresh)
    assert len(seen) == len(by_call) and sum(r["inputs"] for r in seen) == 8
    for n, raw in enumerate(raws):
        params = variants[n // 2]
        got: Any = raw.parse().data[0].embedding
        dims = params.get("dimensions", EMBEDDING_DIMENSIONS)
        if params["encoding_format"] == "base64":  # asked for explicitly: the SDK keeps it
            got = list(struct.unpack(f"<{dims}f", base64.b64decode(got)))
        assert len(got) == dims
        assert got == pytest.approx(embedding_vector(f"v{n // 2}-{n % 2}", dims), abs=1e-6)


def test_passthrough_credentials_merge_only_the_same_caller(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    """emb-pass's upstream has no key of its own: the client's goes upstream, so only the
    same caller's requests may share a call. emb3 (the gateway's key) merges any callers.
    Both routes leave a batch when it is full (2 and 3 members), so what merges does not
    depend on how fast the requests arrive."""
    keys = ("sk-caller-a", "sk-caller-b")

    async def run() -> list[Any]:
        # 5 s: both pairs must arrive while their caller's blocker is in flight, even on a
        # host so loaded that starting four clients takes seconds.
        blockers = [await blocker(gateway, fresh, "emb-pass", "pass", key=key, latency_ms=5000)
                    for key in keys]
        jobs = [client(gateway, key).embeddings.with_raw_response.create(
            model="emb-pass", input=f"{key}-{i}", user="pass", encoding_format="float")
            for i in range(2) for key in keys]
        return list(await asyncio.gather(*jobs, *blockers))[:4]

    raws = arun(run())
    # Members of one call share its upstream x-request-id: never two callers in one call.
    callers: dict[str, set[str]] = {}
    for n, raw in enumerate(raws):
        key = keys[n % 2]
        callers.setdefault(raw.headers["x-request-id"], set()).add(key)
        assert vector(raw.parse().data[0]) == embedding_vector(f"{key}-{n // 2}",
                                                               EMBEDDING_DIMENSIONS)
    assert all(len(c) == 1 for c in callers.values()), callers
    by_key: dict[str, list[int]] = {}
    for r in calls(fresh):
        by_key.setdefault(r["auth"]["key_sha256"], []).append(r["inputs"])
    assert set(by_key) == {fingerprint(k) for k in keys}  # each caller's own key went upstream
    assert sorted(by_key.values()) == [[1, 2], [1, 2]]  # a blocker, then the caller's pair

    fresh.reset()

    async def shared() -> list[Any]:
        first = await blocker(gateway, fresh, "emb3", "shared")
        jobs = [client(gateway, key).embeddings.create(
            model="emb3", input=key, user="shared", encoding_format="float")
            for key in ("sk-caller-a", "sk-caller-b", "sk-caller-c")]
        return await asyncio.gather(*jobs, first)

    answers = arun(shared())
    assert [r["inputs"] for r in calls(fresh)] == [1, 3]  # different callers, one call
    for key, answer in zip(("sk-caller-a", "sk-caller-b", "sk-caller-c"), answers, strict=False):
        assert vector(answer.data[0]) == embedding_vector(key, EMBEDDING_DIMENSIONS)


def _raw_embeddings_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\nauthorization: Bearer " + CLIENT_KEY.encode()
                 + b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_a_member_that_disconnects_does_not_break_the_others(
        gateway: GatewayProcess, fresh: MockUpstream) -> None:
    port = int(gateway.base_url.rsplit(":", 1)[1])
    body = {"model": "emb4", "input": "leaver", "user": "leave", "encoding_format": "float"}

    async def run() -> list[Any]:
        first = await blocker(gateway, fresh, "emb4", "leave", latency_ms=1000)
        # The merged call takes 1 s (the mock's behaviour from now on); one member's client
        # closes its connection while the call is in flight.
        fresh.behave(latency_ms=1000)
        c = client(gateway)
        jobs = [asyncio.create_task(c.embeddings.create(
            model="emb4", input=f"stays {i}", user="leave", encoding_format="float"))
            for i in range(2)]
        await asyncio.sleep(0.2)
        leaver = _raw_embeddings_request(port, body)
        jobs.append(asyncio.create_task(c.embeddings.create(
            model="emb4", input="stays 2", user="leave", encoding_format="float")))
        await asyncio.sleep(0.4)  # the batch (full at 4) is in flight now
        leaver.close()
        results = await asyncio.gather(*jobs)
        await first
        return results

    results = arun(run())
    for i, answer in enumerate(results):
        assert vector(answer.data[0]) == embedding_vector(f"stays {i}", EMBEDDING_DIMENSIONS)
    seen = calls(fresh)
    assert [r["inputs"] for r in seen] == [1, 4]
    assert not seen[1]["cancelled"]  # the others needed it: never cancelled
    # Every request ended exactly once: nothing is left in flight in the worker.
    assert wait_for(lambda: stats(gateway)["upstream"]["in_flight"] == 0, timeout=5)


PAR_KEY = "vx-par-batching-0123456789"


def _keyed_embeddings_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\nauthorization: Bearer " + PAR_KEY.encode()
                 + b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_a_keyed_member_leaving_while_it_waits_and_while_its_batch_is_in_flight(
        mock: MockUpstream, tmp_path: Any) -> None:
    """A `[[key]]` client with max_parallel leaves (1) while its request waits in a group and
    (2) while the merged call carrying it is upstream: each time the key's place comes back
    at once, the member is neither sent nor answered, every other member is answered once, and
    the worker's in-flight count ends at 0 (an end counted twice would take it below)."""
    mock.behave()
    mock.reset()
    config = keyed_config(tmp_path / "velox.toml", mock, "emb-key",
                          "{ max_requests = 8, max_wait_ms = 5000 }", {"par": PAR_KEY},
                          "max_parallel = 4\n")
    env = one_worker(config)

    def active(gw: GatewayProcess) -> int:
        (row,) = [k for k in stats(gw)["keys"] if k["name"] == "par"]
        return row["active"]  # type: ignore[no-any-return]

    def embed(c: openai.AsyncOpenAI, text: str) -> Any:
        return asyncio.create_task(c.embeddings.create(model="emb-key", input=text, user="k",
                                                       encoding_format="float"))

    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw:
        port = int(gw.base_url.rsplit(":", 1)[1])
        leaver = {"model": "emb-key", "input": "leaver", "user": "k", "encoding_format": "float"}

        async def until(predicate: Any) -> None:
            """Poll (bounded, 10 s) without holding up the client tasks."""
            for _ in range(200):
                if predicate():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("condition not met in time")

        async def run() -> list[Any]:
            c = client(gw, PAR_KEY)
            # (1) While waiting: a call of the group is in flight, the leaver waits behind it.
            first = await blocker(gw, mock, "emb-key", "k", latency_ms=2000, key=PAR_KEY)
            sock = _keyed_embeddings_request(port, leaver)
            await until(lambda: active(gw) == 2)
            sock.close()
            await until(lambda: active(gw) == 1)  # back before its group leaves
            stayer = embed(c, "stays 0")  # waits in the group, leaves when the blocker ends
            answers = [await first, await stayer]
            # (2) While in flight: the next blocker, then two members and a leaver merged into
            # one call (1500 ms upstream: the mock's behaviour once the blocker is there).
            batches = batch_stats(gw)["total_batches"]
            second = await blocker(gw, mock, "emb-key", "k", latency_ms=2500, key=PAR_KEY)
            mock.behave(latency_ms=1500)
            jobs = [embed(c, "stays 1"), embed(c, "stays 2")]
            sock = _keyed_embeddings_request(port, {**leaver, "input": "leaver 2"})
            await until(lambda: active(gw) == 4)  # all three wait behind the blocker
            answers.append(await second)
            await until(lambda: batch_stats(gw)["total_batches"] == batches + 2)  # merged, sent
            sock.close()
            await until(lambda: active(gw) == 2)  # the merged call is still upstream
            answers += await asyncio.gather(*jobs)
            await c.close()
            return answers

        before = stats(gw)["requests"]["total"]
        answers = arun(run())
        texts = ["blocker", "stays 0", "blocker", "stays 1", "stays 2"]
        for text, answer in zip(texts, answers, strict=True):
            assert vector(answer.data[0]) == embedding_vector(text, EMBEDDING_DIMENSIONS)
        seen = calls(mock)
        # The first leaver never reached the upstream; the second went in the merged call
        # (which the others needed: not cancelled).
        assert [r["inputs"] for r in seen] == [1, 1, 1, 3] and not seen[3]["cancelled"]
        assert active(gw) == 0
        # Each once, the two leavers too (their access-log lines say 499): every request ends
        # exactly once, whichever way.
        assert stats(gw)["requests"]["total"] == before + 7
        assert wait_for(lambda: worker_rows(gw)[0]["state"]["in_flight"] == 0, timeout=5)

# --- between tenants ------------------------------------------------------------------------

TEAMS = {"team-a": "vx-team-a-0123456789abcdef", "team-b": "vx-team-b-0123456789abcdef"}
# Each request of a test has one input for one tenant and SPREAD inputs for the other, fewer
# requests than SPREAD: whatever crossed over, the inputs each tenant's calls carried could
# not add up to its own (k one-input members = SPREAD x j members is impossible for k < SPREAD).
REQUESTS = 24
SPREAD = 30


@pytest.fixture(scope="module")
def tenants(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[GatewayProcess]:
    """A gateway whose one batching route `emb-t` serves two keys, with the access log on."""
    tmp = tmp_path_factory.mktemp("tenants")
    config = keyed_config(tmp / "velox.toml", mock, "emb-t",
                          "{ max_requests = 64, max_wait_ms = 200 }", TEAMS)
    with GatewayProcess(one_worker(config, access_log=True), log_path=tmp / "velox.log") as gw:
        yield gw


@pytest.fixture
def busy(fresh: MockUpstream) -> MockUpstream:
    fresh.behave(latency_ms=300)  # requests arriving while a call is upstream wait and merge
    return fresh


def embed_t(c: openai.AsyncOpenAI, inputs: list[str], user: str) -> Any:
    return c.embeddings.with_raw_response.create(model="emb-t", input=inputs, user=user,
                                                 encoding_format="float")


def header(call: dict[str, Any], name: str) -> str | None:
    return next((v for n, v in call["headers"] if n == name), None)


def test_members_with_different_organization_or_project_are_never_merged(
        tenants: GatewayProcess, busy: MockUpstream) -> None:
    """One key, two organizations (then two projects of one organization): the members of
    each upstream call all sent the header that call carries."""
    for option, name, values in (
            ("organization", "openai-organization", ("org-alpha", "org-beta")),
            ("project", "openai-project", ("proj-alpha", "proj-beta"))):
        busy.reset()
        sizes = {values[0]: 1, values[1]: SPREAD}

        async def run() -> list[Any]:
            clients = {v: client(tenants, TEAMS["team-a"], {option: v}) for v in values}
            jobs = [embed_t(clients[v], [f"{v} {i} item {j}" for j in range(sizes[v])], "orgs")
                    for i in range(REQUESTS) for v in values]
            return await asyncio.gather(*jobs)

        raws = arun(run())
        assert all(len(raw.parse().data) in (1, SPREAD) for raw in raws)
        carried: dict[str | None, int] = {}
        for call in calls(busy):
            assert call["status"] == 200
            value = header(call, name)
            carried[value] = carried.get(value, 0) + call["inputs"]
        # Each value's calls carried exactly that tenant's inputs: nothing crossed over.
        assert carried == {values[0]: REQUESTS, values[1]: REQUESTS * SPREAD}, carried
        # ... and they were batched: fewer calls than requests for each.
        per_value = [header(c, name) for c in calls(busy)]
        assert all(per_value.count(v) < REQUESTS for v in values), per_value


def test_each_member_books_its_own_tokens_and_has_its_own_access_log_line(
        tenants: GatewayProcess, busy: MockUpstream) -> None:
    before = stats(tenants)
    books_before = {(row["key"], row["route"]): row["input"] for row in before["tokens"]}
    log_before = tenants.log().count('"log":"access"')

    async def run() -> dict[str, list[Any]]:
        clients = {team: client(tenants, key) for team, key in TEAMS.items()}
        jobs = {team: [embed_t(clients[team], [f"{team} {i} item {j}" for j in range(size)],
                               "books") for i in range(REQUESTS)]
                for team, size in (("team-a", 1), ("team-b", 3))}
        done = await asyncio.gather(*(j for team in TEAMS for j in jobs[team]))
        return {"team-a": list(done[:REQUESTS]), "team-b": list(done[REQUESTS:])}

    raws = arun(run())
    merged = [raw for team in TEAMS for raw in raws[team] if "x-velox-batch" in raw.headers]
    assert merged, "nothing was batched"
    # Both keys' requests shared calls (the route sends the gateway's own key upstream).
    assert len(calls(busy)) < 2 * REQUESTS
    used = {team: sum(raw.parse().usage.prompt_tokens for raw in raws[team]) for team in TEAMS}
    assert all(used.values())
    total = 2 * REQUESTS
    # The access log: one line per request, batched members included (each written once the
    # answer is: wait on the counter, then read the lines).
    wait_for(lambda: stats(tenants)["requests"]["total"] - before["requests"]["total"] == total,
             timeout=30)
    wait_for(lambda: stats(tenants)["access_log"]["lines"] - before["access_log"]["lines"]
             == total, timeout=30)
    lines = [json.loads(line) for line in tenants.log().splitlines()
             if '"log":"access"' in line][log_before:]
    assert len(lines) == total
    assert all(line["path"] == EMBED and line["status"] == 200 for line in lines)
    for team in TEAMS:
        mine = [line for line in lines if line["key"] == team]
        assert len(mine) == REQUESTS
        assert sum(line["usage"]["input"] for line in mine) == used[team]
    # The token books: each key's share under its own name, nothing under no key.
    after = stats(tenants)
    books = {(row["key"], row["route"]): row["input"] for row in after["tokens"]}
    for team in TEAMS:
        assert books.get((team, "emb-t"), 0) - books_before.get((team, "emb-t"), 0) == used[team]
    assert books.get(("-", "emb-t"), 0) == books_before.get(("-", "emb-t"), 0)
