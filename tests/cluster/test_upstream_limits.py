"""An [[upstream]]'s rpm held by several hosts together through Redis (issue 11: "every limit
above ... each upstream's ... is global across all Velox hosts").

Three real Velox instances (one worker each) on three ports of 127.0.0.1, one VELOX_CONFIG
file naming the same upstream `limited` (rpm = 120: a burst of 20, 2 tokens a second) behind
the bundled mock (HTTP/2 + TLS), one real redis-server on a free port. The official SDK sends
open-loop at 7.5 times that rate, spread over the hosts, for 6 s. What reached the upstream is
the mock's own count of chat calls. With Redis the hosts together stay within
    burst + rpm/60 x T + hosts x lease cap      (velox.cluster.leases.bound: 3 x 1 here)
and every other request is answered 429 by the gateway; without Redis (the control) each host
admits from its own bucket: more than the hosts' three bursts, above that bound.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.test_routing import start_mock, upstream_table
from velox.cluster import leases as cluster
from velox.state.health import rpm_burst
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

RPM, HOSTS = 120, 3
BURST = rpm_burst(RPM)
RATE = RPM / 60  # tokens per second
LOAD = 15.0  # requests per second over all hosts: 7.5 x the limit
SECONDS = 6.0
UPSTREAM_KEY = {"KEY_LIMITED": "sk-limited-0123456789"}


@pytest.fixture
def mock(tmp_path: Path) -> Any:
    m = start_mock("limited", str(tmp_path))
    try:
        yield m
    finally:
        m.stop()


def start_hosts(tmp_path: Path, mock: MockUpstream, redis: RedisProcess | None) -> list[
        GatewayProcess]:
    config = tmp_path / "velox.toml"
    config.write_text(upstream_table("limited", mock, rpm=RPM) +
                      '[[route]]\nmodel = "m"\ntargets = [{ upstream = "limited" }]\n')
    env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "1", "VELOX_RATE_LIMIT_RPM": "0",
           "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_ACCESS_LOG": "0", **UPSTREAM_KEY}
    if redis is not None:
        env["VELOX_REDIS_URL"] = redis.url
    hosts = [GatewayProcess({**env, "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"},
                            log_path=tmp_path / f"velox-{i}.log") for i in range(HOSTS)]
    try:
        for gw in hosts:
            gw.start(timeout=60)
    except BaseException:
        for gw in hosts:
            gw.stop()
        raise
    return hosts


def redis_hosts(gw: GatewayProcess) -> float:
    _status, body = gw.admin_get("/metrics", timeout=2.0)
    for line in body.decode().splitlines():
        if line.startswith("velox_redis_hosts "):
            return float(line.split()[1])
    return 0.0


async def hammer(hosts: list[GatewayProcess]) -> tuple[dict[int, int], float]:
    """Open loop at LOAD for SECONDS, request k to host k mod HOSTS: (statuses, seconds from
    the first send to the last admitted answer)."""
    clients = [openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="sk-any",
                                  max_retries=0, timeout=30.0) for gw in hosts]
    statuses: dict[int, int] = {}
    last = [0.0]
    t0 = time.monotonic()

    async def one(k: int) -> None:
        try:
            await clients[k % HOSTS].chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            status = 200
            last[0] = max(last[0], time.monotonic() - t0)
        except openai.APIStatusError as exc:
            status = exc.status_code
        except openai.APIError:
            status = 0
        statuses[status] = statuses.get(status, 0) + 1

    tasks = []
    for k in range(int(LOAD * SECONDS)):
        await asyncio.sleep(max(0.0, t0 + k / LOAD - time.monotonic()))
        tasks.append(asyncio.create_task(one(k)))
    await asyncio.wait(tasks, timeout=35)
    for c in clients:
        await c.close()
    return statuses, last[0]


def run(tmp_path: Path, mock: MockUpstream, redis: RedisProcess | None) -> tuple[
        dict[int, int], float, int, list[str]]:
    hosts = start_hosts(tmp_path, mock, redis)
    try:
        if redis is not None:  # every host counted in Redis before the load (bounded wait)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and \
                    not all(redis_hosts(gw) == HOSTS for gw in hosts):
                time.sleep(0.1)
        mock.reset()  # the warm-ups are GET /v1/models anyway; count from here
        statuses, span = asyncio.run(hammer(hosts))
        calls = mock.stats()["by_path"].get("/v1/chat/completions", 0)
    finally:
        logs = []
        for gw in hosts:
            gw.stop()
            logs.append(gw.log())
    return statuses, span, calls, logs


def test_three_hosts_hold_one_upstream_rpm_through_redis(
        tmp_path: Path, mock: MockUpstream, redis_server: RedisProcess) -> None:
    statuses, span, calls, logs = run(tmp_path, mock, redis_server)
    stated = cluster.bound(RPM, BURST, HOSTS)
    assert stated == 3 and BURST == 20
    sent = int(LOAD * SECONDS)
    assert sum(statuses.values()) == sent and set(statuses) <= {200, 429}, statuses
    # Every admitted request reached the upstream, every other one was the gateway's 429.
    assert statuses.get(200, 0) == calls, (statuses, calls)
    # One bucket for the three hosts: its burst, the refill while requests were admitted, and
    # what the hosts may hold (one lease cap each).
    assert calls <= BURST + RATE * span + stated, (calls, span, statuses)
    # ... and it was drawn from through leases, past what the hosts held at the start.
    assert calls >= BURST, (calls, statuses)
    # The bucket is known in Redis by the upstream's name (hosts name an upstream alike).
    assert redis_server.command("EXISTS", "velox:bucket:upstream:limited:rpm") == b":1\r\n"
    for log in logs:
        assert "Traceback" not in log and "sharing 1 limit(s) through Redis" in log, log


def test_without_redis_each_host_allows_its_own_rpm(tmp_path: Path, mock: MockUpstream) -> None:
    statuses, span, calls, logs = run(tmp_path, mock, None)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.get(200, 0) == calls
    # Each host's own bucket: together more than three bursts, well past the shared bound.
    assert calls >= HOSTS * BURST > BURST + RATE * span + cluster.bound(RPM, BURST, HOSTS), \
        (calls, span)
    assert all("Redis" not in log for log in logs)
