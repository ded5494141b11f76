"""velox.system.ports on real sockets of this process: the gateway's sockets share a port the kernel
picked, a second set is refused naming it, and /proc tells who listens where."""

from __future__ import annotations

import os
import socket

import pytest

from velox.system import ports


def test_listeners_share_one_port_and_a_second_set_is_refused() -> None:
    first = ports.listeners("127.0.0.1", 0, 3)
    try:
        port = first[0].getsockname()[1]
        assert {s.getsockname()[1] for s in first} == {port}
        assert ports.in_use("127.0.0.1", port) is not None
        with pytest.raises(SystemExit) as refused:
            ports.listeners("127.0.0.1", port, 2)
        assert f"port {port}" in str(refused.value) and "already listening" in str(refused.value)
        with pytest.raises(SystemExit):  # the wildcard address overlaps it too
            ports.listeners("0.0.0.0", port, 1)
        inodes = {os.fstat(s.fileno()).st_ino for s in first}
        assert ports.listening_inodes("127.0.0.1", port) == inodes
        assert ports.listening_inodes("0.0.0.0", port) == inodes
        assert ports.listening_inodes("127.0.0.2", port) == set()  # another address
        assert ports.holders("127.0.0.1", port) == [os.getpid()]
    finally:
        for sock in first:
            sock.close()
    assert ports.in_use("127.0.0.1", port) is None


def test_a_wildcard_listener_is_seen_from_a_loopback_address() -> None:
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        assert ports.listening_inodes("127.0.0.1", port) == {os.fstat(other.fileno()).st_ino}
        with pytest.raises(SystemExit, match=f"port {port}"):
            ports.listeners("127.0.0.1", port, 1)


def test_proc_addresses_are_decoded() -> None:
    assert str(ports._proc_address("0100007F")) == "127.0.0.1"
    assert str(ports._proc_address("00000000000000000000000001000000")) == "::1"
    assert str(ports._proc_address("0000000000000000FFFF00000100007F")) == "127.0.0.1"
