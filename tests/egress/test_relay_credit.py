"""Socket-free: the relay hands back flow-control credit held for a paused client at every ending.

A real `Framer` codec plays the upstream connection's flow-control bookkeeping (through a small
link that forwards `acknowledge` to it the way `H2Connection` does), and a fake client connection
is paused. The black-box versions of these cases are in tests/e2e/test_hardening_egress.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from velox._types import Request, Route
from velox.egress.framer import Framer
from velox.relay import Exchange


class _Client:
    """The ingress side of one request: paused, and recording what it was asked to do."""

    def __init__(self) -> None:
        self.write_paused = True
        self.calls: list[str] = []

    def start_stream(self, request: Any, status: int, headers: Any) -> None:
        self.calls.append("start")

    def send_chunk(self, data: bytes) -> None:
        self.calls.append("chunk")

    def end_stream(self) -> None:
        self.calls.append("end")

    def respond(self, *args: Any) -> None:
        self.calls.append("respond")

    def respond_error(self, *args: Any) -> None:
        self.calls.append("error")

    def abort(self) -> None:
        self.calls.append("abort")


class _Link:
    """What H2Connection does with credit: forward it to the codec (and reset on cancel)."""

    def __init__(self, codec: Framer) -> None:
        self.codec = codec
        self.credited = 0

    def acknowledge(self, sink: Any, n: int) -> None:
        self.credited += n
        self.codec.acknowledge(sink.stream_id, n)

    def pause_for(self, sink: Any) -> None:
        pass

    def cancel(self, sink: Any) -> None:
        self.codec.reset_stream(sink.stream_id)


def _paused_exchange() -> tuple[Exchange, _Link, _Client]:
    codec = Framer(b"example.com", b"https")
    codec.initiate()
    client = _Client()
    request = Request(client, b"POST", b"/v1/chat/completions", Route.MODEL_CALL, [], b"{}",
                      True, 0)
    exchange = Exchange(request, b"/v1/chat/completions", [], lambda e, s: None,
                        lambda r: None)
    link = _Link(codec)
    exchange.link = link
    exchange.stream_id = codec.send_request(b"POST", b"/v1/chat/completions", [], b"{}")
    exchange.on_response(200, [(b"content-type", b"text/event-stream")], False)
    for _ in range(3):
        exchange.on_data(b"x" * 1000, False)
        exchange.consumed(1000)
    assert exchange.unacked == 3000 and link.credited == 0  # held back while paused
    return exchange, link, client


@pytest.mark.parametrize("ending", ["client_gone", "reset", "expired", "completed"])
def test_every_ending_returns_the_held_credit(ending: str) -> None:
    exchange, link, client = _paused_exchange()
    if ending == "client_gone":
        exchange.client_gone()
    elif ending == "reset":
        exchange.on_error(RuntimeError("the upstream reset the stream"))
    elif ending == "expired":
        exchange.on_error(TimeoutError("deadline"))
        link.cancel(exchange)
    else:
        exchange.on_data(b"", True)
    assert link.credited == 3000
    assert exchange.unacked == 0
    exchange.client_writable()  # a late drain must not credit the same bytes twice
    assert link.credited == 3000


def test_credit_is_still_withheld_while_the_stream_lives() -> None:
    exchange, link, client = _paused_exchange()
    exchange.on_data(b"y" * 10, False)
    exchange.consumed(10)
    assert link.credited == 0
    client.write_paused = False
    exchange.client_writable()
    assert link.credited == 3010
