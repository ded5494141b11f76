"""The profile tool's stages (benches.e2e.profile): py-spy samples are attributed to the stage of
the innermost Velox frame that names one, by package path and function."""

from __future__ import annotations

from pathlib import Path

import velox
from benches.e2e.profile import STAGES, stage_of

ROOT = Path(velox.__file__).parent
_EVENT_LOOP = "event loop (uvloop's C: socket reads, TLS, callbacks dispatch)"


def test_every_file_a_stage_names_is_in_the_tree() -> None:
    missing = [test for _, tests in STAGES for test in tests
               if not (ROOT / test.partition(":")[0]).exists()]
    assert missing == []


def test_a_client_write_inside_an_upstream_read_counts_as_the_client_write() -> None:
    stack = ["run_worker (velox/supervisor.py:696)",
             "H2Connection.data_received (velox/egress/h2conn.py:276)",
             "Exchange.on_answer (velox/relay/exchange.py:184)",
             "ClientConnection.respond (velox/ingress/connection.py:747)"]
    assert stage_of(stack) == "client write (respond / stream, syscall included)"
    assert stage_of(stack[:3]) == "relay (response head, server-timing, accounting)"
    assert stage_of(stack[:2]) == "h2 connection (events, flow control, flush, TLS write)"
    assert stage_of(stack[:1]) == _EVENT_LOOP


def test_a_checkouts_absolute_path_and_the_lab_are_told_apart() -> None:
    assert stage_of(["Spend.row (/srv/gw/velox/spend/wire.py:510)"]) == \
        "spend (prices, ledger rows, cost headers)"
    assert stage_of(["ClientConnection.data_received (/srv/gw/velox/ingress/connection.py:1)"]) \
        == "ingress (httptools callbacks, routing, ring push)"
    assert stage_of(["MockUpstream.respond (velox_lab/mock.py:10)"]) == _EVENT_LOOP
