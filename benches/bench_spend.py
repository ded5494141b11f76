"""What spend costs per request: prices, budgets and ledger rows on against off (target: 5 µs).

One worker's whole request path without sockets (velox_lab/pipeline.py, 64 clients, the
OpenAI SDK's request, the answer carrying OpenAI's usage), with the client's key as a
`[[key]]` three ways: VELOX_SPEND=0 (no pricing, no meter beyond the token counters'); pricing
and the ledger rows (each answer priced from its usage, x-velox-cost-usd, one row per request
into the worker's ledger feed, whose frame is encoded every round as the feed's timer would);
and the same with the key under a budget (a reservation at admission, settled to the exact
cost, in shared memory). The variants are interleaved round by round and timed with the
thread's own CPU clock, so a busy machine moves them alike; `extra_info` carries each
variant's CPU µs per request and its difference to spend off.

Run: `.venv/bin/pytest --benchmark benches/bench_spend.py`.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any

from benches.paired import paired_cpu_us
from velox.admin.ledgerfeed import LedgerFeed
from velox.spend.wire import SharedBudgets, Spend
from velox_lab.pipeline import Pipeline

BATCH = 64
CLIENT_KEY = b"sk-client-0123456789abcdef"  # what velox_lab.pipeline's requests present
ROUNDS = 400
WARMUP = 50

TABLES = f"""
[[route]]
model = "gpt-4o-mini"
targets = [{{ upstream = "default" }}]

[[key]]
name = "bench"
sha256 = "{hashlib.sha256(CLIENT_KEY).hexdigest()}"
"""
BUDGET = 'budget_usd = 1000000\nbudget_period = "month"\n'


def _pipeline(directory: Path, tables: str, spend: bool) -> tuple[Pipeline, LedgerFeed | None]:
    directory.mkdir()
    config = directory / "velox.toml"
    config.write_text(tables)
    pipeline = Pipeline(clients=BATCH, VELOX_CONFIG=str(config),
                        VELOX_SPEND="1" if spend else "0")
    worker = pipeline.worker
    feed = None
    if spend:
        budgets = SharedBudgets(worker.tables, 2) if BUDGET in tables else None
        worker.spend = Spend(worker.tables, budgets, 0, worker.settings.tokens_default_output,
                             worker.shared.spend)
        feed = LedgerFeed(lambda frame: None, lambda: 0)
        worker.spend.feed = feed
        # The stages were listed when the worker was built, with the Spend it made then (no
        # budgets without a supervisor): listed again, so the budget stage runs.
        worker.stages = worker._stage_list()
        worker._index_stages()
    return pipeline, feed


def test_spend_pipeline_paired(benchmark: Any, tmp_path: Path) -> None:
    variants = {
        "spend off (VELOX_SPEND=0)": _pipeline(tmp_path / "off", TABLES, False),
        "prices + ledger rows": _pipeline(tmp_path / "on", TABLES, True),
        "prices + budget + ledger rows": _pipeline(tmp_path / "budget", TABLES + BUDGET, True),
    }
    for pipeline, feed in variants.values():
        for _ in range(WARMUP):
            pipeline.round()
            if feed is not None:
                feed.flush()

    def one_round(pipeline: Pipeline, feed: LedgerFeed | None) -> None:
        pipeline.round()
        if feed is not None:
            feed.flush()  # the feed's timer: one orjson frame of the round's rows

    per_request_us = paired_cpu_us(
        benchmark, "spend-pipeline: one worker, 64 requests per round, no sockets",
        {name: partial(one_round, *pair) for name, pair in variants.items()}, ROUNDS, BATCH)
    for name, (pipeline, feed) in variants.items():
        assert pipeline.worker.in_flight == 0, name
        spend = pipeline.worker.spend
        if feed is not None:  # every request was priced and wrote its row
            assert spend is not None and not spend.held
            assert feed.sent == (ROUNDS + WARMUP) * BATCH and not feed.dropped
    base = per_request_us["spend off (VELOX_SPEND=0)"]
    benchmark.extra_info.update({
        "requests_per_round": BATCH, "rounds_per_variant": ROUNDS,
        "cpu_us_per_request": {k: round(v, 2) for k, v in per_request_us.items()},
        "over_spend_off_us": {k: round(v - base, 2) for k, v in per_request_us.items()},
    })
    print()
    for name, value in per_request_us.items():
        print(f"  {name:34s} {value:7.2f} us/request CPU  ({value - base:+.2f})")
