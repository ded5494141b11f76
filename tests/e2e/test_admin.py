"""The admin side under load: profiles, /metrics, /stats, /healthz, the access log, doctor.

One gateway (2 workers) carries a bounded closed-loop load while the admin endpoints are
exercised; after the load stops, the counters, percentiles and access log are compared with
what the client sent and saw.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import closed_after_the_test
from velox_lab.closedloop import ClosedLoop, chat_request
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

from .conftest import CLIENT_KEY, UPSTREAM_KEY, GatewayFactory, gateway_env, wait_for

BODY = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
QUERY_SECRET = "qs-SECRET-in-the-query-4242"
# Each pipeline stage, and the names by which it may show in a profile. The rate limiter's one
# take per micro-batch is ~0.1% of the time, which a profile of a starved host (~200 samples
# in 2 s at a load average of 19) often misses; its refusal path is what makes the stage
# visible, so the limit must stay below what the gateway serves *while profiled* (the
# profiler triples the CPU per request). At 500/s a host at load 19 served 70/s under the
# profile and refused nothing then; at 20/s every host this runs on refuses most requests.
STAGES = {
    "ingress": ("data_received", "on_message_complete"),
    "worker": ("drain",),
    "parse": ("parse_model_call",),
    "rate limit": ("_limit", "take_up_to", "_refuse_rate_limited", "retry_after_s"),
    "egress": ("send", "flush"),
}
RATE_LIMIT_RPM = 1200
ADMIN_BOUND_S = 2.0  # liveness bound for admin answers while the workers are saturated


def missing_stages(text: str) -> list[str]:
    found = {name for names in STAGES.values() for name in names
             if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text)}
    missing = [f"{stage} (one of {names})" for stage, names in STAGES.items()
               if not found & set(names)]
    must = {"data_received", "on_message_complete", "drain", "parse_model_call"}
    missing += sorted(must - found)
    return missing


def timed_get(client: httpx.Client, url: str) -> httpx.Response:
    started = time.monotonic()
    response = client.get(url)
    elapsed = time.monotonic() - started
    assert elapsed < ADMIN_BOUND_S, f"{url} took {elapsed:.2f} s under load"
    return response


def metric_samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def requests_by_route(text: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for sample in metric_samples(text)["velox_requests_total"]:
        route = sample.labels["route"]
        totals[route] = totals.get(route, 0) + int(sample.value)
    return totals


def access_lines(gw: GatewayProcess) -> list[dict[str, Any]]:
    lines = []
    for line in gw.log().splitlines():
        if line.startswith('{"time"'):
            record = orjson.loads(line)
            assert record["log"] == "access"
            lines.append(record)
    return lines


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_admin_under_load(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_API_KEYS=CLIENT_KEY, VELOX_RATE_LIMIT_RPM=str(RATE_LIMIT_RPM),
                       VELOX_RATE_LIMIT_BURST="20")
    admin = gw.admin_url
    assert admin is not None
    load = ClosedLoop("127.0.0.1", gw.port, chat_request(BODY, f"Bearer {CLIENT_KEY}"),
                      concurrency=32, max_requests=300_000, max_seconds=20).start()
    client = httpx.Client(base_url=admin, timeout=30)
    closed_after_the_test(client)
    try:
        wait_for(lambda: load.completed > 500)
        html: dict[str, httpx.Response] = {}
        profiler = threading.Thread(target=lambda: html.update(
            r=client.get("/debug/pprof/profile?seconds=2")))
        refused_before = load.statuses.get(429, 0)
        profiler.start()
        wait_for(lambda: timed_get(client, "/stats").json()["profiles"]["active"])
        assert client.get("/debug/pprof/profile?seconds=1").status_code == 409
        for bad in ("seconds=0", "seconds=61", "seconds=abc", "seconds=-1", "seconds=nan",
                    "format=png", "worker=2", "worker=x", "seconds=1&seconds=2"):
            reply = client.get(f"/debug/pprof/profile?{bad}")
            assert reply.status_code == 400, bad
            assert reply.json()["error"]["message"]
        while profiler.is_alive():  # the admin side stays live while the workers are saturated
            assert timed_get(client, "/healthz").json()["status"] == "ok"
            metrics_text = timed_get(client, "/metrics").text
            assert "velox_requests_total" in metrics_text
            stats = timed_get(client, "/stats").json()
            assert len(stats["workers"]) == 2
            assert "Velox admin" in timed_get(client, "/debug/pprof/").text
        profiler.join()
        assert load.statuses.get(429, 0) > refused_before, "nothing refused while profiling"
        reply = html["r"]
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
        assert missing_stages(reply.text) == []
        for fmt in ("speedscope", "text", "svg"):
            rendered = client.get(f"/debug/pprof/last?format={fmt}")
            assert rendered.status_code == 200, fmt
            assert missing_stages(rendered.text) == [], fmt
            if fmt == "svg":
                root = ET.fromstring(rendered.content)
                assert root.tag == "{http://www.w3.org/2000/svg}svg"
                assert len(root.findall(".//{http://www.w3.org/2000/svg}rect")) > 20
            if fmt == "speedscope":
                assert "shared" in rendered.json()
        one = client.get("/debug/pprof/profile?seconds=1&worker=1&format=text")
        assert one.status_code == 200 and "worker 1" in one.text and "drain" in one.text
        # Enough answered for the counts below to mean something (20/s from a burst of 20).
        wait_for(lambda: load.statuses.get(200, 0) > 100)
        assert load.running, "the load must outlast the profiles"
    finally:
        load.stop()
        load.join()
    assert load.errors == [] and load.completed == load.sent
    assert set(load.statuses) <= {200, 429} and load.statuses.get(200, 0) > 100

    # A request with a secret in its query string: the access log must drop the query.
    with httpx.Client(base_url=gw.base_url, timeout=20) as api:
        reply = api.post(f"/v1/chat/completions?token={QUERY_SECRET}", content=BODY,
                         headers={"authorization": f"Bearer {CLIENT_KEY}",
                                  "content-type": "application/json"})
    statuses = dict(load.statuses)
    statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
    sent = load.completed + 1

    # /metrics agrees exactly with what was sent.
    wait_for(lambda: requests_by_route(client.get("/metrics").text)["model_call"] == sent)
    samples = metric_samples(client.get("/metrics").text)
    by_route = requests_by_route(client.get("/metrics").text)
    assert by_route["model_call"] == sent
    by_class: dict[str, int] = {}
    for sample in samples["velox_requests_total"]:
        if sample.labels["route"] == "model_call":
            cls = sample.labels["status_class"]
            by_class[cls] = by_class.get(cls, 0) + int(sample.value)
    assert by_class["2xx"] == statuses.get(200, 0) and by_class["4xx"] == statuses.get(429, 0)
    rejected = sum(s.value for s in samples["velox_rejected_requests_total"]
                   if s.labels["reason"] == "rate_limited")
    assert rejected == statuses.get(429, 0)
    assert sum(s.value for s in samples["velox_upstream_responses_total"]) == statuses[200]
    histogram = [s for s in samples["velox_upstream_latency_seconds_bucket"]
                 if s.labels["le"] == "+Inf"]
    assert sum(s.value for s in histogram) == statuses[200]
    assert sum(s.value for s in samples["velox_profile_runs_total"]) == 2

    # /stats percentiles are ordered and consistent with what the client measured.
    stats = client.get("/stats").json()
    for kind in ("total", "overhead", "upstream"):
        lat = stats["latency"][kind]
        assert lat["count"] == statuses[200]
        assert 0 < lat["p50_us"] <= lat["p90_us"] <= lat["p99_us"] <= lat["p999_us"], lat
    client_p50_us = percentile(load.latencies_ns, 0.5) / 1000
    client_p99_us = percentile(load.latencies_ns, 0.99) / 1000
    assert stats["latency"]["total"]["p50_us"] <= client_p50_us
    assert stats["latency"]["total"]["p50_us"] <= client_p99_us
    assert stats["latency"]["overhead"]["p50_us"] <= stats["latency"]["total"]["p50_us"]
    assert stats["requests"]["by_route"]["model_call"] == sent
    assert stats["rate_limit"]["enabled"] and stats["rate_limit"]["rpm"] == RATE_LIMIT_RPM
    assert {w["worker"] for w in stats["workers"]} == {0, 1}
    # A worker that does not answer the snapshot's question within its deadline is "busy"
    # (a busy host's loop a moment behind): asked again until both have answered.
    workers = wait_for(lambda: (lambda ws: all(isinstance(w["state"], dict) for w in ws) and ws)(
        client.get("/stats").json()["workers"]))
    for worker in workers:
        assert worker["pid"] > 0 and worker["ready"]
        state = worker["state"]
        conns = state["upstream"]["connections"]
        assert len(conns) == 2 and all(c["state"] == "READY" for c in conns), conns

    # The access log: one line per request, no key, no query string.
    lines = wait_for(lambda: (lambda ls: len(ls) >= sum(by_route.values()) and ls)(
        access_lines(gw)))
    chat = [r for r in lines if r["path"] == "/v1/chat/completions"]
    assert len(chat) == sent
    final_routes = requests_by_route(client.get("/metrics").text)
    assert len(lines) == sum(final_routes.values())
    assert {r["status"] for r in chat} <= {200, 429}
    ok = [r for r in chat if r["status"] == 200]
    assert all(r["model"] == "gpt-4o-mini" and r["upstream_us"] is not None for r in ok)
    assert all(r["request_id"] for r in chat)
    assert len({r["request_id"] for r in chat}) == len(chat)
    assert all(r["upstream_us"] is None for r in chat if r["status"] == 429)
    log = gw.log()
    for secret in (CLIENT_KEY, UPSTREAM_KEY, QUERY_SECRET):
        assert secret not in log

    # doctor, against the gateway that is up: its ports are Velox's, /readyz and /stats answer.
    doctor = run_doctor(gw.env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f"Velox (pid {gw.pid}) is up there, /readyz 200" in doctor.stdout
    assert f"Velox (pid {gw.pid}) is up there, /stats 200" in doctor.stdout
    client.close()


def test_a_restarted_worker_gets_a_new_control_channel(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_ACCESS_LOG="0")
    admin = gw.admin_url
    victim = psutil.Process(gw.pid).children()[0]
    victim.kill()

    def restarted() -> dict[str, Any] | None:
        stats = httpx.get(f"{admin}/stats", timeout=5).json()
        live = all(isinstance(w["state"], dict) and w["ready"] for w in stats["workers"])
        return stats if stats["restarts"] == 1 and live else None

    stats = wait_for(restarted)
    assert victim.pid not in {w["pid"] for w in stats["workers"]}
    profile = httpx.get(f"{admin}/debug/pprof/profile?seconds=0.3&format=speedscope", timeout=20)
    assert profile.status_code == 200
    assert not [line for line in gw.log().splitlines() if line.startswith('{"time"')]


def test_admin_address_in_use_stops_startup(upstream: MockUpstream, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        gw = GatewayProcess(gateway_env(upstream, VELOX_ADMIN_ADDR=addr),
                            log_path=tmp_path / "velox.log")
        with pytest.raises(RuntimeError, match="exited"):
            gw.start(timeout=20)
    assert f"cannot listen on {addr} (VELOX_ADMIN_ADDR)" in gw.log()


def test_profile_without_pyinstrument_says_how_to_install_it(
        start_gateway: GatewayFactory, tmp_path: Path) -> None:
    # pyinstrument is an extra: a gateway that cannot import it serves, and its profile path
    # answers 501 naming the extra instead of failing in the workers.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['pyinstrument'] = None  # as if not installed\n")
    gw = start_gateway(PYTHONPATH=str(tmp_path))
    status, body = gw.admin_get("/debug/pprof/profile?seconds=0.1")
    assert status == 501, body
    assert "pip install 'velox[profile]'" in orjson.loads(body)["error"]["message"]
    status, _ = gw.admin_get("/stats")
    assert status == 200


def test_admin_off_still_serves(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_ADMIN_ADDR="off")
    assert gw.admin_url is None
    reply = httpx.post(f"{gw.base_url}/v1/chat/completions", content=BODY,
                       headers={"content-type": "application/json"}, timeout=20)
    assert reply.status_code == 200


def run_doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "velox", "doctor"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent,
                          check=False)


def test_doctor_passes_against_the_mock_and_fails_against_a_closed_port(
        upstream: MockUpstream) -> None:
    base = {"PATH": os.environ.get("PATH", ""), "VELOX_PORT": str(free_port()),
            "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}
    good = run_doctor({**base, **gateway_env(upstream)})
    assert good.returncode == 0, good.stdout + good.stderr
    for check in ("config", "port", "admin-port", "upstream-dns", "upstream-connect",
                  "upstream-tls", "upstream-h2", "upstream-warmup"):
        assert re.search(rf"^PASS  {check}\s", good.stdout, re.M), (check, good.stdout)
    assert "ALPN negotiated h2" in good.stdout

    closed = run_doctor({**base, "VELOX_UPSTREAM_ORIGIN": f"https://127.0.0.1:{free_port()}"})
    assert closed.returncode == 1
    assert re.search(r"^FAIL  upstream-connect .*Connection refused", closed.stdout, re.M)
    assert "→ check that the upstream runs" in closed.stdout
    assert re.search(r"^SKIP  upstream-warmup", closed.stdout, re.M)
