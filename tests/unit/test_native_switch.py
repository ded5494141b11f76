"""VELOX_NATIVE=0 runs a worker on every Python twin, the usage scans, the spend book and the
access log's book included, and the twins give what the native pieces give.

One worker's whole request path without sockets (velox_lab/pipeline.py), priced: the same
plain answers and streams (the stream's usage added by the gateway and stripped again) through
a gateway built with VELOX_NATIVE=1 and one built with VELOX_NATIVE=0. The twins must be the
ones called in the second and never in the first, and both must give the same client bytes'
cost headers, the same ledger rows and the same access-log lines apart from times and ids.
The same comparison with real processes, an SDK and a TLS upstream: tests/e2e/
test_native_twins.py.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from velox import _native
from velox.admin import twins as access_twins
from velox.admin.accesslog import AccessLog
from velox.admin.agent import Agent
from velox.ingress import h1write
from velox.relay import twins as usage_twins
from velox.relay import usage
from velox.routing import balance
from velox.routing import twins as hash_twins
from velox.spend.book import BookTwin, SpendBook
from velox.spend.rowframe import FRAME_COLUMNS, unpack
from velox_lab.pipeline import CHAT_BODY, Pipeline

PRICE = """
[[price]]
model = "gpt-4o-mini"
input = 0.15
output = 0.6
cached_input = 0.075
"""
# What differs between two runs of the same requests: clocks, and ids made per process.
_TIMES = {"time", "upstream_us", "total_us", "request_id"}
_ROW_TIMES = {"ts_ms", "latency_us", "request_id"}
_COST = re.compile(rb"\r\nx-velox-cost-usd: ([0-9.]+)\r\n")


@pytest.fixture(autouse=True)
def _native_again() -> Iterator[None]:
    """The switches are module-wide (a worker is a process of its own): put them back for the
    tests that run after these in this process."""
    yield
    usage.use(native=True)
    h1write.use(native=True)
    balance.use(native=True)


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
              calls: dict[str, int]) -> None:
    real: Callable[..., Any] = getattr(module, name)
    calls[name] = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def _run(native: bool, config: Path, out: int) -> tuple[list[bytes], list[dict[str, Any]], Any]:
    """Plain answers and streams through one priced worker, its access log written to `out`:
    the client's cost headers, the ledger's rows and the worker."""
    pipeline = Pipeline(clients=4, codec="native" if native else "framer",
                        VELOX_CONFIG=str(config))
    worker = pipeline.worker
    spend = worker.spend
    assert spend is not None
    spend.priced.rows_max = 1000  # a ledger feed's bound: rows are kept for `take`
    log = AccessLog(0, worker.counters, fd=out, key_names=(), priced=True, native=native)
    worker.log_access, worker.log_done = log.append, log.done
    for _, transport in pipeline.clients:
        transport.keep = True
    pipeline.round()
    pipeline.stream_round(3)
    pipeline.round()
    log.close(timeout=0)
    headers = [c for _, t in pipeline.clients for c in _COST.findall(b"".join(t.chunks))]
    taken = spend.take()
    assert taken is not None
    frame = unpack(taken[0])
    rows = [{name: column[r] for name, column in zip(FRAME_COLUMNS, frame.columns,
                                                      strict=True) if name not in _ROW_TIMES}
            | {"names": frame.labels[frame.columns[1][r]]} for r in range(taken[1])]
    for row in rows:
        del row["label"]  # a number per frame; its names are compared instead
    return headers, rows, worker


def _lines(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in orjson.loads(line).items() if k not in _TIMES}
            for line in path.read_bytes().splitlines()]


def test_native_0_prices_and_logs_on_the_twins_with_the_native_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "velox.toml"
    config.write_text(PRICE)
    calls: dict[str, int] = {}
    for name in ("usage_scan", "usage_parts_scan"):
        _counting(monkeypatch, usage_twins, name, calls)
    _counting(monkeypatch, usage, "estimate_twin", calls)
    _counting(monkeypatch, access_twins, "access_line", calls)
    results = {}
    for native in (True, False):
        path = tmp_path / f"access-{int(native)}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            headers, rows, worker = _run(native, config, fd)
        finally:
            os.close(fd)
        results[native] = headers, rows, _lines(path)
        book = worker.spend.priced
        hashers = {type(tier.hasher) for chain in worker.dispatch.router.chains.values()
                   for picker in chain for tier in picker.tiers}
        if native:
            assert type(book) is SpendBook
            assert hashers == {_native.Rendezvous} and balance.hash64 is _native.hash64
            assert calls == dict.fromkeys(calls, 0), "a twin ran with VELOX_NATIVE=1"
        else:
            assert type(book) is BookTwin
            assert hashers == {hash_twins.Rendezvous} and balance.hash64 is hash_twins.hash64
            # Plain answers' usage with its parts (spend), streams' usage chunk (the meter's
            # scan), every line by the twin's formatter.
            assert calls["usage_parts_scan"] >= 8 and calls["usage_scan"] >= 4, calls
            assert calls["access_line"] == len(results[False][2]), calls
    (headers, rows, lines), twin = results[True], results[False]
    assert len(headers) == 8 and len(rows) == 12 and len(lines) == 12  # 8 plain, 4 streams
    assert all(line["cost_usd"] is not None for line in lines)
    # bytes_out counts the answer's server-timing header, whose durations have as many digits
    # as the host's speed gives them: equal within those digits, the rest exactly.
    sizes = [[line.pop("bytes_out") for line in run] for run in (lines, twin[2])]
    assert all(abs(a - b) <= 8 for a, b in zip(*sizes, strict=True)), sizes
    assert twin == (headers, rows, lines)


def test_the_estimate_twin_reads_what_the_native_scan_reads() -> None:
    image = b'{"model":"m","messages":[{"role":"user","content":[{"type":"image_url",' \
        b'"image_url":{"url":"data:image/png;base64,' + b"A" * 4000 + b'"}}]}]}'
    for body in (CHAT_BODY, image, b'{"max_tokens":7,"max_output_tokens":9}', b"not json",
                 b'{"tools":[{"max_tokens":5}]}', b""):
        assert usage.estimate_twin(body) == usage.estimate_scan(body), body
    usage.use(native=False)
    assert usage.estimate_scan is usage.estimate_twin
    usage.use(native=True)
    assert usage.estimate_scan is not usage.estimate_twin


@pytest.mark.parametrize("native", [True, False])
def test_the_agent_starts_the_log_the_setting_selects(native: bool) -> None:
    """The worker's access log is the admin agent's to make (velox.admin.agent): with
    VELOX_NATIVE=0 it writes through the twin's book and formatter."""
    worker = Pipeline(clients=1, codec="native" if native else "framer").worker
    agent = Agent(worker)
    asyncio.run(agent.start())  # no control socket here: the access log alone
    log = agent.access_log
    assert log is not None and worker.log_access == log.append
    try:
        assert type(log.queue) is (_native.AccessBook if native else access_twins.AccessBook)
        assert log._line is (_native.access_line if native else access_twins.access_line)
    finally:
        log.close(timeout=0)
