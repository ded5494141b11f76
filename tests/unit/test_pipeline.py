"""The worker's whole request path without sockets (velox_lab/pipeline.py): it answers
correctly, and it leaves nothing behind, not even for the cycle collector."""

from __future__ import annotations

import gc

import orjson

from velox_lab.pipeline import EVENT, REPLY_BODY, FakeTransport, Pipeline


def _spied(clients: int, index: int) -> tuple[Pipeline, FakeTransport]:
    """A warmed pipeline whose client `index` writes into a transport that keeps the bytes."""
    pipeline = Pipeline(clients=clients)
    pipeline.round()
    spy = FakeTransport(keep=True)
    client, _ = pipeline.clients[index]
    client.transport = spy  # type: ignore[assignment]
    return pipeline, spy


def test_each_client_gets_the_upstream_answer() -> None:
    pipeline, spy = _spied(4, 0)
    pipeline.round()
    head, _, body = b"".join(spy.chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nserver-timing: ring;dur=" in head
    assert orjson.loads(body) == orjson.loads(REPLY_BODY)


def test_each_client_gets_every_streamed_event_without_what_the_gateway_asked_for() -> None:
    # The streaming benchmark's path (benches/pipeline_ab.py --stream): the relay calls the
    # meter's event reader directly, which must still remove the `"usage":null` members and
    # the usage chunk of the include_usage the gateway added, and keep [DONE].
    pipeline, spy = _spied(3, 1)
    pipeline.stream_round(5)
    assert pipeline.worker.in_flight == 0
    out = b"".join(spy.chunks)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head
    assert body.count(EVENT.replace(b',"usage":null', b"")) == 5
    assert b'"usage"' not in body and body.count(b"data: [DONE]\n\n") == 1
    assert body.endswith(b"0\r\n\r\n")


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


def test_a_stage_added_to_the_list_sees_every_request_and_may_answer_some() -> None:
    # A guardrail is one entry in the worker's stage list: here it refuses the first client's
    # requests (400 with the OpenAI error shape) and lets the others go on to the limiter.
    from velox.core.errors import BadRequest
    from velox.core.types import Request

    pipeline = Pipeline(clients=4)
    worker = pipeline.worker
    first = pipeline.clients[0][0]
    seen: list[Request] = []

    def guard(requests: list[Request]) -> list[Request]:
        seen.extend(requests)
        for request in requests:
            if request.conn is first:
                request.conn.respond_error(request, BadRequest("refused by the guardrail"))
        return [r for r in requests if r.conn is not first]

    worker.add_stage("guard", guard, before="limit")
    assert [name for name, _ in worker.stages] == ["parse", "guard", "limit", "send"]
    spies = []
    for i, (client, _) in enumerate(pipeline.clients):
        spies.append(FakeTransport(keep=True))
        client.transport = spies[i]  # type: ignore[assignment]
    pipeline.round()
    assert len(seen) == 4
    heads = [b"".join(spy.chunks).partition(b"\r\n\r\n") for spy in spies]
    assert heads[0][0].startswith(b"HTTP/1.1 400 ")
    assert orjson.loads(heads[0][2])["error"]["message"] == "refused by the guardrail"
    for head, _, body in heads[1:]:
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert orjson.loads(body) == orjson.loads(REPLY_BODY)
    assert worker.in_flight == 0 and worker.arena.live == 0


def _batches(pipeline: Pipeline) -> tuple[int, int]:
    from velox.core.fields import F

    counters = pipeline.worker.counters
    return counters.get(0, F.BATCHES), counters.get(0, F.BATCH_ITEMS)


def test_a_lone_request_is_drained_in_the_loop_pass_of_its_read() -> None:
    # One client, nothing else in the worker: the read that completes the request also sends
    # it upstream, with no call_soon hop to a drain (a loop pass and a handle per request).
    from velox_lab.pipeline import CLIENT_REQUEST

    pipeline = Pipeline(clients=1)
    pipeline.round()
    client, _ = pipeline.clients[0]
    sent_before = pipeline.upstream_transport.written
    batches = _batches(pipeline)
    client.data_received(CLIENT_REQUEST)
    worker = pipeline.worker
    assert not worker.drain_pending
    assert all(callback != worker.drain for callback, _ in pipeline.loop.ready)
    assert pipeline.upstream_transport.written > sent_before  # the HEADERS and DATA went
    assert _batches(pipeline) == (batches[0] + 1, batches[1] + 1)
    pipeline.answer_streams()
    assert pipeline.worker.in_flight == 0


def test_requests_arriving_while_others_are_in_flight_still_form_one_micro_batch() -> None:
    # Under load the drain waits for the end of the loop pass: the reads of every connection
    # that became readable in it are one batch (only the first, into an idle worker, goes
    # alone).
    pipeline = Pipeline(clients=64)
    pipeline.round()
    batches = _batches(pipeline)
    pipeline.send_requests()
    assert _batches(pipeline) == (batches[0] + 2, batches[1] + 64)
    pipeline.answer_streams()
    batches = _batches(pipeline)
    pipeline.send_requests()  # the first is in flight before the other 63 reads: one batch
    assert _batches(pipeline) == (batches[0] + 2, batches[1] + 64)
    pipeline.answer_streams()
    assert pipeline.responses_written() > 0 and pipeline.worker.in_flight == 0
