"""Many gateway keys in a real gateway: 20,000 `[[key]]` tables start and serve (4,096 with
Redis, every key's rpm and tpm buckets leased); one more than the table's limit (1,000,000, file
and run-time keys together) is a configuration error naming the file, the table and the key;
5,000 keys created at run time through the admin API (the table grows past its first segment of
4,096 while the workers run) are enforced by both workers, the last one within 1 s, from the
OpenAI SDK. Before: 4,097 keys were refused, and a run-time key past the 4,096th was refused
with 401 (the table was full).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import UPSTREAM_KEY
from tests.e2e.test_runtime_keys import FRESH, until_all, workers
from velox.config.tables import TableError, UpstreamSpec, parse
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

SERVED = 20_000  # file keys: five segments of the key table at start
LEASED = 4096  # with Redis: 8,192 leased buckets for the host's one refresher thread
MAX = 1_000_000  # the key table's limit, file and run-time keys together
TOKEN = "many-keys-admin-SECRET-0123456789"


def secret(i: int) -> str:
    return f"sk-many-keys-{i:05d}"


def write_keys(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        digest = hashlib.sha256(secret(i).encode()).hexdigest()
        lines += ["[[key]]", f'name = "k{i}"', f'sha256 = "{digest}"', "rpm = 600",
                  "tpm = 60000", ""]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("many-keys"))) as m:
        yield m


@pytest.mark.parametrize(("n", "redis"), [(SERVED, False), (LEASED, True)],
                         ids=["alone", "with-redis"])
def test_many_file_keys_start_and_serve(
        mock: MockUpstream, tmp_path: Path, n: int, redis: bool) -> None:
    if redis and shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `make redis-server`")
    config = write_keys(tmp_path / "velox.toml", n)
    server = RedisProcess(log_path=tmp_path / "redis.log").start() if redis else None
    env = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY, "VELOX_CONFIG": str(config),
        "VELOX_WORKERS": "2", "VELOX_EGRESS_POOL_CONNECTIONS": "1",
        "VELOX_RATE_LIMIT_RPM": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
    }
    if server is not None:
        env["VELOX_REDIS_URL"] = server.url
    try:
        with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw:
            for i in (0, n // 2, n - 1):  # the first, a middle and the last key
                client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret(i),
                                       max_retries=2, timeout=30)
                closed_after_the_test(client)
                answer = client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
                assert answer.choices[0].message.content
            status, body = gw.admin_get("/stats", timeout=30)
            keys = json.loads(body)["keys"]
            assert status == 200 and len(keys) == n
            assert keys[-1]["name"] == f"k{n - 1}" and keys[-1]["requests"] == 1
            # /metrics: the first VELOX_METRICS_KEYS (100) keys their own series, the rest
            # summed under key="_other" (the last key's request is counted there).
            status, metrics = gw.admin_get("/metrics", timeout=30)
            assert status == 200 and len(metrics) < 100_000, len(metrics)
            assert b'velox_key_requests_total{key="k0"} 1.0' in metrics
            assert b'velox_key_requests_total{key="_other"} 2.0' in metrics
            assert b'key="k99"' in metrics and b'key="k100"' not in metrics
            assert b"velox_key_series_other %d.0" % (n - 100) in metrics
            log = gw.log()
        assert "Traceback" not in log, log[-3000:]
    finally:
        if server is not None:
            server.stop()


def test_one_key_more_than_the_maximum_is_a_configuration_error() -> None:
    """The check itself, on a parsed document of 1,000,001 tables (a TOML file of them takes
    minutes to parse): refused before any table is checked, naming file, table and key."""
    table = {"name": "k", "sha256": hashlib.sha256(b"k").hexdigest()}
    data = {"key": [table] * MAX + [{"name": f"k{MAX}", "sha256": "00" * 32}]}
    template = UpstreamSpec("default", "https://api.openai.com")
    with pytest.raises(TableError) as refused:
        parse(data, "velox.toml", {}, template)
    assert str(refused.value).startswith(
        'velox.toml: [[key]] #1000001 (name "k1000000"): name: at most 1,000,000 [[key]] '
        "tables, this file has 1,000,001"), refused.value


def test_a_keys_table_past_its_limit_stops_start_up_naming_file_table_and_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real start-up refused by the same check: three keys against a limit of two (the real
    limit's file is a 130 MB TOML document)."""
    config = write_keys(tmp_path / "velox.toml", 3)
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "VELOX_CONFIG": str(config),
           "VELOX_WORKERS": "1", "VELOX_PORT": str(free_port()), "VELOX_ADMIN_ADDR": "off",
           "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY}
    code = ("import sys, velox.config.tables as t; t.MAX_KEYS = 2; "
            "from velox.cli import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group it leads: it and any worker
        proc.communicate()
        pytest.fail("velox with 3 keys of 2 was still running after 60 s")
    assert proc.returncode != 0
    assert f'{config}: [[key]] #3 (name "k2"): name: at most 2 [[key]] tables' in err, err
    assert "Traceback" not in err, err


def test_five_thousand_run_time_keys_grow_the_table_and_the_last_is_enforced_at_once(
        mock: MockUpstream, tmp_path: Path) -> None:
    """5,000 keys made through POST /keys on a gateway of 2 workers: past the 4,096th the
    supervisor grows the key table and hands the new segment to both running workers; the
    last key works from the SDK on both workers within 1 s of its creation, is limited (rpm)
    and refused (401) once revoked."""
    env = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY, "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "1", "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        "VELOX_ADMIN_TOKEN": TOKEN, "VELOX_STATE_DIR": str(tmp_path / "state"),
        "VELOX_ACCESS_LOG": "0",
    }
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw, httpx.Client(
            base_url=gw.admin_url or "", timeout=30,
            headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        for i in range(4999):
            made = api.post("/keys", json={"name": f"rt{i}"})
            assert made.status_code == 201, made.text
        last = api.post("/keys", json={"name": "rt-last", "rpm": 1000}).json()["key"]
        until_all(gw, last, "200", 1.0)  # on fresh connections: both workers
        seen = {w["keys_version"] for w in workers(gw)}
        assert len(seen) == 1, seen  # both workers applied the same (last) change
        usage = api.get("/keys/rt-last").json()["usage"]
        assert usage["requests"] >= 1 + FRESH
        assert api.delete("/keys/rt-last").status_code == 204
        until_all(gw, last, "401", 1.0)
        log = gw.log()
    assert "Traceback" not in log and "not mapped" not in log, log[-3000:]
