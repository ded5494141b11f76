"""The tables of the gateway: upstreams, the routes that use them, and the failover policies.

Scalars are `VELOX_*` variables (config.py); what does not fit in a variable (several upstreams,
the routes over them, the retry and breaker policies) lives in one TOML file named by
`VELOX_CONFIG`. Both are parsed into one frozen `Settings`, whose `tables` is a `Tables`.

Without `VELOX_CONFIG` the tables are synthesised from the `VELOX_UPSTREAM_*` variables: one
upstream named `default` and one route `"*"` sending every model to it, which is exactly the
single-upstream gateway Velox was before the tables existed.

Secrets never live in the file: an upstream names the environment variable holding its key
(`api_key_env`), and the resolved key is kept out of `repr` and `--print-config`.

Imports: stdlib only (a leaf of the package; config.py imports it, never the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

UPSTREAM_KINDS = ("openai", "azure")
STRATEGIES = ("weighted", "least_busy", "hash")
CATCH_ALL = "*"
DEFAULT_UPSTREAM = "default"


class TableError(ValueError):
    """A mistake in the VELOX_CONFIG file; the message names the file, the table and the key."""


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
    ca_file: str = ""
    request_timeout_ms: int = 600_000
    connect_timeout_ms: int = 5_000
    warmup_path: str = "/v1/models"
    max_in_flight: int = 0  # requests at once on this upstream across the gateway; 0: no cap
    rpm: int = 0  # this upstream's own shared request bucket; 0: no limit

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
        return [(b"authorization", b"Bearer " + self.api_key.encode())]


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One place a route may send a request (`targets = [{upstream, model, weight, priority}]`)."""

    upstream: str
    model: str = ""  # the upstream's name for the model; "" means the public name unchanged
    weight: int = 1
    priority: int = 0  # lower numbers are used first


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """A model clients name (`[[route]]`); `"*"` catches every model no other route names."""

    model: str
    targets: tuple[TargetSpec, ...]
    strategy: str = "weighted"  # weighted | least_busy | hash
    fallbacks: tuple[str, ...] = ()  # other routes' models, tried in order


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


@dataclass(frozen=True, slots=True)
class Tables:
    upstreams: tuple[UpstreamSpec, ...]
    routes: tuple[RouteSpec, ...]
    retry: RetryPolicy = RetryPolicy()
    breaker: BreakerPolicy = BreakerPolicy()
    source: str = ""  # the VELOX_CONFIG file they came from; "" when synthesised

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
    return Tables(
        upstreams=(spec,),
        routes=(RouteSpec(CATCH_ALL, (TargetSpec(spec.name),)),),
    )
