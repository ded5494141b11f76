"""The tables of the gateway: upstreams, the routes that use them, and the failover policies.

Scalars are `VELOX_*` variables (config.py); what does not fit in a variable (several upstreams,
the routes over them, the retry and breaker policies) lives in one TOML file named by
`VELOX_CONFIG`. Both are parsed into one frozen `Settings`, whose `tables` is a `Tables`.

Without `VELOX_CONFIG` the tables are synthesised from the `VELOX_UPSTREAM_*` variables: one
upstream named `default` and one route `"*"` sending every model to it, which is exactly the
single-upstream gateway Velox was before the tables existed.

`[[price]]` tables (model glob, optional upstream, USD per million tokens) override the shipped
price table entry by entry; velox.spend.prices turns usage into cost with them.

Secrets never live in the file: an upstream names the environment variable holding its key
(`api_key_env`), and the resolved key is kept out of `repr` and `--print-config`.

`load_file` reads the file with `tomllib` and `parse` checks every table; each mistake raises
`TableError` with one message naming the file, the table (`[[route]] #2 (model "gpt-4o")`,
counted from 1 in file order) and the key, e.g.

    velox.toml: [[route]] #2 (model "gpt-4o"): targets[1].weight: must be an integer >= 1, got 0

Per-upstream values the file leaves out come from a template `UpstreamSpec` built from the
`VELOX_*` scalars (config.Settings.default_upstream), so `VELOX_EGRESS_POOL_CONNECTIONS`,
`VELOX_REQUEST_TIMEOUT_MS`, ... stay the defaults of every upstream.

What the request path does with a target (the router's job, not this module's): the upstream
path comes from `UpstreamSpec.upstream_path(path, model)` (unchanged for `kind = "openai"`,
the deployment path with `api-version` for `"azure"`), the credential header from
`UpstreamSpec.auth_headers()`, and when `TargetSpec.upstream_model(public)` differs from the
model the client named, the router rewrites the body's `model` before sending it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

UPSTREAM_KINDS = ("openai", "azure", "anthropic", "gemini", "bedrock")
# Kinds whose API is not OpenAI's: requests and answers are translated at the egress edge
# (velox.egress.edge, with the translators of velox.providers).
TRANSLATED_KINDS = frozenset(("anthropic", "gemini", "bedrock"))
# Settings only one kind reads (each refused on the others, naming the kind that uses it).
KIND_KEYS = {
    "anthropic_version": "anthropic", "default_max_tokens": "anthropic", "thinking": "gemini",
    "aws_region": "bedrock", "aws_access_key_id_env": "bedrock",
    "aws_secret_access_key_env": "bedrock", "aws_session_token_env": "bedrock",
    "embed_input_type": "bedrock",
}
# Cohere Embed's input_type (Bedrock embeddings): OpenAI's request has no such field.
EMBED_INPUT_TYPES = ("search_document", "search_query", "classification", "clustering")
ANTHROPIC_VERSION = "2023-06-01"
# Anthropic requires max_tokens and OpenAI clients (SDK defaults) send none: the upstream's
# default output limit (velox.providers.anthropic uses the same number).
ANTHROPIC_MAX_TOKENS = 4096
STRATEGIES = ("weighted", "least_busy", "hash")
CATCH_ALL = "*"
DEFAULT_UPSTREAM = "default"
PROTOCOLS = ("auto", "h2", "http1")
# Azure OpenAI operations addressed through a deployment (the model is part of the path); the
# others (models, responses, files, ...) live directly under /openai/.
AZURE_DEPLOYMENT_OPERATIONS = frozenset((
    b"chat/completions", b"completions", b"embeddings", b"audio/transcriptions",
    b"audio/translations", b"audio/speech", b"images/generations",
))


class TableError(ValueError):
    """A mistake in the VELOX_CONFIG file; the message names the file, the table and the key,
    and `fix` says what to change, naming them again."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One endpoint and its connection pool (`[[upstream]]`)."""

    name: str
    origin: str  # scheme://host[:port], no path
    api_key: str = field(default="", repr=False)  # resolved from api_key_env; never printed
    api_key_env: str = ""  # "" for the default upstream (VELOX_UPSTREAM_API_KEY / OPENAI_API_KEY)
    kind: str = "openai"  # openai: paths as they are; azure: deployment paths, api-key header
    api_version: str = ""  # azure only: the api-version query parameter
    protocol: str = "auto"  # auto | h2 | http1 (as VELOX_UPSTREAM_PROTOCOL)
    connections: int = 1  # per worker
    # HTTP/1.1 requests written ahead on one connection (1: none; see egress.h1pool).
    http1_pipeline: int = 1
    ca_file: str = ""
    request_timeout_ms: int = 600_000
    connect_timeout_ms: int = 5_000
    warmup_path: str = "/v1/models"
    max_in_flight: int = 0  # requests at once on this upstream across the gateway; 0: no cap
    rpm: int = 0  # this upstream's own shared request bucket; 0: no limit
    tpm: int = 0  # this upstream's own shared token bucket (velox.relay.usage); 0: no limit
    # Streams sent here ask for the usage chunk (stream_options.include_usage, velox.relay.usage);
    # false for an OpenAI-compatible server that rejects the option.
    stream_usage: bool = True
    # Kind-specific settings (KIND_KEYS); the AWS secrets resolved from the *_env variables.
    anthropic_version: str = ANTHROPIC_VERSION
    default_max_tokens: int = ANTHROPIC_MAX_TOKENS
    thinking: str = ""  # gemini: "level" | "budget" | "" (chosen by model name)
    aws_region: str = ""
    aws_access_key_id_env: str = ""
    aws_secret_access_key_env: str = ""
    aws_session_token_env: str = ""
    embed_input_type: str = "search_document"
    aws_access_key_id: str = field(default="", repr=False)
    aws_secret_access_key: str = field(default="", repr=False)
    aws_session_token: str = field(default="", repr=False)

    @property
    def scheme(self) -> str:
        return urlsplit(self.origin).scheme

    @property
    def host(self) -> str:
        return urlsplit(self.origin).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.origin)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def authority(self) -> str:
        return urlsplit(self.origin).netloc

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        """The credential header this upstream expects (none when no key is configured)."""
        if not self.api_key:
            return []
        if self.kind == "azure":
            return [(b"api-key", self.api_key.encode())]
        if self.kind == "anthropic":
            return [(b"x-api-key", self.api_key.encode()),
                    (b"anthropic-version", self.anthropic_version.encode())]
        if self.kind == "gemini":
            return [(b"x-goog-api-key", self.api_key.encode())]
        return [(b"authorization", b"Bearer " + self.api_key.encode())]

    def upstream_path(self, path: bytes, model: str) -> bytes:
        """The path (with query) to send to this upstream for a client's `path` and the
        upstream's `model` (TargetSpec.upstream_model). Pure; cheap for `openai` (unchanged).

        azure: `/v1/chat/completions` for model M becomes
        `/openai/deployments/M/chat/completions?api-version=V` (also completions, embeddings,
        audio and images); other `/v1/X` become `/openai/X?api-version=V`. An existing query
        string is kept and `api-version` appended unless it is already there; paths outside
        `/v1/` are left alone. Raises ValueError for a deployment operation without a model.
        """
        if self.kind != "azure":
            return path
        return azure_path(path, model, self.api_version)


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One place a route may send a request (`targets = [{upstream, model, weight, priority}]`)."""

    upstream: str
    model: str = ""  # the upstream's name for the model; "" means the public name unchanged
    weight: int = 1
    priority: int = 0  # lower numbers are used first

    def upstream_model(self, public: str) -> str:
        """The model name to send upstream for a request that named `public`."""
        return self.model or public


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """A model clients name (`[[route]]`); `"*"` catches every model no other route names."""

    model: str
    targets: tuple[TargetSpec, ...]
    strategy: str = "weighted"  # weighted | least_busy | hash
    fallbacks: tuple[str, ...] = ()  # other routes' models, tried in order
    cache: bool = False  # answers of this route are cached (velox.cache.front); VELOX_CACHE: all
    batch: BatchSpec | None = None  # embeddings batching (velox.batching.batch); None: off
    # The output limit sent to this route's anthropic targets when the client sends none (the
    # Messages API requires one); 0: each upstream's own default_max_tokens.
    default_max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """`batch = { max_requests, max_inputs, max_wait_ms }` on a route: how /v1/embeddings
    calls that arrive while one of their group is in flight are merged (velox.batching.batch)."""

    max_requests: int = 32  # members of one merged call
    max_inputs: int = 2048  # input items of one merged call (OpenAI's own per-call limit)
    max_wait_ms: int = 20  # the first waiting member leaves at the latest this much later


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """`[retry]`: how often a request may be sent again before its first byte reaches the client."""

    attempts: int = 3  # total tries across targets and fallbacks together
    budget_percent: int = 20  # retries at most this share of requests over the window ...
    budget_window_s: int = 10
    budget_min_per_s: int = 10  # ... plus this many per second
    max_elapsed_ms: int = 30_000  # no new attempt once a failed one took longer than this
    same_target_retry_after_s: int = 2  # a 429 retries its own target only below this


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """`[breaker]`: one circuit breaker per upstream, shared by every worker."""

    failures: int = 5  # consecutive upstream-caused failures that open it
    open_s: int = 30  # first opening; doubled for each consecutive opening ...
    max_open_s: int = 300  # ... up to this
    successes: int = 2  # successes in half-open that close it
    probe_interval_s: int = 5  # background probe of an open upstream


# Calendar periods in UTC (velox.spend.ledger.period_start); "total" never starts afresh.
BUDGET_PERIODS = ("day", "week", "month", "total")
DEFAULT_BUDGET_PERIOD = "month"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """A gateway key (`[[key]]`): who a client is, and its own limits (velox.admission.keys)."""

    name: str  # what logs, metrics and /stats show; never the key itself
    sha256: str  # hex SHA-256 of the key (lowercase): the file holds no secret
    rpm: int = 0  # requests per minute; 0: no limit
    tpm: int = 0  # tokens per minute (estimated at admission, settled from usage); 0: none
    max_parallel: int = 0  # requests in flight at once, all workers; 0: no limit
    models: tuple[str, ...] | None = None  # route models it may use; None: all
    # May it use the endpoints forwarded without a model read (files, batches, fine-tuning,
    # stored responses...)? None: the default, no when `models` or `tpm` is set (they could
    # not hold there), yes otherwise.
    forward: bool | None = None
    budget_nanos: int = 0  # `budget_usd` in nano-USD; 0: no budget of its own
    budget_period: str = DEFAULT_BUDGET_PERIOD

    @property
    def may_forward(self) -> bool:
        if self.forward is not None:
            return self.forward
        return self.models is None and not self.tpm

    @property
    def digest(self) -> bytes:
        """The raw 32-byte digest, as auth.caller_of computes it for a request."""
        return bytes.fromhex(self.sha256)


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """A team budget (`[[budget]]`): what several keys may spend together per period."""

    name: str
    budget_nanos: int  # `budget_usd` in nano-USD
    period: str  # BUDGET_PERIODS
    keys: tuple[str, ...]  # [[key]] names


@dataclass(frozen=True, slots=True)
class PriceSpec:
    """What a model costs (`[[price]]`; velox.spend.prices turns usage into money with it).

    Token prices are integers of micro-USD per million tokens, which is pico-USD per token, so
    a request's cost is an exact integer sum (a float would drift over millions of requests);
    the file writes USD per million tokens with at most 6 decimal places. `None` means "priced
    like its parent": cached input and cache writes as input, reasoning as output (a provider
    that bills a part apart gets its own price). Per-image and per-request prices are nano-USD.
    """

    model: str  # a glob over the upstream's model name (fnmatch: *, ?, [...])
    upstream: str = ""  # only for this [[upstream]]; "" for every upstream
    input: int = 0
    output: int = 0
    cached_input: int | None = None
    cache_write: int | None = None
    reasoning: int | None = None
    image: int = 0  # nano-USD per image
    request: int = 0  # nano-USD per request
    source: str = ""  # the file this entry came from


@dataclass(frozen=True, slots=True)
class Tables:
    upstreams: tuple[UpstreamSpec, ...]
    routes: tuple[RouteSpec, ...]
    retry: RetryPolicy = RetryPolicy()
    breaker: BreakerPolicy = BreakerPolicy()
    source: str = ""  # the VELOX_CONFIG file they came from; "" when synthesised
    keys: tuple[KeySpec, ...] = ()  # `[[key]]` gateway keys, in file order (index = position)
    prices: tuple[PriceSpec, ...] = ()  # `[[price]]` entries, overriding the shipped table
    budgets: tuple[BudgetSpec, ...] = ()  # `[[budget]]` teams, in file order

    def upstream(self, name: str) -> UpstreamSpec:
        for spec in self.upstreams:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def route_for(self, model: str) -> RouteSpec | None:
        """The route serving `model`: its own, else the catch-all, else None."""
        catch_all = None
        for route in self.routes:
            if route.model == model:
                return route
            if route.model == CATCH_ALL:
                catch_all = route
        return catch_all


def single_upstream(spec: UpstreamSpec) -> Tables:
    """The tables of a gateway without VELOX_CONFIG: every model to one upstream."""
    # One attempt: with nowhere else to go, a failure is answered as it is, as it always was
    # (requests the upstream provably did not process are still re-sent by egress itself).
    return Tables(
        upstreams=(spec,),
        routes=(RouteSpec(CATCH_ALL, (TargetSpec(spec.name),)),),
        retry=RetryPolicy(attempts=1),
    )


# azure_path results by (path, model, api_version): building one costs ~11 µs (urllib's
# quote), a hit ~0.2 µs, and a gateway sees few distinct combinations. Cleared when full, so a
# client cycling query strings costs the slow path, never unbounded memory.
_AZURE_PATHS: dict[tuple[bytes, str, str], bytes] = {}
_AZURE_PATHS_MAX = 4096
# Gateway keys, the file's [[key]] tables and run-time keys together: the shared key table
# (velox.state.keys) grows by segments of 4,096 up to this many.
MAX_KEYS = 1_000_000


def azure_path(path: bytes, model: str, api_version: str) -> bytes:
    """`/v1/...` as Azure OpenAI spells it (see UpstreamSpec.upstream_path)."""
    key = (path, model, api_version)
    mapped = _AZURE_PATHS.get(key)
    if mapped is None:
        mapped = _azure_path(path, model, api_version)
        if len(_AZURE_PATHS) >= _AZURE_PATHS_MAX:
            _AZURE_PATHS.clear()
        _AZURE_PATHS[key] = mapped
    return mapped


def _azure_path(path: bytes, model: str, api_version: str) -> bytes:
    route, _, query = path.partition(b"?")
    if not route.startswith(b"/v1/"):
        return path
    operation = route[4:]
    if operation in AZURE_DEPLOYMENT_OPERATIONS:
        if not model:
            raise ValueError(f"{route.decode('latin-1')} needs a model (the Azure deployment)")
        route = b"/openai/deployments/" + quote(model, safe="").encode() + b"/" + operation
    else:
        route = b"/openai/" + operation
    if not any(p.partition(b"=")[0] == b"api-version" for p in query.split(b"&")):
        version = b"api-version=" + quote(api_version, safe="").encode()
        query = query + b"&" + version if query else version
    return route + b"?" + query


# --- the VELOX_CONFIG file -------------------------------------------------------------------

TOP_KEYS = ("upstream", "route", "retry", "breaker", "key", "price", "budget")
UPSTREAM_KEYS = ("name", "origin", "api_key_env", "kind", "api_version", "protocol",
                 "connections", "ca_file", "request_timeout_ms", "connect_timeout_ms",
                 "max_in_flight", "rpm", "warmup_path", "tpm", "stream_usage",
                 "http1_pipeline", *KIND_KEYS)
ROUTE_KEYS = ("model", "targets", "strategy", "fallbacks", "cache", "batch",
              "default_max_tokens")
TARGET_KEYS = ("upstream", "model", "weight", "priority")
# Inclusive bounds of every integer key. The limits mirror config.py's for the same VELOX_*
# variables (timeouts, pool size, rpm kept inside the token bucket's int64 arithmetic).
UPSTREAM_INTS = {
    "connections": (1, 256), "http1_pipeline": (1, 64), "request_timeout_ms": (1, 86_400_000),
    "connect_timeout_ms": (1, 600_000), "max_in_flight": (0, 1_000_000),
    "rpm": (0, 1_000_000_000), "tpm": (0, 1_000_000_000),
    "default_max_tokens": (1, 1_000_000),
}
TARGET_INTS = {"weight": (1, 1_000_000), "priority": (0, 1000)}
RETRY_INTS = {
    "attempts": (1, 10), "budget_percent": (0, 100), "budget_window_s": (1, 3600),
    "budget_min_per_s": (0, 1_000_000), "max_elapsed_ms": (1, 86_400_000),
    "same_target_retry_after_s": (0, 3600),
}
BREAKER_INTS = {
    "failures": (1, 255), "open_s": (1, 86_400), "max_open_s": (1, 86_400),
    "successes": (1, 255), "probe_interval_s": (1, 3600),
}
BATCH_INTS = {"max_requests": (1, 4096), "max_inputs": (1, 1_000_000),
              "max_wait_ms": (0, 60_000)}
KEY_KEYS = ("name", "sha256", "rpm", "tpm", "max_parallel", "models", "forward", "budget_usd",
            "budget_period")
BUDGET_KEYS = ("name", "budget_usd", "budget_period", "keys")

# rpm/tpm stay inside the native Limits' bounds (10**9 per minute); 0 means no limit.
KEY_INTS = {"rpm": (0, 1_000_000_000), "tpm": (0, 1_000_000_000),
            "max_parallel": (0, 1_000_000)}
# [[price]]: USD per million tokens (micro-USD integers inside) and USD per image / request
# (nano-USD). At most $1M per million tokens or per call: a bigger number is a typo.
PRICE_TOKEN_KEYS = ("input", "output", "cached_input", "cache_write", "reasoning")
PRICE_FLAT_KEYS = ("image", "request")
PRICE_KEYS = ("model", "upstream", *PRICE_TOKEN_KEYS, *PRICE_FLAT_KEYS)
PRICE_MAX_USD = 1_000_000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # also a metrics label value
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What provider keys start with (OpenAI, Anthropic, Groq, xAI, Google, Hugging Face, ...).
_KEY_PREFIXES = ("sk-", "sk_", "gsk_", "xai-", "AIza", "hf_", "pk-", "rk-", "ghp_", "key-")


def looks_like_a_key(value: str) -> bool:
    """Whether a value meant as a variable NAME looks like a secret instead: a provider key's
    prefix, or 20+ characters with 4+ digits that are not an UPPER_SNAKE name (an Azure key is
    32 hex digits; OPENAI_API_KEY_2 is a name)."""
    text = value.strip()
    if text.startswith(_KEY_PREFIXES):
        return True
    digits = sum(c.isdigit() for c in text)
    if len(text) < 20 or digits < 4:
        return False
    return not (text.isupper() and "_" in text)
_API_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def load_file(path: str | Path, env: Mapping[str, str], template: UpstreamSpec) -> Tables:
    """Read and check the VELOX_CONFIG file; raise TableError naming file, table and key.

    `env` resolves each upstream's `api_key_env`; `template` gives the per-upstream defaults
    (and is the upstream used when the file has no `[[upstream]]`). Relative `ca_file` paths
    are relative to the file's directory.
    """
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TableError(f"{source}: cannot read the VELOX_CONFIG file: "
                         f"{exc.strerror or exc}",
                         f"set VELOX_CONFIG to a readable TOML file (now {source})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TableError(f"{source}: not UTF-8 text (byte {exc.start}); TOML files are "
                         "UTF-8", f"save {source} as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # the message ends "(at line L, column C)"
        raise TableError(f"{source}: TOML syntax error: {exc}",
                         f"fix the TOML syntax of {source} where the error says") from None
    return parse(data, source, env, template, base_dir=Path(path).parent)


def parse(data: Mapping[str, Any], source: str, env: Mapping[str, str],
          template: UpstreamSpec, base_dir: Path | None = None) -> Tables:
    """Check the parsed TOML document and build the frozen `Tables` (see load_file)."""
    _unknown_keys(source, "top level", data, TOP_KEYS)
    upstream_tables = _array_of_tables(source, data, "upstream")
    route_tables = _array_of_tables(source, data, "route")

    upstreams: list[UpstreamSpec] = []
    for index, table in enumerate(upstream_tables, 1):
        spec = _upstream(source, index, table, env, template, base_dir or Path("."))
        for earlier, other in enumerate(upstreams, 1):
            if other.name == spec.name:
                _fail(source, _label("upstream", index, "name", spec.name), "name",
                      f"duplicate name {_q(spec.name)}: [[upstream]] #{earlier} has it already")
        upstreams.append(spec)
    if not upstreams:  # the file only tunes routes or policies: the VELOX_UPSTREAM_* upstream
        upstreams.append(template)
    names = [u.name for u in upstreams]

    routes: list[RouteSpec] = []
    for index, table in enumerate(route_tables, 1):
        route = _route(source, index, table, names)
        for earlier, seen in enumerate(routes, 1):
            if seen.model == route.model:
                _fail(source, _label("route", index, "model", route.model), "model",
                      f"duplicate model {_q(route.model)}: [[route]] #{earlier} has it already")
        routes.append(route)
    if not routes:
        if len(upstreams) > 1:
            _fail(source, "top level", "route",
                  f"{len(upstreams)} upstreams but no [[route]]: add routes naming them "
                  '(model = "*" catches every model no other route names)')
        routes.append(RouteSpec(CATCH_ALL, (TargetSpec(upstreams[0].name),)))
    _check_fallbacks(source, routes)

    retry = _policy(source, data, "retry", RetryPolicy, RETRY_INTS)
    breaker = _policy(source, data, "breaker", BreakerPolicy, BREAKER_INTS)
    if breaker.max_open_s < breaker.open_s:
        _fail(source, "[breaker]", "max_open_s",
              f"must be >= open_s ({breaker.open_s}), got {breaker.max_open_s}")
    keys = _keys(source, _array_of_tables(source, data, "key"), routes)
    prices = parse_prices(source, _array_of_tables(source, data, "price"), names)
    budgets = _budgets(source, _array_of_tables(source, data, "budget"), keys)
    return Tables(upstreams=tuple(upstreams), routes=tuple(routes), retry=retry,
                  breaker=breaker, source=source, keys=keys, prices=prices, budgets=budgets)


# --- one table at a time ---------------------------------------------------------------------


def _upstream(source: str, index: int, table: dict[str, Any], env: Mapping[str, str],
              template: UpstreamSpec, base_dir: Path) -> UpstreamSpec:
    where = _label("upstream", index, "name", table.get("name"))
    if "api_key" in table:
        _fail(source, where, "api_key", "keys never go in the file: put the key in an "
              'environment variable and name that variable with api_key_env = "NAME"')
    _unknown_keys(source, where, table, UPSTREAM_KEYS)
    name = _str(source, where, table, "name", required=True)
    if not _NAME.fullmatch(name):
        _fail(source, where, "name", "must be 1-64 letters, digits, '_', '.' or '-' "
              f"(starting with a letter or digit), got {_q(name)}")
    origin = _str(source, where, table, "origin", required=True)
    checked = _check_origin(origin)
    if checked is None:
        _fail(source, where, "origin", "must be an origin like https://api.openai.com or "
              f"http://127.0.0.1:8000 (scheme and host, no path), got {_q(origin)}")
    origin = checked
    kind = _choice(source, where, table, "kind", UPSTREAM_KINDS, "openai")
    api_version = _str(source, where, table, "api_version")
    if kind == "azure" and not api_version:
        _fail(source, where, "api_version", 'required with kind = "azure" (the api-version '
              'query parameter, e.g. "2024-10-21")')
    if kind != "azure" and "api_version" in table:
        _fail(source, where, "api_version", 'only used with kind = "azure"')
    if api_version and not _API_VERSION.fullmatch(api_version):
        _fail(source, where, "api_version", f"must look like 2024-10-21, got {_q(api_version)}")

    api_key_env = _str(source, where, table, "api_key_env")
    api_key = ""
    if "api_key_env" in table:
        if looks_like_a_key(api_key_env):  # never echoed: it may be the key itself
            _fail(source, where, "api_key_env", "this value looks like a key, not the NAME of "
                  "an environment variable: put the key in a variable (in the environment or "
                  '.env) and write its name here, e.g. api_key_env = "OPENAI_API_KEY"; if it '
                  "is a real key, rotate it: it was written into a file")
        if not _ENV_NAME.fullmatch(api_key_env):
            _fail(source, where, "api_key_env", "must be the NAME of an environment variable "
                  f"(letters, digits, '_'), got {_q(api_key_env)}")
        api_key = env.get(api_key_env, "").strip()
        if not api_key:
            _fail(source, where, "api_key_env", f"the environment variable {api_key_env} is "
                  "not set or empty; export it (or put it in .env) before starting Velox")
    elif kind in ("azure", "anthropic", "gemini"):
        _fail(source, where, "api_key_env", f"required with kind = {_q(kind)}: the NAME of the "
              "environment variable holding the key")
    if kind == "bedrock" and "api_key_env" in table:
        _fail(source, where, "api_key_env", 'not used with kind = "bedrock" (calls are signed '
              "with SigV4): name the credentials' variables with aws_access_key_id_env and "
              "aws_secret_access_key_env")
    kind_settings = _kind_settings(source, where, table, env, kind)

    protocol = _choice(source, where, table, "protocol", PROTOCOLS, template.protocol)
    # Any: spread into UpstreamSpec's keywords beside its str ones.
    ints: dict[str, Any] = {key: _int(source, where, table, key, default, *UPSTREAM_INTS[key])
                            for key, default in (
                                ("connections", template.connections),
                                ("http1_pipeline", template.http1_pipeline),
                                ("request_timeout_ms", template.request_timeout_ms),
                                ("connect_timeout_ms", template.connect_timeout_ms),
                                ("max_in_flight", 0), ("rpm", 0), ("tpm", 0))}
    https = origin.startswith("https://")
    ca_file = _str(source, where, table, "ca_file")
    if "ca_file" in table:
        if not https:
            _fail(source, where, "ca_file", f"set for the http:// origin {origin}; use an "
                  "https:// origin or remove ca_file")
        resolved = Path(ca_file) if os.path.isabs(ca_file) else base_dir / ca_file
        if not resolved.is_file():
            _fail(source, where, "ca_file", f"{_q(str(resolved))} is not an existing file")
        ca_file = str(resolved)
    elif https:
        ca_file = template.ca_file
    default_warmup = ("/openai/models?api-version=" + api_version if kind == "azure"
                      else WARMUP_PATHS.get(kind, template.warmup_path))
    warmup_path = _str(source, where, table, "warmup_path") or default_warmup
    if not warmup_path.startswith("/") or any(c in warmup_path for c in " \r\n\t"):
        _fail(source, where, "warmup_path",
              f"must be a URL path starting with '/' without spaces, got {_q(warmup_path)}")
    return UpstreamSpec(
        name=name, origin=origin, api_key=api_key, api_key_env=api_key_env, kind=kind,
        api_version=api_version, protocol=protocol, ca_file=ca_file, warmup_path=warmup_path,
        stream_usage=_bool(source, where, table, "stream_usage", True), **ints,
        **kind_settings)


# The warm-up (and breaker probe) request per translated kind: any answer below 500 but 429
# shows the upstream is there, so Bedrock's unsigned probe (a 403) serves as well.
WARMUP_PATHS = {"anthropic": "/v1/models", "gemini": "/v1beta/models", "bedrock": "/"}
_AWS_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]{1,2}")


def _kind_settings(source: str, where: str, table: dict[str, Any], env: Mapping[str, str],
                   kind: str) -> dict[str, Any]:
    """The settings only `kind` reads (KIND_KEYS): each refused on another kind, the required
    ones checked, the AWS secrets read from the variables named."""
    for key, owner in KIND_KEYS.items():
        if key in table and owner != kind:
            _fail(source, where, key, f"only used with kind = {_q(owner)} (this upstream's "
                  f"kind is {_q(kind)})")
    if kind == "anthropic":
        version = _str(source, where, table, "anthropic_version") or ANTHROPIC_VERSION
        if not _API_VERSION.fullmatch(version):
            _fail(source, where, "anthropic_version",
                  f"must look like 2023-06-01, got {_q(version)}")
        return {"anthropic_version": version,
                "default_max_tokens": _int(source, where, table, "default_max_tokens",
                                           ANTHROPIC_MAX_TOKENS,
                                           *UPSTREAM_INTS["default_max_tokens"])}
    if kind == "gemini":
        return {"thinking": _choice(source, where, table, "thinking", ("level", "budget"), "")}
    if kind != "bedrock":
        return {}
    if importlib.util.find_spec("botocore") is None:
        _fail(source, where, "kind", 'kind = "bedrock" signs its calls with botocore, which is '
              "not installed: install the extra with pip install 'velox[bedrock]'")
    for key in ("aws_region", "aws_access_key_id_env", "aws_secret_access_key_env"):
        if key not in table:
            _fail(source, where, key, 'missing: required with kind = "bedrock"')
    region = _str(source, where, table, "aws_region", required=True)
    if not _AWS_REGION.fullmatch(region):
        _fail(source, where, "aws_region",
              f"must be an AWS region like us-east-1, got {_q(region)}")
    out: dict[str, Any] = {"aws_region": region, "embed_input_type": _choice(
        source, where, table, "embed_input_type", EMBED_INPUT_TYPES, "search_document")}
    for key in ("aws_access_key_id_env", "aws_secret_access_key_env", "aws_session_token_env"):
        name = _str(source, where, table, key)
        if key not in table:
            continue
        if looks_like_a_key(name) or not _ENV_NAME.fullmatch(name):
            _fail(source, where, key, "must be the NAME of an environment variable (letters, "
                  "digits, '_'), not a credential; if a credential was written here, rotate it")
        value = env.get(name, "").strip()
        if not value:
            _fail(source, where, key, f"the environment variable {name} is not set or empty; "
                  "export it (or put it in .env) before starting Velox")
        out[key] = name
        out[key[:-4]] = value
    return out


def _route(source: str, index: int, table: dict[str, Any], upstreams: list[str]) -> RouteSpec:
    where = _label("route", index, "model", table.get("model"))
    _unknown_keys(source, where, table, ROUTE_KEYS)
    model = _str(source, where, table, "model", required=True)
    strategy = _choice(source, where, table, "strategy", STRATEGIES, "weighted")
    raw_targets = table.get("targets")
    if raw_targets is None:
        _fail(source, where, "targets", "missing: a route needs at least one target, e.g. "
              'targets = [{ upstream = "openai" }]')
    if not isinstance(raw_targets, list) or not raw_targets:
        _fail(source, where, "targets", "must be a non-empty array of inline tables like "
              f'{{ upstream = "openai", weight = 1 }}, got {_kind(raw_targets)}')
    targets = []
    for number, item in enumerate(raw_targets, 1):
        twhere = where + f", target #{number}"
        if not isinstance(item, dict):
            _fail(source, twhere, "targets", "each target must be an inline table like "
                  f'{{ upstream = "openai" }}, got {_kind(item)}')
        if isinstance(item.get("upstream"), str):
            twhere += f" (upstream {_q(item['upstream'])})"
        _unknown_keys(source, twhere, item, TARGET_KEYS)
        upstream = _str(source, twhere, item, "upstream", required=True)
        if upstream not in upstreams:
            _fail(source, twhere, "upstream", f"{_q(upstream)} names no [[upstream]]"
                  + _suggest(upstream, upstreams) + "; defined: "
                  + ", ".join(_q(n) for n in upstreams))
        target_model = _str(source, twhere, item, "model")
        if "model" in item and not target_model:
            _fail(source, twhere, "model", "must not be empty (leave it out to send the "
                  "model the client named)")
        weight = _int(source, twhere, item, "weight", 1, *TARGET_INTS["weight"])
        priority = _int(source, twhere, item, "priority", 0, *TARGET_INTS["priority"])
        targets.append(TargetSpec(upstream, target_model, weight, priority))
    fallbacks = table.get("fallbacks", [])
    if not isinstance(fallbacks, list) or not all(isinstance(f, str) and f for f in fallbacks):
        _fail(source, where, "fallbacks", "must be an array of route models (strings), "
              f"got {_kind(fallbacks) if not isinstance(fallbacks, list) else fallbacks!r}")
    if len(set(fallbacks)) != len(fallbacks):
        _fail(source, where, "fallbacks", f"names a route twice: {fallbacks!r}")
    cache = _bool(source, where, table, "cache")
    batch = _batch(source, where, table)
    max_tokens = _int(source, where, table, "default_max_tokens", 0,
                      *UPSTREAM_INTS["default_max_tokens"])
    return RouteSpec(model, tuple(targets), strategy, tuple(fallbacks), cache, batch, max_tokens)


def _check_fallbacks(source: str, routes: list[RouteSpec]) -> None:
    models = [r.model for r in routes]
    by_model = {r.model: r for r in routes}
    for index, route in enumerate(routes, 1):
        for name in route.fallbacks:
            if name not in by_model:
                _fail(source, _label("route", index, "model", route.model), "fallbacks",
                      f"{_q(name)} names no [[route]]" + _suggest(name, models)
                      + "; routes: " + ", ".join(_q(m) for m in models))
    # A cycle would send a failed request round and round: refuse it, naming the whole cycle.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(model: str) -> None:
        state[model] = 1
        path.append(model)
        for nxt in by_model[model].fallbacks:
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt):], nxt]
                index = models.index(cycle[0]) + 1
                _fail(source, _label("route", index, "model", cycle[0]), "fallbacks",
                      "fallback cycle: " + " -> ".join(_q(m) for m in cycle))
            if state.get(nxt) is None:
                visit(nxt)
        path.pop()
        state[model] = 2

    for model in models:
        if model not in state:
            visit(model)


def _policy(source: str, data: Mapping[str, Any], key: str, cls: type,
            bounds: dict[str, tuple[int, int]]) -> Any:
    table = data.get(key)
    if table is None:
        return cls()
    where = f"[{key}]"
    if not isinstance(table, dict):
        _fail(source, "top level", key, f"must be a table ([{key}]), got {_kind(table)}")
    _unknown_keys(source, where, table, tuple(bounds))
    defaults = cls()
    return cls(**{name: _int(source, where, table, name, getattr(defaults, name), *bounds[name])
                  for name in bounds})


def _batch(source: str, where: str, table: Mapping[str, Any]) -> BatchSpec | None:
    """A route's `batch`: absent or false (off), true (the defaults) or an inline table."""
    value = table.get("batch")
    if value is None or value is False:
        return None
    if value is True:
        return BatchSpec()
    if not isinstance(value, dict):
        _fail(source, where, "batch", "must be true, false or an inline table like "
              "{ max_requests = 32, max_inputs = 2048, max_wait_ms = 20 }, got "
              + _kind(value))
    bwhere = where + ", batch"
    _unknown_keys(source, bwhere, value, tuple(BATCH_INTS))
    defaults = BatchSpec()
    return BatchSpec(**{key: _int(source, bwhere, value, key, getattr(defaults, key), *bounds)
                        for key, bounds in BATCH_INTS.items()})
def _keys(source: str, tables: list[dict[str, Any]],
          routes: list[RouteSpec]) -> tuple[KeySpec, ...]:
    """`[[key]]` tables: unique names and hashes, limits in range, models naming routes."""
    models = [r.model for r in routes]
    keys: list[KeySpec] = []
    by_name: dict[str, int] = {}  # name -> its table's number (a dict: 4,096 keys load fast)
    by_digest: dict[str, int] = {}
    if len(tables) > MAX_KEYS:  # before checking a million tables one by one
        table = tables[MAX_KEYS]
        _fail(source, _label("key", MAX_KEYS + 1, "name", table.get("name")), "name",
              f"at most {MAX_KEYS:,} [[key]] tables, this file has {len(tables):,} (the "
              f"gateway's key table holds {MAX_KEYS:,} keys in all, file and run-time keys: "
              "each has its buckets and counters in shared memory)")
    for index, table in enumerate(tables, 1):
        where = _label("key", index, "name", table.get("name"))
        if "key" in table or "api_key" in table:
            _fail(source, where, "key" if "key" in table else "api_key", "the key itself never "
                  "goes in the file: put its SHA-256 in sha256 (`velox key hash` prints it)")
        _unknown_keys(source, where, table, KEY_KEYS)
        name = _str(source, where, table, "name", required=True)
        if not _NAME.fullmatch(name):
            _fail(source, where, "name", "must be 1-64 letters, digits, '_', '.' or '-' "
                  f"(starting with a letter or digit), got {_q(name)}")
        digest = _str(source, where, table, "sha256", required=True).lower()
        if not _SHA256.fullmatch(digest):
            _fail(source, where, "sha256", "must be the key's SHA-256 as 64 hex digits "
                  f"(`velox key hash` prints it), got {_q(digest[:80])}")
        ints = {key: _int(source, where, table, key, 0, *KEY_INTS[key]) for key in KEY_INTS}
        allowed: tuple[str, ...] | None = None
        if "models" in table:
            raw = table["models"]
            if not isinstance(raw, list) or not all(isinstance(m, str) and m for m in raw):
                _fail(source, where, "models", "must be an array of route models (strings), "
                      f"got {_kind(raw) if not isinstance(raw, list) else raw!r}")
            for model in raw:
                if model not in models:
                    _fail(source, where, "models", f"{_q(model)} names no [[route]]"
                          + _suggest(model, models) + "; routes: "
                          + ", ".join(_q(m) for m in models))
            if len(set(raw)) != len(raw):
                _fail(source, where, "models", f"names a route twice: {raw!r}")
            allowed = tuple(raw)
        if name in by_name:
            _fail(source, where, "name",
                  f"duplicate name {_q(name)}: [[key]] #{by_name[name]} has it already")
        if digest in by_digest:
            earlier = by_digest[digest]
            _fail(source, where, "sha256", f"the same key as [[key]] #{earlier} "
                  f"({_q(keys[earlier - 1].name)}): each key may appear once")
        by_name[name], by_digest[digest] = index, index
        forward = _bool(source, where, table, "forward") if "forward" in table else None
        budget, period = _budget_of(source, where, table)
        keys.append(KeySpec(name, digest, models=allowed, forward=forward, budget_nanos=budget,
                            budget_period=period, **ints))
    return tuple(keys)


def _budget_of(source: str, where: str, table: Mapping[str, Any]) -> tuple[int, str]:
    """`budget_usd` (nano-USD, 0 when absent) and `budget_period` of a [[key]] or [[budget]]."""
    budget = _money(source, where, table, "budget_usd", 9, "USD") or 0
    period = _str(source, where, table, "budget_period") or DEFAULT_BUDGET_PERIOD
    if period not in BUDGET_PERIODS:
        _fail(source, where, "budget_period", f"unknown period {_q(period)}"
              + _suggest(period, list(BUDGET_PERIODS)) + "; valid: "
              + ", ".join(BUDGET_PERIODS) + " (calendar periods in UTC)")
    if "budget_period" in table and "budget_usd" not in table:
        _fail(source, where, "budget_period", "a period without budget_usd limits nothing")
    return budget, period


def _budgets(source: str, tables: list[dict[str, Any]],
             keys: tuple[KeySpec, ...]) -> tuple[BudgetSpec, ...]:
    """`[[budget]]` tables: unique names, a budget, keys naming [[key]] tables."""
    names = [k.name for k in keys]
    out: list[BudgetSpec] = []
    for index, table in enumerate(tables, 1):
        where = _label("budget", index, "name", table.get("name"))
        _unknown_keys(source, where, table, BUDGET_KEYS)
        name = _str(source, where, table, "name", required=True)
        if any(b.name == name for b in out):
            _fail(source, where, "name", f"duplicate name {_q(name)}")
        if "budget_usd" not in table:
            _fail(source, where, "budget_usd", "required: what the team may spend per period")
        budget, period = _budget_of(source, where, table)
        members = table.get("keys", [])
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            _fail(source, where, "keys", "must be an array of [[key]] names (strings)")
        for member in members:
            if member not in names:
                _fail(source, where, "keys", f"{_q(member)} names no [[key]]"
                      + _suggest(member, names))
        out.append(BudgetSpec(name, budget, period, tuple(members)))
    return tuple(out)


def parse_prices(source: str, tables: list[dict[str, Any]],
                 upstreams: list[str] | None) -> tuple[PriceSpec, ...]:
    """`[[price]]` tables: a model glob, an optional upstream naming an [[upstream]] (any name
    when `upstreams` is None: the shipped table), at least one price, each a number >= 0 with
    at most 6 decimal places per million tokens (9 for image / request), one entry per
    (model, upstream)."""
    prices: list[PriceSpec] = []
    seen: dict[tuple[str, str], int] = {}
    for index, table in enumerate(tables, 1):
        where = _label("price", index, "model", table.get("model"))
        _unknown_keys(source, where, table, PRICE_KEYS)
        model = _str(source, where, table, "model", required=True)
        upstream = _str(source, where, table, "upstream")
        if upstreams is not None and "upstream" in table and upstream not in upstreams:
            _fail(source, where, "upstream", f"{_q(upstream)} names no [[upstream]]"
                  + _suggest(upstream, upstreams) + "; defined: "
                  + ", ".join(_q(n) for n in upstreams))
        if not any(k in table for k in (*PRICE_TOKEN_KEYS, *PRICE_FLAT_KEYS)):
            _fail(source, where, "input", "a [[price]] needs at least one price: input, "
                  "output (USD per million tokens), cached_input, cache_write, reasoning, "
                  "image or request (USD each)")
        tokens = {k: _money(source, where, table, k, 6) for k in PRICE_TOKEN_KEYS}
        flat = {k: _money(source, where, table, k, 9) or 0 for k in PRICE_FLAT_KEYS}
        if (model, upstream) in seen:
            _fail(source, where, "model", f"[[price]] #{seen[model, upstream]} prices "
                  f"{_q(model)}" + (f" on {_q(upstream)}" if upstream else "") + " already")
        seen[model, upstream] = index
        prices.append(PriceSpec(model, upstream, input=tokens["input"] or 0,
                                output=tokens["output"] or 0,
                                cached_input=tokens["cached_input"],
                                cache_write=tokens["cache_write"],
                                reasoning=tokens["reasoning"], source=source, **flat))
    return tuple(prices)


def _money(source: str, where: str, table: Mapping[str, Any], key: str,
           decimals: int, unit: str = "") -> int | None:
    """A USD amount as an integer of 10**-decimals USD (None when absent). Floats are read
    through their shortest repr, so 0.15 is exactly 150000 micro-USD, never 149999."""
    value = table.get(key)
    if value is None:
        return None
    unit = unit or ("USD per million tokens" if decimals == 6 else "USD")
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(source, where, key, f"must be a number of {unit} (e.g. 2.5), got {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        _fail(source, where, key, f"must be a finite number of {unit}, got {value}")
    if value < 0:
        _fail(source, where, key, f"must be >= 0 ({unit}), got {value}")
    if value > PRICE_MAX_USD:
        _fail(source, where, key, f"must be at most {PRICE_MAX_USD:,} {unit}, got {value}")
    scaled = Decimal(repr(value)) * 10**decimals
    if scaled != scaled.to_integral_value():
        _fail(source, where, key, f"at most {decimals} decimal places ({unit}), got {value}")
    return int(scaled)


# --- checks and messages ---------------------------------------------------------------------


def _fail(source: str, where: str, key: str, problem: str) -> NoReturn:
    raise TableError(f"{source}: {where}: {key}: {problem}", f"fix {key} of {where} in {source}")


def _label(table: str, index: int, key: str, value: object) -> str:
    label = f"[[{table}]] #{index}"
    return label + f" ({key} {_q(value)})" if isinstance(value, str) and value else label


def _q(value: object) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value}"
    if isinstance(value, str):
        return f"the string {_q(value)}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {_q(close[0])}?)" if close else ""


def _unknown_keys(source: str, where: str, table: Mapping[str, Any],
                  valid: tuple[str, ...]) -> None:
    for key in table:
        if key not in valid:
            _fail(source, where, key, "unknown key" + _suggest(key, valid)
                  + "; valid keys: " + ", ".join(valid))


def _array_of_tables(source: str, data: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key, [])
    if isinstance(value, dict):
        _fail(source, "top level", key, f"[{key}] is a single table; write [[{key}]] "
              "(an array of tables, one per entry)")
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        _fail(source, "top level", key, f"must be an array of tables ([[{key}]]), "
              f"got {_kind(value)}")
    return value


def _str(source: str, where: str, table: Mapping[str, Any], key: str,
         required: bool = False) -> str:
    value = table.get(key)
    if value is None:
        if required:
            _fail(source, where, key, "missing (required)")
        return ""
    if not isinstance(value, str):
        _fail(source, where, key, f"must be a string, got {_kind(value)}")
    value = value.strip()
    if required and not value:
        _fail(source, where, key, "must not be empty")
    return value


def _choice(source: str, where: str, table: Mapping[str, Any], key: str,
            choices: tuple[str, ...], default: str) -> str:
    if key not in table:
        return default
    value = _str(source, where, table, key).lower()
    if value not in choices:
        _fail(source, where, key, "must be one of " + ", ".join(_q(c) for c in choices)
              + f", got {_q(value)}" + _suggest(value, choices))
    return value


def _int(source: str, where: str, table: Mapping[str, Any], key: str, default: int,
         lo: int, hi: int) -> int:
    value = table.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(source, where, key, f"must be an integer from {lo} to {hi}, got {_kind(value)}")
    if not lo <= value <= hi:
        _fail(source, where, key, f"must be an integer from {lo} to {hi}, got {value}")
    return value


def _bool(source: str, where: str, table: Mapping[str, Any], key: str,
          default: bool = False) -> bool:
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        _fail(source, where, key, f"must be true or false, got {_kind(value)}")
    return value


def _check_origin(raw: str) -> str | None:
    """scheme://host[:port] normalised, or None (the same rule as VELOX_UPSTREAM_ORIGIN)."""
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return None
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    return f"{parts.scheme}://{parts.netloc}"


# --- showing them (velox --print-config) -----------------------------------------------------


def mask(secret: str) -> str:
    """A secret as --print-config shows it: its first 3 characters and its length at most."""
    return secret[:3] + "…" + f"({len(secret)} chars)" if len(secret) > 8 else "***"


def describe(tables: Tables) -> str:
    """The effective tables as TOML (defaults filled in), keys masked: for --print-config."""
    origin = (f"from {tables.source}" if tables.source
              else "synthesised from VELOX_UPSTREAM_* (no VELOX_CONFIG)")
    lines = [f"# tables {origin}"]
    for spec in tables.upstreams:
        lines += ["", "[[upstream]]"]
        if spec.api_key_env:
            lines.append(f"# key: {spec.api_key_env}={mask(spec.api_key)}")
        elif spec.api_key:
            lines.append(f"# key: VELOX_UPSTREAM_API_KEY (or OPENAI_API_KEY)={mask(spec.api_key)}")
        else:
            lines.append("# key: none sent")
        for f in dataclasses.fields(spec):
            if not f.repr or KIND_KEYS.get(f.name, spec.kind) != spec.kind:
                continue  # a secret (api_key, the AWS ones), or another kind's setting
            value = getattr(spec, f.name)
            if value != "":  # "" is how the file leaves a key out
                lines.append(f"{f.name} = {_toml(value)}")
    for route in tables.routes:
        lines += ["", "[[route]]", f"model = {_toml(route.model)}",
                  f"strategy = {_toml(route.strategy)}", "targets = ["]
        for t in route.targets:
            model = f"model = {_toml(t.model)}, " if t.model else ""
            lines.append(f"  {{ upstream = {_toml(t.upstream)}, {model}weight = {t.weight}, "
                         f"priority = {t.priority} }},")
        lines += ["]", f"fallbacks = {_toml(list(route.fallbacks))}"]
        if route.cache:
            lines.append("cache = true")
        if route.default_max_tokens:
            lines.append(f"default_max_tokens = {route.default_max_tokens}")
        if route.batch is not None:
            lines.append("batch = { " + ", ".join(
                f"{f.name} = {getattr(route.batch, f.name)}"
                for f in dataclasses.fields(route.batch)) + " }")
    for key in tables.keys:
        lines += ["", "[[key]]", f"name = {_toml(key.name)}", f"sha256 = {_toml(key.sha256)}",
                  f"rpm = {key.rpm}", f"tpm = {key.tpm}", f"max_parallel = {key.max_parallel}"]
        if key.models is not None:
            lines.append(f"models = {_toml(list(key.models))}")
        lines.append(f"forward = {_toml(key.may_forward)}")
    for title, policy in (("retry", tables.retry), ("breaker", tables.breaker)):
        lines += ["", f"[{title}]"]
        lines += [f"{f.name} = {getattr(policy, f.name)}" for f in dataclasses.fields(policy)]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return _q(value)
