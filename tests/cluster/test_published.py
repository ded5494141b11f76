"""The published test (issue 11): several Velox hosts hold ONE limit through Redis, within the
stated bound, and keep serving through a Redis outage.

Three real Velox instances (two workers each) on three ports of 127.0.0.1, one real
redis-server started on a free port, the bundled mock upstream behind them, all sharing
VELOX_RATE_LIMIT_RPM=600 (burst 20), hammered at three times the limit with the official SDK
(benches/e2e/cluster.py's harness, open loop). `make bench-cluster` runs the same for 60 s with
Redis down for 20 s; here it is 20 s with Redis SIGKILLed 6 s in and restarted 8 s later, so
`make test` stays fast. The bounds (velox.cluster.leases.bound: hosts x lease cap, 12 requests here)
are derived in velox/cluster.py's docstring.
"""

from __future__ import annotations

from pathlib import Path

from benches.e2e import cluster as harness
from velox.cluster import leases as cluster

RPM, BURST, HOSTS = 600, 20, 3
RATE = RPM / 60


def test_three_hosts_hold_one_limit_through_a_redis_outage(tmp_path: Path) -> None:
    plan = harness.Plan(hosts=HOSTS, rpm=RPM, burst=BURST, factor=3.0, duration_s=20.0,
                        outage=(6.0, 14.0))
    doc = harness.run(plan, tmp_path)
    stated = cluster.bound(RPM, BURST, HOSTS)
    assert stated == 12
    sent = doc["sent"]
    assert sent == 3 * RATE * 20
    # Every request answered, by Velox itself or the upstream; none failed because Redis did.
    assert set(doc["statuses"]) <= {"200", "429"}, doc["statuses"]
    assert doc["server_errors"] == 0

    # Before the outage: fresh Redis bucket (burst) + the refill, plus at most what the hosts
    # hold; and not below that minus a lease per host held at the end and one asked late.
    # Windows count requests by send time; each was admitted before its answer, so the bounds
    # widen by the refill during the longest send-to-answer time (about 10 ms when the box is
    # quiet, seconds when it is not).
    lag = RATE * doc["max_lag_s"]
    before = harness.window(doc, 0, 6)
    assert BURST + RATE * 6 - 2 * stated - lag <= before <= BURST + RATE * 6 + stated + lag, doc

    # Redis down (after a second to notice): each host its share, 600/3 rpm, so the hosts
    # together still about the limit; at most what they held plus their share buckets.
    share_rate, share_burst = cluster.fallback_share(RPM, BURST, HOSTS)
    assert (share_rate, share_burst) == (200, 6)
    down = harness.window(doc, 7, 14)
    assert RATE * 7 - 2 * stated - lag <= down <= RATE * 7 + HOSTS * share_burst + stated + lag, \
        doc

    # Back: every host shares through Redis again within a few seconds (metrics are sampled
    # once a second), and from 2 s after the restart the total is back at the limit (the
    # restarted Redis kept no data; its buckets start empty, not with a second burst).
    assert all(v is not None and v <= 3.0 for v in doc["recovered_s"].values()), doc
    after = harness.window(doc, 16, 20)
    assert RATE * 4 - 2 * stated - lag <= after <= RATE * 4 + HOSTS * share_burst + stated + lag, \
        doc

    # The whole run: one burst, the limit over the run (+1 s: hosts come back one after
    # another), the stated bound.
    span = max(20.0, doc["last_send_s"], doc["last_admitted_s"])
    assert doc["upper"] <= BURST + RATE * (span + 1.1) + stated + 0.1  # (rounded to 0.1)
    assert doc["lower"] <= doc["admitted"] <= doc["upper"], doc
    assert doc["within"]

    for i, m in enumerate(doc["final_metrics"]):
        assert m["velox_redis_up"] == 1 and m["velox_redis_hosts"] == HOSTS, (i, m)
        assert m["velox_redis_fallbacks"] == 1, (i, m)  # one outage, counted once
        assert m["velox_redis_leased_tokens"] > 0
        # At most one script call per 0.1 s tick (plus reconnects): a few per second, not one
        # per request.
        assert m["velox_redis_commands"] <= 11 * 22, (i, m)
    for log in doc["logs"]:
        # The limits' own lines (the ledger's Redis Stream logs its outage apart, once it has
        # rows to send): logged once, however many retries.
        assert log.count("until it is back this host keeps to") == 1, log
        assert log.count("is reachable again; the limits") == 1, log
        assert "Traceback" not in log


def test_one_host_without_redis_is_exact_as_before(tmp_path: Path) -> None:
    plan = harness.Plan(hosts=1, redis=False, rpm=RPM, burst=BURST, factor=3.0,
                        duration_s=6.0, outage=None)
    doc = harness.run(plan, tmp_path)
    assert set(doc["statuses"]) <= {"200", "429"}, doc["statuses"]
    # One shared-memory bucket, no leases: burst + the refill while requests were sent, to
    # the request (the next request after each refill takes it, at 30 requests per second).
    # (Tokens refill until the last admission, no later than its answer.)
    last = doc["last_send_s"]
    most = BURST + RATE * doc["last_admitted_s"] + 1
    assert BURST + RATE * last - 2 <= doc["admitted"] <= most, doc
    assert "velox_redis_up" not in doc["final_metrics"][0]


def test_three_hosts_hold_one_gateway_key_to_its_rpm_and_tpm(tmp_path: Path) -> None:
    """The issue's key: rpm = 600, tpm = 60000 ([[key]] in VELOX_CONFIG, no gateway limit),
    shared by three hosts through Redis. Its buckets hold a minute's worth (burst = 600), so
    the load is six times the rate for 20 s (1,200 requests) to get past the burst here;
    `make bench-cluster` runs it at 3x for 60 s."""
    plan = harness.Plan(hosts=HOSTS, rpm=RPM, burst=RPM, tpm=60_000, keyed=True, factor=6.0,
                        duration_s=20.0, outage=None)
    doc = harness.run(plan, tmp_path)
    stated = cluster.bound(RPM, RPM, HOSTS)
    assert stated == 12
    assert set(doc["statuses"]) <= {"200", "429"}, doc["statuses"]
    # Three hosts alone would admit up to 3 x (600 + 200); together: one key's worth.
    assert doc["admitted"] <= doc["upper"], doc
    span = max(20.0, doc["last_send_s"], doc["last_admitted_s"])
    assert doc["upper"] <= RPM + RATE * span + stated + 0.1  # (upper is rounded to 0.1)
    assert doc["admitted"] > RPM / 3  # more than one host's third: the hosts drew from one pool
    # Not asserted here: "not below the limit minus a lease per host". Drawing a minute's
    # burst at 6x the rate takes many leases a second, and a host gets at most one lease cap
    # per round trip to Redis; on a quiet machine that is ample (80 per second per host), on
    # a box loaded twenty deep the refresher's round trips stretch and fewer get through.
    # The gateway-limit test above asserts that lower bound where the rate binds.
    # Tokens: what the admitted answers used stays within the key's tpm bound (at ~20 tokens
    # a request the rpm binds first; the token buckets are shared the same way).
    assert 0 < doc["tokens"] <= doc["tokens_upper"], doc
    for m in doc["final_metrics"]:
        assert m["velox_redis_up"] == 1 and m["velox_redis_fallbacks"] == 0, m
    assert all("Traceback" not in log for log in doc["logs"])
