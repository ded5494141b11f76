"""Spend on the request path, end to end: a real Velox (two workers) with a price table and keys
under budgets, the bundled mock over HTTP/2 + TLS, the official `openai` SDK as client.

What it proves: each answer's cost is its usage at the configured price, and the
`x-velox-cost-usd` header, the access log's `cost_usd` and the ledger's row agree on it to the
nano-dollar, streams included (in the log and the ledger); a key with a $0.01 budget is refused
with 429 `insufficient_quota` (the SDK's RateLimitError, not retried) once its spend reaches the
budget, after exactly the number of requests the price table predicts (one at a time, streams
and plain answers mixed); a team budget stops both of its keys together; the spend survives a
SIGTERM and a SIGKILL of the whole gateway (the restarted gateway still refuses); configuration
mistakes name file, table and key.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import sqlite3
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import UPSTREAM_KEY, wait_for
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

KEYS = {"open": "vx-open-0123456789", "capped": "vx-capped-0123456789",
        "red1": "vx-red1-0123456789", "red2": "vx-red2-0123456789",
        "kept": "vx-kept-0123456789", "burst": "vx-burst-0123456789"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# USD per million tokens: a mock answer (a few tokens each way) costs about $0.001, so a
# $0.01 budget lasts about ten requests.
INPUT_USD, OUTPUT_USD = 100, 200


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
[[route]]
model = "m"
targets = [{{ upstream = "default" }}]

[[route]]
model = "unpriced-model"
targets = [{{ upstream = "default" }}]

[[price]]
model = "m"
input = {INPUT_USD}
output = {OUTPUT_USD}

[[key]]
name = "open"
sha256 = "{sha(KEYS['open'])}"

[[key]]
name = "capped"
sha256 = "{sha(KEYS['capped'])}"
budget_usd = 0.01
budget_period = "day"

[[key]]
name = "red1"
sha256 = "{sha(KEYS['red1'])}"

[[key]]
name = "red2"
sha256 = "{sha(KEYS['red2'])}"

[[key]]
name = "burst"
sha256 = "{sha(KEYS['burst'])}"
budget_usd = 0.01
budget_period = "week"

[[key]]
name = "kept"
sha256 = "{sha(KEYS['kept'])}"
budget_usd = 0.01
budget_period = "total"

[[budget]]
name = "red"
budget_usd = 0.01
budget_period = "month"
keys = ["red1", "red2"]
"""


def nanos(prompt: int, completion: int) -> int:
    """The price table's cost of a usage, in nano-USD (micro-USD per million tokens = pico-USD
    per token, rounded half up to nano-USD)."""
    pico = prompt * INPUT_USD * 10**6 + completion * OUTPUT_USD * 10**6
    return (pico + 500) // 1000


def usd(value: int) -> Decimal:
    return Decimal(value) / 10**9


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("spend-certs"))) as m:
        yield m


def gateway_for(mock: MockUpstream, directory: Path, **extra: str) -> GatewayProcess:
    config = directory / "velox.toml"
    config.write_text(CONFIG)
    env = {
        "VELOX_UPSTREAM_ORIGIN": mock.origin,
        "VELOX_UPSTREAM_CA_FILE": mock.ca_file,
        "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "VELOX_CONFIG": str(config),
        "VELOX_WORKERS": "2",
        "VELOX_EGRESS_POOL_CONNECTIONS": "1",
        "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5",
        "VELOX_STATE_DIR": str(directory / "state"),
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        **extra,
    }
    return GatewayProcess(env, log_path=directory / f"velox-{free_port()}.log")


@pytest.fixture(scope="module")
def gw(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    with gateway_for(mock, tmp_path_factory.mktemp("spend-gw")) as g:
        yield g


def sdk(gw: GatewayProcess, key: str) -> openai.OpenAI:
    # The SDK's own retries left on: a budget refusal must not be retried (x-should-retry).
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEYS[key], timeout=20)
    closed_after_the_test(client)
    return client


def ledger_rows(gw: GatewayProcess, **where: str) -> list[dict[str, Any]]:
    path = Path(gw.env["VELOX_STATE_DIR"]) / "ledger.sqlite3"
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        clause = " AND ".join(f"{k} = ?" for k in where) or "1"
        return [dict(r) for r in conn.execute(
            f"SELECT * FROM ledger WHERE {clause} ORDER BY id", tuple(where.values()))]
    finally:
        conn.close()


def access_lines(gw: GatewayProcess, key: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.log().splitlines()
            if '"log":"access"' in line and f'"key":"{key}"' in line]


def call(client: openai.OpenAI, stream: bool) -> tuple[int, int, str | None]:
    """One chat call: (prompt, completion tokens, x-velox-cost-usd or None for a stream)."""
    if stream:
        chunks = list(client.chat.completions.create(
            **CHAT, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens, None
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    reply = raw.parse()
    assert reply.usage is not None
    return reply.usage.prompt_tokens, reply.usage.completion_tokens, \
        raw.headers.get("x-velox-cost-usd")


def test_header_access_log_and_ledger_agree_with_the_price_table(gw: GatewayProcess) -> None:
    client = sdk(gw, "open")
    expected = []
    for stream in (False, True, False, True):
        prompt, completion, header = call(client, stream)
        cost = nanos(prompt, completion)
        expected.append(cost)
        if not stream:
            assert header is not None and Decimal(header) == usd(cost)
    rows = wait_for(lambda: len(ledger_rows(gw, key="open")) >= 4 and ledger_rows(gw, key="open"))
    assert [r["cost_nanos"] for r in rows] == expected
    assert {r["model"] for r in rows} == {"m"} and {r["upstream"] for r in rows} == {"default"}
    assert {r["api"] for r in rows} == {"chat"} and {r["status"] for r in rows} == {200}
    assert all(r["input_tokens"] > 0 and r["output_tokens"] > 0 for r in rows)
    lines = wait_for(lambda: len(access_lines(gw, "open")) >= 4 and access_lines(gw, "open"))
    assert sorted(Decimal(str(line["cost_usd"])) for line in lines) == \
        sorted(usd(c) for c in expected)
    # /spend reads the same ledger.
    status, body = gw.admin_get("/spend?since=1d&by=key")
    assert status == 200
    (row,) = [r for r in json.loads(body) if r["key"] == "open"]
    assert row["requests"] == 4
    assert Decimal(str(row["cost_usd"])) == usd(sum(expected))


def spend_metrics(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = gw.admin_get("/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if s.name.startswith("velox_spend_")}


def test_the_spend_metric_equals_the_ledgers_sum(gw: GatewayProcess) -> None:
    """velox_spend_usd_total (from both workers' shared counters) per key equals the sum of
    the ledger's cost for that key; a model without a price is counted apart, never as $0."""
    client = sdk(gw, "open")
    before = len(ledger_rows(gw, key="open"))
    for stream in (False, True, False, True, False, True):
        call(client, stream)
    for _ in range(3):
        client.chat.completions.create(model="unpriced-model", messages=CHAT["messages"])

    def agree() -> dict[str, Decimal] | None:
        rows = ledger_rows(gw)
        ledger: dict[str, Decimal] = {}
        for r in rows:
            if r["cost_nanos"] is not None:
                ledger[r["key"]] = ledger.get(r["key"], Decimal(0)) + usd(r["cost_nanos"])
        metric = {dict(labels)["key"]: Decimal(str(v)) for (name, labels), v in
                  spend_metrics(gw).items() if name == "velox_spend_usd_total"}
        if sum(1 for r in rows if r["key"] == "open") < before + 9:
            return None  # the ledger's rows are still on their way (batched every 0.1 s)
        # The metric is a float of USD: equal to the nano-dollar's float rounding.
        return ledger if all(abs(metric.get(k, Decimal(-1)) - v) < Decimal("1e-12")
                             for k, v in ledger.items()) and metric.keys() == ledger.keys() \
            else None

    assert wait_for(agree)
    got = spend_metrics(gw)
    labels = (("key", "open"), ("model", "unpriced-model"), ("route", "unpriced-model"),
              ("upstream", "default"))
    assert got[("velox_spend_unpriced_requests_total", labels)] == 3
    assert ("velox_spend_usd_total", labels) not in got
    assert got[("velox_spend_usd_total", (("key", "open"), ("model", "m"), ("route", "m"),
                                          ("upstream", "default")))] > 0


def spend_until_refused(client: openai.OpenAI, limit: int = 100) -> tuple[list[int], Any]:
    """Requests one at a time (streams and plain answers alternating) until one is refused:
    (the cost in nano-USD of each request served, the refusal)."""
    costs: list[int] = []
    for i in range(limit):
        try:
            prompt, completion, _ = call(client, stream=i % 2 == 1)
        except openai.RateLimitError as exc:
            return costs, exc
        costs.append(nanos(prompt, completion))
    raise AssertionError(f"{limit} requests served under a $0.01 budget")


def test_a_spent_budget_is_insufficient_quota_after_the_expected_count(
        gw: GatewayProcess, mock: MockUpstream) -> None:
    client = sdk(gw, "capped")
    costs, refusal = spend_until_refused(client)
    # One at a time: a request is admitted while anything is left, so the spend stops with
    # the first request that reaches the budget: over it by less than that request's cost.
    budget = 10_000_000
    assert sum(costs[:-1]) < budget <= sum(costs)
    assert len(costs) == math.ceil(budget / costs[0])  # the mock's answers cost alike
    assert refusal.status_code == 429 and refusal.code == "insufficient_quota"
    assert refusal.response.headers["x-velox-budget-remaining-usd"] == "0"
    assert refusal.response.headers["x-should-retry"] == "false"
    assert "capped" in refusal.message
    # The refusal is final for the period and costs the upstream nothing.
    mock.reset()
    with pytest.raises(openai.RateLimitError):
        call(client, stream=True)
    assert not [r for r in mock.requests() if r["path"] == "/v1/chat/completions"]
    # Another key is not affected.
    assert call(sdk(gw, "open"), stream=False)[0] > 0


def test_concurrent_clients_overshoot_by_at_most_one_request_per_worker(
        gw: GatewayProcess) -> None:
    """Six threads, streams and plain answers, on a $0.01 key: the spend the ledger records
    ends between the budget and the budget plus one request per worker (two). A refusal while
    the budget is held by reservations in flight says so and may be retried (the SDK does,
    after its Retry-After); the final one is not retryable."""
    served: list[int] = []
    finals: list[Any] = []
    lock = threading.Lock()

    def client_loop(n: int) -> None:
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEYS["burst"],
                               timeout=20, max_retries=8)
        try:
            for i in range(200):
                try:
                    call(client, stream=(n + i) % 2 == 1)
                except openai.RateLimitError as exc:
                    if exc.response.headers.get("x-should-retry") == "false":
                        with lock:
                            finals.append(exc)
                        return
                    continue  # held by requests in flight (the SDK retried it 8 times)
                with lock:
                    served.append(1)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(finals) == 6, "every client ends with the final refusal"
    assert all("is spent" in exc.message for exc in finals)
    rows = wait_for(lambda: len(ledger_rows(gw, key="burst")) >= len(served)
                    and ledger_rows(gw, key="burst"))
    assert len(rows) == len(served)
    costs = [r["cost_nanos"] for r in rows]
    budget = 10_000_000
    assert budget <= sum(costs) < budget + 2 * max(costs), (sum(costs), max(costs))


def test_a_team_budget_stops_both_keys(gw: GatewayProcess) -> None:
    one, two = sdk(gw, "red1"), sdk(gw, "red2")
    served = 0
    refused: set[str] = set()
    for i in range(100):
        name, client = ("red1", one) if i % 2 == 0 else ("red2", two)
        try:
            call(client, stream=False)
            served += 1
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota" and "red" in exc.message
            refused.add(name)
            if len(refused) == 2:
                break
    assert refused == {"red1", "red2"}
    assert served >= 2  # both keys spent from the one budget before it ran out


def test_spend_survives_sigterm_and_sigkill(mock: MockUpstream, tmp_path: Path) -> None:
    gw = gateway_for(mock, tmp_path).start()
    try:
        costs, _ = spend_until_refused(sdk(gw, "kept"))
        served = len(costs)
        # The rows are committed before the gateway stops: a SIGKILL loses what the last
        # 0.35 s (a worker's 0.1 s feed interval, the writer's 0.25 s) had not written.
        wait_for(lambda: len(ledger_rows(gw, key="kept")) >= served)
    finally:
        gw.stop()  # SIGTERM
    # Each restart resumes from the ledger's total: the key stays refused, through a SIGKILL
    # of the whole gateway too.
    for sig in (signal.SIGKILL, signal.SIGTERM):
        again = gateway_for(mock, tmp_path).start()
        try:
            with pytest.raises(openai.RateLimitError) as info:
                call(sdk(again, "kept"), stream=False)
            assert info.value.code == "insufficient_quota"
            # Another key of the restarted gateway is served.
            assert call(sdk(again, "open"), stream=True)[0] > 0
        finally:
            again.signal(sig)
            again.wait(20)
            again.stop()
    conn = sqlite3.connect(Path(tmp_path / "state" / "ledger.sqlite3"))
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        (kept,) = conn.execute("SELECT COUNT(*) FROM ledger WHERE key = 'kept'").fetchone()
        assert kept == served  # the refused requests wrote no row
    finally:
        conn.close()


@pytest.mark.parametrize(("table", "needle"), [
    ('[[key]]\nname = "k"\nsha256 = "{h}"\nbudget_usd = -1\n',
     '[[key]] #1 (name "k"): budget_usd: must be >= 0'),
    ('[[key]]\nname = "k"\nsha256 = "{h}"\nbudget_usd = 1\nbudget_period = "year"\n',
     '[[key]] #1 (name "k"): budget_period: unknown period "year"'),
    ('[[key]]\nname = "k"\nsha256 = "{h}"\n[[budget]]\nname = "t"\nbudget_usd = 1\n'
     'keys = ["k", "nobody"]\n', '[[budget]] #1 (name "t"): keys: "nobody" names no [[key]]'),
    ('[[budget]]\nname = "t"\nbudget_usd = "lots"\n',
     '[[budget]] #1 (name "t"): budget_usd: must be a number'),
])
def test_budget_mistakes_name_file_table_and_key(tmp_path: Path, table: str,
                                                 needle: str) -> None:
    from velox.config.tables import TableError, UpstreamSpec, load_file

    config = tmp_path / "velox.toml"
    config.write_text(table.format(h=sha("k")))
    with pytest.raises(TableError) as info:
        load_file(config, {}, UpstreamSpec("default", "https://api.openai.com"))
    assert str(info.value).startswith(f"{config}: {needle}"), str(info.value)


def test_a_gateway_with_a_bad_budget_does_not_start(mock: MockUpstream, tmp_path: Path) -> None:
    gw = gateway_for(mock, tmp_path)
    Path(gw.env["VELOX_CONFIG"]).write_text(CONFIG.replace('budget_period = "day"',
                                                           'budget_period = "fortnight"'))
    with pytest.raises(RuntimeError) as info:
        gw.start()
    assert '[[key]] #2 (name "capped"): budget_period: unknown period "fortnight"' in \
        str(info.value)
