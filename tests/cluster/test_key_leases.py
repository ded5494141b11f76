"""A gateway key ([[key]] rpm = 600, tpm = 60000, the README's example) shared through Redis,
driven as SDK users drive it: the official `openai` SDK without `max_tokens` (each request
then reserves its prompt plus the default output, about 1,050 tokens, and uses a few), one
load process per host, steady and in bursts.

Two failures this guards against: a tpm key locked out after its first request (the local
bucket, refunded to just under the next reservation, never asked for a lease again, and its
demand estimate decayed to 0 since nothing was admitted), and a several-hosts limit that does
not hold both ways (not more than the stated bound, not far fewer than the limit).

Real processes: a real redis-server, the bundled mock upstream (HTTP/2 + TLS), Velox hosts of
two workers each, and the load processes (benches/e2e/paced.py). Bounds are in requests; the
load waits on events (the hosts registered, the processes' answers), never on a sleep.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from benches.e2e import cluster as harness
from benches.e2e import paced
from velox.cluster import leases as cluster

RPM, TPM = 600, 60_000
RATE = RPM / 60
# Empty both of the key's buckets in Redis, by Redis's own clock (as LEASE_LUA stores them).
EMPTY_LUA = """
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2]))
for i = 1, #KEYS do redis.call('HSET', KEYS[i], 'l', '0', 't', now) end
return 1
"""


def run(tmp_path: Path, hosts: int, per_host: float, duration_s: float, burst: int,
        empty: bool) -> dict[str, Any]:
    """The key on `hosts` hosts, `per_host` requests a second to each from its own process
    (in bursts of `burst`), for `duration_s`; the key's Redis buckets emptied first if asked."""
    plan = harness.Plan(hosts=hosts, rpm=RPM, burst=RPM, tpm=TPM, keyed=True, outage=None,
                        duration_s=duration_s)
    c = harness.Cluster(plan, tmp_path)
    try:
        c.start()  # returns once every host is registered in Redis
        emptied = time.time()
        if empty:
            assert c.redis is not None
            reply = c.redis.command("EVAL", EMPTY_LUA, "2", "velox:bucket:key:bench:rpm",
                                    "velox:bucket:key:bench:tpm")
            assert reply == b":1\r\n", reply
        procs = [paced.spawn(gw.base_url + "/v1", harness.CLIENT_KEY, per_host, duration_s,
                             None, burst) for gw in c.gateways]
        start = paced.start(procs)  # once every process has imported the SDK
        docs = [paced.collect(p, duration_s + 120) for p in procs]
        stats = [json.loads(gw.admin_get("/stats")[1])["keys"][0] for gw in c.gateways]
        logs = [gw.log() for gw in c.gateways]
    finally:
        c.stop()
    statuses: dict[int, int] = {}
    for doc in docs:
        for _, status in doc["records"]:
            statuses[status] = statuses.get(status, 0) + 1
    return {
        "statuses": statuses, "sent": sum(d["sent"] for d in docs),
        "admitted": statuses.get(200, 0), "tokens": sum(d["tokens"] for d in docs),
        # The Redis buckets refilled from the emptying to the first send.
        "lead_s": start - emptied,
        "last_send_s": max(d["last_send_s"] for d in docs),
        "last_admitted_s": max(d["last_admitted_s"] for d in docs),
        "failures": [d["failures"] for d in docs], "stats": stats, "logs": logs,
        "records": sorted(r for d in docs for r in d["records"]),
    }


@pytest.mark.parametrize("burst", [1, 4], ids=["steady", "bursts-of-4"])
def test_one_host_sdk_requests_are_not_locked_out(tmp_path: Path, burst: int) -> None:
    """Below the key's limits (8 requests a second of 10), SDK-shaped requests are served:
    each reserves more than a second's lease of the tpm (1,000 tokens on one host) and gives
    most of it back. Before the fix: one 200, then 429 for every request."""
    duration = 8.0
    doc = run(tmp_path, hosts=1, per_host=8.0, duration_s=duration, burst=burst, empty=False)
    assert set(doc["statuses"]) <= {200, 429}, doc
    # A first take or two may be refused while the first leases arrive; a loaded box starves
    # the supervisor's refresher of CPU, leases come late and more requests get 429. Measured
    # on the 2-core box: 62 and 58 of 64 passed at a load average of 10-11, 51 and 47 at 13
    # (a busy loop added); a locked-out key passes 1.
    assert doc["admitted"] >= 0.5 * doc["sent"], doc
    # ...and it serves to the end: a lockout is for good.
    late = [s for t, s in doc["records"] if t >= duration * 0.75]
    assert late.count(200) >= 0.5 * len(late), doc
    assert all("Traceback" not in log for log in doc["logs"])


@pytest.mark.parametrize("burst", [1, 4], ids=["steady", "bursts-of-4"])
def test_three_hosts_hold_the_key_to_its_limit_both_ways(tmp_path: Path, burst: int) -> None:
    """Three hosts, the key's buckets emptied in Redis, then three times the key's rpm from
    three processes (one per host) for 15 s: together the hosts admit the key's rate, not
    three times it (each host alone would admit all of its 10 a second), and not far fewer.
    Before the fix the tpm reservations locked the key out on every host."""
    duration = 15.0
    doc = run(tmp_path, hosts=3, per_host=RATE, duration_s=duration, burst=burst, empty=True)
    assert set(doc["statuses"]) <= {200, 429}, doc
    stated = cluster.bound(RPM, RPM, 3)
    assert stated == 12
    # Upper: the refill from the emptying to the last admission, plus what the hosts held.
    upper = RATE * (doc["lead_s"] + max(duration, doc["last_admitted_s"])) + stated
    assert doc["admitted"] <= upper, doc
    # Lower: the refill while requests were sent, less a lease cap per host held at the end
    # and one asked late. A loaded box starves the refreshers of CPU (their 0.05 s ticks
    # stretch) and requests meanwhile get 429. Measured of ~170-190 allowed: 171 and 165
    # passed at a load average of 10-14, 171 and 94 at 16-19 (a busy loop added); a
    # locked-out key passes 3. Not far fewer than the limit:
    lower = 0.5 * RATE * doc["last_send_s"] - 2 * stated
    assert doc["admitted"] >= lower, doc
    # Each host is refused its share of the excess: none admits its whole demand.
    assert all(s["refused"]["rpm"] + s["refused"]["tpm"] > 0 for s in doc["stats"]), doc
    # The tokens the answers used stay within the tpm bound (a key's reservations are given
    # back when settled: the rpm binds first).
    tokens_upper = TPM + TPM / 60 * (doc["lead_s"] + duration) + \
        cluster.bound(TPM, TPM, 3, largest=2048 + 1024)
    assert 0 < doc["tokens"] <= tokens_upper, doc
    assert all("Traceback" not in log for log in doc["logs"])
