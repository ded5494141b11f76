"""What seeing inside costs: the access log per request, and a running profile's throughput cost.

* `test_access_log_cost`: one worker's whole path without sockets (velox_lab/pipeline.py), 64
  requests per round, CPU time per request with the access log off, with only its hot-path
  enqueue, and on. "On" also formats and writes the round's lines (to /dev/null) on the same
  thread, so it includes the logging thread's work, not only the enqueue.
* `test_profile_throughput_cost`: a real gateway (2 workers) in front of the mock upstream,
  under a closed loop of 64 connections; requests per second and the workers' CPU time per
  request, first without and then while `/debug/pprof/profile` runs, alternating a few times.
  Meanwhile `/stats` and `/metrics` are fetched every 50 ms: how long the admin server takes
  to answer while the workers are saturated.

Run: `pytest --benchmark benches/bench_admin.py -s`.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import httpx
import orjson
import psutil

from velox.admin.accesslog import AccessLog
from velox_lab.closedloop import ClosedLoop, chat_request
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream
from velox_lab.pipeline import Pipeline

CLIENTS = 64


def _round(access_log: str) -> Callable[[], None]:
    """One pipeline round for: "off", "enqueue" (hot path only: lines dropped), "on"."""
    pipeline = Pipeline(clients=CLIENTS)
    log = None
    if access_log != "off":
        log = AccessLog(0, pipeline.worker.counters, fd=os.open(os.devnull, os.O_WRONLY))
        pipeline.worker.log_access = log.append

    def round_() -> None:
        pipeline.round()
        if log is not None:
            if access_log == "on":
                log.flush()
            else:
                log.queue.take(1 << 24)  # made, then discarded

    for _ in range(50):
        round_()
    return round_


def test_access_log_cost(benchmark) -> None:
    """CPU time (process_time: every thread, immune to other processes' load) per request."""
    variants = ("off", "enqueue", "on")
    rounds = {v: _round(v) for v in variants}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    gc.collect()
    gc.freeze()

    def measure() -> None:
        for _ in range(30):  # interleaved, so drift hits every variant alike
            for variant in variants:
                round_ = rounds[variant]
                started = time.process_time_ns()
                for _ in range(40):
                    round_()
                samples[variant].append((time.process_time_ns() - started) / 40 / CLIENTS / 1e3)

    benchmark.group = "access log: CPU per request, one worker's path without sockets"
    benchmark.pedantic(measure, rounds=1, iterations=1)
    gc.unfreeze()
    per_request = {v: statistics.median(samples[v]) for v in variants}
    benchmark.extra_info.update({f"cpu_us_per_request_{v}": round(per_request[v], 2)
                                 for v in variants})
    print("\naccess log CPU per request: " + ", ".join(
        f"{v} {per_request[v]:.2f} us" for v in variants))


def _worker_cpu_s(gw: GatewayProcess) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in psutil.Process(gw.pid).children())


class AdminProbe(threading.Thread):
    """Fetches /stats and /metrics alternately every 50 ms; records how long each took."""

    def __init__(self, admin_url: str) -> None:
        super().__init__(name="admin-probe", daemon=True)
        self.admin_url = admin_url
        self.stop = threading.Event()
        self.ms: dict[str, list[float]] = {"/stats": [], "/metrics": []}

    def run(self) -> None:
        with httpx.Client(base_url=self.admin_url, timeout=30) as client:
            while not self.stop.wait(0.05):
                for path, samples in self.ms.items():
                    started = time.perf_counter()
                    assert client.get(path).status_code == 200
                    samples.append((time.perf_counter() - started) * 1e3)


def _run(gw: GatewayProcess, request: bytes, seconds: float,
         profile: bool, probe: AdminProbe | None = None) -> tuple[float, float]:
    """(requests per second, worker CPU µs per request) over one closed-loop run."""
    load = ClosedLoop("127.0.0.1", gw.port, request, concurrency=CLIENTS,
                      max_seconds=seconds + 0.5)
    cpu_before = _worker_cpu_s(gw)
    load.start()
    time.sleep(0.25)  # connections open, loop warm
    done_before, t0 = load.completed, time.monotonic()
    profiler = None
    if probe is not None:
        probe.start()
    if profile:
        profiler = threading.Thread(target=lambda: httpx.get(
            f"{gw.admin_url}/debug/pprof/profile?seconds={seconds}&format=text",
            timeout=seconds + 30))
        profiler.start()
    time.sleep(seconds)
    done, t1 = load.completed, time.monotonic()
    load.join()
    if probe is not None:
        probe.stop.set()
        probe.join(60)
    if profiler is not None:
        profiler.join()
    assert set(load.statuses) == {200} and not load.errors, (load.statuses, load.errors[:3])
    cpu = _worker_cpu_s(gw) - cpu_before
    return (done - done_before) / (t1 - t0), cpu / max(1, load.completed) * 1e6


def test_profile_throughput_cost(benchmark) -> None:
    body = orjson.dumps({"model": "gpt-4o-mini",
                         "messages": [{"role": "user", "content": "hello"}]})
    request = chat_request(body)
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    probes: list[AdminProbe] = []
    with MockUpstream(tls=True, certdir=tempfile.mkdtemp()) as mock:
        env = {"VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
               "VELOX_WORKERS": "2", "VELOX_EGRESS_POOL_CONNECTIONS": "2",
               "VELOX_UPSTREAM_API_KEY": "sk-bench", "VELOX_ACCESS_LOG": "0",
               "VELOX_RATE_LIMIT_RPM": "0"}
        with GatewayProcess(env) as gw:

            def measure() -> None:
                for _ in range(3):
                    for profile in (False, True):
                        probe = None if profile else AdminProbe(gw.admin_url or "")
                        if probe is not None:
                            probes.append(probe)
                        results[profile].append(_run(gw, request, 3.0, profile, probe))

            benchmark.pedantic(measure, rounds=1, iterations=1)
    base_rps = statistics.median(r for r, _ in results[False])
    prof_rps = statistics.median(r for r, _ in results[True])
    base_cpu = statistics.median(c for _, c in results[False])
    prof_cpu = statistics.median(c for _, c in results[True])
    for path in ("/stats", "/metrics"):
        samples = sorted(ms for probe in probes for ms in probe.ms[path])
        key = path.strip("/")
        benchmark.extra_info.update({
            f"admin_{key}_under_load_p50_ms": round(statistics.median(samples), 2),
            f"admin_{key}_under_load_max_ms": round(samples[-1], 2),
            f"admin_{key}_under_load_n": len(samples)})
    benchmark.extra_info.update({
        "rps_without_profile": round(base_rps), "rps_while_profiling": round(prof_rps),
        "throughput_cost_pct": round((1 - prof_rps / base_rps) * 100, 1),
        "worker_cpu_us_per_request": round(base_cpu, 1),
        "worker_cpu_us_per_request_profiling": round(prof_cpu, 1),
    })
    print(f"\nwithout profile: {base_rps:.0f} req/s, {base_cpu:.1f} us worker CPU/request; "
          f"while profiling: {prof_rps:.0f} req/s, {prof_cpu:.1f} us "
          f"({(1 - prof_rps / base_rps) * 100:.1f}% fewer requests per second)")
