"""CPU cost of the bundled mock upstream per request.

Run: `pytest --benchmark benches/bench_mock.py -s` (or `python -m velox_lab.mock.selfbench`).

The figure that matters is `mock_cpu_us_per_request` in extra_info (also printed): the mock's
own utime+stime divided by requests, with 64 requests in flight. pytest-benchmark's wall time is
only the duration of one fixed-size run. Budget: <= 25 us over HTTP/2 + TLS, so that on a 2-core
machine the mock is never what limits a gateway benchmark.
"""

from __future__ import annotations

import pytest

from velox_lab.mock.selfbench import measure

REQUESTS = 30000


@pytest.mark.parametrize("scenario", ["h2-tls", "h1"])
def test_mock_cpu_per_request(benchmark, scenario):
    result = benchmark.pedantic(measure, args=(scenario,), kwargs={"requests": REQUESTS},
                                rounds=1, iterations=1)
    summary = result.summary()
    benchmark.extra_info.update(summary)
    print(f"\n{scenario}: {summary['mock_cpu_us_per_request']} us CPU/request in the mock, "
          f"{summary['requests_per_second']} req/s")
