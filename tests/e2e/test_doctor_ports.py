"""`velox doctor`'s port check against listeners that are not a healthy Velox: one that
answers HTTP as another program would, and one that accepts and stays silent (as a Velox
starved of CPU may for a while). The second is not called "another program" outright."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from velox.admin.doctor import check_port


class _NotVelox(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_program() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotVelox)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_program_answering_http_is_named_not_velox(other_program: int) -> None:
    result = check_port("port", "VELOX_PORT", "127.0.0.1", other_program, ())
    assert result.status == "FAIL"
    assert "another program (not Velox: /healthz answered 404)" in result.detail, result


def test_a_silent_listener_is_not_called_another_program_outright() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts; nothing ever answers
        port = silent.getsockname()[1]
        result = check_port("port", "VELOX_PORT", "127.0.0.1", port, ())
    assert result.status == "FAIL"
    assert "/healthz did not answer within 2 s" in result.detail, result
    assert "a Velox too busy to answer" in result.detail
    assert f"pid {os.getpid()}" in result.detail  # who holds the port, by /proc
