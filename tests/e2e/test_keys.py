"""Gateway keys end to end: `[[key]]` tables in a VELOX_CONFIG file, a real Velox (two workers),
the bundled mock over HTTP/2 + TLS, the official `openai` SDK and httpx as clients.

What it proves: an unknown key is 401 (AuthenticationError) while `[[key]]` keys and
VELOX_API_KEYS both work and neither reaches the upstream; a model the key may not use is 403
(PermissionDeniedError); a key over its rpm or tpm gets 429 (RateLimitError) with Retry-After,
and every answer carries the key's x-ratelimit-* headers (not the provider's); `max_parallel`
places return to zero after every way a request can end (success, upstream 503, upstream
timeout, client gone mid-stream, client gone before the answer, worker SIGKILLed), read from
/stats while they are held and after; /stats, /metrics and the access log name keys, never the
key itself; `velox key hash|new`; configuration mistakes are named by file, table and key.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import UPSTREAM_KEY, wait_for
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream, fingerprint

KEYS = {  # name -> the key clients present
    "open": "vx-open-0123456789",
    "rpm": "vx-rpm-0123456789",
    "models": "vx-models-0123456789",
    "tokens": "vx-tokens-0123456789",
    "par": "vx-par-0123456789",
}
PLAIN = "plain-api-key-0123"  # VELOX_API_KEYS, combined with the tables' keys
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TIMEOUT_MS = 4000  # VELOX_REQUEST_TIMEOUT_MS: the upstream-timeout case waits past it


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
[[route]]
model = "m"
targets = [{{ upstream = "default" }}]

[[route]]
model = "other"
targets = [{{ upstream = "default" }}]

[retry]
attempts = 1          # each case below ends its own way, not by a retry

[breaker]
failures = 255        # the 503 case must not open the breaker for the cases after it

[[key]]
name = "open"
sha256 = "{sha(KEYS['open'])}"

[[key]]
name = "rpm"
sha256 = "{sha(KEYS['rpm'])}"
rpm = 3

[[key]]
name = "models"
sha256 = "{sha(KEYS['models'])}"
models = ["m"]

[[key]]
name = "tokens"
sha256 = "{sha(KEYS['tokens'])}"
rpm = 100
tpm = 1000

[[key]]
name = "par"
sha256 = "{sha(KEYS['par'])}"
max_parallel = 2
"""


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("keys-certs"))) as m:
        yield m


def gateway_for(mock: MockUpstream, directory: Path) -> GatewayProcess:
    config = directory / "velox.toml"
    config.write_text(CONFIG)
    return GatewayProcess({
        "VELOX_UPSTREAM_ORIGIN": mock.origin,
        "VELOX_UPSTREAM_CA_FILE": mock.ca_file,
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "VELOX_CONFIG": str(config),
        "VELOX_API_KEYS": PLAIN,
        "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "1",
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_REQUEST_TIMEOUT_MS": str(TIMEOUT_MS),
        "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
    }, log_path=directory / "velox.log")


@pytest.fixture(scope="module")
def gw(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    with gateway_for(mock, tmp_path_factory.mktemp("keys-gw")) as g:
        yield g


def sdk(gw: GatewayProcess, key: str, **kw: Any) -> openai.OpenAI:
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0,
                           timeout=kw.pop("timeout", 20), **kw)
    closed_after_the_test(client)
    return client


def post(gw: GatewayProcess, key: str, headers: dict[str, str] | None = None,
         body: dict | None = None, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body or CHAT,
                      headers={"authorization": f"Bearer {key}", **(headers or {})},
                      timeout=timeout)


def stats(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.admin_get("/stats")
    assert status == 200
    return json.loads(body)


def key_row(gw: GatewayProcess, name: str) -> dict[str, Any]:
    (row,) = [k for k in stats(gw)["keys"] if k["name"] == name]
    return row


def active(gw: GatewayProcess, name: str = "par") -> int:
    return key_row(gw, name)["active"]


# --- who may call ------------------------------------------------------------------------------


def test_unknown_key_is_401_and_both_kinds_of_keys_work(gw: GatewayProcess,
                                                        mock: MockUpstream) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(gw, "vx-unknown").chat.completions.create(**CHAT)
    assert info.value.code == "invalid_api_key"
    mock.reset()
    for key in (KEYS["open"], PLAIN):
        reply = sdk(gw, key).chat.completions.create(**CHAT)
        assert reply.choices[0].message.content
    # The upstream saw the gateway's own key, never a client's.
    seen = {r["auth"]["key_sha256"] for r in mock.requests()
            if r["path"] == "/v1/chat/completions"}
    assert seen == {fingerprint(UPSTREAM_KEY)}
    # The access log names the key, never the key itself.
    lines = wait_for(lambda: [json.loads(line) for line in gw.log().splitlines()
                              if '"log":"access"' in line and '"key":"open"' in line])
    assert lines[-1]["status"] == 200
    assert KEYS["open"] not in gw.log()


def test_forbidden_model_is_permission_denied(gw: GatewayProcess) -> None:
    client = sdk(gw, KEYS["models"])
    assert client.chat.completions.create(**CHAT).choices
    for model in ("other", "gpt-anything"):  # a named route, and one the key's list lacks
        with pytest.raises(openai.PermissionDeniedError) as info:
            client.chat.completions.create(**{**CHAT, "model": model})
        assert info.value.status_code == 403
        assert info.value.code == "model_not_allowed"
        assert "models" in str(info.value) and model in str(info.value)
    assert key_row(gw, "models")["refused"]["model"] == 2
    # Another key may use it.
    assert sdk(gw, KEYS["open"]).chat.completions.create(**{**CHAT, "model": "other"}).choices


# --- rate limits -------------------------------------------------------------------------------


def test_rpm_over_limit_is_429_with_retry_after_and_headers(gw: GatewayProcess) -> None:
    client = sdk(gw, KEYS["rpm"])
    remaining = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(**CHAT)
        assert raw.http_response.status_code == 200
        # The key's limit (3), not the provider's own x-ratelimit-* (the mock sends 10000).
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**CHAT)
    error = info.value
    assert error.status_code == 429 and error.type == "rate_limit_error"
    assert "'rpm'" in error.message and "requests per minute" in error.message
    headers = error.response.headers
    # 3 a minute: the next request is possible within 20 s (less the time the three took).
    assert 1 <= int(headers["retry-after"]) <= 20
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    row = key_row(gw, "rpm")
    assert row["requests"] == 3 and row["refused"]["rpm"] == 1
    assert row["remaining_requests"] == 0
    metrics = {}
    text = httpx.get(f"{gw.admin_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metrics[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert metrics[("velox_key_requests_total", (("key", "rpm"),))] == 3
    assert metrics[("velox_key_refused_total", (("key", "rpm"), ("reason", "rpm")))] == 1
    assert metrics[("velox_key_remaining", (("key", "rpm"), ("kind", "requests")))] == 0
    assert KEYS["rpm"] not in text and sha(KEYS["rpm"]) not in text


def test_tpm_reservation_over_limit_is_429(gw: GatewayProcess) -> None:
    client = sdk(gw, KEYS["tokens"])
    # The estimate reserves body bytes / 4 + max_tokens: ~900 of the 1000, held while the
    # first answer takes 2 s (once answered, the reservation is settled to the real usage).
    threads, results = hold(lambda: client.chat.completions.with_raw_response.create(
        **CHAT, max_tokens=880, extra_headers={"x-mock-latency-ms": "2000"}), n=1)
    wait_for(lambda: key_row(gw, "tokens")["active"] == 1)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**CHAT, max_tokens=880)
    for t in threads:
        t.join(timeout=30)
    raw = results[0]
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000"
    left = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert 0 <= left <= 120
    assert "tokens per minute" in info.value.message
    assert int(info.value.response.headers["retry-after"]) >= 1
    row = key_row(gw, "tokens")
    assert row["refused"]["tpm"] == 1 and row["refused"]["rpm"] == 0
    # The refused request's request token went back: 100 - 1 admitted.
    assert row["remaining_requests"] >= 99


# --- max_parallel: every way a request ends gives its place back -------------------------------


def hold(fn: Callable[[], Any], n: int = 2) -> tuple[list[threading.Thread], list[Any]]:
    """Run fn n times in threads; results (or exceptions) are collected in order of ending."""
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(fn())
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def third_is_refused(gw: GatewayProcess) -> None:
    """With both places held, a third request is refused by max_parallel."""
    refused = post(gw, KEYS["par"])
    assert refused.status_code == 429, refused.text
    assert "max_parallel" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"


def back_to_zero(gw: GatewayProcess) -> None:
    wait_for(lambda: active(gw) == 0, timeout=20)
    # And the places really are free: two at once pass again.
    threads, results = hold(lambda: post(gw, KEYS["par"]))
    join(threads)
    assert [r.status_code for r in results] == [200, 200]
    assert active(gw) == 0


def test_places_return_after_success(gw: GatewayProcess) -> None:
    assert active(gw) == 0
    threads, results = hold(lambda: post(gw, KEYS["par"], {"x-mock-latency-ms": "3000"}))
    wait_for(lambda: active(gw) == 2)
    third_is_refused(gw)
    join(threads)
    assert [r.status_code for r in results] == [200, 200]
    back_to_zero(gw)


def test_places_return_after_upstream_503(gw: GatewayProcess, mock: MockUpstream) -> None:
    assert active(gw) == 0
    mock.behave(status=503, latency_ms=3000)
    try:
        threads, results = hold(lambda: post(gw, KEYS["par"]))
        wait_for(lambda: active(gw) == 2)
        third_is_refused(gw)
        join(threads)
    finally:
        mock.behave()
    assert [r.status_code for r in results] == [503, 503]
    back_to_zero(gw)


def test_places_return_after_upstream_timeout(gw: GatewayProcess) -> None:
    assert active(gw) == 0
    slow = {"x-mock-latency-ms": str(TIMEOUT_MS + 5000)}
    threads, results = hold(lambda: post(gw, KEYS["par"], slow))
    wait_for(lambda: active(gw) == 2)
    third_is_refused(gw)
    join(threads)
    assert [r.status_code for r in results] == [504, 504]
    assert results[0].json()["error"]["code"] == "upstream_timeout"
    back_to_zero(gw)


def test_places_return_after_client_leaves_mid_stream(gw: GatewayProcess) -> None:
    assert active(gw) == 0
    started = threading.Barrier(3, timeout=30)
    leave = threading.Event()

    def stream() -> int:
        body = {**CHAT, "stream": True}
        headers = {"authorization": f"Bearer {KEYS['par']}", "x-mock-chunks": "200",
                   "x-mock-chunk-delay-ms": "100"}
        with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json=body,
                          headers=headers, timeout=30) as response:
            assert response.status_code == 200, response.read()
            chunks = response.iter_bytes()  # kept: dropping it would close the stream now
            first = next(chunks)  # the stream has begun
            started.wait()
            leave.wait(30)
            return len(first)  # closing the response here cuts the connection mid-stream

    threads, results = hold(stream)
    started.wait()
    assert active(gw) == 2  # both streams are in flight
    third_is_refused(gw)
    leave.set()
    join(threads)
    assert all(isinstance(r, int) and r > 0 for r in results), results
    back_to_zero(gw)


def test_places_return_after_client_leaves_before_the_answer(gw: GatewayProcess) -> None:
    assert active(gw) == 0
    threads, results = hold(lambda: post(gw, KEYS["par"], {"x-mock-latency-ms": "4000"},
                                         timeout=1.0))
    wait_for(lambda: active(gw) == 2)
    join(threads)
    assert all(isinstance(r, httpx.ReadTimeout) for r in results), results
    back_to_zero(gw)


def test_places_return_after_worker_sigkill(mock: MockUpstream, tmp_path: Path) -> None:
    with gateway_for(mock, tmp_path) as gw:
        assert active(gw) == 0
        threads, results = hold(lambda: post(gw, KEYS["par"], {"x-mock-latency-ms": "20000"}))
        wait_for(lambda: active(gw) == 2)
        third_is_refused(gw)
        pids = [w["pid"] for w in stats(gw)["workers"]]
        assert len(pids) == 2
        for pid in pids:  # whichever workers hold the two requests die with them
            os.kill(pid, signal.SIGKILL)
        join(threads)
        assert all(isinstance(r, httpx.HTTPError) for r in results), results
        # Nothing in the dead workers can give the places back: the supervisor does.
        wait_for(lambda: active(gw) == 0, timeout=30)
        wait_for(lambda: all(w["ready"] and w["pid"] not in pids
                             for w in stats(gw)["workers"]), timeout=30)
        back_to_zero(gw)
        assert "died with" in gw.log()


# --- tools and configuration -------------------------------------------------------------------


def velox(*args: str, stdin: str = "", env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    return subprocess.run([sys.executable, "-m", "velox", *args], input=stdin, text=True,
                          capture_output=True, timeout=60, env={**base, **(env or {})}, check=False)


def test_velox_key_hash_and_new() -> None:
    done = velox("key", "hash", stdin="vx-some-key\n")
    assert done.returncode == 0
    assert done.stdout.strip() == sha("vx-some-key")
    new = velox("key", "new")
    assert new.returncode == 0
    key, line = new.stdout.splitlines()
    assert key.startswith("vx-") and len(key) > 40
    assert line == f'sha256 = "{sha(key)}"'
    assert velox("key", "new").stdout.splitlines()[0] != key  # random each time
    empty = velox("key", "hash", stdin="")
    assert empty.returncode == 2 and "no key on stdin" in empty.stderr


def test_configuration_mistakes_name_file_table_and_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(CONFIG + f'\n[[key]]\nname = "again"\nsha256 = "{sha(KEYS["rpm"])}"\n')
    done = velox("--print-config", env={"VELOX_CONFIG": str(config),
                                        "VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9"})
    assert done.returncode == 2
    assert (f'{config}: [[key]] #6 (name "again"): sha256: the same key as [[key]] #2 ("rpm")'
            in done.stderr), done.stderr
    config.write_text(CONFIG.replace('models = ["m"]', 'models = ["m", "gtp-4o"]'))
    done = velox("--print-config", env={"VELOX_CONFIG": str(config),
                                        "VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9"})
    assert done.returncode == 2
    assert f'{config}: [[key]] #3 (name "models"): models: "gtp-4o" names no [[route]]' \
        in done.stderr, done.stderr
    # A valid file prints its keys by name and hash, with their limits.
    config.write_text(CONFIG)
    done = velox("--print-config", env={"VELOX_CONFIG": str(config),
                                        "VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9"})
    assert done.returncode == 0, done.stderr
    assert 'name = "rpm"' in done.stdout and "max_parallel = 2" in done.stdout
