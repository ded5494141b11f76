"""A request's lifecycle (velox.core.types): the transition table, and one end per request
through ingress, whichever way it comes (answered, its connection lost before, during or after
its answer was queued, pipelined behind another)."""

from __future__ import annotations

import pytest

from velox.config.settings import load
from velox.core.types import (
    ADMITTED,
    ANSWERING,
    DONE,
    PARSED,
    QUEUED,
    SENT,
    STATE_NAMES,
    TRANSITIONS,
    Kind,
    LifecycleError,
    Request,
)
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.connection import WHOLE_BYTES, ClientConnection, IngressState
from velox_lab.pipeline import FakeTransport

from ..ends import RecordingEnds, sent

JSON = [(b"content-type", b"application/json")]
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


class Ring:
    def __init__(self) -> None:
        self.pushed: list[Request] = []

    def try_push(self, request: Request) -> bool:
        self.pushed.append(request)
        return True


def connected() -> tuple[ClientConnection, Ring, RecordingEnds]:
    arena = Arena(1 << 16)
    ends = RecordingEnds(arena)
    ring = Ring()
    state = IngressState(None, ring, lambda: None, arena, Auth(load({}, dotenv=None)),
                         1 << 20, 64 * 1024, lambda: True, ends)
    conn = ClientConnection(state)
    conn.connection_made(FakeTransport(keep=True))  # type: ignore[arg-type]
    return conn, ring, ends


def request() -> Request:
    return Request(None, b"POST", b"/v1/x", Kind.MODEL_CALL, [], b"", True, 0)  # type: ignore[arg-type]


def test_every_state_but_done_may_end_and_nothing_leaves_done() -> None:
    for state in range(len(STATE_NAMES)):
        r = request()
        r.state = state
        if state == DONE:
            with pytest.raises(LifecycleError, match="finished twice"):
                r.finish(200, 0, None)
        else:
            r.finish(200, 0, None)
            assert r.done


@pytest.mark.parametrize("start", range(len(STATE_NAMES)))
def test_only_the_tables_moves_are_allowed(start: int) -> None:
    for to in range(len(STATE_NAMES) - 1):  # DONE is finish()'s
        r = request()
        r.state = start
        if to in TRANSITIONS[start]:
            r.advance(to)
            assert r.state == to
        else:
            with pytest.raises(LifecycleError, match=f"{STATE_NAMES[start]} -> "):
                r.advance(to)
            assert r.state == start


def test_the_way_through_a_worker() -> None:
    r = request()
    assert r.state == QUEUED
    sent(r)
    assert r.state == SENT
    r.advance(ADMITTED)  # a follower whose leader failed goes on alone
    r.advance(SENT)
    r.advance(ANSWERING)
    with pytest.raises(LifecycleError):
        r.advance(PARSED)  # sent again after its answer started: a bug


def test_an_answered_request_ends_once_and_gives_its_body_back() -> None:
    conn, ring, ends = connected()
    conn.data_received(CHAT)
    (r,) = ring.pushed
    segment = r.arena_segment
    assert segment >= 0 and r.state == QUEUED
    conn.respond(sent(r), 200, JSON, b"{}")
    assert r.done and ends.finished_requests == [r] and ends.segments == [segment]
    conn.connection_lost(None)  # the client goes after its answer: nothing ends twice
    assert ends.finished_requests == [r]


def test_a_client_that_leaves_while_queued_ends_its_request_and_those_behind_it() -> None:
    conn, ring, ends = connected()
    conn.data_received(CHAT + CHAT + CHAT)  # one in the ring, two pipelined behind it
    (first,) = ring.pushed
    conn.connection_lost(None)
    assert first.done and len(ends.finished_requests) == 3
    assert ends.answered == [(499, 0)] * 3 and len(ends.segments) == 3


def test_a_client_that_leaves_mid_stream_ends_with_the_streams_status_and_bytes() -> None:
    conn, ring, ends = connected()
    conn.data_received(CHAT)
    (r,) = ring.pushed
    conn.start_stream(sent(r), 200, [(b"content-type", b"text/event-stream")])
    conn.send_chunk(b"data: {}\n\n")
    conn.state.flush()
    assert r.state == ANSWERING
    conn.connection_lost(ConnectionResetError())
    ((status, size),) = ends.answered
    assert status == 200 and size > len(b"data: {}\n\n")


def test_a_large_answer_ends_when_queued_and_not_again_when_its_client_leaves() -> None:
    conn, ring, ends = connected()
    conn.data_received(CHAT)
    (r,) = ring.pushed
    conn.pause_writing()  # the client takes nothing: the answer stays queued
    conn.respond(sent(r), 200, JSON, b"x" * (WHOLE_BYTES * 2))
    assert r.done and conn.queued and ends.finished_requests == [r]
    conn.connection_lost(None)
    assert ends.finished_requests == [r]
