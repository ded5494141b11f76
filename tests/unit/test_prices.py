"""Prices and cost maths (socket-free): the shipped table, [[price]] in VELOX_CONFIG overriding
it entry by entry, which entry prices a model, exact integer cost from a usage record, unknown
prices as None (logged once per model), and bad price tables refused naming file, table and key.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import orjson
import pytest

from velox.config import settings as config
from velox.config.tables import PriceSpec
from velox.providers.base import Usage  # the usage record the translators produce
from velox.spend import prices
from velox.spend.prices import PriceTable, cost_nanos, load_defaults

ROOT = Path(__file__).resolve().parents[2]


def _micro(usd: str) -> int:
    return int(Fraction(usd) * 10**6)


def _spec(model: str = "m", **prices_usd: str) -> PriceSpec:
    fields = {k: _micro(v) for k, v in prices_usd.items()}
    return PriceSpec(model, **fields)  # type: ignore[arg-type]


def _exact_nanos(spec: PriceSpec, u: Usage) -> Fraction:
    """The cost as an exact fraction of nano-USD, computed independently of cost_nanos."""
    def per_token(value: int | None, parent: int) -> Fraction:
        return Fraction(parent if value is None else value, 10**6) / 10**6  # USD per token

    plain_in = u.input - u.cached_input - u.cache_write
    usd = (plain_in * per_token(spec.input, spec.input)
           + u.cached_input * per_token(spec.cached_input, spec.input)
           + u.cache_write * per_token(spec.cache_write, spec.input)
           + (u.output - u.reasoning) * per_token(spec.output, spec.output)
           + u.reasoning * per_token(spec.reasoning, spec.output))
    return usd * 10**9


# --- cost maths ------------------------------------------------------------------------------


def test_plain_input_and_output() -> None:
    spec = _spec(input="2.5", output="10")
    # 1,000 in at $2.50/M = $0.0025; 500 out at $10/M = $0.005.
    assert cost_nanos(spec, Usage(input=1000, output=500)) == 7_500_000


def test_cached_and_cache_write_are_parts_of_input_priced_as_such() -> None:
    spec = _spec(input="3", output="15", cached_input="0.30", cache_write="3.75")
    u = Usage(input=10_000, output=1000, cached_input=6000, cache_write=3000)
    # 1,000 plain x $3/M + 6,000 x $0.30/M + 3,000 x $3.75/M + 1,000 x $15/M
    expected_usd = Fraction(3000 + 1800 + 11250 + 15000, 10**6)
    assert cost_nanos(spec, u) == expected_usd * 10**9 == 31_050_000


def test_parts_without_their_own_price_are_priced_as_their_parent() -> None:
    spec = _spec(input="1", output="4")
    with_parts = Usage(input=1000, output=800, cached_input=400, cache_write=100, reasoning=300)
    plain = Usage(input=1000, output=800)
    assert cost_nanos(spec, with_parts) == cost_nanos(spec, plain)


def test_reasoning_billed_apart_when_priced() -> None:
    spec = _spec(input="1", output="4", reasoning="8")
    u = Usage(input=0, output=1000, reasoning=600)
    assert cost_nanos(spec, u) == (400 * 4 + 600 * 8) * 1000  # pico -> nano: /1000 per M


def test_cost_rounds_once_half_up_to_nano_usd() -> None:
    spec = _spec(input="0.000015")  # 15 pico-USD per token
    assert cost_nanos(spec, Usage(input=1)) == 0  # 0.015 nano-USD rounds down
    assert cost_nanos(spec, Usage(input=33)) == 0  # 0.495
    assert cost_nanos(spec, Usage(input=34)) == 1  # 0.51
    half = _spec(input="0.0005")  # 500 pico-USD per token
    assert cost_nanos(half, Usage(input=1)) == 1  # 0.5 nano-USD: half up
    assert cost_nanos(half, Usage(input=3)) == 2  # 1.5: rounded once, not per token


def test_inconsistent_usage_is_clamped_never_negative() -> None:
    spec = _spec(input="1", output="2", cached_input="0.1")
    u = Usage(input=100, output=-5, cached_input=500, cache_write=50, reasoning=10)
    assert cost_nanos(spec, u) == cost_nanos(spec, Usage(input=100, cached_input=100))
    assert cost_nanos(spec, u) >= 0


def test_images_and_per_request_prices() -> None:
    spec = PriceSpec("img", image=40_000_000, request=1_000_000)  # $0.04/image, $0.001/call
    assert cost_nanos(spec, Usage(), images=3) == 121_000_000


def test_a_million_requests_sum_exactly() -> None:
    """Integer costs add up with no drift; a float running total does drift."""
    spec = _spec(input="0.15", output="0.60", cached_input="0.075")
    usages = [Usage(input=137 + i % 91, output=53 + i % 17, cached_input=i % 64)
              for i in range(1000)]
    total = sum(cost_nanos(spec, u) for u in usages) * 1000
    exact = sum(_exact_nanos(spec, u) for u in usages) * 1000
    # Each request rounds once by at most half a nano-USD.
    assert abs(total - exact) <= Fraction(1000 * 1000, 2)
    assert all(abs(cost_nanos(spec, u) - _exact_nanos(spec, u)) <= Fraction(1, 2)
               for u in usages)


def test_prices_from_floats_are_exact() -> None:
    """0.15 in the file is exactly 150,000 micro-USD per million tokens, not 149,999."""
    table = PriceTable()
    spec = table.price_for("", "gpt-4o-mini")
    assert spec is not None
    assert (spec.input, spec.output, spec.cached_input) == (150_000, 600_000, 75_000)


# --- which entry prices a model ---------------------------------------------------------------


def _defaults(*specs: PriceSpec) -> prices.Defaults:
    return prices.Defaults(tuple(specs), "2026-01-01", "shipped.toml")


def test_most_specific_entry_wins() -> None:
    table = PriceTable(
        [PriceSpec("gpt-4o*", input=1, source="cfg"),
         PriceSpec("gpt-4o", upstream="azure", input=2, source="cfg")],
        _defaults(PriceSpec("gpt-4o", input=3, source="shipped.toml"),
                  PriceSpec("gpt-4o-mini*", input=4, source="shipped.toml"),
                  PriceSpec("*", input=5, source="shipped.toml")))
    assert table.price_for("azure", "gpt-4o").input == 2  # type: ignore[union-attr]
    assert table.price_for("openai", "gpt-4o").input == 3  # exact beats the file's glob
    assert table.price_for("openai", "gpt-4o-mini-2024").input == 4  # longer glob
    assert table.price_for("openai", "gpt-4o-2024").input == 1
    assert table.price_for("openai", "other").input == 5  # type: ignore[union-attr]


def test_configuration_overrides_the_shipped_table_entry_by_entry() -> None:
    shipped = _defaults(PriceSpec("a", input=1, source="s"), PriceSpec("b", input=2, source="s"))
    table = PriceTable([PriceSpec("a", input=10, source="cfg"),
                        PriceSpec("c", input=30, source="cfg")], shipped)
    assert [(p.model, p.input) for p in table.entries] == [("a", 10), ("c", 30), ("b", 2)]
    assert table.price_for("", "b").input == 2  # type: ignore[union-attr]
    # The same glob on one upstream is a different entry: the shipped one stays for the rest.
    table = PriceTable([PriceSpec("a", upstream="azure", input=7, source="cfg")], shipped)
    assert table.price_for("azure", "a").input == 7  # type: ignore[union-attr]
    assert table.price_for("openai", "a").input == 1  # type: ignore[union-attr]


def test_unknown_model_costs_none_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    table = PriceTable([], _defaults(PriceSpec("known", input=1, source="s")))
    caplog.set_level(logging.WARNING, "velox.spend")
    for _ in range(3):
        assert table.cost("u", "mystery", Usage(input=1000)) is None
    assert table.cost("u", "other-mystery", Usage(input=1)) is None
    assert table.cost("u", "known", Usage(input=0)) == 0  # priced, and free: 0, not None
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2
    assert "'mystery'" in told[0] and "'other-mystery'" in told[1]


def test_the_lookup_memo_is_bounded() -> None:
    table = PriceTable([], _defaults(PriceSpec("m*", input=1, source="s")))
    for i in range(prices._MEMO_MAX * 2 + 5):
        table.price_for("", f"m{i}")
    assert len(table._memo) <= prices._MEMO_MAX


# --- the shipped table --------------------------------------------------------------------------


def test_the_shipped_table_is_dated_cited_and_covers_the_three_providers() -> None:
    defaults = load_defaults()
    assert defaults.taken == "2026-11-26"
    text = prices.DEFAULT_FILE.read_text()
    for page in ("developers.openai.com", "platform.claude.com", "ai.google.dev"):
        assert page in text
    table = PriceTable()
    for model in ("gpt-4o", "gpt-4.1-mini", "gpt-5-mini", "claude-sonnet-4-5-20250929",
                  "claude-haiku-4-5-20251001", "claude-opus-4-1-20250805", "gemini-2.5-pro",
                  "gemini-2.5-flash", "text-embedding-3-small"):
        assert table.price_for("", model) is not None, model
    opus41 = table.price_for("", "claude-opus-4-1-20250805")
    opus46 = table.price_for("", "claude-opus-4-6")
    assert opus41 is not None and opus46 is not None
    assert (opus41.input, opus46.input) == (15_000_000, 5_000_000)
    for spec in defaults.prices:  # a cached read never costs more than a plain input token
        if spec.cached_input is not None:
            assert spec.cached_input <= spec.input, spec.model


# --- [[price]] in VELOX_CONFIG -----------------------------------------------------------------


def _load(tmp_path: Path, toml: str) -> config.Settings:
    path = tmp_path / "velox.toml"
    path.write_text(toml)
    return config.load({"VELOX_CONFIG": str(path), "AZURE_KEY": "azure-test-key"}, dotenv=None)


def test_price_tables_are_read_from_the_configuration(tmp_path: Path) -> None:
    settings = _load(tmp_path, """
[[upstream]]
name = "azure"
origin = "https://example.openai.azure.com"
kind = "azure"
api_version = "2024-10-21"
api_key_env = "AZURE_KEY"

[[price]]
model = "gpt-4o"
upstream = "azure"
input = 2.75
output = 11
cached_input = 1.375

[[price]]
model = "my-finetune-*"
input = 0.3
output = 1.2
request = 0.0001
""")
    assert settings.tables is not None
    got = settings.tables.prices
    assert [(p.model, p.upstream, p.input, p.output, p.cached_input, p.request) for p in got] == [
        ("gpt-4o", "azure", 2_750_000, 11_000_000, 1_375_000, 0),
        ("my-finetune-*", "", 300_000, 1_200_000, None, 100_000)]
    table = PriceTable(got)
    assert table.price_for("azure", "gpt-4o").input == 2_750_000  # type: ignore[union-attr]
    assert table.price_for("openai", "gpt-4o").input == 2_500_000  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "key", "problem"), [
    ('model = "x"\ninput = -1', "input", "must be >= 0"),
    ('model = "x"\ninput = "2.5"', "input", 'must be a number of USD per million tokens'),
    ('model = "x"\noutput = true', "output", "got the boolean true"),
    ('model = "x"\ninput = 1\ninptu = 2', "inptu", 'unknown key (did you mean "input"?)'),
    ('model = "x"\ninput = 0.0000001', "input", "at most 6 decimal places"),
    ('model = "x"\ninput = inf', "input", "must be a finite number"),
    ('model = "x"\ninput = nan', "input", "must be a finite number"),
    ('model = "x"\nimage = 1e7', "image", "must be at most 1,000,000 USD"),
    ('model = "x"', "input", "needs at least one price"),
    ('input = 1', "model", "missing (required)"),
    ('model = "x"\nupstream = "nowhere"\ninput = 1', "upstream", '"nowhere" names no [[upstream]]'),
])
def test_bad_price_tables_are_refused_naming_file_table_and_key(
        tmp_path: Path, body: str, key: str, problem: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        _load(tmp_path, "[[price]]\n" + body + "\n")
    message = str(err.value)
    path = str(tmp_path / "velox.toml")
    assert message.startswith(f"{path}: [[price]] #1"), message
    assert f": {key}: " in message and problem in message, message


def test_a_duplicate_entry_is_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as err:
        _load(tmp_path, '[[price]]\nmodel = "x"\ninput = 1\n\n[[price]]\nmodel = "x"\n'
                        'output = 2\n')
    assert '[[price]] #2 (model "x"): model: [[price]] #1 prices "x" already' in str(err.value)


def _velox(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "velox", *args], check=False, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **env},
                          cwd=ROOT, timeout=60)


def test_start_up_and_velox_prices_refuse_a_bad_price(tmp_path: Path) -> None:
    path = tmp_path / "velox.toml"
    path.write_text('[[price]]\nmodel = "gpt-4o"\noutput = -3\n')
    for args in (["prices"], ["--print-config"], []):
        out = _velox(args, {"VELOX_CONFIG": str(path)})
        assert out.returncode == 2, (args, out.stderr)
        assert f'{path}: [[price]] #1 (model "gpt-4o"): output: must be >= 0' in out.stderr


def test_velox_prices_prints_the_effective_table(tmp_path: Path) -> None:
    path = tmp_path / "velox.toml"
    path.write_text('[[price]]\nmodel = "gpt-4o"\ninput = 2\noutput = 8\n')
    out = _velox(["prices", "--json"], {"VELOX_CONFIG": str(path)})
    assert out.returncode == 0, out.stderr
    doc = orjson.loads(out.stdout)
    assert doc["taken"] == "2026-11-26"
    first = {r["model"]: r for r in doc["prices"]}
    assert first["gpt-4o"] == {"model": "gpt-4o", "upstream": None, "input": 2.0, "output": 8.0,
                               "cached_input": None, "cache_write": None, "reasoning": None,
                               "image": 0.0, "request": 0.0, "source": str(path)}
    assert first["gpt-4o-mini*"]["source"] == "shipped"
    text = _velox(["prices"], {"VELOX_CONFIG": str(path)})
    assert "shipped prices taken 2026-11-26" in text.stdout
    one = _velox(["prices", "--model", "claude-3-5-haiku-20241022"], {})
    assert one.returncode == 0 and "claude-3-5-haiku*" in one.stdout
    none = _velox(["prices", "--model", "no-such-model"], {})
    assert none.returncode == 1 and "no entry prices 'no-such-model'" in none.stderr


def test_an_anthropic_answer_is_priced_as_anthropic_bills_it() -> None:
    """The anthropic translator's usage (cache reads and writes folded into input, as OpenAI
    counts) priced by the shipped table gives Anthropic's own arithmetic: uncached input,
    cache writes, cache reads and output each at their price."""
    from velox.providers.anthropic import usage_of

    usage = usage_of({"input_tokens": 1200, "cache_creation_input_tokens": 3000,
                      "cache_read_input_tokens": 50_000, "output_tokens": 700})
    assert (usage.input, usage.cached_input, usage.cache_write) == (54_200, 50_000, 3000)
    cost = PriceTable().cost("anthropic", "claude-sonnet-4-5-20250929", usage)
    anthropic_usd = (Fraction(1200 * 3) + Fraction(3000 * 375, 100) + Fraction(50_000 * 30, 100)
                     + Fraction(700 * 15)) / 10**6
    assert cost == anthropic_usd * 10**9 == 40_350_000
