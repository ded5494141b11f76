"""The configuration reference page (docs/reference/configuration.md), generated.

Both halves come from the tables the parsers use, so the page cannot drift from what Velox
accepts: the variables from `settings.FIELDS` (`markdown_table()`), the TOML tables from the
key lists and integer bounds of `tables` (UPSTREAM_KEYS, UPSTREAM_INTS, ...) with the defaults
of their frozen specs. What each key means is written here, once, in `KEY_DOCS`; a test fails
when a table gains a key this module does not describe (or describes one it lost), and another
when the page in docs/ differs from `page()`.

    python -m velox.config.reference > docs/reference/configuration.md
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from velox.config import tables as t
from velox.config.settings import markdown_table

# What the file leaves out of an [[upstream]] comes from the VELOX_* scalars (the template
# UpstreamSpec of load_file): the default shown is the variable, not the dataclass value.
# The README's short table: the variables most deployments set (tests keep it generated).
README_VARIABLES = (
    "VELOX_HOST", "VELOX_PORT", "VELOX_WORKERS", "VELOX_UPSTREAM_ORIGIN",
    "VELOX_UPSTREAM_API_KEY", "VELOX_API_KEYS", "VELOX_CONFIG", "VELOX_RATE_LIMIT_RPM",
    "VELOX_ADMIN_ADDR", "VELOX_ADMIN_TOKEN", "VELOX_ACCESS_LOG", "VELOX_CACHE",
    "VELOX_REDIS_URL", "VELOX_SHUTDOWN_GRACE_S", "VELOX_OTEL_ENDPOINT",
)

_FROM_VARIABLE = {
    "protocol": "`VELOX_UPSTREAM_PROTOCOL`", "connections": "`VELOX_EGRESS_POOL_CONNECTIONS`",
    "http1_pipeline": "`VELOX_UPSTREAM_PIPELINE`",
    "ca_file": "`VELOX_UPSTREAM_CA_FILE`", "request_timeout_ms": "`VELOX_REQUEST_TIMEOUT_MS`",
    "connect_timeout_ms": "`VELOX_CONNECT_TIMEOUT_MS`",
    "warmup_path": "`VELOX_UPSTREAM_WARMUP_PATH`",
}

# One entry per table: (title, what it is, the keys the parser accepts, their integer bounds,
# the spec whose defaults apply, what each key means). `required` keys have no default.
KEY_DOCS: dict[str, dict[str, str]] = {
    "upstream": {
        "name": "unique name: what routes, logs, metrics and `/stats` use (1-64 letters, "
                "digits, `_`, `.`, `-`)",
        "origin": "`scheme://host[:port]` of the server, no path",
        "api_key_env": "the NAME of the environment variable holding the key (start-up fails "
                       "if it is unset or empty); leave it out for a server without keys. "
                       "The key itself never goes in the file",
        "kind": "`openai` (paths as they are), `azure` (deployment paths, `api-key` header; "
                "needs `api_version` and `api_key_env`), or a provider whose own API is "
                "translated to and from OpenAI's: `anthropic`, `gemini`, `bedrock` (see "
                "docs/providers/)",
        "anthropic_version": "`anthropic-version` sent upstream (`kind = \"anthropic\"`)",
        "default_max_tokens": "`max_tokens` sent to an `anthropic` upstream when the client "
                              "sends none (the Messages API requires one)",
        "thinking": "how a Gemini upstream gets `reasoning_effort`: `level` or `budget` "
                    "(empty: by model name)",
        "aws_region": "the Bedrock region (`kind = \"bedrock\"`; required)",
        "aws_access_key_id_env": "the NAME of the variable holding the AWS access key id "
                                 "(bedrock; required)",
        "aws_secret_access_key_env": "the NAME of the variable holding the AWS secret key "
                                     "(bedrock; required)",
        "aws_session_token_env": "the NAME of the variable holding an AWS session token "
                                 "(bedrock; optional)",
        "embed_input_type": "Cohere Embed's `input_type` on Bedrock embeddings",
        "api_version": "Azure's `api-version` query parameter (`kind = \"azure\"` only)",
        "protocol": "`auto` (ALPN for https, HTTP/1.1 for http), `h2` (on http: cleartext "
                    "HTTP/2 with prior knowledge) or `http1`",
        "connections": "upstream connections per worker",
        "http1_pipeline": "HTTP/1.1 only: requests of one micro-batch written together on one "
                          "connection, up to this many, answered in order (1: none; set it only "
                          "for a server known to handle pipelining, e.g. vLLM, llama.cpp)",
        "ca_file": "extra CA certificates (PEM) trusted for this upstream; relative to the file",
        "request_timeout_ms": "time allowed for response headers (then 504, or a retry)",
        "connect_timeout_ms": "time allowed to open a connection and answer its warm-up GET",
        "warmup_path": "GET sent on every new connection before it takes requests (azure: "
                       "`/openai/models?api-version=V`)",
        "max_in_flight": "requests at once on this upstream, all workers together; a request "
                         "every target of which is full gets 503 `overloaded` (0: no cap)",
        "rpm": "this upstream's own requests per minute, shared by all workers (and hosts, "
               "with `VELOX_REDIS_URL`); an empty bucket skips the target (0: no limit)",
        "tpm": "this upstream's own tokens per minute, reserved from each request's estimate "
               "and settled from its usage (0: no limit)",
        "stream_usage": "streams ask for the usage chunk (`stream_options.include_usage`) so "
                        "their tokens are counted exactly; false for a server that rejects "
                        "the option",
    },
    "route": {
        "model": "the model name clients use; `\"*\"` catches every model no other route "
                 "names; unique",
        "targets": "where requests go: an array of inline tables (below)",
        "strategy": "how a target is picked within a priority group: `weighted` (smooth "
                    "weighted round-robin), `least_busy` (power of two choices over in-flight "
                    "requests) or `hash` (affinity by `x-velox-affinity`, `prompt_cache_key` "
                    "or `user`)",
        "fallbacks": "other routes' models, tried in order when no target of this one can "
                     "take the request",
        "cache": "answers of this route are cached (`VELOX_CACHE=1`: every route)",
        "batch": "embeddings batching: `true` for the defaults, or an inline table (below)",
        "default_max_tokens": "this route's `max_tokens` for its `anthropic` targets when the "
                              "client sends none (0: each upstream's own)",
    },
    "route.targets": {
        "upstream": "the `[[upstream]]` name",
        "model": "the upstream's name for the model (the body's `model` is rewritten to it; "
                 "empty: the client's)",
        "weight": "share of the requests within its priority group",
        "priority": "lower groups are used first; the next only when no target of the "
                    "current one can take the request",
    },
    "route.batch": {
        "max_requests": "requests merged into one upstream call at most",
        "max_inputs": "input items of one merged call at most (OpenAI's own limit per call)",
        "max_wait_ms": "the first waiting request leaves at the latest this long after it "
                       "arrived",
    },
    "retry": {
        "attempts": "tries in all, across targets and fallbacks (1: no retry)",
        "budget_percent": "retries over the window may be at most this share of requests ...",
        "budget_window_s": "... over this many seconds ...",
        "budget_min_per_s": "... plus this many per second",
        "max_elapsed_ms": "no new try once the failed one took longer than this",
        "same_target_retry_after_s": "an upstream 429 is retried on its own target only when "
                                     "nothing else can take the request and its "
                                     "`Retry-After` is at most this",
    },
    "breaker": {
        "failures": "upstream-caused failures in a row that open the breaker",
        "open_s": "how long the first opening lasts; doubled at each consecutive opening ...",
        "max_open_s": "... up to this (at least `open_s`)",
        "successes": "successful probes in half-open that close it",
        "probe_interval_s": "how often each worker probes an upstream whose open time is over",
    },
    "key": {
        "name": "unique name: what logs, metrics and `/stats` show (never the key)",
        "sha256": "the key's SHA-256, 64 hex digits (`velox key hash` prints it); unique",
        "rpm": "requests per minute (0: no limit)",
        "tpm": "tokens per minute, estimated at admission and settled from usage (0: no limit)",
        "max_parallel": "requests in flight at once, all workers together (0: no limit)",
        "models": "the route models the key may use (absent: all); its routes' fallbacks are "
                  "held to the same list",
        "forward": "may it use endpoints forwarded without a model read (files, batches, ...)? "
                   "Absent: only a key without `models` and `tpm`",
        "budget_usd": "USD the key may spend per `budget_period`, priced from each answer's "
                      "usage; a request whose estimated cost does not fit gets 429 "
                      "`insufficient_quota` (absent: no budget of its own)",
        "budget_period": "`day`, `week` (from Monday), `month` or `total`; calendar periods "
                         "in UTC (default `month`)",
    },
    "budget": {
        "name": "unique name of the team budget",
        "budget_usd": "USD the keys may spend together per `budget_period`",
        "budget_period": "`day`, `week` (from Monday), `month` or `total` (UTC)",
        "keys": "the `[[key]]` names under this budget (each also under its own, if it has one)",
    },
    "price": {
        "model": "a glob (`*`, `?`, `[...]`) over the model name sent upstream",
        "upstream": "only requests sent to this `[[upstream]]` (absent: every upstream)",
        "input": "USD per million input tokens (at most 6 decimal places)",
        "output": "USD per million output tokens",
        "cached_input": "USD per million cached input tokens (absent: `input`)",
        "cache_write": "USD per million prompt-cache write tokens (absent: `input`)",
        "reasoning": "USD per million reasoning tokens (absent: `output`)",
        "image": "USD per image",
        "request": "USD per request",
    },
}

_TABLES: tuple[tuple[str, str, str, tuple[str, ...], Mapping[str, tuple[int, int]], Any], ...] = (
    ("upstream", "[[upstream]]", "One server and its connection pool. Without any, the "
     "upstream built from `VELOX_UPSTREAM_*` (named `default`) is the only one.",
     t.UPSTREAM_KEYS, t.UPSTREAM_INTS, t.UpstreamSpec),
    ("route", "[[route]]", "A model clients name and where its requests go. Without any, one "
     "route `\"*\"` sends every model to the only upstream.",
     t.ROUTE_KEYS, {}, t.RouteSpec),
    ("route.targets", "targets = [{ ... }]", "Inline tables in a route's `targets`.",
     t.TARGET_KEYS, t.TARGET_INTS, t.TargetSpec),
    ("route.batch", "batch = { ... }", "A route's embeddings batching (`batch = true` takes "
     "every default).", tuple(t.BATCH_INTS), t.BATCH_INTS, t.BatchSpec),
    ("retry", "[retry]", "When a request is sent again, before any of its answer reached the "
     "client. Without `VELOX_CONFIG`, `attempts` is 1.",
     tuple(t.RETRY_INTS), t.RETRY_INTS, t.RetryPolicy),
    ("breaker", "[breaker]", "One circuit breaker per upstream, shared by every worker.",
     tuple(t.BREAKER_INTS), t.BREAKER_INTS, t.BreakerPolicy),
    ("key", "[[key]]", "A gateway key with its own limits; the file holds its hash, never the "
     "key. At most 4,096.", t.KEY_KEYS, t.KEY_INTS, t.KeySpec),
    ("price", "[[price]]", "Overrides the shipped price table (`velox/spend/prices.toml`) "
     "entry by entry; every answer is priced from its usage (`x-velox-cost-usd`, the access "
     "log's `cost_usd`, the ledger).", t.PRICE_KEYS, {}, t.PriceSpec),
    ("budget", "[[budget]]", "A team budget shared by several keys (one host; see "
     "docs/governance.md).", t.BUDGET_KEYS, {}, t.BudgetSpec),
)

_REQUIRED = {("upstream", "name"), ("upstream", "origin"), ("route", "model"),
             ("route", "targets"), ("route.targets", "upstream"), ("key", "name"),
             ("key", "sha256"), ("price", "model"), ("budget", "name"),
             ("budget", "budget_usd"), ("budget", "keys")}


def table_keys() -> dict[str, tuple[str, ...]]:
    """Every table's accepted keys, as the parser knows them (for the completeness test)."""
    return {name: keys for name, _, _, keys, _, _ in _TABLES}


def _default(table: str, key: str, spec: Any) -> str:
    if (table, key) in _REQUIRED:
        return "required"
    if table == "upstream" and key in _FROM_VARIABLE:
        return _FROM_VARIABLE[key]
    fields = {f.name: f for f in dataclasses.fields(spec)}
    field = fields.get(key)
    if field is None or field.default is dataclasses.MISSING or field.default in ("", None):
        return "—"
    value = field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f"`{value}`"


def _range(key: str, ints: Mapping[str, tuple[int, int]]) -> str:
    if key not in ints:
        return ""
    lo, hi = ints[key]
    return f" ({lo:,} to {hi:,})"


def tables_markdown() -> str:
    """One section per table: key, default, what it does (integer bounds included)."""
    out: list[str] = []
    for name, title, intro, keys, ints, spec in _TABLES:
        docs = KEY_DOCS[name]
        out += [f"### `{title}`", "", intro, "", "| Key | Default | What it does |",
                "|---|---|---|"]
        out += [f"| `{key}` | {_default(name, key, spec)} | {docs[key]}{_range(key, ints)} |"
                for key in keys]
        out.append("")
    return "\n".join(out)


def page() -> str:
    """The whole of docs/reference/configuration.md."""
    return "\n".join([
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m velox.config.reference` from the settings and table "
        "parsers; do not edit. -->",
        "",
        "Velox reads `VELOX_*` environment variables once at start-up (a `.env` file in the "
        "working directory too; the environment wins), and one TOML file named by "
        "`VELOX_CONFIG` for what does not fit in a variable. An invalid value stops start-up "
        "with a message naming the variable, or the file, table and key, and the accepted "
        "form. `velox --print-config` prints the effective settings and tables, secrets "
        "masked; `.env.example` lists every variable with its default.",
        "",
        "## Environment variables",
        "",
        markdown_table().rstrip("\n"),
        "",
        "## The `VELOX_CONFIG` file",
        "",
        "Tables are counted from 1 in file order in error messages (`[[route]] #2 (model "
        "\"gpt-4o\")`). Unknown keys are refused with the closest valid one suggested. "
        "Integer keys show their accepted range.",
        "",
        tables_markdown(),
    ])


if __name__ == "__main__":
    print(page(), end="")
