"""The test launcher's port picking: ports below the kernel's ephemeral range, reserved across
processes, so a port picked for a gateway is not taken before the gateway binds it (by another
test's pick, or by an outgoing connection's source port)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest

from velox_lab import launch


def _picks(book: str, count: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    launch.RESERVED = Path(book)
    out.put([launch.free_port() for _ in range(count)])


@pytest.fixture()
def book(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ports"
    monkeypatch.setattr(launch, "RESERVED", path)
    return path


def test_ports_come_from_below_the_ephemeral_range(book: Path) -> None:
    low = launch._ephemeral_low()
    if low - launch.BELOW_EPHEMERAL < 1024:
        pytest.skip("this host's ephemeral range leaves no room below it")
    ports = [launch.free_port() for _ in range(20)]
    assert all(low - launch.BELOW_EPHEMERAL <= p < low for p in ports)
    assert len(set(ports)) == 20  # each reserved: never handed out twice


def test_processes_picking_at_once_never_get_the_same_port(book: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_picks, args=(str(book), 40, out)) for _ in range(3)]
    for proc in procs:
        proc.start()
    got = [port for _ in procs for port in out.get(timeout=60)]
    for proc in procs:
        proc.join(30)
    assert len(got) == 120 and len(set(got)) == 120


def test_a_port_something_listens_on_is_not_handed_out(
        book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A range of 8 ports, one of them taken by a listener: at most 7 picks from it, never the
    # taken one, then the kernel's pick outside it. (Another process on the host may hold one
    # of the others too, hence "at most".)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: port + 4)
        monkeypatch.setattr(launch, "BELOW_EPHEMERAL", 8)
        span = range(port - 4, port + 4)
        picks = [launch.free_port() for _ in range(8)]
        inside = [p for p in picks if p in span]
        assert port not in picks
        assert len(set(inside)) == len(inside) >= 4
        assert picks[-1] not in span  # the range is used up: reserved or taken
