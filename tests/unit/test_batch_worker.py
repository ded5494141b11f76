"""Embeddings batching inside a real worker, without sockets (velox_lab/pipeline.py): a batched
request goes through the stage list and ends through its one `finish`, and a member whose
client leaves gives back everything it held, once."""

from __future__ import annotations

from pathlib import Path

import orjson

from velox.core.fields import F
from velox.core.types import BATCHED, DONE, SENT
from velox.state.keys import rpm_index
from velox_lab.pipeline import Pipeline

from .test_keys import sha

_TABLES = f"""
[[route]]
model = "emb"
targets = [{{ upstream = "default" }}]
batch = {{ max_requests = 8, max_inputs = 4, max_wait_ms = 5000 }}

[[key]]
name = "a"
sha256 = "{sha("k")}"
tpm = 100000
max_parallel = 4
"""


def _embeddings(text: str | list[str]) -> bytes:
    body = orjson.dumps({"model": "emb", "input": text})
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer k\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def _pipeline(tmp_path: Path) -> Pipeline:
    path = tmp_path / "velox.toml"
    path.write_text(_TABLES)
    return Pipeline(clients=3, VELOX_CONFIG=str(path))


def test_a_member_leaving_while_queued_gives_back_everything_once(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    worker = pipeline.worker
    limits = worker.shared.keys.limits  # type: ignore[union-attr]
    counters = worker.counters
    (first, _), (queued, _), (third, _) = pipeline.clients
    lines: list[tuple[object, ...]] = []
    worker.log_access = lines.append

    first.data_received(_embeddings("first"))  # nothing in flight: leaves alone at once
    pipeline.loop.run_ready()
    assert len(pipeline.conn.streams) == 1 and worker.in_flight == 1
    queued.data_received(_embeddings("queued"))  # its group has a call upstream: it waits
    pipeline.loop.run_ready()
    waiting = queued.current
    assert waiting is not None and waiting.state == BATCHED
    assert worker.in_flight == 2 and limits.active(rpm_index(0)) == 2
    assert len(pipeline.conn.streams) == 1
    requests = counters.get(0, F.REQUESTS)

    queued.connection_lost(None)  # its client leaves while it waits in the group
    assert waiting.state == DONE
    assert worker.in_flight == 1  # in flight once, given back once
    assert limits.active(rpm_index(0)) == 1  # its key's place
    assert counters.get(0, F.REQUESTS) == requests + 1  # counted and logged once
    assert [status for _, request, _, status, _ in lines if request is waiting] == [499]
    group = next(iter(worker.batcher.groups.values()))  # type: ignore[union-attr]
    assert not group.pending and group.inputs == 0

    third.data_received(_embeddings("third"))  # the group goes on without it
    pipeline.loop.run_ready()
    assert worker.in_flight == 2
    pipeline.answer_streams()  # first's answer (the mock reply is a chat completion: 200)
    assert worker.in_flight == 1 and limits.active(rpm_index(0)) == 1
    pipeline.loop.run_ready()  # the upstream is idle for the group: third leaves alone
    pipeline.answer_streams()
    assert worker.in_flight == 0 and limits.active(rpm_index(0)) == 0
    assert not worker.batcher.groups  # type: ignore[union-attr]


def test_a_request_that_fills_a_batch_alone_leaves_through_the_stage_list(
        tmp_path: Path) -> None:
    """A request with as many inputs as the batch takes fills it: it leaves inside the batch
    stage as a batch of one, BATCHED -> SENT through run(..., "send"), in flight once."""
    pipeline = _pipeline(tmp_path)
    worker = pipeline.worker
    (client, transport), _, _ = pipeline.clients
    transport.keep = True
    client.data_received(_embeddings(["a", "b", "c", "d"]))
    pipeline.loop.run_ready()
    request = client.current
    assert request is not None and request.state == SENT
    assert worker.in_flight == 1 and len(pipeline.conn.streams) == 1
    pipeline.answer_streams()
    assert request.state == DONE and worker.in_flight == 0
    assert b"".join(transport.chunks).startswith(b"HTTP/1.1 200 OK\r\n")
    assert not worker.batcher.groups  # type: ignore[union-attr]
