"""What the usage ledger costs and sustains (velox/spend/ledger.py, velox/admin/ledgerfeed.py).

Groups:

* ledger-writer: the supervisor's writer thread end to end: 1,000,000 rows submitted in frames
  of 1,000 (as the control channel delivers them: velox.spend.rowframe's binary, decoded by
  `submit_frame`) until all are committed, one transaction per ~4,096 rows, WAL, with the
  daily totals. `extra_info`: rows per second
  (wall clock, and per CPU second of the process), and the file's size per million rows
  (database + WAL after the writer closed).
* ledger-worker: what a worker pays per request: `LedgerFeed.add` of a row plus its share of
  the flush that packs 1,000 rows into one control frame (rowframe.pack); and the
  supervisor's side, splitting that frame off the stream and decoding it (FrameReader,
  rowframe.unpack). Per row.

Run: `.venv/bin/pytest --benchmark benches/bench_ledger.py`.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

from velox.admin.control import FrameReader
from velox.admin.ledgerfeed import LedgerFeed
from velox.spend.ledger import LedgerWriter, make_row
from velox.spend.rowframe import pack, unpack

ROWS = 1_000_000
FRAME = 1000


def _rows(n: int, seed: int = 7) -> list[tuple[Any, ...]]:
    """Rows as a busy gateway makes them: 200 keys in 20 teams, 12 models on 3 upstreams,
    an upstream request id of 38 characters, one row in fifty without a price."""
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    models = [f"gpt-4o-mini-{i}" for i in range(12)]
    out = []
    for i in range(n):
        key = rnd.randrange(200)
        out.append(make_row(
            ts_ms=now - (n - i) // 10, key=f"team{key % 20}-key{key}", team=f"team{key % 20}",
            route=models[i % 12], upstream=f"upstream-{i % 3}", model=models[i % 12],
            api="chat", status=200 if i % 50 else 429, input_tokens=rnd.randrange(50, 4000),
            output_tokens=rnd.randrange(1, 800), cached_tokens=rnd.randrange(0, 1024),
            reasoning_tokens=0, cost_nanos=None if i % 50 == 0 else rnd.randrange(10**6),
            latency_us=rnd.randrange(200_000, 9_000_000),
            request_id=f"req_{uuid.UUID(int=rnd.getrandbits(128)).hex}"))
    return out


def test_ledger_writer_throughput(benchmark: Any, tmp_path: Path) -> None:
    rows = _rows(ROWS)
    frames = [pack(rows[i:i + FRAME])[0] for i in range(0, ROWS, FRAME)]
    result: dict[str, float] = {}

    def run() -> None:
        path = tmp_path / f"ledger-{len(result)}.sqlite3"
        writer = LedgerWriter(path, interval_s=0.05)
        writer.start()
        wall, cpu = time.perf_counter(), time.process_time()
        for frame in frames:
            if writer.submit_frame(frame) < FRAME:  # never expected: the queue holds 262k
                raise AssertionError("the writer's queue overflowed")
            while writer.stats()["queued"] > 8 * 4096:
                time.sleep(0.001)  # frames arrive as fast as the writer takes them
        while writer.stats()["written"] < ROWS:
            time.sleep(0.001)
        result["wall_s"] = time.perf_counter() - wall
        result["cpu_s"] = time.process_time() - cpu
        writer.close()
        size = sum(p.stat().st_size for p in tmp_path.glob(path.name + "*"))
        result["bytes"] = size

    benchmark.group = "ledger-writer: 1M rows through the writer thread"
    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update({
        "rows": ROWS,
        "rows_per_s_wall": round(ROWS / result["wall_s"]),
        "rows_per_cpu_s": round(ROWS / result["cpu_s"]),
        "file_mb_per_million_rows": round(result["bytes"] / 1e6 * 1e6 / ROWS, 1),
        "bytes_per_row": round(result["bytes"] / ROWS, 1),
        "cores": len(os.sched_getaffinity(0)),
    })


def test_ledger_worker_feed_per_row(benchmark: Any) -> None:
    rows = _rows(FRAME)
    sink: list[bytes] = []
    feed = LedgerFeed(sink.append, lambda: 0, rows_max=FRAME + 1)

    def run() -> None:
        add = feed.add
        for row in rows:
            add(row)
        feed.flush()
        sink.clear()

    benchmark.group = "ledger-worker: per row"
    benchmark.pedantic(run, rounds=300, warmup_rounds=20)
    benchmark.extra_info["us_per_row"] = round(benchmark.stats.stats.median / FRAME * 1e6, 3)


def test_ledger_supervisor_decode_per_row(benchmark: Any) -> None:
    frames: list[bytes] = []
    feed = LedgerFeed(frames.append, lambda: 0, rows_max=FRAME + 1)
    for row in _rows(FRAME):
        feed.add(row)
    feed.flush()
    frame = frames[0]

    def run() -> None:
        (body,) = FrameReader().feed(frame)
        assert len(unpack(body).columns[0]) == FRAME

    benchmark.group = "ledger-worker: per row"
    benchmark.pedantic(run, rounds=300, warmup_rounds=20)
    benchmark.extra_info["us_per_row"] = round(benchmark.stats.stats.median / FRAME * 1e6, 3)
