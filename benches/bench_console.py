"""What the console costs the gateway, and what a key lookup costs as the key table grows.

* `test_sampler_cost`: one sample of the console's sampler (velox/admin/sampler.py) on shared
  memory with 2 workers, 3 upstreams and latency histograms holding 100,000 answers: µs per
  sample, and the share of one core it takes at its 1 s interval (it runs whether or not a
  page is open).
* `test_open_page_cost`: a real gateway (2 workers, the mock upstream, a light closed loop of
  1 connection as idle traffic). The supervisor's CPU time (psutil, the process that runs the
  admin server) over 300 polls of what the Overview page asks every second
  (`/ui/api/series?after=<last>`) and of what the Upstreams page asks (`/ui/api/upstreams`
  plus the series): CPU per poll, hence % of one core for one open page; and the supervisor's
  CPU over 20 s with no page open, for scale.
* `test_key_lookup`: the request path finds a caller's key by ONE dict lookup of its 32-byte
  digest (velox.keys.KeyStage.by_digest; ingress hashed the credential already), and run-time
  keys will keep it so: ns per lookup of present keys (1,024 of them in turn, so the cache
  is not always warm) in a dict of 10, 10,000 and 100,000 keys, and of an absent key.

Run: `pytest --benchmark benches/bench_console.py -s`.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
from typing import Any

import httpx
import psutil
import pytest

from velox.admin.sampler import Sampler
from velox.config.tables import RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.core.fields import H
from velox.state.stats import SharedStats
from velox_lab.closedloop import ClosedLoop, chat_request
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

POLLS = 300
TOKEN = "bench-console-token-0123456789"


def test_sampler_cost(benchmark: Any) -> None:
    ups = tuple(UpstreamSpec(f"u{i}", f"https://127.0.0.1:{9000 + i}") for i in range(3))
    tables = Tables(ups, (RouteSpec("*", tuple(TargetSpec(u.name) for u in ups)),))
    shared = SharedStats(2, tables)
    rng = random.Random(1)
    for slot in range(shared.slots):
        for _ in range(25_000):
            shared.histograms[H.TOTAL].record(slot, int(rng.lognormvariate(6.5, 1.0)))
    sampler = Sampler(shared)
    sampler.take()
    benchmark(sampler.take)
    per_sample_us = benchmark.stats.stats.median * 1e6
    benchmark.extra_info.update(per_sample_us=round(per_sample_us, 1),
                                core_share_pct_at_1hz=round(per_sample_us / 1e4, 4))
    print(f"\nsampler: {per_sample_us:.0f} us per sample = "
          f"{per_sample_us / 1e4:.3f}% of one core at one sample a second")


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_open_page_cost(benchmark: Any) -> None:
    with MockUpstream(tls=True, certdir=tempfile.mkdtemp()) as mock:
        env = {"VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
               "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0", "VELOX_ACCESS_LOG": "0",
               "VELOX_UPSTREAM_API_KEY": "sk-bench", "VELOX_ADMIN_TOKEN": TOKEN}
        with GatewayProcess(env) as gw:
            body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
            idle = ClosedLoop(gw.host, gw.port, chat_request(body), concurrency=1,
                              max_seconds=600).start()
            supervisor = psutil.Process(gw.pid)
            admin = httpx.Client(base_url=gw.admin_url or "",
                                 headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            try:
                time.sleep(3)  # samples to return
                before, t0 = _cpu(supervisor), time.monotonic()
                time.sleep(20)
                idle_share = (_cpu(supervisor) - before) / (time.monotonic() - t0)
                results = {}
                for page, paths in (("overview", ("/ui/api/series",)),
                                    ("upstreams", ("/ui/api/upstreams", "/ui/api/series"))):
                    last = time.time() - 1.5  # a page asks for the samples it lacks: ~1
                    before = _cpu(supervisor)
                    for _ in range(POLLS):
                        for path in paths:
                            query = {"after": f"{last}"} if path.endswith("series") else None
                            assert admin.get(path, params=query).status_code == 200
                    results[page] = (_cpu(supervisor) - before) / POLLS
                benchmark.pedantic(lambda: admin.get("/ui/api/series", params={"after": "0"}),
                                   rounds=50, iterations=1)
            finally:
                idle.stop()
                idle.join()
                admin.close()
    for page, cpu in results.items():
        benchmark.extra_info[f"{page}_cpu_us_per_poll"] = round(cpu * 1e6)
        benchmark.extra_info[f"{page}_core_share_pct_at_1hz"] = round(cpu * 100, 3)
        print(f"\n{page} page: {cpu * 1e6:.0f} us of supervisor CPU per poll = "
              f"{cpu * 100:.3f}% of one core at one poll a second")
    benchmark.extra_info["supervisor_idle_core_share_pct"] = round(idle_share * 100, 3)
    benchmark.extra_info["idle_traffic_req_per_s"] = round(idle.completed / max(idle.elapsed,
                                                                                 1e-9))
    print(f"supervisor with no page open (sampler, heartbeats, idle traffic): "
          f"{idle_share * 100:.3f}% of one core")


@pytest.mark.parametrize("keys", [10, 10_000, 100_000])
def test_key_lookup(benchmark: Any, keys: int) -> None:
    digests = [hashlib.sha256(os.urandom(16)).digest() for _ in range(keys)]
    table = {d: i for i, d in enumerate(digests)}
    probe = [digests[(i * 7919) % keys] for i in range(1024)]
    absent = hashlib.sha256(b"absent").digest()
    get = table.get

    def lookups() -> None:
        for d in probe:
            get(d)

    benchmark(lookups)
    per_ns = benchmark.stats.stats.median / len(probe) * 1e9
    start = time.perf_counter_ns()
    for _ in range(100_000):
        get(absent)
    miss_ns = (time.perf_counter_ns() - start) / 100_000
    benchmark.extra_info.update(keys=keys, ns_per_lookup=round(per_ns, 1),
                                ns_per_absent_lookup=round(miss_ns, 1))
    print(f"\n{keys:,} keys: {per_ns:.1f} ns per lookup (present), {miss_ns:.1f} ns absent")
