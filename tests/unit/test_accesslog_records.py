"""The access log keeps records, not requests: a request's line is made when it ends, or when its
exchange ends and its meter has settled (spend's meter settles after the client's answer is
written), so the request and its exchange are freed at once instead of living until the flush
for the cyclic GC to walk. Runs the socket-free worker (velox_lab.pipeline) with pricing on, as
shipped; the lines still carry the settled usage and the cost."""

from __future__ import annotations

import gc
import os
import select
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from tests.unit.test_books import _request
from velox.admin.accesslog import AccessLog
from velox.core.types import Request
from velox_lab.pipeline import Pipeline


@pytest.fixture
def out(tmp_path: Any) -> Iterator[tuple[int, Any]]:
    path = tmp_path / "access.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    yield fd, path
    os.close(fd)


def _lines(path: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _live_requests() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Request)


def test_ended_requests_are_freed_before_the_flush_and_their_lines_are_whole(
        out: tuple[int, Any]) -> None:
    fd, path = out
    pipeline = Pipeline(clients=16, VELOX_STATE_DIR="off")  # pricing on, as shipped
    worker = pipeline.worker
    assert worker.spend is not None
    log = AccessLog(0, fd=fd, priced=True)
    worker.log_access, worker.log_done = log.append, log.done
    pipeline.round()
    log.flush()
    gc.collect()
    gc.disable()  # only reference counting frees anything below
    try:
        before = _live_requests()
        for _ in range(5):
            pipeline.round()
        # 80 requests ended and none is written yet; holding them until the flush kept
        # every request (and its exchange) alive: 80 more here.
        assert len(log.queue) == 80 and not log.waiting
        assert _live_requests() - before < 16
    finally:
        gc.enable()
    assert log.flush() == 80
    lines = _lines(path)
    assert len(lines) == 96
    for line in lines:  # the meter settled after the answer was written: usage and cost read
        assert line["usage"] == {"input": 31, "output": 4, "exact": True}
        assert isinstance(line["cost_usd"], float) and line["cost_usd"] > 0


def _holder(done: bool) -> SimpleNamespace:
    meter = SimpleNamespace(done=done, input=7, output=3, exact=True, cost=1500)
    return SimpleNamespace(meter=meter, upstream_name=b"u", attempts=1, t_sent=1, t_headers=2,
                           headers=[])


def _item(holder: Any, n: int) -> tuple[Any, ...]:
    return (time.perf_counter_ns(), _request(b"/v1/x", "m", -1), holder, 200, n)


def test_a_line_waits_for_its_meter_and_a_holder_never_done_is_read_a_flush_later(
        out: tuple[int, Any]) -> None:
    fd, path = out
    log = AccessLog(0, fd=fd, priced=True)
    settles, never = _holder(False), _holder(False)
    log.append(_item(settles, 1))
    log.append(_item(never, 2))
    assert log.flush() == 0  # both wait
    settles.meter.done = True
    log.done(settles)
    # The settled one, and the other at the second flush since it came, as its meter stands.
    assert log.flush() == 2
    log.done(never)  # too late to matter, and nothing is written twice
    assert log.flush() == 0
    first, second = _lines(path)
    assert first["bytes_out"] == 1 and first["usage"] == {"input": 7, "output": 3, "exact": True}
    assert first["cost_usd"] == 0.0000015
    assert second["bytes_out"] == 2 and second["usage"] is None
    assert second["cost_usd"] == 0.0000015


def test_a_priced_line_takes_the_cost_set_when_the_exchange_ends(out: tuple[int, Any]) -> None:
    # Tokens counted at the body (the meter done early), priced only at the exchange's end
    # (an answer the body could not price): the line has the final cost, not null.
    fd, path = out
    log = AccessLog(0, fd=fd, priced=True)
    holder = _holder(True)
    holder.meter.cost = None
    log.append(_item(holder, 1))
    holder.meter.cost = 2_000_000_000
    log.done(holder)
    log.flush()
    assert _lines(path)[0]["cost_usd"] == 2


def test_one_holder_for_two_requests_loses_neither_and_close_writes_what_waits(
        out: tuple[int, Any]) -> None:
    fd, path = out
    log = AccessLog(0, fd=fd)
    holder = _holder(False)
    log.append(_item(holder, 1))
    log.append(_item(holder, 2))
    log.append(_item(_holder(False), 3))
    log.close()
    assert sorted(line["bytes_out"] for line in _lines(path)) == [1, 2, 3]
    assert all("cost_usd" not in line for line in _lines(path))  # not priced


def test_a_file_takes_large_writes_a_pipe_pipe_buf(out: tuple[int, Any]) -> None:
    # A pipe needs writes of at most PIPE_BUF for lines of several workers not to interleave;
    # a regular file does not: 64 KiB a write, ~190 lines where PIPE_BUF holds ~12.
    fd, _ = out
    r, w = os.pipe()
    try:
        for target, most in ((fd, 1 << 16), (w, select.PIPE_BUF)):
            log = AccessLog(0, fd=target)
            for n in range(600):
                log.append(_item(None, n))
            log._format()
            sizes = [len(chunk) for chunk, _ in log.held]
            assert max(sizes) <= most and max(sizes) > most - 1024
            log.held.clear()
            log.held_bytes = 0
            log.close()
    finally:
        os.close(r)
        os.close(w)
