"""The worker's whole request path without sockets (velox_lab/pipeline.py): it answers
correctly, and it leaves nothing behind, not even for the cycle collector."""

from __future__ import annotations

import gc

import orjson

from velox_lab.pipeline import REPLY_BODY, FakeTransport, Pipeline


def test_each_client_gets_the_upstream_answer() -> None:
    pipeline = Pipeline(clients=4)
    pipeline.round()
    spy = FakeTransport(keep=True)
    client, _ = pipeline.clients[0]
    client.transport = spy  # type: ignore[assignment]
    pipeline.round()
    head, _, body = b"".join(spy.chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nserver-timing: ring;dur=" in head
    assert orjson.loads(body) == orjson.loads(REPLY_BODY)


def test_hot_path_makes_no_garbage_cycles_and_keeps_nothing() -> None:
    pipeline = Pipeline(clients=16)
    for _ in range(200):  # warm the caches (encoded header fields and the like) first
        pipeline.round()
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(200):  # 3,200 requests
            pipeline.round()
        assert gc.collect() == 0, "a request left a reference cycle behind"
        # Counted after a collection, like `before`: it untracks tuples of plain values.
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 20, f"{grown} objects kept after 3,200 requests"
    worker = pipeline.worker
    assert worker.in_flight == 0 and not worker.pool.pool.conns[0].streams  # type: ignore[attr-defined]
    assert worker.arena is not None and worker.arena.live == 0
    assert not pipeline.conn.streams and pipeline.conn.codec.stream_state_count == 0
