"""What the per-request bookkeeping costs: the access log, token accounting, the counters.

Groups:

* books-pieces: one call of each piece a request pays for, the native one beside the Python
  it replaced (kept here as the reference): the access-log line (its fields gathered and
  written into the worker's buffer, as the log makes it; its declared record built and
  `access_line` of it, as it was; the line's dict through orjson with the Python attribute
  walk, before that), the usage of an answer
  (`usage_scan` against the regular expression), the usage with its cached and reasoning
  parts as pricing reads it (`usage_parts_scan` against usage_scan and the parts' search and
  parse, on the mock's answer with its parts 0 and with both reported), the token estimate
  (`estimate_scan` against input_tokens + output_limit), and Counters.add with an IntEnum
  field against a plain int.
* books-pipeline: one worker's whole request path without sockets (velox_lab/pipeline.py, 64
  clients, the OpenAI SDK's request), four ways: no access log and no token accounting, the
  access log alone (formatted and written to /dev/null at the end of each round, on the
  worker's thread, so its cost is in the thread's clock), token accounting alone
  (VELOX_TOKEN_ACCOUNTING=1, the default), both. Rounds are interleaved and timed with the
  thread's own CPU clock; `extra_info` has each variant's CPU us per request and its
  difference to the bare one.

* books-writer: what one worker's log sustains: 64 real pipeline records (spend on, so
  priced) formatted and written per flush of 1,024, to /dev/null and to a regular file
  (64 KiB writes) and to a pipe read by a thread (PIPE_BUF writes); lines/s of the loop's
  CPU in `extra_info`.

Run: `.venv/bin/pytest --benchmark benches/bench_books.py`.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import threading
import time
from typing import Any

import orjson
import pytest

from velox._native import AccessBook, access_line, estimate_scan, usage_parts_scan, usage_scan
from velox.admin.accesslog import AccessLog
from velox.core.fields import F
from velox.relay.records import access_record, log_fields
from velox.relay.usage import input_tokens, output_limit
from velox.spend.wire import _parts
from velox.state.stats import SharedStats
from velox_lab.mock.payloads import chat_completion
from velox_lab.pipeline import CHAT_BODY, REPLY_BODY, Pipeline

BATCH = 64
ROUNDS = 300


def _orjson_line(item: tuple[Any, ...], offset: int) -> bytes:
    """The access line as it was made before vx_books (attribute walk + dict + orjson)."""
    t_end, request, exchange, status, bytes_out = item
    upstream_us = request_id = upstream = usage = None
    attempts = 0
    if exchange is not None:
        meter = exchange.meter
        if meter is not None and meter.done:
            usage = {"input": meter.input, "output": meter.output, "exact": meter.exact}
        name = exchange.upstream_name
        upstream = name.decode() if name else None
        attempts = exchange.attempts
        if exchange.t_headers and exchange.t_sent:
            upstream_us = (exchange.t_headers - exchange.t_sent) // 1000
        for name, value in exchange.headers:
            if name == b"x-request-id":
                request_id = value[:512].decode("latin-1")
                break
    model = request.model
    return orjson.dumps({
        "time": "2026-01-01T00:00:00.000Z", "log": "access", "worker": 0,
        "method": "POST", "path": request.path.split(b"?", 1)[0][:512].decode("latin-1"),
        "model": model[:512] if model else None, "status": status,
        "bytes_in": len(request.body), "bytes_out": bytes_out, "upstream": upstream,
        "attempts": attempts, "upstream_us": upstream_us,
        "total_us": max(0, t_end - request.t_received) // 1000, "request_id": request_id,
        "key": None, "usage": usage,
    }, option=orjson.OPT_APPEND_NEWLINE)


def _logged_item() -> tuple[Any, ...]:
    """A real item of the access log: a pipeline round's last request and exchange."""
    pipeline = Pipeline(clients=1, codec="native")
    items: list[tuple[Any, ...]] = []
    pipeline.worker.log_access = items.append
    pipeline.round()
    pipeline.round()
    return items[-1]


_CHAT_USAGE = re.compile(
    rb'"usage"\s*:\s*\{\s*"prompt_tokens"\s*:\s*(\d{1,15})\s*,\s*"completion_tokens"\s*:'
    rb'\s*(\d{1,15})')


def _regex_usage(body: bytes) -> tuple[int, int] | None:
    i = body.rfind(b'"usage"')
    m = _CHAT_USAGE.match(body, i) if i >= 0 else None
    return (int(m.group(1)), int(m.group(2))) if m else None


# The mock's chat answer as the OpenAI API writes it: its usage details with both parts 0 (most
# answers), and with a prompt-cache hit and reasoning reported.
_ASKED = {"messages": [{"role": "user", "content": "Say hello."}]}
_ZERO_PARTS = chat_completion(_ASKED, "gpt-4o-mini", "b", 1, 12)
_WITH_PARTS = chat_completion({**_ASKED, "prompt_cache_key": "k", "reasoning_effort": "low"},
                              "gpt-4o-mini", "b", 1, 12)


def _pieces() -> dict[str, Any]:
    item = _logged_item()
    record = access_record(item)
    offset = 1_700_000_000_000_000_000
    counters = SharedStats(1).counters
    plain = int(F.REQUESTS)
    book = AccessBook(0, b"p-", (), True, 0)  # room 0: each line written, then dropped
    book.wall_offset = offset
    return {
        "access line: log_fields + native AccessBook.add (as the log makes it)":
            lambda: log_fields(book.add, item),
        "access line: access_record + native access_line":
            lambda: access_line(access_record(item), offset, 0, b"p-", 1, ()),
        "access line: native access_line of a record": lambda: access_line(record, offset, 0,
                                                                           b"p-", 1, ()),
        "access line: dict through orjson (before)": lambda: _orjson_line(item, offset),
        "usage: native usage_scan": lambda: usage_scan(REPLY_BODY),
        "usage: regular expression (before)": lambda: _regex_usage(REPLY_BODY),
        "usage with parts 0: native usage_parts_scan": lambda: usage_parts_scan(_ZERO_PARTS),
        "usage with parts 0: usage_scan + parts search (before)":
            lambda: (usage_scan(_ZERO_PARTS), _parts((_ZERO_PARTS,))),
        "usage with parts: native usage_parts_scan": lambda: usage_parts_scan(_WITH_PARTS),
        "usage with parts: usage_scan + parts search and parse (before)":
            lambda: (usage_scan(_WITH_PARTS), _parts((_WITH_PARTS,))),
        "estimate: native estimate_scan": lambda: estimate_scan(CHAT_BODY),
        "estimate: input_tokens + output_limit (before)":
            lambda: (input_tokens(CHAT_BODY), output_limit(CHAT_BODY)),
        "Counters.add, plain int field": lambda: counters.add(0, plain, 1),
        "Counters.add, IntEnum field (before)": lambda: counters.add(0, F.REQUESTS, 1),
    }


PIECES = list(_pieces())


@pytest.mark.parametrize("piece", PIECES)
def test_books_piece(benchmark: Any, piece: str) -> None:
    call = _pieces()[piece]
    benchmark.group = "books-pieces: one call"
    benchmark(call)


PIPELINE_VARIANTS = {  # name -> (access log, env)
    "bare (no log, VELOX_TOKEN_ACCOUNTING=0)": (False, {"VELOX_TOKEN_ACCOUNTING": "0"}),
    "access log": (True, {"VELOX_TOKEN_ACCOUNTING": "0"}),
    "token accounting": (False, {}),
    "access log + token accounting (defaults)": (True, {}),
}


def test_books_pipeline_paired(benchmark: Any) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    runs = {}
    try:
        for name, (log, env) in PIPELINE_VARIANTS.items():
            pipeline = Pipeline(clients=BATCH, codec="native", **env)
            access = AccessLog(0, pipeline.worker.counters, fd=devnull) if log else None
            if access is not None:
                pipeline.worker.log_access = access.append
                pipeline.worker.log_done = access.done

            def round_(pipeline: Pipeline = pipeline, access: AccessLog | None = access) -> None:
                pipeline.round()
                if access is not None:
                    access.flush()

            for _ in range(50):
                round_()
            runs[name] = (round_, access)
        names = list(runs)
        samples: dict[str, list[int]] = {name: [] for name in names}

        def run() -> None:
            clock = time.thread_time_ns
            for r in range(ROUNDS):
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    t0 = clock()
                    runs[name][0]()
                    samples[name].append(clock() - t0)

        gc.collect()
        gc.freeze()
        try:
            benchmark.group = "books-pipeline: one worker, 64 requests per round, no sockets"
            benchmark.pedantic(run, rounds=1, iterations=1)
        finally:
            gc.unfreeze()
        for name, (_, access) in runs.items():
            if access is not None:  # every request of every round got its line
                assert access.written == (ROUNDS + 50) * BATCH, name
    finally:
        os.close(devnull)
    per_request_us = {name: statistics.median(v) / BATCH / 1000 for name, v in samples.items()}
    base = per_request_us[names[0]]
    benchmark.extra_info.update({
        "requests_per_round": BATCH, "rounds_per_variant": ROUNDS,
        "cpu_us_per_request": {k: round(v, 2) for k, v in per_request_us.items()},
        "over_bare_us": {k: round(v - base, 2) for k, v in per_request_us.items()},
    })
    print()
    for name, value in per_request_us.items():
        print(f"  {name:44s} {value:7.2f} us/request CPU  ({value - base:+.2f})")


WRITER_LINES = 100_000


@pytest.mark.parametrize("target", ["/dev/null", "file", "pipe"])
def test_books_writer(benchmark: Any, target: str, tmp_path: Any) -> None:
    pipeline = Pipeline(clients=BATCH, codec="native", VELOX_STATE_DIR="off")
    records: list[Any] = []
    pipeline.worker.log_access = lambda item: records.append(access_record(item))
    pipeline.worker.log_done = None
    for _ in range(3):
        pipeline.round()
    records = (records * (WRITER_LINES // len(records) + 1))[:WRITER_LINES]
    reader = None
    if target == "/dev/null":
        fd = os.open(os.devnull, os.O_WRONLY)
    elif target == "file":
        fd = os.open(tmp_path / "access.log", os.O_WRONLY | os.O_CREAT)
    else:
        r, fd = os.pipe()
        reader = threading.Thread(
            target=lambda: [None for _ in iter(lambda: os.read(r, 1 << 16), b"")])
        reader.start()
    try:
        log = AccessLog(0, fd=fd, priced=True, held_max=1 << 30)

        def run() -> None:
            add = log.queue.add  # each line made as at its request's end, then a flush
            for start in range(0, WRITER_LINES, 1024):
                for record in records[start:start + 1024]:
                    add(*record)
                log.flush()

        clock = time.thread_time_ns
        t0 = clock()
        benchmark.group = "books-writer: lines formatted and written, one thread"
        benchmark.pedantic(run, rounds=1, iterations=1)
        cpu = clock() - t0
        log.close(timeout=10)
        assert log.written == WRITER_LINES
    finally:
        os.close(fd)
        if reader is not None:
            reader.join()
            os.close(r)
    benchmark.extra_info["lines_per_cpu_second"] = round(WRITER_LINES / (cpu / 1e9))
    print(f"\n  {target}: {WRITER_LINES / (cpu / 1e9):,.0f} lines/s of CPU")
