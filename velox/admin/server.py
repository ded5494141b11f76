"""The admin HTTP server: one address for the whole gateway, served from the supervisor.

It runs in the supervisor process on its own OS threads (`transport.py`: one thread reads
every connection's request head, and authenticated requests are served on threads of their
own, at most `MAX_CONNECTIONS` at once), never on a worker's event loop, so it answers while
every worker is saturated. /metrics, /healthz and all of /stats but each worker's `state` read
shared memory; profiles and worker state go over the control channel (`control.py`).

Routes (GET; HEAD for the cheap ones):

* `/healthz`: 200 `{"status": "ok", ...}` while the supervisor runs (with how many workers
  are ready).
* `/metrics`: Prometheus text (`metrics.py`).
* `/stats`: JSON (`snapshot.py`).
* `/spend?since=7d&until=...&by=key`: spend and tokens over a period from this host's usage
  ledger, the JSON of `velox spend --json` (velox.spend.report); 400 for a bad period or
  grouping, 404 when the ledger is off.
* `/debug/pprof/`: an index page linking the rest.
* `/debug/pprof/profile?seconds=N&format=html|speedscope|text|svg&worker=K`: profile the
  workers' loops for N seconds (default 10, at most 60) and return the merged result. One at
  a time (409 otherwise); bad parameters get 400 with a JSON error; without pyinstrument (an
  extra: `velox[profile]`), 501 saying how to install it.
* `/debug/pprof/last?format=...`: the last profile again, in any format, without waiting.
* `/keys`, `/keys/{name}`, `/keys/{name}/rotate`, `/audit`: run-time gateway keys
  (`keyapi.py`, kept by `keystore.py`); JSON in and out, POST/PATCH/DELETE.
* `/ui`: the operator's console (`console.py`), and `/ui/api/...`, the numbers it polls.

Protection (it can profile the workers and reads every counter):

* VELOX_ADMIN_TOKEN (and VELOX_ADMIN_TOKENS, labelled): when set, every path but /healthz
  and the console's static files needs `Authorization: Bearer <token>` (the scheme in any
  case, every token compared in constant time); anything else gets 401. /healthz stays open
  for probes. The token's label is who the key audit log names ("admin" for
  VELOX_ADMIN_TOKEN, "local" when no token is set).
* Changing requests (the key API) must be JSON and same-origin (`console.csrf_problem`), and
  without a token the key API and the console's data only answer a loopback Host header
  (403 otherwise).
* Without a token only a loopback address may be bound: VELOX_ADMIN_ADDR=0.0.0.0:6060 and no
  token stops start-up with a message saying how to fix it (`bind_problem`).
* A request head must arrive whole within `READ_TIMEOUT_S` (an idle connection is closed
  then too), and waiting for one holds no thread. /healthz and 401s are answered at once;
  at most `MAX_CONNECTIONS` authenticated requests are served at once, the next gets 503
  (3,000 idle clients once gave the supervisor 3,004 threads; 16 trickling a byte every 8 s
  once kept every path, /healthz included, at 503).

The socket is bound when the supervisor starts (before any fork, so a taken address fails
start-up with a message naming VELOX_ADMIN_ADDR); the thread starts after the first workers
are forked.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from velox.admin import keyapi, profiling, snapshot
from velox.admin.console import API_HEADERS, Console, csrf_problem, loopback_host
from velox.admin.control import ControlError, ControlHub
from velox.admin.keystore import KeyStore
from velox.admin.metrics import VeloxCollector, make_registry
from velox.admin.sampler import Sampler
from velox.admin.transport import MAX_SERVING, READ_TIMEOUT_S, Answer, Request, Server, error
from velox.config.settings import is_loopback
from velox.core.fields import F
from velox.spend import report
from velox.state.stats import SharedStats

log = logging.getLogger("velox.admin")

# How long past the profile's own duration to wait for the workers' sessions.
_PROFILE_GRACE_S = 10.0
_JSON = "application/json"
# Authenticated requests served at once (transport.py); READ_TIMEOUT_S bounds a whole head.
MAX_CONNECTIONS = MAX_SERVING
__all__ = ["MAX_CONNECTIONS", "READ_TIMEOUT_S", "AdminServer", "bind_problem", "is_loopback"]


def bind_problem(settings: Any) -> str | None:
    """Why VELOX_ADMIN_ADDR may not be bound as configured (None: it may)."""
    endpoint = settings.admin_endpoint
    if endpoint is None or settings.admin_token or settings.admin_tokens:
        return None
    host = endpoint[0]
    if is_loopback(host):
        return None
    return (f"VELOX_ADMIN_ADDR={settings.admin_addr} is not a loopback address and "
            f"VELOX_ADMIN_TOKEN is empty: anyone who can reach it could read /stats and run "
            f"profiles; set VELOX_ADMIN_TOKEN to a secret, or bind 127.0.0.1")


class AdminServer:
    def __init__(self, settings: Any, shared: SharedStats, limiter: Any,
                 endpoint: tuple[str, int]) -> None:
        self.settings = settings
        self.shared = shared
        self.limiter = limiter
        self.hub = ControlHub()
        self.started_at = time.time()
        self.profile_lock = threading.Lock()
        self.profile_runs = 0
        self.last_profile: Any = None  # the last merged pyinstrument Session
        self.last_profile_title = ""
        problem = bind_problem(settings)
        if problem is not None:
            raise SystemExit(f"velox: {problem}")
        self.tokens = [(label, token.encode()) for label, token in admin_tokens(settings)]
        self.server = Server(_listen(settings.admin_addr, endpoint), self.quick, self.slow,
                             _busy)
        self.collector = VeloxCollector(shared, limiter, settings.ring_depth, self.started_at,
                                        self.profile_state, lambda: self.server.refused,
                                        settings.metrics_keys)
        self.registry = make_registry(self.collector)
        # velox.cluster.leases.Cluster with VELOX_REDIS_URL (see use_cluster)
        self.cluster: Any = None
        tables = settings.tables
        self.keys = KeyStore(settings.state_dir, settings.redis_url,
                             config_names=[k.name for k in tables.keys],
                             routes=[r.model for r in tables.routes])
        self.key_api = keyapi.KeyAPI(self.keys, shared.keys)
        self.sampler = Sampler(shared)
        self.console = Console(self.sampler)

    def use_cluster(self, cluster: Any) -> None:
        """Show the Redis refresher's state in /metrics (velox_redis_*) and /stats ("redis")."""
        self.cluster = cluster
        self.collector.cluster = cluster

    @property
    def address(self) -> str:
        host, port = self.server.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def start(self) -> None:
        log.info("admin on http://%s (/metrics, /stats, /healthz, /debug/pprof/, /keys, the "
                 "console at /ui)", self.address)
        self.keys.start()
        self.sampler.start()
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.sampler.stop()
        self.keys.stop()
        self.hub.close()

    def use(self, shared: SharedStats) -> None:
        """After a reload: read the new configuration's shared state (its upstreams)."""
        self.shared = shared
        self.collector.shared = shared
        self.sampler.use(shared)
        self.key_api.shared_keys = shared.keys
        self.keys.config_names = frozenset(k.name for k in shared.tables.keys)
        self.keys.routes = tuple(r.model for r in shared.tables.routes)

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited admin socket and control channels."""
        self.server.close_in_child()
        self.hub.close_in_child()

    def who(self, header: str | None) -> str | None:
        """The label of the token `header` presents (None: no valid token)."""
        if not self.tokens:
            return "local"
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
            return None
        presented = token.strip().encode("latin-1", "replace")
        found = None
        for label, expected in self.tokens:  # every one compared: no early exit to time
            if hmac.compare_digest(presented, expected) and found is None:
                found = label
        return found

    def authorized(self, path: str, header: str | None) -> bool:
        return path == "/healthz" or self.who(header) is not None

    def quick(self, request: Request) -> Answer | None:
        """What the head reader answers itself, at any load: /healthz, the console's files,
        401, 403 and 405."""
        path, method = request.path, request.method
        get = method in ("GET", "HEAD")
        if get and path == "/healthz":
            return self.healthz()
        if get and (path == "/ui" or path.startswith("/ui/")) and \
                not path.startswith("/ui/api/"):
            return self.console.static(path) or error(404, f"no console file {path}")
        if not self.authorized(path, request.authorization):
            return _UNAUTHORIZED
        allowed = keyapi.methods(path) or ("GET", "HEAD")
        if method not in allowed:
            return error(405, f"{path} answers {', '.join(allowed)}")._replace(
                headers=(("Allow", ", ".join(allowed)),))
        guarded = keyapi.methods(path) is not None or path.startswith("/ui/api/")
        if guarded and not self.tokens and not loopback_host(request):
            return error(403, "without VELOX_ADMIN_TOKEN the admin server only answers "
                              "requests addressed to a loopback name (Host header)")
        problem = csrf_problem(request)
        if problem is not None:
            return error(403, problem)
        return None

    def slow(self, request: Request) -> Answer:
        """An authenticated request, on a serving thread."""
        path, query, head = request.path, request.query, request.method == "HEAD"
        if keyapi.methods(path) is not None:
            answer = self.key_api.handle(request, self.who(request.authorization) or "?")
            return answer._replace(headers=answer.headers + API_HEADERS)
        if path.startswith("/ui/api/"):
            return self.console.api(request, self.shared)
        if path == "/metrics":
            return self.metrics()
        if path == "/stats":
            return self.stats()
        if path == "/spend":
            return self.spend(query)
        if path in ("/debug/pprof", "/debug/pprof/"):
            return self.index()
        if path == "/debug/pprof/profile" and not head:
            return self.profile(query)
        if path == "/debug/pprof/last" and not head:
            return self.last(query)
        return error(404, f"unknown admin path {path}; see /debug/pprof/")

    def profile_state(self) -> tuple[int, bool]:
        return self.profile_runs, self.profile_lock.locked()

    # --- endpoints (each returns status, content type, body) -------------------------------

    def healthz(self) -> Answer:
        rows = self.shared.counters.snapshot()
        serving = self.shared.active_slots()
        ready = sum(1 for slot in serving if rows[slot][F.READY])
        body = {"status": "ok", "workers": len(serving), "workers_ready": ready,
                "uptime_s": round(time.time() - self.started_at, 3)}
        return Answer(200, _JSON, orjson.dumps(body))

    def metrics(self) -> Answer:
        return Answer(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))

    def stats(self) -> Answer:
        runs, active = self.profile_state()
        doc = snapshot.build(self.shared, self.limiter, self.settings, self.hub,
                             self.started_at, runs, active, self.cluster)
        return Answer(200, _JSON, orjson.dumps(doc, option=orjson.OPT_INDENT_2))

    def spend(self, query: dict[str, list[str]]) -> Answer:
        def one(name: str, default: str | None) -> str | None:
            return query.get(name, [default])[-1]

        try:
            rows = report.local_totals(self.settings.state_dir, one("since", "7d") or "7d",
                                       one("until", None), one("by", "key") or "key",
                                       int(time.time() * 1000))
        except report.BadQuery as exc:
            return error(400, str(exc))
        except report.NoLedger as exc:
            return error(404, str(exc))
        return Answer(200, _JSON, orjson.dumps(rows))

    def profile(self, query: dict[str, list[str]]) -> Answer:
        if not profiling.available():
            return error(501, profiling.MISSING)
        try:
            params = profiling.parse_params(query, self.shared.slots)
        except profiling.BadParams as exc:
            return error(400, str(exc))
        serving = self.shared.active_slots()
        if params.worker is not None and params.worker not in serving:
            return error(400, f"worker={params.worker} is not a serving worker; serving: "
                              f"{', '.join(map(str, serving))}")
        if not self.profile_lock.acquire(blocking=False):
            return error(409, "a profile is already running; try again when it is done")
        try:
            self.profile_runs += 1
            slots = [params.worker] if params.worker is not None else serving
            answers = self.hub.call_each(slots, "profile", params.seconds + _PROFILE_GRACE_S,
                                         seconds=params.seconds)
        finally:
            self.profile_lock.release()
        docs = [a for a in answers.values() if not isinstance(a, ControlError)]
        failed = {s: str(a) for s, a in answers.items() if isinstance(a, ControlError)}
        if failed:
            log.warning("profile: no session from worker(s) %s", failed)
        if not docs:
            return error(503, f"no worker returned a profile: {failed}")
        session = profiling.merge(docs)
        who = ("worker " + str(params.worker) if params.worker is not None
               else f"{len(docs)} worker(s)")
        title = f"Velox CPU profile: {who}, {params.seconds:g} s"
        self.last_profile, self.last_profile_title = session, title
        return Answer(200, profiling.FORMATS[params.fmt],
                      profiling.render(session, params.fmt, title))

    def last(self, query: dict[str, list[str]]) -> Answer:
        try:
            fmt = profiling.parse_format(query)
        except profiling.BadParams as exc:
            return error(400, str(exc))
        session = self.last_profile
        if session is None:
            return error(404, "no profile has been taken yet: GET /debug/pprof/profile first")
        return Answer(200, profiling.FORMATS[fmt],
                      profiling.render(session, fmt, self.last_profile_title))

    def index(self) -> Answer:
        page = _index_page(self.shared.active_slots())  # after a reload: the new slots
        return Answer(200, "text/html; charset=utf-8", page.encode())


_UNAUTHORIZED = error(401, "the admin server needs Authorization: Bearer <VELOX_ADMIN_TOKEN>"
                      )._replace(headers=(("WWW-Authenticate", 'Bearer realm="velox-admin"'),))


def admin_tokens(settings: Any) -> list[tuple[str, str]]:
    """(label, token) of every admin token: VELOX_ADMIN_TOKEN is "admin"."""
    out = [("admin", settings.admin_token)] if settings.admin_token else []
    return out + list(settings.admin_tokens)


def _busy() -> Answer:
    return error(503, f"the admin server is serving {MAX_CONNECTIONS} requests already; "
                      "try again when one is done")


def _listen(addr: str, endpoint: tuple[str, int]) -> socket.socket:
    host, port = endpoint
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"velox: cannot listen on {addr} (VELOX_ADMIN_ADDR): "
            f"{exc.strerror or exc}; set VELOX_ADMIN_ADDR to a free host:port, or off"
        ) from None
    return sock


def _index_page(serving: list[int]) -> str:
    workers = len(serving)
    fmt_links = " · ".join(
        f'<a href="profile?seconds=10&amp;format={f}">{f}</a>' for f in profiling.FORMATS)
    per_worker = " · ".join(
        f'<a href="profile?seconds=10&amp;worker={w}">worker {w}</a>' for w in serving)
    last = " · ".join(f'<a href="last?format={f}">{f}</a>' for f in profiling.FORMATS)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Velox admin</title>
<style>body{{font:15px/1.5 system-ui,sans-serif;max-width:52em;margin:2em auto;padding:0 1em}}
code{{background:#f3f3f0;padding:0 .3em}}</style></head><body>
<h1>Velox admin</h1>
<h2>CPU profile of the workers' event loops</h2>
<p>10 s, all {workers} worker(s) merged: {fmt_links}<br>
One worker (html): {per_worker}<br>
The last profile again: {last}</p>
<p>Parameters: <code>seconds</code> (default {profiling.DEFAULT_SECONDS:g}, at most
{profiling.MAX_SECONDS:g}), <code>format</code> (html, speedscope, text, svg),
<code>worker</code>. One profile at a time. While it runs, the profiled workers serve
noticeably fewer requests per second (the profiler's hook runs on every call).</p>
<h2>Stats</h2>
<p><a href="/stats">/stats</a> (JSON) · <a href="/metrics">/metrics</a> (Prometheus) ·
<a href="/healthz">/healthz</a> · <a href="/spend?since=7d&amp;by=key">/spend</a> (usage
ledger, JSON)</p>
</body></html>
"""
