"""Every setting Velox reads, parsed once into one frozen `Settings`.

This is the only module that looks at the environment. Each variable is declared once in
`FIELDS` with its default, its parser and a one-line description; `.env.example`, the
`--print-config` output and the error messages are all derived from that table, so they cannot
drift apart. A `.env` file in the working directory is read if present; variables already in the
environment win over it.

`VELOX_CONFIG` names a TOML file of upstreams, routes and failover policies; tables.py parses
it, and `Settings.tables` holds the result (synthesised from VELOX_UPSTREAM_* without it).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from velox.config.tables import (
    DEFAULT_UPSTREAM,
    TableError,
    Tables,
    UpstreamSpec,
    load_file,
    single_upstream,
)

DEFAULT_PORT = 8080
DEFAULT_RING_DEPTH = 16_384
DEFAULT_BATCH_MAX = 64
DEFAULT_ARENA_BYTES = 262_144
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_PARSE_OFF_LOOP_BYTES = 256 * 1024
DEFAULT_RATE_LIMIT_RPM = 10_000
DEFAULT_RATE_LIMIT_BURST = 500
DEFAULT_REQUEST_TIMEOUT_MS = 600_000
DEFAULT_CONNECT_TIMEOUT_MS = 5_000
DEFAULT_STREAM_IDLE_TIMEOUT_MS = 300_000
DEFAULT_SHUTDOWN_GRACE_S = 30
DEFAULT_KEEPALIVE_TIMEOUT_S = 75
DEFAULT_WORKER_HANG_S = 10
DEFAULT_BODY_TIMEOUT_MS = 30_000
# A client whose connection takes none of its answer for this long is disconnected (what is
# waiting for it dropped). nginx's send_timeout is 60 s; a reading client drains its 64 KiB
# transport buffer in well under a second even on a slow link, so 30 s cuts only clients that
# stopped reading, while bounding how long such a client holds a worker's memory.
DEFAULT_WRITE_TIMEOUT_MS = 30_000
DEFAULT_CACHE_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_CACHE_TTL_S = 3600
# /metrics: gateway keys with their own series (VELOX_METRICS_KEYS). 2,048 keys made a 0.87 MB
# scrape costing ~0.34 s of supervisor CPU (benches/bench_metrics.py); 100 keys stay small.
DEFAULT_METRICS_KEYS = 100
# The token bucket keeps tokens in int64 scaled by 60e6 (µs per minute); these bounds keep
# every product inside int64 with room to spare.
MAX_RATE_LIMIT = 1_000_000_000

EGRESS_CHOICES = ("auto", "http1")
PROTOCOL_CHOICES = ("auto", "h2", "http1")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A setting has an invalid value; the message names the variable (or file, table and key)
    and the accepted form, and `fix` says what to change."""

    def __init__(self, message: str, fix: str = "fix that variable (see .env.example)") -> None:
        super().__init__(message)
        self.fix = fix


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


# --- value parsers: each takes the raw string and returns the typed value or raises ValueError
# with a description of the accepted form (the caller adds the variable's name and value).


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"an integer from {lo} to {hi}") from None
        if not lo <= value <= hi:
            raise ValueError(f"an integer from {lo} to {hi}")
        return value

    return parse


def _power_of_two(lo: int, hi: int) -> Callable[[str], int]:
    as_int = _int_in(lo, hi)

    def parse(raw: str) -> int:
        form = f"a power of two from {lo} to {hi}"
        try:
            value = as_int(raw)
        except ValueError:
            raise ValueError(form) from None
        if value & (value - 1):
            raise ValueError(form)
        return value

    return parse


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("one of 1/0, true/false, yes/no, on/off")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        low = raw.strip().lower()
        if low not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return low

    return parse


def _text(raw: str) -> str:
    return raw.strip()


def _url_path(raw: str) -> str:
    path = raw.strip()
    if not path.startswith("/") or any(c in path for c in " \r\n\t"):
        raise ValueError("a URL path starting with '/' and without spaces")
    return path


def _origin(raw: str) -> str:
    form = "an origin like https://api.openai.com or http://127.0.0.1:9000 (no path)"
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(form)
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(form)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(form) from None
    return f"{parts.scheme}://{parts.netloc}"


def _listen_addr(raw: str) -> str:
    form = "host:port (e.g. 127.0.0.1:6060, [::1]:6060; port 0 picks one) or off"
    text = raw.strip()
    if text.lower() == "off":
        return "off"
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535 or " " in host:
        raise ValueError(form)
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


def _existing_file(raw: str) -> str:
    path = raw.strip()
    if path and not Path(path).is_file():
        raise ValueError("the path of an existing PEM file")
    return path


def _key_list(raw: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if any(" " in k for k in keys):
        raise ValueError("comma-separated keys without spaces inside a key")
    return keys


def _redis_url(raw: str) -> str:
    form = ("redis://[user:password@]host[:port][/db] or rediss:// (TLS), e.g. "
            "redis://127.0.0.1:6379/0")
    url = raw.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(form)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(form) from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(form)
    return url


def _ratio(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("a number from 0 to 1 (e.g. 0.01 for 1%)") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError("a number from 0 to 1 (e.g. 0.01 for 1%)")
    return value


def _base_url(raw: str) -> str:
    form = "an http(s) base URL like http://127.0.0.1:4318 (spans go to <base>/v1/traces)"
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ValueError(form)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(form) from None
    return url


def default_state_dir(env: Mapping[str, str]) -> str:
    """Where durable state lives when VELOX_STATE_DIR is empty: the XDG state directory."""
    base = env.get("XDG_STATE_HOME", "").strip() or os.path.join(
        env.get("HOME", "").strip() or os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "velox")


def _labelled_tokens(raw: str) -> tuple[tuple[str, str], ...]:
    form = ("comma-separated label=token pairs (labels of letters, digits, '_', '.', '-'; "
            "tokens printable ASCII without spaces or commas)")
    out = []
    for item in (i.strip() for i in raw.split(",") if i.strip()):
        label, sep, token = item.partition("=")
        if not sep or not label or not token or not all(
                c.isalnum() or c in "_.-" for c in label):
            raise ValueError(form)
        out.append((label, _token(token)))
    if len({label for label, _ in out}) != len(out):
        raise ValueError(form + ", each label once")
    return tuple(out)


def _token(raw: str) -> str:
    token = raw.strip()
    if token and not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError("printable ASCII without spaces (it travels in an HTTP header)")
    return token


@dataclass(frozen=True, slots=True)
class Field:
    env: str
    attr: str
    parse: Callable[[str], Any]
    default: str  # as written in .env.example; "" means unset
    help: str
    secret: bool = False


FIELDS: tuple[Field, ...] = (
    Field("VELOX_HOST", "host", _text, "127.0.0.1", "address the gateway listens on"),
    Field("VELOX_PORT", "port", _int_in(0, 65535), str(DEFAULT_PORT),
          "port the gateway listens on (0 picks a free port and logs it)"),
    Field("VELOX_WORKERS", "workers", _int_in(1, 1024), "",
          "worker processes (empty: one per usable core)"),
    Field("VELOX_PIN_WORKERS", "pin_workers", _bool, "1",
          "pin each worker to its own core, NUMA node by node"),
    Field("VELOX_RING_DEPTH", "ring_depth", _power_of_two(2, 1 << 20), str(DEFAULT_RING_DEPTH),
          "requests a worker queues before answering 503 overloaded (power of two)"),
    Field("VELOX_BATCH_MAX", "batch_max", _int_in(1, 1024), str(DEFAULT_BATCH_MAX),
          "largest micro-batch a worker drains from its ring at once"),
    Field("VELOX_ARENA_BYTES", "arena_bytes", _int_in(0, 1 << 30), str(DEFAULT_ARENA_BYTES),
          "size of each worker's preallocated body arena"),
    Field("VELOX_MAX_BODY_BYTES", "max_body_bytes", _int_in(1, 1 << 31),
          str(DEFAULT_MAX_BODY_BYTES), "largest request body accepted (larger gets 413)"),
    Field("VELOX_MAX_HEADER_BYTES", "max_header_bytes", _int_in(1024, 1 << 24),
          str(DEFAULT_MAX_HEADER_BYTES),
          "largest request line plus headers accepted (431; at most 100 header fields, "
          "whatever their size)"),
    Field("VELOX_PARSE_OFF_LOOP_BYTES", "parse_off_loop_bytes", _int_in(0, 1 << 31),
          str(DEFAULT_PARSE_OFF_LOOP_BYTES),
          "bodies this large are validated in a thread, off the event loop (0: never)"),
    Field("VELOX_RATE_LIMIT_RPM", "rate_limit_rpm", _int_in(0, MAX_RATE_LIMIT),
          str(DEFAULT_RATE_LIMIT_RPM),
          "global requests per minute across all workers (0: no limit)"),
    Field("VELOX_RATE_LIMIT_BURST", "rate_limit_burst", _int_in(1, MAX_RATE_LIMIT),
          str(DEFAULT_RATE_LIMIT_BURST), "token bucket capacity (requests admitted at once)"),
    Field("VELOX_UPSTREAM_ORIGIN", "upstream_origin", _origin, "https://api.openai.com",
          "where requests are forwarded"),
    Field("VELOX_UPSTREAM_PROTOCOL", "upstream_protocol", _choice(*PROTOCOL_CHOICES), "auto",
          "auto: ALPN for https, HTTP/1.1 for http; h2 on http means h2c prior knowledge"),
    Field("VELOX_UPSTREAM_REQUEST_PATH", "upstream_request_path", _url_path, "/v1/responses",
          "upstream path for payloads POSTed to /"),
    Field("VELOX_UPSTREAM_WARMUP_PATH", "upstream_warmup_path", _url_path, "/v1/models",
          "GET sent on every new upstream connection before /readyz turns 200"),
    Field("VELOX_UPSTREAM_CA_FILE", "upstream_ca_file", _existing_file, "",
          "extra CA certificates (PEM) trusted for the upstream; SSL_CERT_FILE also works"),
    Field("VELOX_UPSTREAM_API_KEY", "upstream_api_key", _text, "",
          "bearer token sent upstream (falls back to OPENAI_API_KEY)", secret=True),
    Field("VELOX_API_KEYS", "api_keys", _key_list, "",
          "comma-separated keys clients must present (empty: no client auth)", secret=True),
    Field("VELOX_EGRESS", "egress", _choice(*EGRESS_CHOICES), "auto",
          "upstream protocol: auto (each upstream's own: HTTP/2 where TLS offers it) or http1 "
          "(HTTP/1.1 to every upstream)"),
    Field("VELOX_EGRESS_POOL_CONNECTIONS", "egress_pool_connections", _int_in(1, 256), "",
          "upstream connections per worker (empty: one per usable core)"),
    Field("VELOX_UPSTREAM_PIPELINE", "upstream_pipeline", _int_in(1, 64), "1",
          "HTTP/1.1 requests pipelined on one upstream connection (1: none; only for a server "
          "known to answer pipelined requests in order)"),
    Field("VELOX_REQUEST_TIMEOUT_MS", "request_timeout_ms", _int_in(1, 86_400_000),
          str(DEFAULT_REQUEST_TIMEOUT_MS), "time allowed for upstream response headers (504)"),
    Field("VELOX_CONNECT_TIMEOUT_MS", "connect_timeout_ms", _int_in(1, 600_000),
          str(DEFAULT_CONNECT_TIMEOUT_MS), "time allowed to open an upstream connection"),
    Field("VELOX_STREAM_IDLE_TIMEOUT_MS", "stream_idle_timeout_ms", _int_in(1, 86_400_000),
          str(DEFAULT_STREAM_IDLE_TIMEOUT_MS), "longest gap between streamed chunks"),
    Field("VELOX_SHUTDOWN_GRACE_S", "shutdown_grace_s", _int_in(0, 3600),
          str(DEFAULT_SHUTDOWN_GRACE_S), "on SIGTERM, time allowed for in-flight requests"),
    Field("VELOX_KEEPALIVE_TIMEOUT_S", "keepalive_timeout_s", _int_in(1, 3600),
          str(DEFAULT_KEEPALIVE_TIMEOUT_S),
          "idle client connections are closed after this, counted from the end of the "
          "last answer"),
    Field("VELOX_LOG_LEVEL", "log_level", _choice(*LOG_LEVELS), "info", "logging level"),
    Field("VELOX_ADMIN_ADDR", "admin_addr", _listen_addr, "127.0.0.1:6060",
          "admin server (/metrics, /stats, /debug/pprof/): host:port, port 0 picks one, off"),
    Field("VELOX_ACCESS_LOG", "access_log", _bool, "1",
          "one JSON line per request on stdout (never keys, bodies or query strings)"),
    Field("VELOX_ACCESS_LOG_BUFFER_BYTES", "access_log_buffer_bytes", _int_in(4096, 1 << 30),
          "1048576", "access-log bytes each worker holds while stdout blocks; past them "
          "lines are dropped and counted, the worker never waits"),
    Field("VELOX_CONFIG", "config_file", _text, "",
          "TOML file of upstreams, routes, retry and breaker policies (empty: one upstream "
          "from VELOX_UPSTREAM_*)"),
    Field("VELOX_ADMIN_TOKEN", "admin_token", _token, "",
          "bearer token the admin server requires on every path but /healthz (empty: none; "
          "then it may only bind a loopback address)", secret=True),
    Field("VELOX_ADMIN_TOKENS", "admin_tokens", _labelled_tokens, "",
          "more admin tokens, one per person or tool, as label=token pairs: the key audit log "
          "names who made each change by its label (VELOX_ADMIN_TOKEN's label is admin)",
          secret=True),
    Field("VELOX_WORKER_HANG_S", "worker_hang_s", _int_in(0, 3600), str(DEFAULT_WORKER_HANG_S),
          "a worker whose loop is silent this long is killed and restarted (0: never)"),
    Field("VELOX_BODY_TIMEOUT_MS", "body_timeout_ms", _int_in(100, 86_400_000),
          str(DEFAULT_BODY_TIMEOUT_MS),
          "a request (line, headers, body) must arrive within this time of its first byte (408)"),
    Field("VELOX_WRITE_TIMEOUT_MS", "write_timeout_ms", _int_in(100, 86_400_000),
          str(DEFAULT_WRITE_TIMEOUT_MS),
          "a client that takes none of its answer for this long is disconnected (a slow reader "
          "is paced, not cut: only one whose writes stay blocked this long)"),
    Field("VELOX_UPSTREAM_PING_INTERVAL_MS", "upstream_ping_interval_ms",
          _int_in(0, 86_400_000), "10000",
          "HTTP/2 PING an idle upstream connection this often (0: no liveness PINGs)"),
    Field("VELOX_UPSTREAM_PING_TIMEOUT_MS", "upstream_ping_timeout_ms", _int_in(1, 600_000),
          "5000", "an upstream connection whose PING is unanswered this long is replaced"),
    Field("VELOX_RELOAD_READY_S", "reload_ready_s", _int_in(1, 3600), "30",
          "on SIGHUP, a new worker not ready within this many seconds aborts the reload"),
    Field("VELOX_CACHE", "cache", _bool, "0",
          "response cache on every route (0: only on routes with cache = true in VELOX_CONFIG)"),
    Field("VELOX_CACHE_MAX_BYTES", "cache_max_bytes", _int_in(65_536, 1 << 40),
          str(DEFAULT_CACHE_MAX_BYTES),
          "memory of the response cache, shared by all workers (least recently used evicted)"),
    Field("VELOX_CACHE_TTL_S", "cache_ttl_s", _int_in(1, 31_536_000), str(DEFAULT_CACHE_TTL_S),
          "a cached answer is served for at most this many seconds after it was stored"),
    Field("VELOX_TOKENS_DEFAULT_OUTPUT", "tokens_default_output", _int_in(0, 1 << 30), "1024",
          "output tokens reserved for a request that gives no max_tokens (capped at the limit)"),
    Field("VELOX_TOKEN_ACCOUNTING", "token_accounting", _bool, "1",
          "read the usage of every model call (tokens per key and route in /stats and /metrics);"
          " 0: only of requests a tpm limit applies to (and, with VELOX_SPEND, priced). On by"
          " default: the per-key token counts are the gateway's usage books, and they cost"
          " ~6.5 us of ~86 us of worker CPU per request (socket-free pipeline)"),
    Field("VELOX_METRICS_KEYS", "metrics_keys", _int_in(0, 4096), str(DEFAULT_METRICS_KEYS),
          "gateway keys with their own /metrics series (the first [[key]] tables in file "
          "order); the others are summed under key=\"_other\" (/stats lists every key)"),
    Field("VELOX_REDIS_URL", "redis_url", _redis_url, "",
          "Redis shared by several Velox hosts: every rate limit becomes global across them "
          "(empty: this host alone)"),
    Field("VELOX_CACHE_REDIS_TIMEOUT_MS", "cache_redis_timeout_ms", _int_in(1, 10_000), "5",
          "with VELOX_REDIS_URL, a local cache miss waits at most this long for the Redis "
          "tier's answer, then goes on as a miss"),
    Field("VELOX_ALLOW_OPEN", "allow_open", _bool, "0",
          "serve clients that present no key on a VELOX_HOST other than loopback, with the "
          "upstream keys (an open relay: refused at start-up unless 1, and then logged)"),
    Field("VELOX_NATIVE", "native", _bool, "1",
          "the native C paths (0: their Python reference twins, for differential tests: "
          "httptools alone for request heads and HTTP/1.1 upstream answers, the Python response "
          "writer, the Python HTTP/2 framer, the usage and estimate scans, the spend book, the "
          "access log's lines and the routes' hashing in Python; the same answers, costs, "
          "ledger rows and log lines, slower. Shared-memory state (counters, limits, ring, "
          "cache) and the request-body JSON scanner stay native)"),
    Field("VELOX_STATE_DIR", "state_dir", _text, "",
          "directory of this host's durable state: the usage ledger (ledger.sqlite3) and "
          "run-time keys (keys.sqlite3), made mode 0700 by the first write (empty: "
          "$XDG_STATE_HOME/velox, else ~/.local/state/velox; off: nothing kept across restarts)"),
    Field("VELOX_LEDGER_RETENTION_DAYS", "ledger_retention_days", _int_in(1, 36_500), "90",
          "ledger rows older than this many days are deleted, in small batches (daily spend "
          "totals are kept)"),
    Field("VELOX_LEDGER_STREAM_MAXLEN", "ledger_stream_maxlen", _int_in(1_000, 1_000_000_000),
          "1000000", "with VELOX_REDIS_URL, the ledger rows of every host also go to the Redis "
          "Stream velox:ledger, capped at about this many entries"),
    Field("VELOX_SPEND", "spend", _bool, "1",
          "price every model call from its usage (x-velox-cost-usd, cost_usd in the access "
          "log, ledger rows); 0: none of it, and [[key]]/[[budget]] budgets are refused"),
    Field("VELOX_OTEL_ENDPOINT", "otel_endpoint", _base_url, "",
          "OpenTelemetry collector base URL (OTLP/HTTP; the otel extra: pip install "
          "'velox[otel]'): traces of requests go to <base>/v1/traces (empty: no tracing)"),
    Field("VELOX_OTEL_SAMPLE", "otel_sample", _ratio, "1",
          "share of requests traced, 0 to 1 (a client's traceparent decides for its request)"),
)

# Settings an earlier version had, with what became of them: set in the environment, each gets
# a start-up warning saying so (like a misspelt variable) and is otherwise ignored, so a .env
# copied from an older .env.example still starts.
REMOVED = {
    "VELOX_QUEUE": "the native ring is the only ingress queue",
    "VELOX_ARENA": "request bodies always go through the arena (VELOX_ARENA_BYTES=0 keeps each "
                   "body in its own buffer)",
    "VELOX_INGRESS_PARSER": "VELOX_NATIVE=0 selects httptools alone for request heads",
    "VELOX_OTEL_CAPTURE_CONTENT": "prompts and completions are never recorded in traces",
}
# Values of VELOX_EGRESS an earlier version accepted: warned about, read as `auto`.
REMOVED_EGRESS = {
    "native": "the native HTTP/2 codec is what auto uses (VELOX_NATIVE=0: the Python framer)",
    "framer": "VELOX_NATIVE=0 selects the Python framer",
    "jh2": "the h2 and jh2 codecs were comparison baselines and are gone",
    "h2": "the h2 and jh2 codecs were comparison baselines and are gone",
    "httpx": "the httpx egress was a comparison baseline and is gone",
}


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    workers: int = 1
    pin_workers: bool = True
    ring_depth: int = DEFAULT_RING_DEPTH
    batch_max: int = DEFAULT_BATCH_MAX
    arena_bytes: int = DEFAULT_ARENA_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    parse_off_loop_bytes: int = DEFAULT_PARSE_OFF_LOOP_BYTES
    rate_limit_rpm: int = DEFAULT_RATE_LIMIT_RPM
    rate_limit_burst: int = DEFAULT_RATE_LIMIT_BURST
    upstream_origin: str = "https://api.openai.com"
    upstream_protocol: str = "auto"
    upstream_request_path: str = "/v1/responses"
    upstream_warmup_path: str = "/v1/models"
    upstream_ca_file: str = ""
    upstream_api_key: str = dataclasses.field(default="", repr=False)  # secrets: never in repr
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    egress: str = "auto"
    egress_pool_connections: int = 1
    upstream_pipeline: int = 1
    request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS
    stream_idle_timeout_ms: int = DEFAULT_STREAM_IDLE_TIMEOUT_MS
    shutdown_grace_s: int = DEFAULT_SHUTDOWN_GRACE_S
    keepalive_timeout_s: int = DEFAULT_KEEPALIVE_TIMEOUT_S
    log_level: str = "info"
    admin_addr: str = "127.0.0.1:6060"
    access_log: bool = True
    access_log_buffer_bytes: int = 1 << 20
    config_file: str = ""
    admin_token: str = ""
    admin_tokens: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    worker_hang_s: int = DEFAULT_WORKER_HANG_S
    body_timeout_ms: int = DEFAULT_BODY_TIMEOUT_MS
    write_timeout_ms: int = DEFAULT_WRITE_TIMEOUT_MS
    upstream_ping_interval_ms: int = 10_000
    upstream_ping_timeout_ms: int = 5_000
    reload_ready_s: int = 30
    cache: bool = False
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    cache_ttl_s: int = DEFAULT_CACHE_TTL_S
    tokens_default_output: int = 1024
    metrics_keys: int = DEFAULT_METRICS_KEYS
    token_accounting: bool = True
    redis_url: str = dataclasses.field(default="", repr=False)  # may hold a password
    cache_redis_timeout_ms: int = 5
    native: bool = True
    allow_open: bool = False
    state_dir: str = ""
    ledger_retention_days: int = 90
    ledger_stream_maxlen: int = 1_000_000
    spend: bool = True
    otel_endpoint: str = ""
    otel_sample: float = 1.0
    # VELOX_* variables that name no setting, each with a did-you-mean (see unknown_variables):
    # logged at start-up and on reload, printed by doctor.
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    # Derived from the environment but not a VELOX_* variable of its own.
    ssl_cert_file: str = ""
    # Upstreams, routes and failover policies (velox.config.tables). None here means "synthesise
    # them from the VELOX_UPSTREAM_* settings above", which __post_init__ does.
    tables: Tables | None = None

    def __post_init__(self) -> None:
        if self.tables is None:
            object.__setattr__(self, "tables", single_upstream(self.default_upstream()))

    def default_upstream(self) -> UpstreamSpec:
        """The one upstream the VELOX_UPSTREAM_* variables describe."""
        protocol = "http1" if self.egress == "http1" else self.upstream_protocol
        return UpstreamSpec(
            name=DEFAULT_UPSTREAM, origin=self.upstream_origin, api_key=self.upstream_api_key,
            protocol=protocol, connections=self.egress_pool_connections,
            http1_pipeline=self.upstream_pipeline,
            ca_file=self.upstream_ca_file, request_timeout_ms=self.request_timeout_ms,
            connect_timeout_ms=self.connect_timeout_ms, warmup_path=self.upstream_warmup_path,
        )

    @property
    def upstream_scheme(self) -> str:
        return urlsplit(self.upstream_origin).scheme

    @property
    def upstream_host(self) -> str:
        return urlsplit(self.upstream_origin).hostname or ""

    @property
    def upstream_port(self) -> int:
        parts = urlsplit(self.upstream_origin)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def upstream_authority(self) -> str:
        return urlsplit(self.upstream_origin).netloc

    @property
    def admin_endpoint(self) -> tuple[str, int] | None:
        """VELOX_ADMIN_ADDR as (host, port), or None when it is off."""
        if self.admin_addr == "off":
            return None
        host, _, port = self.admin_addr.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def egress_protocol(self) -> str:
        """The protocol the pool will try first: "h2" or "http1" (ALPN may still fall back)."""
        if self.egress == "http1" or self.upstream_protocol == "http1":
            return "http1"
        if self.upstream_protocol == "h2":
            return "h2"
        return "h2" if self.upstream_scheme == "https" else "http1"

    def redacted(self) -> dict[str, object]:
        """The effective settings by variable name, secrets masked (for --print-config)."""
        out: dict[str, object] = {}
        for f in FIELDS:
            value = getattr(self, f.attr)
            if f.secret and value:
                value = _mask(value)
            elif f.attr == "redis_url" and value:
                value = redact_url(value)
            out[f.env] = value
        return out


def redact_url(url: str) -> str:
    """A URL with its password masked (VELOX_REDIS_URL in logs and --print-config)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _mask(value: object) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # label=token pairs
        return ",".join(f"{label}={_mask(token)}" for label, token in value)
    if isinstance(value, tuple):
        return ",".join(_mask(v) for v in value)
    text = str(value)
    return text[:3] + "…" + f"({len(text)} chars)" if len(text) > 8 else "***"


def load(environ: Mapping[str, str] | None = None, dotenv: str | Path | None = ".env") -> Settings:
    """Build `Settings` from the environment (and `.env`), or raise ConfigError naming the variable.

    `environ` defaults to os.environ; tests pass their own mapping and `dotenv=None`.
    """
    env: dict[str, str] = {}
    if dotenv is not None and Path(dotenv).is_file():
        from dotenv import dotenv_values

        env.update({k: v for k, v in dotenv_values(dotenv).items() if v is not None})
    env.update(os.environ if environ is None else environ)

    values: dict[str, Any] = {}
    warnings = list(unknown_variables(env))
    for f in FIELDS:
        raw = env.get(f.env)
        if f.env == "VELOX_EGRESS" and raw is not None and raw.strip().lower() in REMOVED_EGRESS:
            warnings.append(f"VELOX_EGRESS={raw.strip()} was removed in this version and is read "
                            f"as auto: {REMOVED_EGRESS[raw.strip().lower()]}")
            raw = None
        if raw is None or raw.strip() == "":
            raw = f.default
        if raw == "" and f.default == "":
            continue
        try:
            values[f.attr] = f.parse(raw)
        except ValueError as exc:
            shown = redact_url(raw.strip()) if f.attr == "redis_url" else raw
            raise ConfigError(f"{f.env}={shown!r} is invalid: expected {exc}") from None

    cores = usable_cores()
    values.setdefault("workers", cores)
    values.setdefault("egress_pool_connections", cores)
    values.setdefault("state_dir", default_state_dir(env))
    if not values.get("upstream_api_key"):
        values["upstream_api_key"] = env.get("OPENAI_API_KEY", "").strip()
    values["ssl_cert_file"] = env.get("SSL_CERT_FILE", "").strip()
    values["warnings"] = tuple(warnings)
    settings = Settings(**values)
    _check_consistency(settings)
    _check_extras(settings)
    if settings.config_file:
        settings = dataclasses.replace(settings, tables=_load_tables(settings, env))
    _check_exposure(settings)
    return settings


# Settings that need an optional extra installed: (attribute, variable, modules, extra).
_EXTRAS = (("otel_endpoint", "VELOX_OTEL_ENDPOINT",
            ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"), "otel"),)


def _check_extras(settings: Settings) -> None:
    """Refuse to start when a setting asks for what an extra that is not installed provides
    (checked here, so the worker never fails after the fork)."""
    for attr, env, modules, extra in _EXTRAS:
        if getattr(settings, attr) and not all(_installed(m) for m in modules):
            raise ConfigError(f"{env} is set but the '{extra}' extra is not installed: "
                              f"pip install 'velox[{extra}]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def unknown_variables(env: Mapping[str, str]) -> tuple[str, ...]:
    """A warning for each VELOX_* variable that is no setting (a typo is otherwise silently
    ignored), with the closest setting's name when one is close, or what became of it when an
    earlier version had it (REMOVED)."""
    prefix = "VELOX_"
    known = {f.env.removeprefix(prefix): f.env for f in FIELDS}
    out = []
    for name in sorted(n for n in env if n.startswith(prefix)):
        suffix = name.removeprefix(prefix)
        if suffix in known:
            continue
        if name in REMOVED:
            out.append(f"{name} was removed in this version and is ignored: {REMOVED[name]}")
            continue
        # Compared without the prefix every name shares, which would make anything look close.
        close = difflib.get_close_matches(suffix, known, n=1, cutoff=0.6)
        hint = f"did you mean {known[close[0]]}?" if close else "see .env.example for the settings"
        out.append(f"{name} is not a Velox setting and is ignored; {hint}")
    return tuple(out)


def _load_tables(settings: Settings, env: Mapping[str, str]) -> Tables:
    """The VELOX_CONFIG file's tables, with the VELOX_* scalars as per-upstream defaults."""
    try:
        tables = load_file(settings.config_file, env, settings.default_upstream())
    except TableError as exc:
        raise ConfigError(str(exc), exc.fix or f"fix {settings.config_file} (VELOX_CONFIG)"
                          ) from None
    if settings.egress == "http1":  # the whole gateway speaks HTTP/1.1 upstream
        upstreams = []
        for index, spec in enumerate(tables.upstreams, 1):
            if spec.protocol == "h2":
                where = f"[[upstream]] #{index} (name \"{spec.name}\")"
                raise ConfigError(
                    f"{tables.source}: {where}: protocol: \"h2\" contradicts VELOX_EGRESS=http1; "
                    "pick one protocol", f"fix protocol of {where} in {tables.source}, or "
                    "VELOX_EGRESS")
            upstreams.append(dataclasses.replace(spec, protocol="http1"))
        tables = dataclasses.replace(tables, upstreams=tuple(upstreams))
    if not settings.spend and (tables.budgets or any(k.budget_nanos for k in tables.keys)):
        raise ConfigError(
            f"{tables.source}: budgets (budget_usd in [[key]] or [[budget]] tables) need "
            "requests priced, and VELOX_SPEND=0 turns pricing off",
            f"unset VELOX_SPEND, or remove the budgets from {tables.source}")
    return tables


def _check_consistency(s: Settings) -> None:
    if s.upstream_scheme == "http" and s.upstream_ca_file:
        raise ConfigError(
            "VELOX_UPSTREAM_CA_FILE is set but VELOX_UPSTREAM_ORIGIN is http://; "
            "use an https:// origin or unset the CA file"
        )
    if s.egress == "http1" and s.upstream_protocol == "h2":
        raise ConfigError(
            "VELOX_EGRESS=http1 contradicts VELOX_UPSTREAM_PROTOCOL=h2; pick one protocol"
        )
    if not s.native and not any(importlib.util.find_spec(m) for m in ("jh2", "hpack")):
        raise ConfigError(
            "VELOX_NATIVE=0 runs the Python HTTP/2 framer, whose HPACK decoder comes from the "
            "jh2 or hpack package, and neither is installed",
            "install the development extra (pip install 'velox[dev]') or unset VELOX_NATIVE")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only ever means this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def unprotected(s: Settings) -> str | None:
    """Why anyone who can reach the gateway may use it (None: only this machine, or only
    clients presenting a key)."""
    tables = s.tables
    assert tables is not None
    if s.api_keys or tables.keys or is_loopback(s.host):
        return None
    return (f"VELOX_HOST={s.host} is not a loopback address and no client key is configured "
            f"(VELOX_API_KEYS, or [[key]] tables in VELOX_CONFIG)")


def relayed_keys(s: Settings) -> str | None:
    """The upstream keys an unprotected gateway would lend to anyone, in words (None: none)."""
    tables = s.tables
    assert tables is not None
    if unprotected(s) is None:
        return None
    names = [u.name for u in tables.upstreams if u.api_key]
    if not names:
        return None
    if not tables.source:
        return "the upstream key (VELOX_UPSTREAM_API_KEY or OPENAI_API_KEY)"
    return f"the key of upstream(s) {', '.join(names)} of {tables.source}"


def _check_exposure(s: Settings) -> None:
    """An open relay of the operator's upstream keys only when asked for by name."""
    relayed = relayed_keys(s)
    if relayed and not s.allow_open:
        fix = ("set VELOX_API_KEYS (or [[key]] tables), or VELOX_HOST=127.0.0.1, or "
               "VELOX_ALLOW_OPEN=1 to serve everyone on purpose")
        raise ConfigError(f"{unprotected(s)}: anyone who can reach it would be served with "
                          f"{relayed}; {fix}", fix)


def replace(settings: Settings, **changes: Any) -> Settings:
    tables = settings.tables
    if "tables" not in changes and tables is not None and not tables.source:
        changes["tables"] = None  # synthesised from the settings: synthesise again
    return dataclasses.replace(settings, **changes)


def env_example() -> str:
    """The text of `.env.example`, generated from FIELDS."""
    lines = [
        "# Velox configuration. Every variable is optional; the value shown is the default.",
        "# Copy to .env (read from the working directory) or export the variables.",
        "",
    ]
    for f in FIELDS:
        lines.append(f"# {f.help}")
        lines.append(f"{f.env}={f.default}")
        lines.append("")
    lines.append("# Used when VELOX_UPSTREAM_API_KEY is empty.")
    lines.append("OPENAI_API_KEY=")
    return "\n".join(lines) + "\n"


def markdown_table(only: tuple[str, ...] = ()) -> str:
    """The variables as a Markdown table, generated from FIELDS: all of them for the reference
    page, or the `only` ones (the README's short table); tests keep both equal to this."""
    per_core = {"VELOX_WORKERS", "VELOX_EGRESS_POOL_CONNECTIONS"}
    rows = ["| Variable | Default | What it does |", "|---|---|---|"]
    for f in FIELDS:
        if only and f.env not in only:
            continue
        default = "usable cores" if f.env in per_core else (f"`{f.default}`" if f.default else "—")
        rows.append(f"| `{f.env}` | {default} | {f.help} |")
    if not only:
        rows.append("| `OPENAI_API_KEY` | — | upstream key used when `VELOX_UPSTREAM_API_KEY` "
                    "is empty |")
    return "\n".join(rows) + "\n"
