"""Several upstreams behind one gateway: weights, least busy, priorities, rewriting, Azure,
failover, breakers, the retry budget, fallbacks, the commit point and consistent hashing.

Real processes throughout: three (or four) instances of the bundled mock over HTTP/2 + TLS, one
Velox with two workers and a VELOX_CONFIG file, the official SDK or httpx as the client. Each
mock is told how to misbehave at run time (`MockUpstream.behave`), or killed with SIGKILL and
started again on its port.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import CLIENT_KEY, client_for, wait_for
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

KEYS = {"KEY_A": "sk-a-0123456789", "KEY_B": "sk-b-0123456789", "KEY_C": "sk-c-0123456789",
        "KEY_AZ": "az-0123456789"}
NAMES = ("a", "b", "c")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def certdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("routing-certs"))


def start_mock(name: str, certdir: str, port: int = 0, **kw: object) -> MockUpstream:
    extra = ["--port", str(port)] if port else []
    return MockUpstream(tls=True, certdir=certdir, name=name, extra_args=extra,
                        **kw).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mocks(certdir: str) -> Iterator[dict[str, MockUpstream]]:
    started = {name: start_mock(name, certdir) for name in NAMES}
    try:
        yield started
    finally:
        for mock in started.values():
            mock.stop()


@pytest.fixture
def fresh(mocks: dict[str, MockUpstream]) -> dict[str, MockUpstream]:
    """The module's mocks, alive, behaving normally, with their counters reset."""
    for name, mock in list(mocks.items()):
        if mock._proc is None or mock._proc.poll() is not None:  # killed by an earlier test
            mocks[name] = start_mock(name, str(Path(mock.ca_file).parent), port=mock.port)
    for mock in mocks.values():
        mock.behave()
        mock.reset()
    return mocks


def upstream_table(name: str, mock: MockUpstream, **extra: object) -> str:
    lines = [
        "[[upstream]]", f'name = "{name}"', f'origin = "{mock.origin}"',
        f'api_key_env = "KEY_{name.upper()}"', f'ca_file = "{mock.ca_file}"',
        "connections = 1",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "velox.toml"
    path.write_text(text)
    return path


def start(tmp_path: Path, config: Path, **env: str) -> GatewayProcess:
    base = {
        "VELOX_CONFIG": str(config),
        "VELOX_WORKERS": "2",
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_ACCESS_LOG": "0",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        **KEYS,
    }
    base.update(env)
    gw = GatewayProcess(base, log_path=tmp_path / "velox.log")
    return gw.start(wait_ready=True)


@pytest.fixture
def gateways() -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    yield started
    for gw in started:
        gw.stop()


async def _fire(base_url: str, total: int, concurrency: int, body: dict | None = None,
                headers: dict | None = None, deadline_s: float = 180.0,
                out: list[httpx.Response] | None = None) -> list[httpx.Response]:
    """`total` chat calls over `concurrency` connections; bounded in count and time. The
    responses are appended to `out` (if given) as they come, for a caller watching progress.

    Each connection is its own one-connection client: httpcore's pool scans every connection
    it holds on each request, which made the client, not Velox, the bottleneck: 400 calls
    over 32 connections took 14 s on a busy 2-core box with one shared client, 0.9 s so."""
    out = [] if out is None else out
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    ssl_context = httpx.create_ssl_context()  # made once: loading the CA store takes 0.2 s
    stop_at = time.monotonic() + deadline_s
    queue = list(range(total))

    async def one_worker() -> None:
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30,
                                     verify=ssl_context, headers={
                                         "authorization": f"Bearer {CLIENT_KEY}"}) as client:
            while queue and time.monotonic() < stop_at:
                queue.pop()
                out.append(await client.post("/v1/chat/completions", json=body or CHAT,
                                              headers=headers))

    await asyncio.gather(*(one_worker() for _ in range(concurrency)))
    return out


def fire(gw: GatewayProcess, total: int, concurrency: int = 32, **kw: object
         ) -> list[httpx.Response]:
    return asyncio.run(_fire(gw.base_url, total, concurrency, **kw))  # type: ignore[arg-type]


def chat_calls(mock: MockUpstream) -> int:
    """Chat calls the mock received (warm-ups and probes are GET /v1/models)."""
    return mock.stats()["by_path"].get("/v1/chat/completions", 0)


def shares(responses: list[httpx.Response]) -> Counter[str]:
    return Counter(r.headers.get("x-velox-upstream", "?") for r in responses)


def admin_stats(gw: GatewayProcess) -> dict:
    return httpx.get(f"{gw.admin_url}/stats", timeout=10).json()


def upstream_stats(gw: GatewayProcess, name: str) -> dict:
    return next(u for u in admin_stats(gw)["upstreams"] if u["name"] == name)


# --- spreading ---------------------------------------------------------------------------


def test_weights_three_to_one_split_75_25(tmp_path: Path, fresh: dict, gateways: list) -> None:
    config = write_config(tmp_path, upstream_table("a", fresh["a"]) + upstream_table(
        "b", fresh["b"]) + """
[[route]]
model = "m"
targets = [{ upstream = "a", weight = 3 }, { upstream = "b", weight = 1 }]
""")
    gw = start(tmp_path, config)
    gateways.append(gw)
    # Smooth weighted round-robin is deterministic per worker (a, a, b, a, ...): each worker is
    # within one request of 3:1 at any count, so 1,000 requests pin the split to +-0.2%, well
    # inside the 3% asked; more requests would prove nothing more.
    total = 1000
    responses = fire(gw, total, concurrency=32)
    assert len(responses) == total
    assert all(r.status_code == 200 for r in responses)
    assert all(r.headers["x-velox-attempts"] == "1" for r in responses)
    seen = shares(responses)
    assert abs(seen["a"] / total - 0.75) <= 0.03, seen
    # The mocks agree with the header: each counted exactly the calls it answered.
    assert chat_calls(fresh["a"]) == seen["a"]
    assert chat_calls(fresh["b"]) == seen["b"]


def test_least_busy_sends_less_to_a_slow_upstream(tmp_path: Path, fresh: dict,
                                                  gateways: list) -> None:
    config = write_config(tmp_path, upstream_table("a", fresh["a"]) + upstream_table(
        "b", fresh["b"]) + """
[[route]]
model = "m"
strategy = "least_busy"
targets = [{ upstream = "a" }, { upstream = "b" }]
""")
    gw = start(tmp_path, config)
    gateways.append(gw)
    # b slower by a second: at 100 ms, a host at a load average of 25 made the mock a about
    # as slow as b (181 of 600 went to b).
    fresh["b"].behave(latency_ms=1000)
    responses = fire(gw, 600, concurrency=32)
    assert all(r.status_code == 200 for r in responses)
    seen = shares(responses)
    assert seen["b"] < 0.3 * len(responses), seen


def test_priorities_and_model_rewrite(tmp_path: Path, fresh: dict, gateways: list) -> None:
    config = write_config(tmp_path, upstream_table("a", fresh["a"]) + upstream_table(
        "b", fresh["b"]) + """
[[route]]
model = "m"
targets = [{ upstream = "a", model = "m-on-a" }, { upstream = "b", priority = 1 }]
""")
    gw = start(tmp_path, config)
    gateways.append(gw)
    responses = fire(gw, 200, concurrency=8)
    assert shares(responses) == Counter({"a": 200})
    received = fresh["a"].requests(limit=5)
    assert {r["model"] for r in received} == {"m-on-a"}  # rewritten for the upstream
    fresh["a"].behave(status=503)
    responses = fire(gw, 200, concurrency=8)
    assert all(r.status_code == 200 for r in responses), Counter(r.status_code
                                                                  for r in responses)
    assert shares(responses)["b"] == 200
    assert {r["model"] for r in fresh["b"].requests(limit=5)} == {"m"}  # b keeps the name


def test_azure_upstream_gets_deployment_path_version_and_api_key(
        tmp_path: Path, certdir: str, gateways: list) -> None:
    with MockUpstream(tls=True, certdir=certdir, name="az") as az:
        config = write_config(tmp_path, f"""
[[upstream]]
name = "az"
kind = "azure"
origin = "{az.origin}"
api_key_env = "KEY_AZ"
api_version = "2024-10-21"
ca_file = "{az.ca_file}"
connections = 1

[[route]]
model = "gpt-4o"
targets = [{{ upstream = "az", model = "prod-4o" }}]
""")
        gw = start(tmp_path, config)
        gateways.append(gw)
        client = client_for(gw)
        reply = client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert reply.headers["x-velox-upstream"] == "az"
        assert reply.parse().choices[0].message.content
        seen = [r for r in az.requests(limit=10) if r["method"] == "POST"][-1]
        assert seen["path"].startswith("/openai/deployments/prod-4o/chat/completions?")
        assert "api-version=2024-10-21" in seen["query"]
        assert seen["auth"]["kind"] == "api-key"
        stream = client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_models_lists_the_routes(tmp_path: Path, fresh: dict, gateways: list) -> None:
    config = write_config(tmp_path, upstream_table("a", fresh["a"]) + """
[[route]]
model = "alpha"
targets = [{ upstream = "a" }]

[[route]]
model = "beta"
targets = [{ upstream = "a", model = "b-internal" }]
""")
    gw = start(tmp_path, config)
    gateways.append(gw)
    models = client_for(gw).models.list()
    assert sorted(m.id for m in models.data) == ["alpha", "beta"]
    assert fresh["a"].stats()["by_path"].get("/v1/models", 0) <= 2  # warm-ups only
    with pytest.raises(openai.NotFoundError):
        client_for(gw).chat.completions.create(model="gamma", messages=[])


# --- failover ----------------------------------------------------------------------------


def three_up(fresh: dict, **route: str) -> str:
    text = "".join(upstream_table(n, fresh[n]) for n in NAMES)
    extra = "".join(f"{k} = {v}\n" for k, v in route.items())
    return text + f"""
[[route]]
model = "m"
targets = [{{ upstream = "a" }}, {{ upstream = "b" }}, {{ upstream = "c" }}]
{extra}
[breaker]
failures = 3
open_s = 2
max_open_s = 4
probe_interval_s = 1
"""


def test_sigkill_one_of_three_under_load(tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, three_up(fresh)))
    gateways.append(gw)
    victim = fresh["c"]

    async def scenario() -> list[httpx.Response]:
        # The kill comes a quarter of the way through 1,200 calls, however fast the host: 64
        # calls in flight (some on c) when it dies, 900 more after it, well past the breaker's
        # opening (3 failures).
        done: list[httpx.Response] = []
        load = asyncio.create_task(_fire(gw.base_url, 1200, concurrency=64, deadline_s=180,
                                         out=done))
        deadline = time.monotonic() + 60
        while len(done) < 300 and not load.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        assert 300 <= len(done) < 900, len(done)  # on, with hundreds of calls still to come
        return await load

    responses = asyncio.run(scenario())
    codes = Counter(r.status_code for r in responses)
    assert codes == Counter({200: len(responses)}), codes
    state = wait_for(lambda: upstream_stats(gw, "c")["state"] in ("open", "half_open"))
    assert state
    # While it is open nothing but probes goes its way (and it is dead: nothing reaches it).
    after = fire(gw, 300, concurrency=16)
    assert all(r.status_code == 200 for r in after)
    assert "c" not in shares(after)
    # Back on its port: in service again within max_open_s plus a probe interval (and slack;
    # each failed probe while it was dead doubled the open time, capped at 4 s, so how long the
    # load above took on a busy host does not matter).
    fresh["c"] = start_mock("c", str(Path(victim.ca_file).parent), port=victim.port)
    wait_for(lambda: upstream_stats(gw, "c")["state"] == "closed", timeout=45)
    assert shares(fire(gw, 300, concurrency=16))["c"] > 0
    # Every breaker transition is logged once for the whole gateway (two workers), by the
    # worker that made it: opened once, as many half-open lines as openings (each ended in
    # one), closed once; nothing about a and b. A worker logs on its next tick, so the last
    # lines may lag the state a little.
    kinds = wait_for(lambda: (k := breaker_lines(gw, "c"))["closed"] == 1
                     and k["half-open"] == k["opened"] + k["opened again"] and k, timeout=10)
    assert kinds["opened"] == 1, kinds
    assert not breaker_lines(gw, "a") and not breaker_lines(gw, "b")
    opened = next(line for line in gw.log().splitlines()
                  if "upstream 'c': circuit breaker opened after" in line)
    assert "WARNING" in opened and "route 'm'" in opened and "(the last: " in opened, opened


def breaker_lines(gw: GatewayProcess, name: str) -> Counter[str]:
    """The gateway's log lines about upstream `name`'s breaker, by transition."""
    kinds: Counter[str] = Counter()
    for line in gw.log().splitlines():
        _, found, rest = line.partition(f"upstream {name!r}: circuit breaker ")
        if found:
            kinds["opened again" if rest.startswith("opened again") else rest.split()[0]
                  .rstrip(":;")] += 1
    return kinds


async def _fire_mixed(base_url: str, total: int, concurrency: int,
                      out: list[tuple[bool, int, str, str, bool]]) -> None:
    """`total` chat calls over `concurrency` one-connection clients, every other one streamed;
    each outcome goes to `out` as it ends: (streamed, status, x-velox-upstream,
    x-velox-attempts, complete). Plain answers come in slow pieces (the mock's slow-body
    fault) and streams' heads after 30 ms, so an upstream killed under this load holds both
    kinds where a retry can still happen: plain answers between their head and their end,
    streams before their head. A cut connection is an outcome (incomplete), not an error."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    queue = list(range(total))
    slow_body = {"x-mock-fault": "slow-body", "x-mock-chunk-delay-ms": "10"}
    late_head = {"x-mock-latency-ms": "30"}

    async def one_worker() -> None:
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30, headers={
                "authorization": f"Bearer {CLIENT_KEY}"}) as client:
            while queue:
                streamed = queue.pop() % 2 == 1
                status, upstream, attempts, complete = 0, "", "", False
                try:
                    async with client.stream(
                            "POST", "/v1/chat/completions",
                            json={**CHAT, "stream": True} if streamed else CHAT,
                            headers=late_head if streamed else slow_body) as r:
                        status = r.status_code
                        upstream = r.headers.get("x-velox-upstream", "")
                        attempts = r.headers.get("x-velox-attempts", "")
                        text = (await r.aread()).decode()
                    complete = ("data: [DONE]" in text if streamed
                                else bool(json.loads(text).get("choices")))
                except (httpx.TransportError, ValueError):
                    pass
                out.append((streamed, status, upstream, attempts, complete))

    await asyncio.gather(*(one_worker() for _ in range(concurrency)))


def test_sigkill_mid_answer_every_request_not_yet_committed_goes_elsewhere(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # Requests in flight on a killed upstream are sent again as long as nothing of their
    # answer reached the client: plain answers whose headers had come but not their whole
    # body (they used to get 502 "the upstream connection was lost") and streams before
    # their head. Streams c had begun to relay can only end with an error event.
    gw = start(tmp_path, write_config(tmp_path, three_up(fresh)))
    gateways.append(gw)
    victim = fresh["c"]

    async def scenario() -> list[tuple[bool, int, str, str, bool]]:
        done: list[tuple[bool, int, str, str, bool]] = []
        # 1,000 calls, c killed after 250: 64 are in flight then, of both kinds, and 750 are
        # still to go (the other upstreams serve them; more of them would prove nothing new).
        load = asyncio.create_task(_fire_mixed(gw.base_url, 1000, 64, done))
        deadline = time.monotonic() + 60
        while len(done) < 250 and not load.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        assert 250 <= len(done) < 750, len(done)  # mid-load: 64 calls in flight
        await asyncio.wait_for(load, 180)
        return done

    outcomes = asyncio.run(scenario())
    assert len(outcomes) == 1000
    assert Counter(o[1] for o in outcomes) == Counter({200: 1000})
    plain = [o for o in outcomes if not o[0]]
    streams = [o for o in outcomes if o[0]]
    assert all(o[4] for o in plain), [o for o in plain if not o[4]]
    cut = [o for o in streams if not o[4]]
    assert all(o[2] == "c" for o in cut) and len(cut) <= 64, cut
    # The kill did catch both kinds in flight on c: they were answered by another upstream.
    assert any(o[3] != "1" and o[2] != "c" for o in plain)
    assert any(o[3] != "1" and o[2] != "c" for o in streams)


@pytest.mark.parametrize("how", ["503", "429", "timeout"])
def test_a_failing_upstream_shifts_traffic_to_the_others(
        how: str, tmp_path: Path, fresh: dict, gateways: list) -> None:
    text = three_up(fresh).replace(
        'name = "b"\n', 'name = "b"\nrequest_timeout_ms = 300\n')
    gw = start(tmp_path, write_config(tmp_path, text))
    gateways.append(gw)
    if how == "timeout":
        fresh["b"].behave(latency_ms=2000)
    else:
        fresh["b"].behave(status=int(how))
    responses = fire(gw, 300, concurrency=16)
    assert Counter(r.status_code for r in responses) == Counter({200: 300})
    assert "b" not in shares(responses)
    retried = [r for r in responses if r.headers["x-velox-attempts"] != "1"]
    assert retried  # some requests met b before its breaker opened, and were moved
    assert upstream_stats(gw, "b")["state"] in ("open", "half_open")


def test_fallbacks_are_used_and_attempts_counted(tmp_path: Path, fresh: dict,
                                                 gateways: list) -> None:
    config = write_config(tmp_path, upstream_table("a", fresh["a"]) + upstream_table(
        "b", fresh["b"]) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]
fallbacks = ["backup"]

[[route]]
model = "backup"
targets = [{ upstream = "b", model = "m-small" }]
""")
    gw = start(tmp_path, config)
    gateways.append(gw)
    fresh["a"].behave(status=503)
    reply = client_for(gw).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.headers["x-velox-upstream"] == "b"
    assert reply.headers["x-velox-attempts"] == "2"
    assert fresh["b"].requests(limit=1)[-1]["model"] == "m-small"


def test_retry_budget_caps_retries_when_every_target_fails(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, three_up(fresh).replace(
        "failures = 3", "failures = 255")))  # breakers out of the way: the budget alone
    gateways.append(gw)
    for mock in fresh.values():
        mock.behave(status=503)
    t0 = time.monotonic()
    responses = fire(gw, 600, concurrency=16)
    elapsed = time.monotonic() - t0
    assert Counter(r.status_code for r in responses) == Counter({503: 600})
    calls = sum(chat_calls(m) for m in fresh.values())
    # 20% of requests plus 10 per second (over at most the 10 s window), never 3x.
    allowed = 600 + 0.2 * 600 + 10 * (elapsed + 10) + 2 * 16
    assert 600 <= calls <= allowed, (calls, allowed)
    assert calls < 2 * 600


def test_a_stream_broken_midway_ends_with_an_error_event_and_is_not_retried(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, three_up(fresh)))
    gateways.append(gw)
    with httpx.Client(base_url=gw.base_url, timeout=20) as client:
        with client.stream("POST", "/v1/chat/completions",
                           json={**CHAT, "stream": True},
                           headers={"authorization": f"Bearer {CLIENT_KEY}",
                                    "x-mock-fault": "reset-mid-stream", "x-mock-chunks": "8"},
                           ) as resp:
            assert resp.status_code == 200
            text = "".join(resp.iter_text())
    assert "data: [DONE]" not in text
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events and "error" in json.loads(events[-1])
    assert sum(chat_calls(m) for m in fresh.values()) == 1
    with pytest.raises(openai.APIError):
        stream = client_for(gw).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_headers={"x-mock-fault": "reset-mid-stream"})
        for _ in stream:
            pass


# --- consistent hashing --------------------------------------------------------------------


def test_hash_keeps_a_key_on_its_upstream_and_moves_only_the_dead_ones_keys(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, three_up(fresh, strategy='"hash"')))
    gateways.append(gw)

    def placement() -> dict[str, str]:
        where: dict[str, str] = {}
        with httpx.Client(base_url=gw.base_url, timeout=20,
                          headers={"authorization": f"Bearer {CLIENT_KEY}"}) as client:
            for key in range(60):
                seen = {client.post("/v1/chat/completions", json=CHAT,
                                    headers={"x-velox-affinity": f"user-{key}"}
                                    ).headers["x-velox-upstream"] for _ in range(3)}
                assert len(seen) == 1, (key, seen)
                where[f"user-{key}"] = seen.pop()
        return where

    before = placement()
    assert set(before.values()) == set(NAMES)
    os.kill(fresh["b"].pid, signal.SIGKILL)
    after = placement()
    for key, name in before.items():
        if name != "b":
            assert after[key] == name, key
        else:
            assert after[key] != "b"
