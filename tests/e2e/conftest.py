"""Fixtures for end-to-end tests: a real mock upstream (HTTP/2 + TLS) and real Velox processes.

Gateways are started as `python -m velox` subprocesses with explicit VELOX_* settings and are
stopped by PID at the end of the test (or module) that started them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import closed_after_the_test
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789"
CLIENT_KEY = "sk-client-key-abcdef"


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    certdir = tmp_path_factory.mktemp("mock-certs")
    with MockUpstream(tls=True, certdir=str(certdir)) as mock:
        yield mock


@pytest.fixture(scope="module")
def plain_mock() -> Iterator[MockUpstream]:
    """The mock without TLS: a cleartext HTTP/1.1 upstream, as self-hosted servers are."""
    with MockUpstream(tls=False) as mock:
        yield mock


def gateway_env(mock: MockUpstream, **extra: str) -> dict[str, str]:
    env = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin,
        "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "2",
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "10",
        # Its own admin port: gateways of concurrently running tests must never collide.
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
    }
    if mock.ca_file:
        env["VELOX_UPSTREAM_CA_FILE"] = mock.ca_file
    env.update(extra)
    return env


GatewayFactory = Callable[..., GatewayProcess]


@pytest.fixture
def start_gateway(tmp_path: Path, upstream: MockUpstream) -> Iterator[GatewayFactory]:
    started: list[GatewayProcess] = []

    def start(mock: MockUpstream | None = None, wait_ready: bool = True,
              **env: str) -> GatewayProcess:
        gw = GatewayProcess(gateway_env(mock or upstream, **env),
                            log_path=tmp_path / f"velox-{len(started)}.log")
        started.append(gw)
        return gw.start(wait_ready=wait_ready)

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def gateway(upstream: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[GatewayProcess]:
    """One shared gateway (2 workers, no rate limit) for tests that do not change settings."""
    log = tmp_path_factory.mktemp("gw") / "velox.log"
    with GatewayProcess(gateway_env(upstream), log_path=log) as gw:
        yield gw


def client_for(gw: GatewayProcess, **kw: object) -> openai.OpenAI:
    """An SDK client of the gateway, closed when the test ends (tests/conftest.py)."""
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0,
                           timeout=kw.pop("timeout", 20), **kw)  # type: ignore[arg-type]
    closed_after_the_test(client)
    return client


def async_client_for(gw: GatewayProcess, **kw: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0,
                              timeout=kw.pop("timeout", 20), **kw)  # type: ignore[arg-type]


def raw(gw: GatewayProcess) -> httpx.Client:
    """A plain HTTP client of the gateway, closed when the test ends (tests/conftest.py)."""
    client = httpx.Client(base_url=gw.base_url, timeout=20)
    closed_after_the_test(client)
    return client


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, step: float = 0.05) -> Any:
    """Poll until predicate() is truthy and return its value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def worker_rows(gw: GatewayProcess, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The gateway's /stats rows of its workers once every worker has answered the snapshot's
    question: one whose loop is a moment behind on a busy host is "busy" there (the snapshot
    waits 0.25 s), and is asked again."""
    def answered() -> list[dict[str, Any]] | None:
        status, body = gw.admin_get("/stats")
        assert status == 200, body
        rows: list[dict[str, Any]] = json.loads(body)["workers"]
        return rows if all(isinstance(row["state"], dict) for row in rows) else None

    return wait_for(answered, timeout)  # type: ignore[no-any-return]


@contextlib.contextmanager
def two_hosts(mock: MockUpstream, tmp_path: Path, admin_token: str,
              ) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways (hosts) sharing a real redis-server through VELOX_REDIS_URL."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `make redis-server`")
    with RedisProcess(log_path=tmp_path / "redis.log") as redis:
        env = {"VELOX_REDIS_URL": redis.url, "VELOX_ADMIN_TOKEN": admin_token}
        with GatewayProcess(gateway_env(mock, **env), log_path=tmp_path / "a.log") as a, \
                GatewayProcess(gateway_env(mock, **env), log_path=tmp_path / "b.log") as b:
            yield a, b
