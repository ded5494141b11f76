"""The frame census (benches/frames.py): what it counts per request, on this tree's pipeline."""

from __future__ import annotations

from benches.frames import _ROUNDS, census
from velox_lab.pipeline import Pipeline


def test_census_counts_each_phase_per_request() -> None:
    clients = 2
    pipeline = Pipeline(clients=clients, VELOX_SPEND="0")
    pipeline.round()
    n = _ROUNDS * clients
    send, send_native = census(pipeline, "send")
    answer, _ = census(pipeline, "answer")
    # One request each: the client read, the native head parse, the upstream stream opened.
    assert send["connection.py:ClientConnection._fast"] == n
    assert send_native["reqhead"] == n and send_native["H2Client.send_request"] == n
    # One answer each, written once; the harness's own frames are not counted.
    assert answer["connection.py:ClientConnection.respond"] == n
    assert answer["exchange.py:Exchange.on_answer"] == n
    assert not any("Pipeline" in frame or "FakeTransport" in frame for frame in answer)
    # The micro-batch's frames are counted per batch: the first read of a round is drained at
    # once (nothing in flight: Worker.after_read), the next one's wait for the loop's drain.
    assert send["worker.py:Worker.run"] == 2 * _ROUNDS
    assert pipeline.worker.in_flight == 0
