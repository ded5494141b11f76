"""The HTTP/2 connection's state machine: one table, and every pair outside it is a bug.

As h2's own state machine tests: Hypothesis walks every (state, input) pair; pairs in the table
move where the table says, every other pair raises and leaves the connection CLOSED.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox.egress.h2conn import TRANSITIONS, ConnectionStateError, H2Connection, Input, State

from ._pool_peer import PoolPeer


def _connection(state: State) -> H2Connection:
    conn = H2Connection(PoolPeer().pool, 0, None)  # type: ignore[arg-type]  # no codec needed
    conn.state = state
    return conn


@given(st.sampled_from(State), st.sampled_from(Input))
def test_every_pair_moves_by_the_table_or_raises_and_closes(state: State, event: Input) -> None:
    conn = _connection(state)
    if (state, event) in TRANSITIONS:
        conn._move(event)
        assert conn.state is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(ConnectionStateError):
            conn._move(event)
        assert conn.state is State.CLOSED


def test_closed_is_terminal_and_every_state_can_be_lost() -> None:
    assert not [pair for pair in TRANSITIONS if pair[0] is State.CLOSED]
    assert all(TRANSITIONS[(s, Input.LOST)] is State.CLOSED for s in State if s is not State.CLOSED)


def test_a_real_connection_walks_the_table_to_closed() -> None:
    peer = PoolPeer()
    server = peer.connect(0)  # CONNECTING → WARMING → READY
    conn = server.conn
    client = peer.submit()
    peer.pump()
    conn.retire()  # READY → DRAINING: no new streams, the open one finishes
    assert conn.state is State.DRAINING and conn.capacity == 0
    server.respond(server.requests[0])
    peer.pump()
    assert client.status == 200 and server.transport.closed
    conn.connection_lost(None)  # DRAINING → CLOSED
    assert conn.state is State.CLOSED
    conn.connection_lost(None)  # a second report of the same loss is ignored, not a transition
    assert conn.state is State.CLOSED
