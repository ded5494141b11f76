"""Does a large upload stall the worker for everyone else? Loop latency during 16 MiB uploads.

One worker (so the uploads and the probes share one event loop) in front of the mock
upstream over HTTP/2 + TLS. A closed loop of probes (4 connections) runs for a few
seconds while another connection uploads 16 MiB chat bodies back to back; the probes'
latency percentiles and maximum say how long the loop was held. The probes are `GET /healthz`,
which the worker answers itself, so their latency is the loop's and not the upstream's. Two
gateways run side by side, measured alternately so machine drift hits both alike:

* `off-loop` (the default): bodies of VELOX_PARSE_OFF_LOOP_BYTES (256 KiB) or more are
  validated by the native scanner in a thread, with the GIL released;
* `on-loop` (VELOX_PARSE_OFF_LOOP_BYTES=0): orjson parses every body on the event loop,
  which holds the loop for the whole parse of each 16 MiB body;
* `no parse`: the same uploads to a path Velox forwards without parsing (`/v1/files`; the
  mock answers 404), the floor: what receiving and forwarding 16 MiB cost the loop.

`quiet` runs have no uploads. Receiving and forwarding cost the loop too (socket reads, body
framing and TLS writes in slices of at most 1 MiB), and the machine is shared: the mock decrypts
and parses every upload on the same 2 cores as the worker, in every variant alike.

Run: `pytest --benchmark benches/bench_bigbody.py -s`.
"""

from __future__ import annotations

import http.client
import multiprocessing
import statistics
import tempfile
import time

import orjson

from velox_lab.closedloop import ClosedLoop
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

# 16 MiB of message text, the largest body VELOX_MAX_BODY_BYTES accepts by default.
_TEXT = "All work and no play makes a long prompt. " * (16 * 1024 * 1024 // 43 - 4)
LARGE = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": _TEXT}]})
PROBE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
CONFIGS = {"off-loop": {}, "on-loop": {"VELOX_PARSE_OFF_LOOP_BYTES": "0"}}
# variant: (gateway, upload path, the upstream's answer to it); None: no uploads
VARIANTS: dict[str, tuple[str, str | None, int]] = {
    "off-loop quiet": ("off-loop", None, 0),
    "off-loop uploads": ("off-loop", "/v1/chat/completions", 200),
    "on-loop uploads": ("on-loop", "/v1/chat/completions", 200),
    "no parse uploads": ("off-loop", "/v1/files", 404),
}
SECONDS = 4.0
ROUNDS = 3


class Uploader:
    """Posts LARGE on one keep-alive connection, back to back, until stopped. A process of its
    own, so its sends never compete with the probes for this process's GIL."""

    def __init__(self, port: int, path: str, status: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        self._count = ctx.Value("i", 0)
        self._failed = ctx.Value("i", 0)
        self._proc = ctx.Process(target=self._run, args=(port, path, status), daemon=True)

    def start(self) -> None:
        self._proc.start()

    def join(self, timeout: float) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            raise TimeoutError("the uploader did not stop")

    @property
    def uploads(self) -> int:
        return self._count.value

    @property
    def failed(self) -> int:
        return self._failed.value

    def _run(self, port: int, path: str, status: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            while not self.stop.is_set():
                conn.request("POST", path, body=LARGE,
                             headers={"content-type": "application/json"})
                reply = conn.getresponse()
                reply.read()
                counter = self._count if reply.status == status else self._failed
                with counter.get_lock():
                    counter.value += 1
        finally:
            conn.close()


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def _run(gw: GatewayProcess, path: str | None, status: int) -> dict[str, float]:
    uploader = Uploader(gw.port, path, status) if path else None
    if uploader is not None:
        uploader.start()
        time.sleep(0.3)  # the first upload is on its way
    load = ClosedLoop("127.0.0.1", gw.port, PROBE, concurrency=4,
                      max_seconds=SECONDS).start().join()
    if uploader is not None:
        uploader.stop.set()
        uploader.join(60)
        assert uploader.uploads > 0 and uploader.failed == 0, (uploader.uploads, uploader.failed)
    assert set(load.statuses) == {200} and not load.errors, (load.statuses, load.errors[:3])
    lat = load.latencies_ns
    return {"p50_us": _percentile(lat, 0.5), "p99_us": _percentile(lat, 0.99),
            "p999_us": _percentile(lat, 0.999), "max_us": max(lat) / 1e3,
            "uploads": uploader.uploads if uploader else 0}


def test_large_uploads_do_not_stall_the_loop(benchmark) -> None:
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    with MockUpstream(tls=True, certdir=tempfile.mkdtemp()) as mock:
        base = {"VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
                "VELOX_WORKERS": "1", "VELOX_EGRESS_POOL_CONNECTIONS": "1",
                "VELOX_UPSTREAM_API_KEY": "sk-bench", "VELOX_ACCESS_LOG": "0",
                "VELOX_RATE_LIMIT_RPM": "0"}
        gateways = {name: GatewayProcess({**base, **env}).start() for name, env in CONFIGS.items()}
        try:
            def measure() -> None:
                for r in range(ROUNDS):
                    order = list(VARIANTS)[r % len(VARIANTS):] + list(VARIANTS)[:r % len(VARIANTS)]
                    for variant in order:
                        name, path, status = VARIANTS[variant]
                        runs[variant].append(_run(gateways[name], path, status))

            benchmark.group = "large uploads: /healthz latency on the uploading worker"
            benchmark.pedantic(measure, rounds=1, iterations=1)
        finally:
            for gw in gateways.values():
                gw.stop()
    summary = {key: {stat: round(statistics.median(r[stat] for r in results), 1)
                     for stat in ("p50_us", "p99_us", "p999_us", "max_us", "uploads")}
               for key, results in runs.items()}
    for key, stats in summary.items():
        benchmark.extra_info.update({f"{key.replace(' ', '_')}_{k}": v for k, v in stats.items()})
    on, off = summary["on-loop uploads"], summary["off-loop uploads"]
    benchmark.extra_info["ratio_p999_on_vs_off"] = round(on["p999_us"] / off["p999_us"], 2)
    benchmark.extra_info["ratio_max_on_vs_off"] = round(on["max_us"] / off["max_us"], 2)
    print()
    for key, stats in summary.items():
        print(f"{key:18s} p50 {stats['p50_us']:8.0f} us  p99 {stats['p99_us']:8.0f} us  "
              f"p99.9 {stats['p999_us']:8.0f} us  max {stats['max_us']:8.0f} us  "
              f"({stats['uploads']:.0f} uploads of {len(LARGE) / 2**20:.1f} MiB)")
