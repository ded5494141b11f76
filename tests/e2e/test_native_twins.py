"""VELOX_NATIVE=0 serves what the native gateway serves, priced and logged: two real Velox
processes side by side, one native and one on every Python twin (the usage and estimate scans,
the spend book and the access log's book among them), the bundled mock over HTTP/2 + TLS as an
OpenAI and an Anthropic upstream, the official `openai` and `anthropic` SDKs as clients with
their defaults.

The same calls go to both: plain chat answers (one reporting cached and reasoning tokens),
streams with the usage asked for and without it (the gateway asks and strips it again), and
Messages answers plain and streamed, from a key under a budget and a tpm (so the admission's
estimates run too). Both gateways must give the same `x-velox-cost-usd` headers, the same
ledger rows and the same access-log lines, apart from times and ids. Which implementation ran
is proved socket-free (tests/unit/test_native_switch.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import anthropic
import openai

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import wait_for
from tests.e2e.test_spend_parts import price_tables
from tests.e2e.test_spend_wire import ledger_rows
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

KEY = "vx-twins-0123456789"
UPSTREAM_KEYS = {"KEY_OA": "sk-oa-upstream-0123456789", "KEY_AN": "sk-ant-upstream-0123456789"}
HI = [{"role": "user", "content": "Tell me about the weather in a few words, please."}]
CALLS = 6  # each gateway's requests below, one ledger row and one log line each
# What two runs of the same calls may differ in: clocks, row numbers and ids made per process.
_LINE_CLOCKS = {"time", "upstream_us", "total_us", "request_id"}
_ROW_CLOCKS = {"id", "ts_ms", "latency_us", "request_id"}
# The gateway's stage times and the mock's own (as OpenAI's): their digits vary run to run.
_CLOCK_HEADERS = ("server-timing", "openai-processing-ms")


def _config(mock: MockUpstream) -> str:
    """An OpenAI and an Anthropic upstream, a route to each, every part priced apart (the
    prices of tests/e2e/test_spend_parts.py), and the key."""
    upstreams = "".join(
        f'[[upstream]]\nname = "{name}"\norigin = "{mock.origin}"\n'
        f'api_key_env = "KEY_{name.upper()}"\nca_file = "{mock.ca_file}"\n{extra}\n'
        for name, extra in (("oa", ""), ("an", 'kind = "anthropic"\n')))
    routes = "".join(f'[[route]]\nmodel = "{model}"\ntargets = [{{ upstream = "{name}" }}]\n\n'
                     for model, name in (("gpt-x", "oa"), ("claude-x", "an")))
    return upstreams + price_tables() + routes + f"""[[key]]
name = "twins"
sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"
tpm = 10000000
budget_usd = 100
budget_period = "day"
"""


def _gateway(mock: MockUpstream, directory: Path, native: str) -> GatewayProcess:
    config = directory / "velox.toml"
    config.write_text(_config(mock))
    env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "1", "VELOX_NATIVE": native,
           "VELOX_RATE_LIMIT_RPM": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
           "VELOX_STATE_DIR": str(directory / "state"),
           "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **UPSTREAM_KEYS}
    return GatewayProcess(env, log_path=directory / "velox.log")


def _calls(gw: GatewayProcess) -> tuple[list[str], list[int]]:
    """The calls, one after another: the plain answers' cost headers, and per answer the
    length of its header values a clock decides (the part of bytes_out two runs may differ
    in)."""
    oa = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEY, timeout=20)
    an = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY, timeout=20)
    closed_after_the_test(oa)
    closed_after_the_test(an)
    costs: list[str] = []
    timings: list[int] = []

    def answered(headers: Any, priced: bool) -> None:
        timings.append(sum(len(headers.get(name, "")) for name in _CLOCK_HEADERS))
        if priced:
            costs.append(headers["x-velox-cost-usd"])

    raw = oa.chat.completions.with_raw_response.create(
        model="gpt-x", messages=HI, prompt_cache_key="weather", reasoning_effort="low")
    details = raw.parse().usage
    assert details is not None and details.prompt_tokens_details is not None
    assert details.prompt_tokens_details.cached_tokens  # the parts are under test too
    answered(raw.headers, True)
    raw = oa.chat.completions.with_raw_response.create(model="gpt-x", messages=HI)
    answered(raw.headers, True)
    stream = oa.chat.completions.create(model="gpt-x", messages=HI, stream=True,
                                        stream_options={"include_usage": True})
    assert list(stream)[-1].usage is not None
    answered(stream.response.headers, False)
    stream = oa.chat.completions.create(model="gpt-x", messages=HI, stream=True)
    assert all(c.usage is None for c in stream)  # stripped: the client did not ask
    answered(stream.response.headers, False)
    raw_an = an.messages.with_raw_response.create(model="claude-x", max_tokens=64,
                                                  messages=HI)  # type: ignore[arg-type]
    assert raw_an.parse().usage.output_tokens > 0
    answered(raw_an.headers, True)
    with an.messages.stream(model="claude-x", max_tokens=64,
                            messages=HI) as events:  # type: ignore[arg-type]
        assert events.get_final_message().usage.output_tokens > 0
        answered(events.response.headers, False)
    return costs, timings


def _lines(gw: GatewayProcess, timings: list[int]) -> list[dict[str, Any]] | None:
    """The access log's lines in the calls' order (one worker, one call at a time), their
    clocks left out (bytes_out less its clocks' digits)."""
    lines = [json.loads(text) for text in gw.log().splitlines()
             if '"log":"access"' in text and '"key":"twins"' in text]
    if len(lines) < CALLS:
        return None
    for line, timing in zip(lines, timings, strict=True):
        line["bytes_out"] -= timing
    return [{k: v for k, v in line.items() if k not in _LINE_CLOCKS} for line in lines]


def _rows(gw: GatewayProcess) -> list[dict[str, Any]] | None:
    rows = ledger_rows(gw, key="twins")
    if len(rows) < CALLS:
        return None
    return [{k: v for k, v in row.items() if k not in _ROW_CLOCKS} for row in rows]


def test_native_0_gives_the_same_costs_ledger_rows_and_log_lines(tmp_path: Path) -> None:
    seen = {}
    for native in ("1", "0"):
        directory = tmp_path / f"native-{native}"
        directory.mkdir()
        # A mock each: its answers number themselves (ids, so bytes_out), from the same start.
        with MockUpstream(tls=True, certdir=str(directory)) as mock, \
                _gateway(mock, directory, native) as gw:
            headers, timings = _calls(gw)
            seen[native] = (headers, wait_for(lambda gw=gw: _rows(gw)),
                            wait_for(lambda gw=gw: _lines(gw, timings)))
    headers, rows, lines = seen["1"]
    assert len(headers) == 3 and len(rows) == len(lines) == CALLS
    assert all(row["cost_nanos"] > 0 for row in rows)
    assert all(line["cost_usd"] for line in lines)
    assert {row["reasoning_tokens"] for row in rows} != {0}  # a part priced apart
    twin_headers, twin_rows, twin_lines = seen["0"]
    assert twin_headers == headers
    for native_row, twin_row in zip(rows, twin_rows, strict=True):
        assert twin_row == native_row
    for native_line, twin_line in zip(lines, twin_lines, strict=True):
        assert twin_line == native_line, f"{native_line} {twin_line}"
