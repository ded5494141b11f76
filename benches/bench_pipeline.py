"""One worker's request path without sockets, per request (the Python side of a proxied call).

Each round: 64 clients each send an OpenAI SDK-shaped chat request (HTTP/1.1, 15 headers, a
~300-byte JSON body); ingress parses them and pushes them on the ring; one drain pops the batch,
parses the bodies from the arena, takes tokens, routes, encodes HTTP/2 frames and writes them
once; canned upstream answers come back through the codec and the relay writes each client
its response. The kernel's share (loopback sockets, TLS) is what this leaves out; the
end-to-end benchmark measures the whole. Variants change one thing at a time: VELOX_NATIVE=0 (every
Python twin), VELOX_BATCH_MAX=1, and the upstream connection's codec (the h2 and jh2 libraries,
the baselines the native codec is measured against; velox_lab.codecs).

Run: `pytest --benchmark benches/bench_pipeline.py`.
"""

from __future__ import annotations

import gc

import pytest

from velox_lab.pipeline import Pipeline

CLIENTS = 64
# name: (codec, settings)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "default (native, batch 64)": ("native", {}),
    "VELOX_NATIVE=0": ("framer", {}),
    "VELOX_BATCH_MAX=1": ("native", {"VELOX_BATCH_MAX": "1"}),
    "codec jh2": ("jh2", {}),
    "codec h2": ("h2", {}),
}


def _ready(codec: str = "native", **env: str) -> Pipeline:
    pipeline = Pipeline(clients=CLIENTS, codec=codec, **env)
    for _ in range(50):
        pipeline.round()
    # As in a worker: start-up objects are frozen out of the collector's sight.
    gc.collect()
    gc.freeze()
    return pipeline


def _per_request(benchmark: pytest.FixtureRequest) -> None:
    median = benchmark.stats.stats.median  # type: ignore[attr-defined]
    benchmark.extra_info["requests_per_round"] = CLIENTS  # type: ignore[attr-defined]
    benchmark.extra_info["per_request_us"] = round(median / CLIENTS * 1e6, 2)  # type: ignore[attr-defined]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pipeline_round(benchmark, variant: str) -> None:
    codec, env = VARIANTS[variant]
    pipeline = _ready(codec, **env)
    benchmark.group = "pipeline: one worker, 64 requests per round, no sockets"
    benchmark.pedantic(pipeline.round, rounds=300, iterations=1, warmup_rounds=10)
    _per_request(benchmark)
    assert pipeline.worker.in_flight == 0
    gc.unfreeze()


@pytest.mark.parametrize("phase", ["client request -> upstream frames",
                                   "upstream answer -> client"])
def test_pipeline_phase(benchmark, phase: str) -> None:
    pipeline = _ready()
    benchmark.group = "pipeline phases (default configuration), 64 requests per round"
    if phase.startswith("client"):
        benchmark.pedantic(pipeline.send_requests, setup=pipeline.answer_streams,
                           rounds=300, warmup_rounds=10)
    else:
        benchmark.pedantic(pipeline.answer_streams, setup=pipeline.send_requests,
                           rounds=300, warmup_rounds=10)
    _per_request(benchmark)
    gc.unfreeze()
