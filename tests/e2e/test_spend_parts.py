"""Cached, cache-write and reasoning tokens priced apart, streams included, and batched
embeddings priced per member, end to end: a real Velox (one worker) with a price table whose
parts all differ, the bundled mock over HTTP/2 + TLS as an OpenAI, an Anthropic and a Gemini
upstream, the official `openai` and `anthropic` SDKs as clients (their defaults: no max_tokens).

For each case the usage the SDK parsed gives the expected cost by the price table; the ledger's
row, the access log's `cost_usd` and (plain answers) `x-velox-cost-usd` must equal it to the
nano-dollar:

* OpenAI chat, plain and streamed with include_usage: prompt_tokens_details.cached_tokens
  (prompt_cache_key) and completion_tokens_details.reasoning_tokens (reasoning_effort);
* the Responses API streamed: input_tokens_details / output_tokens_details;
* the Messages API to an Anthropic upstream, plain and streamed: cache_creation_input_tokens
  on the first call with a cache_control block, cache_read_input_tokens on the next;
* chat translated to a Gemini upstream, streamed with and without include_usage:
  cachedContentTokenCount and thoughtsTokenCount;
* embeddings merged by the batching stage: each member's share of the merged call's usage, at
  the model's price, in its own answer's header and its own ledger row (none for the merged
  call itself).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import wait_for
from tests.e2e.test_spend_wire import ledger_rows
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

KEY = "vx-parts-0123456789"
UPSTREAM_KEYS = {"KEY_OA": "sk-oa-upstream-0123456789", "KEY_AN": "sk-ant-upstream-0123456789",
                 "KEY_GEM": "AIza-upstream-0123456789"}
# USD per million tokens: every part a price of its own, so a part priced as another shows.
PRICES = {
    "gpt-x": {"input": 100, "cached_input": 10, "output": 200, "reasoning": 700},
    "claude-x": {"input": 300, "cached_input": 30, "cache_write": 375, "output": 1500},
    "cached-gem-x": {"input": 50, "cached_input": 5, "output": 400, "reasoning": 900},
    "text-emb-x": {"input": 20, "output": 0},
}
HI = [{"role": "user", "content": "Tell me about the weather in a few words, please."}]


def price_tables() -> str:
    out = ""
    for model, parts in PRICES.items():
        out += f'[[price]]\nmodel = "{model}"\n' + "".join(
            f"{name} = {usd}\n" for name, usd in parts.items()) + "\n"
    return out


def expected(model: str, inp: int, out: int, cached: int = 0, written: int = 0,
             reasoning: int = 0) -> int:
    """The price table's cost in nano-USD (micro-USD per million tokens = pico-USD per token;
    cached input and cache writes are parts of the input, reasoning a part of the output)."""
    p = {k: v * 10**6 for k, v in PRICES[model].items()}
    pico = ((inp - cached - written) * p["input"] + cached * p.get("cached_input", p["input"])
            + written * p.get("cache_write", p["input"])
            + (out - reasoning) * p["output"] + reasoning * p.get("reasoning", p["output"]))
    return (pico + 500) // 1000


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockUpstream]:
    with MockUpstream(tls=True, certdir=str(tmp_path_factory.mktemp("parts-certs"))) as m:
        yield m


@pytest.fixture(scope="module")
def gw(mock: MockUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("parts")
    upstreams = "".join(
        f'[[upstream]]\nname = "{name}"\norigin = "{mock.origin}"\n'
        f'api_key_env = "KEY_{name.upper()}"\nca_file = "{mock.ca_file}"\n{extra}\n'
        for name, extra in (("oa", ""), ("an", 'kind = "anthropic"\n'),
                            ("gem", 'kind = "gemini"\n')))
    config = tmp / "velox.toml"
    config.write_text(upstreams + price_tables() + f"""
[[route]]
model = "gpt-x"
targets = [{{ upstream = "oa" }}]

[[route]]
model = "claude-x"
targets = [{{ upstream = "an" }}]

[[route]]
model = "gem-x"
targets = [{{ upstream = "gem", model = "cached-gem-x" }}]

[[route]]
model = "text-emb-x"
targets = [{{ upstream = "oa" }}]
batch = {{ max_requests = 8, max_wait_ms = 2000 }}

[[key]]
name = "parts"
sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"
""")
    # One worker: the batched requests all meet the slow call of their group (batching is per
    # worker).
    env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "1", "VELOX_RATE_LIMIT_RPM": "0",
           "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_STATE_DIR": str(tmp / "state"),
           "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **UPSTREAM_KEYS}
    with GatewayProcess(env, log_path=Path(tmp) / "velox.log") as gateway:
        yield gateway


def oa(gw: GatewayProcess) -> openai.OpenAI:
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEY, timeout=20)
    closed_after_the_test(client)
    return client


def ledger(gw: GatewayProcess) -> list[dict[str, Any]]:
    return ledger_rows(gw)


def costs_logged(gw: GatewayProcess) -> list[Decimal]:
    return [Decimal(str(line["cost_usd"])) for line in
            (json.loads(text) for text in gw.log().splitlines()
             if '"log":"access"' in text and '"key":"parts"' in text)
            if line.get("cost_usd") is not None]


class Rows:
    """The ledger rows and access-log costs that arrive after it is made."""

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.rows = len(ledger(gw))
        self.lines = len(costs_logged(gw))

    def new(self, n: int) -> tuple[list[dict[str, Any]], list[Decimal]]:
        rows = wait_for(lambda: len(ledger(self.gw)) >= self.rows + n and ledger(self.gw))
        lines = wait_for(lambda: len(costs_logged(self.gw)) >= self.lines + n
                         and costs_logged(self.gw))
        return rows[self.rows:], lines[self.lines:]


def nano_usd(text: str) -> int:
    return int(Decimal(text) * 10**9)


def test_openai_chat_plain_and_streamed_price_cached_and_reasoning_apart(
        gw: GatewayProcess) -> None:
    client = oa(gw)
    since = Rows(gw)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-x", messages=HI, prompt_cache_key="weather", reasoning_effort="low")
    plain = raw.parse().usage
    assert plain is not None and plain.prompt_tokens_details is not None
    assert plain.completion_tokens_details is not None
    cached = plain.prompt_tokens_details.cached_tokens or 0
    reasoning = plain.completion_tokens_details.reasoning_tokens or 0
    assert cached > 0 and reasoning > 0  # the case under test: both parts reported
    want = [expected("gpt-x", plain.prompt_tokens, plain.completion_tokens, cached,
                     reasoning=reasoning)]
    assert nano_usd(raw.headers["x-velox-cost-usd"]) == want[0]
    chunks = list(client.chat.completions.create(
        model="gpt-x", messages=HI, prompt_cache_key="weather", reasoning_effort="low",
        stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.completion_tokens_details is not None
    want.append(expected("gpt-x", usage.prompt_tokens, usage.completion_tokens,
                         usage.prompt_tokens_details.cached_tokens or 0,
                         reasoning=usage.completion_tokens_details.reasoning_tokens or 0))
    # Priced as plain input and output, the stream would cost more than this (cached input
    # is cheaper than the difference reasoning adds): the split must be what the ledger has.
    assert want[1] != expected("gpt-x", usage.prompt_tokens, usage.completion_tokens)
    rows, lines = since.new(2)
    assert [r["cost_nanos"] for r in rows] == want
    assert [r["cached_tokens"] for r in rows] == [cached, cached]
    assert [r["reasoning_tokens"] for r in rows] == [reasoning, reasoning]
    assert lines == [Decimal(w) / 10**9 for w in want]


def test_a_responses_stream_prices_its_parts(gw: GatewayProcess) -> None:
    since = Rows(gw)
    events = list(oa(gw).responses.create(model="gpt-x", input="Weather?", stream=True,
                                          prompt_cache_key="weather",
                                          reasoning={"effort": "low"}))
    usage = events[-1].response.usage  # response.completed
    assert usage is not None
    cached = usage.input_tokens_details.cached_tokens
    reasoning = usage.output_tokens_details.reasoning_tokens
    assert cached > 0 and reasoning > 0
    rows, lines = since.new(1)
    want = expected("gpt-x", usage.input_tokens, usage.output_tokens, cached,
                    reasoning=reasoning)
    assert rows[0]["api"] == "responses" and rows[0]["cost_nanos"] == want
    assert lines == [Decimal(want) / 10**9]


def test_anthropic_cache_writes_and_reads_priced_plain_and_streamed(gw: GatewayProcess) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY, max_retries=0, timeout=20)
    closed_after_the_test(client)
    system = [{"type": "text", "text": "You answer about the weather. " * 40,
               "cache_control": {"type": "ephemeral"}}]
    since = Rows(gw)
    want, headers = [], []
    for stream in (False, True, False, True):
        if stream:
            with client.messages.stream(model="claude-x", max_tokens=64, system=system,
                                        messages=HI) as events:
                usage = events.get_final_message().usage
        else:
            raw = client.messages.with_raw_response.create(
                model="claude-x", max_tokens=64, system=system, messages=HI)
            usage = raw.parse().usage
            headers.append(nano_usd(raw.headers["x-velox-cost-usd"]))
        read = usage.cache_read_input_tokens or 0
        written = usage.cache_creation_input_tokens or 0
        want.append(expected("claude-x", usage.input_tokens + read + written,
                             usage.output_tokens, read, written))
    rows, lines = since.new(4)
    assert [r["cache_write_tokens"] > 0 for r in rows] == [True, False, False, False]
    assert all(r["cached_tokens"] > 0 for r in rows[1:])
    assert [r["cost_nanos"] for r in rows] == want
    assert headers == [want[0], want[2]]
    assert lines == [Decimal(w) / 10**9 for w in want]


def test_a_translated_gemini_stream_prices_cached_and_thinking_tokens(
        gw: GatewayProcess) -> None:
    client = oa(gw)
    since = Rows(gw)
    chunks = list(client.chat.completions.create(
        model="gem-x", messages=HI, reasoning_effort="low", stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.completion_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    reasoning = usage.completion_tokens_details.reasoning_tokens or 0
    assert cached > 0 and reasoning > 0
    want = expected("cached-gem-x", usage.prompt_tokens, usage.completion_tokens, cached,
                    reasoning=reasoning)
    # Without include_usage the client sees no usage: the translator tells the meter, parts
    # and all (the mock answers the same request alike).
    list(client.chat.completions.create(model="gem-x", messages=HI, reasoning_effort="low",
                                        stream=True))
    rows, lines = since.new(2)
    assert [r["cost_nanos"] for r in rows] == [want, want]
    assert [(r["cached_tokens"], r["reasoning_tokens"]) for r in rows] == \
        [(cached, reasoning)] * 2
    assert lines == [Decimal(want) / 10**9] * 2


def test_batched_embeddings_are_priced_per_member(gw: GatewayProcess, mock: MockUpstream) -> None:
    client = oa(gw)
    since = Rows(gw)
    embeddings_calls = mock.stats()["by_path"].get("/v1/embeddings", 0)
    # A slow first call of the group goes out alone (the mock holds it while it arrives); the
    # ones sent while it is in flight wait in the worker and leave together as one call.
    mock.behave(latency_ms=3000)
    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(
        client.embeddings.with_raw_response.create(model="text-emb-x", input="the blocker")))
    first.start()
    try:
        wait_for(lambda: mock.stats()["by_path"].get("/v1/embeddings", 0) > embeddings_calls)
    finally:
        mock.behave()
    inputs = ["one", "a longer input of several words", "mid sized text", "more words"]
    start = threading.Barrier(len(inputs))

    def embed(text: str) -> None:
        start.wait()
        answers.append(client.embeddings.with_raw_response.create(model="text-emb-x",
                                                                   input=text))

    threads = [threading.Thread(target=embed, args=(text,)) for text in inputs]
    for t in threads:
        t.start()
    for t in (*threads, first):
        t.join(60)
    assert len(answers) == len(inputs) + 1
    merged = [a for a in answers if int(a.headers.get("x-velox-batch", "1")) > 1]
    assert merged, "no request was merged: nothing under test"
    for answer in answers:
        tokens = answer.parse().usage.prompt_tokens
        assert nano_usd(answer.headers["x-velox-cost-usd"]) == expected("text-emb-x", tokens, 0)
    rows, lines = since.new(len(answers))
    # One row per member, none for the merged call (its key is no client's).
    assert len(ledger(gw)) == since.rows + len(answers)
    assert {r["key"] for r in rows} == {"parts"} and {r["api"] for r in rows} == {"embeddings"}
    assert sorted(r["cost_nanos"] for r in rows) == sorted(
        nano_usd(a.headers["x-velox-cost-usd"]) for a in answers)
    assert sorted(lines) == sorted(Decimal(a.headers["x-velox-cost-usd"]) for a in answers)
