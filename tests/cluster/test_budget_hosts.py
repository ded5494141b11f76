"""One budget shared by three hosts through Redis, driven as SDK users drive it.

Real processes: a real redis-server, the bundled mock upstream (HTTP/2 + TLS) with a priced
model, three Velox hosts of two workers each (their own state directory and ledger), and one
load process per host (benches/e2e/paced.py: the official `openai` SDK, no `max_tokens`), all
together at three times the rate the budget lasts the run. Each host alone would spend the
whole budget; together the three ledgers hold the budget within the stated bound
(velox.spend.hosts.bound) both ways. With Redis SIGKILLed mid-run and started again empty:
no 5xx, and afterwards Redis holds again what the hosts spent (rebuilt from their reports).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benches.e2e import cluster as harness
from benches.e2e import paced
from tests.e2e.conftest import UPSTREAM_KEY, wait_for
from velox.spend import hosts as budget_hosts
from velox.spend.ledger import ledger_path
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

HOSTS, WORKERS = 3, 2
CLIENT_KEY = "vx-shared-budget-0123456789"
BUDGET_USD = 0.04
DEFAULT_OUTPUT = 64  # VELOX_TOKENS_DEFAULT_OUTPUT: a request's estimate, without max_tokens
# USD per million tokens: a mock answer costs about $0.00036, so the budget lasts ~110 requests.
CONFIG = f"""
[[price]]
model = "{paced.MODEL}"
input = 100
output = 10

[[key]]
name = "shared"
sha256 = "{hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}"
budget_usd = {BUDGET_USD}
budget_period = "day"
"""
DURATION_S = 12.0


@pytest.fixture
def mock(tmp_path: Path) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path)) as m:
        yield m


def start_hosts(tmp_path: Path, mock: MockUpstream, redis_url: str,
                hosts: int = HOSTS) -> list[GatewayProcess]:
    config = tmp_path / "velox.toml"
    config.write_text(CONFIG)
    gateways = []
    for i in range(hosts):
        env = {
            "VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file,
            "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY, "VELOX_CONFIG": str(config),
            "VELOX_WORKERS": str(WORKERS), "VELOX_EGRESS_POOL_CONNECTIONS": "1",
            "VELOX_RATE_LIMIT_RPM": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
            "VELOX_TOKENS_DEFAULT_OUTPUT": str(DEFAULT_OUTPUT), "VELOX_REDIS_URL": redis_url,
            "VELOX_STATE_DIR": str(tmp_path / f"state{i}"),
            "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        }
        gateways.append(GatewayProcess(env, log_path=tmp_path / f"velox{i}.log"))
    try:
        harness.start_all(gateways)
    except BaseException:
        for gw in gateways:
            gw.stop()
        raise
    return gateways


def metric(gw: GatewayProcess, name: str) -> float | None:
    try:
        _, body = gw.admin_get("/metrics", timeout=2.0)
    except OSError:
        return None
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def ledger(state_dir: Path) -> tuple[int, int]:
    """(cost in nano-USD, largest single cost) of every row of one host's ledger."""
    conn = sqlite3.connect(ledger_path(state_dir))
    try:
        total, largest = conn.execute(
            "SELECT COALESCE(SUM(cost_nanos), 0), COALESCE(MAX(cost_nanos), 0) FROM requests"
        ).fetchone()
    finally:
        conn.close()
    return int(total), int(largest)


def budget_hash(redis: RedisProcess) -> dict[str, str]:
    """The budget's hash in Redis for today: u:<host>, a:<host>, t:<host>."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    reply = redis.command("HGETALL", f"velox:budget:key:shared:day:{day}").decode()
    lines = [x for x in reply.split("\r\n") if x and x[0] not in "*$"]
    return dict(zip(lines[0::2], lines[1::2], strict=False))


def redis_used(redis: RedisProcess) -> tuple[int, int]:
    """(sum of the hosts' reported `used`, sum of their `held`) in the budget's hash, units."""
    fields = budget_hash(redis)
    used = sum(int(v) for k, v in fields.items() if k.startswith("u:"))
    held = sum(int(v) for k, v in fields.items() if k.startswith("a:"))
    return used, held


@pytest.mark.parametrize("outage", [False, True], ids=["redis-up", "redis-killed"])
def test_three_hosts_hold_one_budget_within_the_bound(tmp_path: Path, mock: MockUpstream,
                                                      outage: bool) -> None:
    redis = RedisProcess(log_path=tmp_path / "redis.log").start()
    gateways: list[GatewayProcess] = []
    try:
        gateways = start_hosts(tmp_path, mock, redis.url)
        # Every host sees the three in Redis.
        wait_for(lambda: all(metric(gw, "velox_redis_hosts") == HOSTS for gw in gateways), 30)
        # The budget lasts ~110 requests; three times that over the run.
        per_host = 3 * 110 / DURATION_S / HOSTS
        procs = [paced.spawn(gw.base_url + "/v1", CLIENT_KEY, per_host, DURATION_S, None)
                 for gw in gateways]
        start = paced.start(procs)  # once every process has imported the SDK
        if outage:  # down from a sixth of the run (the budget is not spent yet) to a quarter
            time.sleep(max(0.0, start + DURATION_S / 6 - time.time()))
            redis.kill()
            # Every host noticed Redis went away.
            wait_for(lambda: all(metric(gw, "velox_redis_up") == 0 for gw in gateways), 30)
            time.sleep(max(0.0, start + DURATION_S / 4 - time.time()))
            redis.start()  # empty: no persistence
            # Every host is back on Redis.
            wait_for(lambda: all(metric(gw, "velox_redis_up") == 1 for gw in gateways), 30)
        docs = [paced.collect(p, DURATION_S + 120) for p in procs]
        # Redis commands over the run (rate leases' heartbeats and the budgets' calls): a figure
        commands = sum(metric(gw, "velox_redis_commands_total") or 0 for gw in gateways)
        logs = [gw.log() for gw in gateways]
        for gw in gateways:  # SIGTERM: the ledgers written, the allowances returned
            gw.stop()
        gateways = []
        used, held = redis_used(redis)
    finally:
        for gw in gateways:
            gw.stop()
        redis.stop()
    statuses: dict[int, int] = {}
    for doc in docs:
        for _, status in doc["records"]:
            statuses[status] = statuses.get(status, 0) + 1
    books = [ledger(tmp_path / f"state{i}") for i in range(HOSTS)]
    spent = sum(total for total, _ in books)
    largest = max(most for _, most in books)
    budget = int(BUDGET_USD * 10**9)
    # The largest estimate: the prompt (its body's bytes / 4: ~19 tokens, 32 allowed) plus
    # the default output.
    estimate = 32 * 100_000 + DEFAULT_OUTPUT * 10_000
    units = 1000  # nano-USD per unit of the budget (a micro-USD)
    size = budget // units
    cap = budget_hosts.allowance_cap(size, 1) * units
    # Past the budget: a request in flight per worker when it ran out, an allowance cap per
    # host (and, with the outage, what the hosts' last views of what was left may be behind).
    upper = budget + budget_hosts.bound(size, HOSTS, -(-largest // units), HOSTS * WORKERS,
                                        -(-estimate // units), outage) * units
    lower = budget - HOSTS * (cap + estimate)
    summary = {"statuses": statuses, "spent": spent, "budget": budget, "upper": upper,
               "lower": lower, "largest": largest, "used": used, "held": held,
               "failures": [d["failures"] for d in docs],
               "commands_per_host_s": round(commands / HOSTS / (DURATION_S + 2), 1)}
    print(json.dumps(summary))
    assert set(statuses) <= {200, 429}, summary  # no 5xx, nothing unanswered
    # Each host alone would have admitted all of its third: the budget three times over.
    assert statuses.get(429, 0) > 0, summary
    assert lower <= spent <= upper, summary
    # Reconciled: what Redis holds for the period is what the ledgers hold (to the micro-USD
    # each worker carries below one unit), nothing held once the hosts have left.
    assert abs(used * units - spent) <= HOSTS * WORKERS * units + units, summary
    assert held == 0, summary
    if outage:  # the first host back found the hash gone and held it until all reported
        assert any("Redis lost the budgets' data" in log for log in logs), logs
    assert all("Traceback" not in log for log in logs)


def test_a_restarted_host_reports_under_its_name_and_resumes_from_its_ledger(
        tmp_path: Path, mock: MockUpstream) -> None:
    """A host stopped and started again (its state directory kept) reports its spend under
    the same name, resumed from its ledger: the period's spend in Redis is still what the
    ledgers hold, not that plus the host's spend before its restart."""
    import openai

    redis = RedisProcess(log_path=tmp_path / "redis.log").start()
    gateways: list[GatewayProcess] = []

    def spend(gw: GatewayProcess, n: int) -> None:
        # The SDK's default retries: one client in a loop spends the budget's allowance cap
        # (5% of $0.04 over two hosts: ~3 requests) faster than a loaded refresher's tick may
        # bring the next, and is answered 429 with Retry-After: 1 meanwhile, which the SDK
        # retries.
        with openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY,
                           timeout=30) as client:
            for _ in range(n):
                client.chat.completions.create(
                    model=paced.MODEL, messages=[{"role": "user", "content": "Say hello."}])

    try:
        gateways = start_hosts(tmp_path, mock, redis.url, hosts=2)
        wait_for(lambda: all(metric(gw, "velox_redis_hosts") == 2 for gw in gateways), 30)
        spend(gateways[0], 12)
        spend(gateways[1], 5)
        gateways[0].stop()  # SIGTERM: its rows written, its allowance returned
        names = {k for k in budget_hash(redis) if k.startswith("u:")}
        gateways[0].start(timeout=60)
        wait_for(lambda: all(metric(gw, "velox_redis_hosts") == 2 for gw in gateways), 30)
        spend(gateways[0], 4)
        for gw in gateways:
            gw.stop()
        gateways = []
        fields = budget_hash(redis)
    finally:
        for gw in gateways:
            gw.stop()
        redis.stop()
    assert len(names) == 2 and {k for k in fields if k.startswith("u:")} == names, fields
    spent = sum(ledger(tmp_path / f"state{i}")[0] for i in range(2))
    used = sum(int(v) for k, v in fields.items() if k.startswith("u:"))
    assert spent > 0 and abs(used * 1000 - spent) <= 2 * WORKERS * 1000 + 1000, (used, spent)


def grants(gw: GatewayProcess) -> dict[str, float]:
    """The shared budget's allowance figures in one host's /metrics, by metric name."""
    _, body = gw.admin_get("/metrics", timeout=5.0)
    out = {}
    for line in body.decode().splitlines():
        name, _, rest = line.partition('{budget="shared",kind="key"} ')
        if rest and name.startswith("velox_budget_"):
            out[name] = float(rest)
    return out


def test_budget_grants_are_in_metrics(tmp_path: Path, mock: MockUpstream) -> None:
    """Two hosts spend one budget past its end (one SDK load process each): each host's
    /metrics tells the asks for an allowance it sent to Redis, how many were granted some or
    nothing, the USD granted (together within the budget) and the allowance it holds."""
    redis = RedisProcess(log_path=tmp_path / "redis.log").start()
    gateways: list[GatewayProcess] = []
    try:
        gateways = start_hosts(tmp_path, mock, redis.url, hosts=2)
        wait_for(lambda: all(metric(gw, "velox_redis_hosts") == 2 for gw in gateways), 30)
        duration = 6.0  # the budget lasts ~110 requests: twice that over the run
        procs = [paced.spawn(gw.base_url + "/v1", CLIENT_KEY, 220 / duration / 2, duration,
                             None) for gw in gateways]
        paced.start(procs)  # once every process has imported the SDK
        docs = [paced.collect(p, duration + 120) for p in procs]
        # The refresher's last call is at most a heartbeat old: its asks are counted.
        figures = [grants(gw) for gw in gateways]
    finally:
        for gw in gateways:
            gw.stop()
        redis.stop()
    statuses = [status for doc in docs for _, status in doc["records"]]
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses
    for host in figures:
        asks = host["velox_budget_grant_asks_total"]
        assert host["velox_budget_grants_total"] >= 1, figures
        assert asks == host["velox_budget_grants_total"] + \
            host["velox_budget_grant_refusals_total"], figures
        assert 0 <= host["velox_budget_allowance_usd"] <= BUDGET_USD, figures
    # The budget ran out while the hosts still asked: some asks got nothing.
    assert sum(h["velox_budget_grant_refusals_total"] for h in figures) >= 1, figures
    granted = sum(h["velox_budget_granted_usd_total"] for h in figures)
    # Grants never pass the budget; the hosts spent most of it through them (a first request
    # may borrow one estimate before its host's first grant).
    assert BUDGET_USD / 2 <= granted <= BUDGET_USD + 1e-9, figures
