"""The ledger's Redis Stream mirror against a real redis-server: rows of two hosts in one capped
stream, read back by `velox spend --all-hosts`; Redis killed while rows keep coming (the file
keeps every row, the writer never stalls), then back: the rows written meanwhile are sent from
the cursor.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson

from tests.e2e.conftest import wait_for
from velox.spend import report
from velox.spend.ledger import STREAM, LedgerWriter, connect, make_row
from velox_lab.launch import RedisProcess

ROOT = Path(__file__).resolve().parents[2]



def _rows(n: int, key: str, prefix: str, cost: int | None = 2000) -> list[tuple[object, ...]]:
    now = int(time.time() * 1000)
    return [make_row(ts_ms=now, key=key, team="t", model="gpt-4o", input_tokens=7,
                     output_tokens=2, cost_nanos=cost, request_id=f"{prefix}{i}")
            for i in range(n)]


def _xlen(redis: RedisProcess) -> int:
    reply = redis.command("XLEN", STREAM)  # RESP integer: b":N\r\n"
    return int(reply[1:].strip())


def test_two_hosts_in_one_stream_read_by_velox_spend_all_hosts(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    writers = [LedgerWriter(tmp_path / f"host{i}.sqlite3", redis_url=redis_server.url,
                            host=f"host-{i}", interval_s=0.02) for i in range(2)]
    for writer in writers:
        writer.start()
    writers[0].submit(_rows(300, "alice", "a"))
    writers[1].submit(_rows(200, "bob", "b"))
    writers[1].submit(_rows(50, "carol", "c", cost=None))
    wait_for(lambda: _xlen(redis_server) == 550, timeout=60)
    for writer in writers:
        writer.close()
    conn = report.from_stream(redis_server.url, 0)
    rows = report.totals(conn, 0, int(time.time() * 1000) + 1, "key")
    assert [(r["key"], r["requests"], r["cost_usd"], r["unpriced_requests"]) for r in rows] == [
        ("alice", 300, 6e-4, 0), ("bob", 200, 4e-4, 0), ("carol", 50, None, 50)]

    out = subprocess.run([sys.executable, "-m", "velox", "spend", "--all-hosts", "--json",
                          "--by", "team"], check=False, capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "VELOX_REDIS_URL": redis_server.url}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout) == [{"team": "t", "requests": 550, "input_tokens": 3850,
                                         "output_tokens": 1100, "cost_usd": 0.001,
                                         "unpriced_requests": 50}]


def test_redis_down_then_back_loses_no_row_and_never_stalls_the_writer(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    path = tmp_path / "ledger.sqlite3"
    writer = LedgerWriter(path, redis_url=redis_server.url, host="h", interval_s=0.02,
                          stream_maxlen=100_000)
    writer.start()
    try:
        writer.submit(_rows(100, "k", "before-"))
        wait_for(lambda: _xlen(redis_server) == 100, timeout=60)
        redis_server.kill()
        for i in range(20):  # rows keep coming while Redis is gone
            writer.submit(_rows(50, "k", f"down{i}-"))
        wait_for(lambda: writer.stats()["written"] == 1100, timeout=60)
        wait_for(lambda: writer.stats()["redis"]["errors"] >= 1, timeout=60)
        assert writer.stats()["redis"]["up"] is False
        redis_server.start()  # back, and empty (no persistence): like a replaced node
        # The rows written while Redis was down arrive.
        wait_for(lambda: _xlen(redis_server) == 1000, timeout=120)
        # ... and the writer says Redis is up once it has noted the last batch as sent (its
        # cursor in the ledger file, a moment after Redis has the rows).
        wait_for(lambda: writer.stats()["redis"]["up"] is True, timeout=30)
    finally:
        writer.close()
    ids = {f[b"request_id"] for _, f in redis_server_entries(redis_server)}
    assert ids == {f"down{i}-{j}".encode() for i in range(20) for j in range(50)}
    assert connect(path, readonly=True).execute(
        "SELECT COUNT(*) FROM requests").fetchone()[0] == 1100


def redis_server_entries(redis_server: RedisProcess) -> list[tuple[bytes, dict[bytes, bytes]]]:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        return list(client.xrange(STREAM))
    finally:
        client.close()


def test_the_stream_is_capped(tmp_path: Path, redis_server: RedisProcess) -> None:
    writer = LedgerWriter(tmp_path / "ledger.sqlite3", redis_url=redis_server.url,
                          interval_s=0.02, stream_maxlen=1000)
    writer.start()
    for i in range(10):
        writer.submit(_rows(1000, "k", f"r{i}-"))
    wait_for(lambda: writer.stats()["redis"]["sent"] == 10_000, timeout=60)
    writer.close()
    # MAXLEN ~ trims whole macro nodes: about the cap, never the 10,000 sent.
    assert 1000 <= _xlen(redis_server) < 3000
