"""VELOX_METRICS_KEYS: the first N [[key]] tables (file order) have their own /metrics series,
the rest are summed under key="_other" (requests, refusals, in flight, tokens per route; no
`remaining`). Socket-free: the admin server's collector over real shared memory."""

from __future__ import annotations

import hashlib
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from velox.admin.metrics import VeloxCollector, make_registry
from velox.config.settings import ConfigError, load
from velox.config.tables import KeySpec, RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.state.stats import SharedStats

ROUTES = ("a", "*")


def shared_with_usage(n: int) -> SharedStats:
    keys = tuple(KeySpec(f"k{i}", hashlib.sha256(b"%d" % i).hexdigest(), rpm=60, tpm=6000)
                 for i in range(n))
    tables = Tables((UpstreamSpec("u", "https://api.openai.com"),),
                    tuple(RouteSpec(m, (TargetSpec("u"),)) for m in ROUTES), keys=keys)
    shared = SharedStats(1, tables)
    for i in range(n):
        for _ in range(i + 1):  # key i: i + 1 admitted, one still in flight
            assert shared.keys.limits.enter(2 * i, 0, 0)
        for _ in range(i):
            assert shared.keys.limits.leave(2 * i, 0)
        shared.keys.counters[1].add(0, i, 10 * i)  # refused for tpm
        field = ((i + 1) * len(ROUTES) + 1) * 2  # route "*": input, then output
        shared.tokens[0].add(0, field, 100 * (i + 1))
        shared.tokens[0].add(0, field + 1, i + 1)
    return shared


def scrape(shared: SharedStats, max_keys: int) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                      float]:
    c = VeloxCollector(shared, None, 64, time.time(), lambda: (0, False), max_keys=max_keys)
    text = generate_latest(make_registry(c)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_first_keys_have_their_own_series_and_the_rest_are_summed() -> None:
    got = scrape(shared_with_usage(5), max_keys=2)
    assert got[("velox_key_requests_total", (("key", "k0"),))] == 1
    assert got[("velox_key_requests_total", (("key", "k1"),))] == 2
    assert ("velox_key_requests_total", (("key", "k2"),)) not in got
    assert got[("velox_key_requests_total", (("key", "_other"),))] == 3 + 4 + 5
    assert got[("velox_key_active", (("key", "_other"),))] == 3
    assert got[("velox_key_refused_total", (("key", "_other"), ("reason", "tpm")))] == 90
    assert got[("velox_key_remaining", (("key", "k1"), ("kind", "tokens")))] == 6000
    assert not any(name == "velox_key_remaining" and ("key", "_other") in labels
                   for name, labels in got)
    other = (("key", "_other"), ("kind", "input"), ("route", "*"))
    assert got[("velox_tokens_total", other)] == 300 + 400 + 500
    assert got[("velox_tokens_total", (("key", "k1"), ("kind", "output"), ("route", "*")))] == 2
    assert got[("velox_key_series_other", ())] == 3


@pytest.mark.parametrize("max_keys,own", [(0, 0), (5, 5), (4096, 5)])
def test_the_cap_at_its_ends(max_keys: int, own: int) -> None:
    got = scrape(shared_with_usage(5), max_keys=max_keys)
    named = {dict(labels)["key"] for name, labels in got if name == "velox_key_requests_total"}
    assert named == {f"k{i}" for i in range(own)} | ({"_other"} if own < 5 else set())
    total = sum(v for (name, _), v in got.items() if name == "velox_key_requests_total")
    assert total == 15  # every request counted once, whichever series holds it


def test_the_setting() -> None:
    assert load({}, dotenv=None).metrics_keys == 100
    assert load({"VELOX_METRICS_KEYS": "0"}, dotenv=None).metrics_keys == 0
    with pytest.raises(ConfigError, match="VELOX_METRICS_KEYS"):
        load({"VELOX_METRICS_KEYS": "5000"}, dotenv=None)


def test_spend_series_follow_the_same_cap() -> None:
    """velox_spend_usd_total and velox_spend_unpriced_requests_total: counted by the worker's
    Spend.book, per key and route target, the keys past the cap summed under _other."""
    from types import SimpleNamespace

    from velox.spend.wire import Spend

    shared = shared_with_usage(4)
    spend = Spend(shared.tables, None, 0, 256, shared.spend)
    star = SimpleNamespace(index=1)  # the "*" route's target: model label "*"
    for key in range(4):
        spend.book(star, key, 1_500_000 * (key + 1))  # $0.0015 x (key + 1)
        spend.book(star, key, None)  # unknown cost: counted apart, never as 0
    spend.book(star, -1, 250_000)  # no key
    spend.book(star, 2, 0)  # nothing used: no series of its own
    spend.book(None, 0, 10**9)  # nothing was sent (no target): not counted
    got = scrape(shared, max_keys=1)
    labels = (("model", "*"), ("route", "*"), ("upstream", "u"))
    usd = {dict(lb)["key"]: v for (name, lb), v in got.items()
           if name == "velox_spend_usd_total"}
    assert usd == {"k0": pytest.approx(0.0015), "_other": pytest.approx(0.0015 * (2 + 3 + 4)),
                   "-": pytest.approx(0.00025)}
    assert got[("velox_spend_unpriced_requests_total", (("key", "_other"), *labels))] == 3
    assert got[("velox_spend_unpriced_requests_total", (("key", "k0"), *labels))] == 1
