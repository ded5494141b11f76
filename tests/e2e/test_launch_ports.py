"""The launcher's picked ports can be taken by another process before the gateway binds them
(test processes side by side): a first start then moves to fresh ports instead of failing."""

from __future__ import annotations

import socket
from pathlib import Path

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import gateway_env


def test_a_port_taken_after_the_pick_moves_the_first_start(tmp_path: Path,
                                                             upstream: MockUpstream) -> None:
    gw = GatewayProcess(gateway_env(upstream, VELOX_WORKERS="1"),
                        log_path=tmp_path / "velox.log")
    picked = gw.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picked))
        squatter.listen()
        try:
            gw.start()
            assert gw.port != picked
            assert gw.admin_get("/stats")[0] == 200
        finally:
            gw.stop()
