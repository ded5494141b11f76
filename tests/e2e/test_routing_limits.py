"""Routing at its limits: per-upstream caps and buckets, 429s from upstreams, what /stats,
/metrics and the access log say after a run, /readyz per route, panic mode, and `velox doctor`
over every upstream of a file.

Real processes as in test_routing.py (whose helpers and mock fixtures this module reuses): the
bundled mock over HTTP/2 + TLS, one Velox with two workers and a VELOX_CONFIG file, httpx as
the client; `velox doctor` runs as its own process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import CLIENT_KEY, wait_for
from tests.e2e.test_routing import (  # noqa: F401  (fixtures: certdir, mocks, fresh, gateways)
    CHAT,
    KEYS,
    admin_stats,
    certdir,
    chat_calls,
    fire,
    fresh,
    gateways,
    mocks,
    shares,
    start,
    upstream_stats,
    upstream_table,
    write_config,
)
from velox_lab.launch import free_port
from velox_lab.mock.state import fingerprint

AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def post(gw: object, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body or CHAT,  # type: ignore
                      headers=AUTH, timeout=30)


def metrics(gw: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every /metrics sample by (name, sorted labels), parsed by prometheus_client."""
    text = httpx.get(f"{gw.admin_url}/metrics", timeout=10).text  # type: ignore[attr-defined]
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def readyz(gw: object) -> int:
    return httpx.get(f"{gw.base_url}/readyz", timeout=10).status_code  # type: ignore


def two_up(fresh: dict, breaker: str = "", **extra: object) -> str:
    return upstream_table("a", fresh["a"], **extra) + upstream_table(
        "b", fresh["b"], **extra) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }, { upstream = "b" }]
""" + breaker


# --- per-upstream limits ---------------------------------------------------------------------


def test_max_in_flight_full_on_every_target_is_503_overloaded(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, max_in_flight=1)))
    gateways.append(gw)
    # Slow answers hold both places while the checks below run (3 s: slack for a busy host).
    fresh["a"].behave(latency_ms=3000)
    fresh["b"].behave(latency_ms=3000)
    slow: list[httpx.Response] = []

    def hold(n: int) -> None:
        slow.append(post(gw))

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for t in holders:
        t.start()
    # Both places taken (the gauge is shared by the two workers) ...
    wait_for(lambda: sum(u["in_flight"] for u in admin_stats(gw)["upstreams"]) == 2)
    samples = metrics(gw)
    for name in ("a", "b"):
        assert samples[("velox_upstream_in_flight", (("upstream", name),))] == 1
    # ... so a third request is refused at once, not queued behind them.
    refused = post(gw)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert "x-velox-upstream" not in refused.headers
    assert admin_stats(gw)["upstreams"][0]["in_flight"] == 1  # refused while both were held
    for t in holders:
        t.join(timeout=30)
    assert [r.status_code for r in slow] == [200, 200]
    assert sorted(r.headers["x-velox-upstream"] for r in slow) == ["a", "b"]
    assert chat_calls(fresh["a"]) + chat_calls(fresh["b"]) == 2  # the refused one went nowhere
    rows = {u["name"]: u for u in admin_stats(gw)["upstreams"]}
    assert rows["a"]["in_flight"] == rows["b"]["in_flight"] == 0  # every place came back
    assert rows["a"]["refused_full"] + rows["b"]["refused_full"] >= 2


def test_rpm_empty_on_every_target_is_429_with_the_buckets_retry_after(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # rpm 6: a burst of 1 token, then one every 10 s.
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, rpm=6)))
    gateways.append(gw)
    first = [post(gw) for _ in range(2)]
    assert [r.status_code for r in first] == [200, 200]
    assert sorted(r.headers["x-velox-upstream"] for r in first) == ["a", "b"]
    refused = post(gw)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    wait = int(refused.headers["retry-after"])
    assert 1 <= wait <= 10  # from the bucket: the next token is at most 10 s away
    assert chat_calls(fresh["a"]) + chat_calls(fresh["b"]) == 2


# --- 429 from an upstream --------------------------------------------------------------------


def test_upstream_429_moves_the_request_and_counts_against_the_breaker(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    breaker = "\n[breaker]\nfailures = 3\nopen_s = 30\nmax_open_s = 60\n"
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, breaker)))
    gateways.append(gw)
    fresh["a"].behave(status=429)  # retry-after: 1
    responses = fire(gw, 40, concurrency=4)
    assert Counter(r.status_code for r in responses) == Counter({200: 40})
    assert shares(responses) == Counter({"b": 40})
    moved = [r for r in responses if r.headers["x-velox-attempts"] == "2"]
    assert moved and len(moved) == chat_calls(fresh["a"])  # every 429 was moved, once
    a = upstream_stats(gw, "a")
    assert a["failures"] == chat_calls(fresh["a"])
    assert a["state"] == "open"  # three 429s in a row
    assert admin_stats(gw)["retries"]["status_429"] == len(moved)


def test_single_target_429_waits_out_retry_after_then_retries_it(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    config = upstream_table("a", fresh["a"]) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]
"""
    gw = start(tmp_path, write_config(tmp_path, config))
    gateways.append(gw)
    fresh["a"].behave(status=429)
    reply: list[httpx.Response] = []
    t = threading.Thread(target=lambda: reply.append(post(gw)))
    t.start()
    # The 429 (retry-after: 1) has been answered; the gateway now waits one second, during
    # which the mock recovers: the same target's second answer is the client's.
    wait_for(lambda: chat_calls(fresh["a"]) == 1, step=0.01)
    fresh["a"].behave()
    t.join(timeout=30)
    assert reply[0].status_code == 200, reply[0].text
    assert reply[0].headers["x-velox-upstream"] == "a"
    assert reply[0].headers["x-velox-attempts"] == "2"
    assert chat_calls(fresh["a"]) == 2
    assert admin_stats(gw)["retries"]["status_429"] == 1


def test_a_client_leaving_while_a_429_is_waited_out_releases_its_place(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # The retry waits out Retry-After (1 s) on a timer; the client leaves meanwhile. The attempt
    # waiting to be sent must be released (in flight back to 0), never sent, never crash.
    config = upstream_table("a", fresh["a"]) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]
"""
    gw = start(tmp_path, write_config(tmp_path, config))
    gateways.append(gw)
    fresh["a"].behave(status=429)
    try:
        httpx.post(f"{gw.base_url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=0.4)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the gateway answered before Retry-After was waited out")
    time.sleep(1.5)  # past the retry timer
    assert chat_calls(fresh["a"]) == 1  # the second attempt was never sent
    assert upstream_stats(gw, "a")["in_flight"] == 0
    fresh["a"].behave()
    assert post(gw).status_code == 200
    assert "Traceback" not in gw.log_path.read_text()


# --- what a run leaves in /stats, /metrics and the access log ---------------------------------


def test_stats_metrics_and_access_log_reflect_a_run(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    text = "".join(upstream_table(n, fresh[n]) for n in ("a", "b", "c")) + """
[[route]]
model = "m"
targets = [{ upstream = "a", weight = 2 }, { upstream = "b" }, { upstream = "c" }]

[breaker]
failures = 3
open_s = 60
max_open_s = 120
"""
    gw = start(tmp_path, write_config(tmp_path, text), VELOX_ACCESS_LOG="1")
    gateways.append(gw)
    fresh["c"].behave(status=503)
    responses = fire(gw, 200, concurrency=8)
    assert Counter(r.status_code for r in responses) == Counter({200: 200})
    seen = shares(responses)
    assert "c" not in seen
    calls = {n: chat_calls(fresh[n]) for n in ("a", "b", "c")}
    moved = sum(1 for r in responses if r.headers["x-velox-attempts"] == "2")
    assert moved == calls["c"] >= 3

    stats = admin_stats(gw)
    rows = {u["name"]: u for u in stats["upstreams"]}
    for name in ("a", "b"):
        row = rows[name]
        assert row["state"] == "closed" and row["consecutive_failures"] == 0
        assert row["in_flight"] == 0 and row["failures"] == 0
        assert row["requests"] == calls[name] == row["by_status_class"]["2xx"]
        assert row["latency"]["count"] == calls[name]
        assert 0 < row["latency"]["p50_us"] <= row["latency"]["p99_us"]
    c = rows["c"]
    assert c["state"] == "open" and c["open_count"] == 1
    assert c["failures"] == c["requests"] == calls["c"] == c["by_status_class"]["5xx"]
    assert sum(r["retries"] for r in rows.values()) == moved  # charged to the retry's target
    assert stats["retries"]["status_5xx"] == moved
    (route,) = stats["routes"]
    picks = {t["upstream"]: t for t in route["targets"]}
    assert {n: picks[n]["picks"] for n in picks} == calls
    assert abs(sum(t["share"] for t in route["targets"]) - 1) < 0.01
    assert picks["a"]["share"] > picks["b"]["share"] > picks["c"]["share"]

    samples = metrics(gw)

    def upstream_requests(name: str, cls: str) -> float:
        return samples[("velox_upstream_requests_total",
                        (("status_class", cls), ("upstream", name)))]

    assert upstream_requests("a", "2xx") == calls["a"]
    assert upstream_requests("b", "2xx") == calls["b"]
    assert upstream_requests("c", "5xx") == calls["c"]
    assert upstream_requests("c", "2xx") == 0
    assert samples[("velox_upstream_state", (("state", "open"), ("upstream", "c")))] == 1
    assert samples[("velox_upstream_state", (("state", "closed"), ("upstream", "c")))] == 0
    assert samples[("velox_upstream_state", (("state", "closed"), ("upstream", "a")))] == 1
    assert samples[("velox_retries_total", (("reason", "status_5xx"),))] == moved
    assert samples[("velox_retries_total", (("reason", "connect"),))] == 0
    for name in ("a", "b", "c"):
        assert samples[("velox_upstream_in_flight", (("upstream", name),))] == 0

    def log_lines() -> list[dict]:
        return [json.loads(line) for line in gw.log().splitlines()
                if line.startswith('{"time"') and '"/v1/chat/completions"' in line]

    lines = wait_for(lambda: (lambda got: got if len(got) == 200 else None)(log_lines()))
    assert Counter(line["upstream"] for line in lines) == seen
    assert Counter(line["attempts"] for line in lines) == Counter(
        int(r.headers["x-velox-attempts"]) for r in responses)


# --- readiness -------------------------------------------------------------------------------


def test_readyz_follows_every_routes_breakers_and_ignores_a_full_upstream(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    text = upstream_table("a", fresh["a"]) + upstream_table("b", fresh["b"], max_in_flight=1) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]

[[route]]
model = "n"
targets = [{ upstream = "b" }]

[breaker]
failures = 3
open_s = 2
max_open_s = 2
successes = 1
probe_interval_s = 1
"""
    gw = start(tmp_path, write_config(tmp_path, text))  # waits for one /readyz 200
    gateways.append(gw)
    # One 200 came from one worker; on a loaded host the other may still be warming its
    # connections for a moment: wait (bounded) until both say so, before the checks below.
    wait_for(lambda: [readyz(gw) for _ in range(4)] == [200] * 4)
    # b at its max_in_flight is busy, not broken: still ready. Its one place is held by an
    # answer the mock delays; when asking took longer than the hold (a loaded host once took
    # more than 3 s for the pause and four questions), b was no longer full while asked, so
    # it is asked again under a hold twice as long.
    held: list[httpx.Response] = []
    for hold_ms in (3000, 6000, 12000, 24000):
        fresh["b"].behave(latency_ms=hold_ms)
        held.clear()
        t = threading.Thread(target=lambda: held.append(post(gw, {**CHAT, "model": "n"})))
        t.start()
        wait_for(lambda: upstream_stats(gw, "b")["in_flight"] == 1)
        time.sleep(0.6)  # more than two worker ticks: each worker's READY gauge is current
        assert [readyz(gw) for _ in range(4)] == [200] * 4
        full_while_asked = upstream_stats(gw, "b")["in_flight"] == 1
        t.join(timeout=hold_ms / 1000 + 30)
        assert held[0].status_code == 200
        if full_while_asked:
            break
    else:
        raise AssertionError("b's place was never still held when readiness had been asked")
    # Every upstream of route n open: not ready, though route m is fine.
    fresh["b"].behave(status=503)
    for _ in range(3):
        assert post(gw, {**CHAT, "model": "n"}).status_code == 503
    assert upstream_stats(gw, "b")["state"] == "open"
    assert wait_for(lambda: readyz(gw) == 503, timeout=5)
    assert post(gw).status_code == 200  # route m still serves
    # b recovers: the background probe closes its breaker and the gateway is ready again.
    fresh["b"].behave()
    wait_for(lambda: upstream_stats(gw, "b")["state"] == "closed", timeout=20)
    assert wait_for(lambda: readyz(gw) == 200, timeout=5)


# --- panic mode ------------------------------------------------------------------------------


def test_panic_mode_sends_to_the_target_open_longest(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    breaker = "\n[breaker]\nfailures = 1\nopen_s = 60\nmax_open_s = 120\n"
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, breaker)))
    gateways.append(gw)
    fresh["a"].behave(status=503)
    fresh["b"].behave(status=503)
    # One request fails on its first target (which opens), then on the other (which opens).
    failed = post(gw)
    assert failed.status_code == 503
    assert failed.headers["x-velox-attempts"] == "2"
    rows = {u["name"]: u for u in admin_stats(gw)["upstreams"]}
    assert rows["a"]["state"] == rows["b"]["state"] == "open", rows
    assert rows["a"]["panics"] == rows["b"]["panics"] == 0
    longest = (failed.headers["x-velox-upstream"] == "a" and "b") or "a"  # the first one tried
    assert rows[longest]["opened_at_ms"] <= rows[failed.headers["x-velox-upstream"]][
        "opened_at_ms"]
    fresh["a"].behave()
    fresh["b"].behave()
    # Every target open: rather than failing, requests go to the one open longest.
    replies = [post(gw) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert {r.headers["x-velox-upstream"] for r in replies} == {longest}
    after = {u["name"]: u for u in admin_stats(gw)["upstreams"]}
    assert after[longest]["panics"] == 3
    assert after["a" if longest == "b" else "b"]["panics"] == 0
    assert chat_calls(fresh[longest]) == 4  # its failure, then the three panics


# --- doctor ----------------------------------------------------------------------------------


def test_doctor_checks_every_upstream_of_the_file_by_name(
        tmp_path: Path, fresh: dict) -> None:
    down_port = free_port()  # nothing listens there: the second upstream is down
    text = upstream_table("a", fresh["a"]) + upstream_table("b", fresh["b"]).replace(
        fresh["b"].origin, f"https://127.0.0.1:{down_port}") + """
[[route]]
model = "m"
targets = [{ upstream = "a" }, { upstream = "b" }]
"""
    config = write_config(tmp_path, text)
    env = {"PATH": os.environ.get("PATH", ""), "VELOX_CONFIG": str(config),
           "VELOX_PORT": str(free_port()), "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
           **KEYS}
    doctor = subprocess.run([sys.executable, "-m", "velox", "doctor"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    out = doctor.stdout
    assert doctor.returncode == 1, out + doctor.stderr
    assert re.search(r"^PASS  config .*2 upstream\(s\) \(a, b\) and 1 route\(s\)", out, re.M), out
    for check in ("dns", "connect", "tls", "h2", "warmup"):
        assert re.search(rf"^PASS  upstream-{check}\[a\] ", out, re.M), (check, out)
    assert "ALPN negotiated h2" in out
    assert re.search(r"^PASS  upstream-warmup\[a\] GET /v1/models answered 200", out, re.M)
    assert re.search(r"^PASS  upstream-dns\[b\] ", out, re.M)
    assert re.search(rf"^FAIL  upstream-connect\[b\] cannot connect to 127.0.0.1:{down_port}: "
                     r"Connection refused", out, re.M), out
    assert f"`origin` of [[upstream]] 'b' in {config}" in out  # where to fix it
    for check in ("tls", "h2", "warmup"):
        assert re.search(rf"^SKIP  upstream-{check}\[b\] ", out, re.M), (check, out)
    assert "1 check(s) failed" in out
    # The mock saw the warm-up with a's own key.
    seen = [r for r in fresh["a"].requests(limit=20) if r["path"] == "/v1/models"]
    assert seen and seen[-1]["auth"] == {"kind": "authorization",
                                         "key_sha256": fingerprint(KEYS["KEY_A"])}


def test_doctor_names_the_key_variable_of_an_upstream_answering_401(
        tmp_path: Path, fresh: dict) -> None:
    config = write_config(tmp_path, upstream_table("c", fresh["c"]) + """
[[route]]
model = "m"
targets = [{ upstream = "c" }]
""")
    fresh["c"].behave(status=401)  # as an upstream refusing the key does
    env = {"PATH": os.environ.get("PATH", ""), "VELOX_CONFIG": str(config),
           "VELOX_PORT": str(free_port()), "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
           **KEYS}
    doctor = subprocess.run([sys.executable, "-m", "velox", "doctor"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    out = doctor.stdout
    assert doctor.returncode == 1, out + doctor.stderr
    assert re.search(r"^FAIL  upstream-warmup\[c\] GET /v1/models answered 401: the configured "
                     r"key was refused", out, re.M), out
    assert "set the variable KEY_C (`api_key_env` of [[upstream]] 'c'" in out
