"""An idle gateway leaves its workers asleep: no timer wakes a worker's loop more than a few
times a second once its last client has gone, on a real gateway (2 workers, access log on, the
mock upstream over HTTP/2 + TLS). /stats counts each worker's timer runs (`timer_wakes`: its
tick, the access log's flushes, the upstream pool's sweeps). An always-armed access-log flush
(50 ms) and a 0.25 s tick woke each worker ~25 times a second; idle now: the tick once a second
and the pool's sweep every few seconds.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import orjson

from velox_lab.launch import GatewayProcess

from .conftest import CLIENT_KEY, GatewayFactory, wait_for

# Generous: what is left idle is ~1.2 a second (the heartbeat tick, one pool's sweep). A
# loaded host only delays timers, so fewer runs, never more, fall in the window.
MAX_WAKES_PER_S = 6.0
WINDOW_S = 4.0


def workers(gw: GatewayProcess) -> list[dict[str, Any]]:
    status, body = gw.admin_get("/stats")
    assert status == 200, body
    return list(orjson.loads(body)["workers"])


def test_idle_workers_wake_a_few_times_a_second(start_gateway: GatewayFactory) -> None:
    gw = start_gateway()
    with openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0,
                       timeout=20) as client:  # closed: its connection leaves the worker
        for _ in range(4):  # lines for the access log: its flush must disarm after them
            reply = client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content
    wait_for(lambda: all(w["ready"] and not w["in_flight"] for w in workers(gw)))
    # The line of every request was written (the flush armed by the first of them ran).
    wait_for(lambda: orjson.loads(gw.admin_get("/stats")[1])["access_log"]["lines"] >= 4)
    before, t0 = workers(gw), time.monotonic()
    time.sleep(WINDOW_S)  # the measured window itself, not a wait for an event
    after, elapsed = workers(gw), time.monotonic() - t0
    for b, a in zip(before, after, strict=True):
        assert a["pid"] == b["pid"]
        assert b["timer_wakes"] > 0  # the counter counts: the ticks since start
        rate = (a["timer_wakes"] - b["timer_wakes"]) / elapsed
        assert rate <= MAX_WAKES_PER_S, (a["worker"], rate)
