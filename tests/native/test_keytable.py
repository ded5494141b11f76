"""The key table that grows: Limits and Counters on memfds, mapped by processes that forked
before they existed (descriptors over an AF_UNIX socket, SCM_RIGHTS), and velox.state.keys.
KeyTable built on them."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

from velox.core.fields import KF
from velox.state.keys import MAX_SEGMENTS, SEGMENT_KEYS, TABLE_MAX_KEYS, KeyTable
from velox.state.limits import Limits
from velox.state.stats import Counters


def test_memfd_limits_and_counters_attach_to_the_same_state() -> None:
    limits = Limits(8, slots=2, memfd=True)
    limits.configure(0, 60, 5)
    counters = Counters(2, 10, memfd=True)
    fd_l, fd_c = limits.fd(), counters.fd()
    try:
        other_l, other_c = Limits.attach(fd_l), Counters.attach(fd_c, 2, 10)
    finally:
        os.close(fd_l)
        os.close(fd_c)
    assert len(other_l) == 8 and other_l.slots == 2
    assert other_l.take(0, 2) == 0 and limits.level(0) == 3  # one bucket, two views
    counters.add(1, 3, 7)
    assert other_c.get(1, 3) == 7


def test_attach_refuses_what_is_not_its_mapping() -> None:
    counters = Counters(2, 10, memfd=True)
    fd = counters.fd()
    try:
        with pytest.raises(ValueError, match="not a Limits mapping"):
            Limits.attach(fd)
        with pytest.raises(ValueError, match="not Counters of 4 x 10"):
            Counters.attach(fd, 4, 10)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="anonymous"):
        Limits(1).fd()
    with pytest.raises(ValueError, match="anonymous"):
        Counters(1, 1).fd()
    with pytest.raises(OSError):
        Limits.attach(10**6)  # not an open descriptor


def _worker(sock: socket.socket, slots: int) -> None:
    """A worker forked before the segment existed: maps it from the descriptors it is sent,
    takes from key 5's request bucket and counts a refusal for key 4,100 (segment 1)."""
    table = KeyTable(slots)
    for _ in range(2):
        _, fds, _, _ = socket.recv_fds(sock, 16, 1 + len(KF))
        table.attach(fds)
        for fd in fds:
            os.close(fd)
    seg, k = table.locate(5)
    ok = seg.limits.take(2 * k, 3) == 0
    seg, k = table.locate(SEGMENT_KEYS + 4)
    seg.counters[KF.REFUSED_RPM].add(1, k, 1)
    sock.sendall(b"1" if ok else b"0")


def test_segments_made_after_fork_reach_the_workers_over_scm_rights() -> None:
    ctx = multiprocessing.get_context("fork")
    ours, theirs = socket.socketpair()
    table = KeyTable(slots=2)
    child = ctx.Process(target=_worker, args=(theirs, 2))
    child.start()  # before any segment exists: it can only see them through descriptors
    theirs.close()
    try:
        for _ in range(2):
            fds = table.fds(table.grow())
            socket.send_fds(ours, [b"s"], fds)
            for fd in fds:
                os.close(fd)
        assert table.capacity == 2 * SEGMENT_KEYS
        seg0 = table.segments[0]
        seg0.limits.configure(2 * 5, 60, 10)  # configured after the send: shared state
        # The child's answer is the event waited on (a generous bound, never a sleep).
        ours.settimeout(60)
        assert ours.recv(1) == b"1"
        assert seg0.limits.level(2 * 5) == 7
        assert table.segments[1].counters[KF.REFUSED_RPM].get(1, 4) == 1
    finally:
        ours.close()
        child.join(60)
    assert child.exitcode == 0


def test_attach_checks_the_segment_shape_and_grow_stops_at_the_limit() -> None:
    table = KeyTable(slots=2)
    fds = table.fds(table.grow())
    try:
        with pytest.raises(ValueError, match="not a key segment of 4 slots"):
            KeyTable(slots=4).attach(fds)
        with pytest.raises(ValueError, match="descriptors"):
            KeyTable(slots=2).attach(fds[:2])
    finally:
        for fd in fds:
            os.close(fd)
    assert MAX_SEGMENTS * SEGMENT_KEYS >= TABLE_MAX_KEYS
    table.segments *= MAX_SEGMENTS  # the same segment repeated: only the count matters here
    with pytest.raises(ValueError, match="at most 1,000,000 keys"):
        table.grow()
    _, k = table.locate(TABLE_MAX_KEYS - 1)
    assert k == (TABLE_MAX_KEYS - 1) % SEGMENT_KEYS
