"""The documented maximum of `[[key]]` tables (4,096) starts a real gateway, alone and with
Redis (every key's rpm and tpm buckets leased: 8,192 of them), and one more is a
configuration error naming the file, the table and the key. Before: 2,049 keys and more
crashed start-up with a raw traceback (a shared table of 2 fields per key, at most 4,096
fields)."""

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

import openai
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import UPSTREAM_KEY
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

MAX = 4096


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


@pytest.mark.parametrize("redis", [False, True], ids=["alone", "with-redis"])
def test_the_documented_maximum_of_keys_starts_and_serves(
        mock: MockUpstream, tmp_path: Path, redis: bool) -> None:
    if redis and shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `make redis-server`")
    config = write_keys(tmp_path / "velox.toml", MAX)
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
            for i in (0, MAX // 2, MAX - 1):  # the first, a middle and the last key
                client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret(i),
                                       max_retries=2, timeout=30)
                closed_after_the_test(client)
                answer = client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
                assert answer.choices[0].message.content
            status, body = gw.admin_get("/stats", timeout=30)
            keys = json.loads(body)["keys"]
            assert status == 200 and len(keys) == MAX
            assert keys[-1]["name"] == f"k{MAX - 1}" and keys[-1]["requests"] == 1
            # /metrics: the first VELOX_METRICS_KEYS (100) keys their own series, the rest
            # summed under key="_other" (the last key's request is counted there).
            status, metrics = gw.admin_get("/metrics", timeout=30)
            assert status == 200 and len(metrics) < 100_000, len(metrics)
            assert b'velox_key_requests_total{key="k0"} 1.0' in metrics
            assert b'velox_key_requests_total{key="_other"} 2.0' in metrics
            assert b'key="k99"' in metrics and b'key="k100"' not in metrics
            assert b"velox_key_series_other 3996.0" in metrics
            log = gw.log()
        assert "Traceback" not in log, log[-3000:]
    finally:
        if server is not None:
            server.stop()


def test_one_key_more_than_the_maximum_is_a_configuration_error(tmp_path: Path) -> None:
    config = write_keys(tmp_path / "velox.toml", MAX + 1)
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "VELOX_CONFIG": str(config),
           "VELOX_WORKERS": "1", "VELOX_PORT": str(free_port()), "VELOX_ADMIN_ADDR": "off",
           "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY}
    proc = subprocess.Popen([sys.executable, "-m", "velox"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group it leads: it and any worker
        proc.communicate()
        pytest.fail("velox with 4,097 keys was still running after 60 s")
    assert proc.returncode != 0
    assert f'{config}: [[key]] #4097 (name "k4096"): name: at most 4,096 [[key]] tables' in err, \
        err
    assert "Traceback" not in err, err
