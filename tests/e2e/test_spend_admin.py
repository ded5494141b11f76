"""/spend on a real gateway's admin server answers the JSON of `velox spend --json`, from the
ledger in VELOX_STATE_DIR, behind the admin token; bad parameters get 400.

The request path does not write the ledger yet (that wiring comes with the pipeline's
request context), so the ledger is filled beforehand by the real writer.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson

from tests.e2e.conftest import GatewayFactory
from velox.spend.ledger import LedgerWriter, ledger_path, make_row
from velox_lab.launch import http_get

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "admin-token-for-spend-0123"


def _fill(state_dir: Path) -> None:
    now = int(time.time() * 1000)
    writer = LedgerWriter(ledger_path(state_dir))
    writer.start()
    rows = [make_row(ts_ms=now - 3600_000, key="alice", team="red", model="gpt-4o",
                     input_tokens=100, output_tokens=20, cost_nanos=450_000,
                     request_id=f"a{i}") for i in range(7)]
    rows += [make_row(ts_ms=now - 2 * 86_400_000, key="bob", team="red", model="m",
                      input_tokens=5, output_tokens=1, cost_nanos=None, request_id=f"b{i}")
             for i in range(3)]
    rows += [make_row(ts_ms=now - 30 * 86_400_000, key="old", request_id="o")]
    writer.submit(rows)
    writer.close()


def test_spend_endpoint_answers_what_velox_spend_prints(
        tmp_path: Path, start_gateway: GatewayFactory) -> None:
    state = tmp_path / "state"
    _fill(state)
    gw = start_gateway(VELOX_STATE_DIR=str(state), VELOX_ADMIN_TOKEN=TOKEN)
    status, body = gw.admin_get("/spend?since=7d&by=key")
    assert status == 200, body
    rows = orjson.loads(body)
    assert rows == [
        {"key": "alice", "requests": 7, "input_tokens": 700, "output_tokens": 140,
         "cost_usd": 0.00315, "unpriced_requests": 0},
        {"key": "bob", "requests": 3, "input_tokens": 15, "output_tokens": 3,
         "cost_usd": None, "unpriced_requests": 3}]
    cli = subprocess.run([sys.executable, "-m", "velox", "spend", "--since", "7d", "--by",
                          "key", "--json"], check=False, capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "VELOX_STATE_DIR": str(state)}, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert orjson.loads(cli.stdout) == rows

    status, body = gw.admin_get("/spend?since=60d&by=team")
    assert status == 200
    assert [(r["team"], r["requests"]) for r in orjson.loads(body)] == [("red", 10), ("", 1)]
    status, body = gw.admin_get("/spend?since=7d&by=cost")
    assert status == 400 and b"by='cost'" in body
    status, body = gw.admin_get("/spend?since=last-week")
    assert status == 400 and b"since='last-week'" in body
    host, _, port = gw.env["VELOX_ADMIN_ADDR"].rpartition(":")
    status, _ = http_get(host, int(port), "/spend?since=7d", 5.0, {})
    assert status == 401  # behind the admin token like everything but /healthz
