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
  a time (409 otherwise); bad parameters get 400 with a JSON error.
* `/debug/pprof/last?format=...`: the last profile again, in any format, without waiting.

Protection (it can profile the workers and reads every counter):

* VELOX_ADMIN_TOKEN: when set, every path but /healthz needs `Authorization: Bearer <token>`
  (the scheme in any case, the token compared in constant time); anything else gets 401.
  /healthz stays open for probes.
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

Imports: admin.control, admin.metrics, admin.profiling, admin.snapshot, admin.transport,
config, spend.report, stats, stdlib, prometheus_client, orjson.
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

from velox.admin import profiling, snapshot
from velox.admin.control import ControlError, ControlHub
from velox.admin.metrics import VeloxCollector, make_registry
from velox.admin.transport import MAX_SERVING, READ_TIMEOUT_S, Answer, Request, Server, error
from velox.config import is_loopback
from velox.spend import report
from velox.stats import F, SharedStats

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
    if endpoint is None or settings.admin_token:
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
        self.token = settings.admin_token.encode() if settings.admin_token else b""
        self.server = Server(_listen(settings.admin_addr, endpoint), self.quick, self.slow,
                             _busy)
        self.collector = VeloxCollector(shared, limiter, settings.ring_depth, self.started_at,
                                        self.profile_state, lambda: self.server.refused,
                                        settings.metrics_keys)
        self.registry = make_registry(self.collector)
        self.cluster: Any = None  # velox.cluster.Cluster with VELOX_REDIS_URL (see use_cluster)

    def use_cluster(self, cluster: Any) -> None:
        """Show the Redis refresher's state in /metrics (velox_redis_*) and /stats ("redis")."""
        self.cluster = cluster
        self.collector.cluster = cluster

    @property
    def address(self) -> str:
        host, port = self.server.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def start(self) -> None:
        log.info("admin on http://%s (/metrics, /stats, /healthz, /debug/pprof/)", self.address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.hub.close()

    def use(self, shared: SharedStats) -> None:
        """After a reload: read the new configuration's shared state (its upstreams)."""
        self.shared = shared
        self.collector.shared = shared

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited admin socket and control channels."""
        self.server.close_in_child()
        self.hub.close_in_child()

    def authorized(self, path: str, header: str | None) -> bool:
        if not self.token or path == "/healthz":
            return True
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
            return False
        return hmac.compare_digest(token.strip().encode("latin-1", "replace"), self.token)

    def quick(self, request: Request) -> Answer | None:
        """What the head reader answers itself, at any load: /healthz, 401, 405."""
        get = request.method in ("GET", "HEAD")
        if get and request.path == "/healthz":
            return self.healthz()
        if not self.authorized(request.path, request.authorization):
            return _UNAUTHORIZED
        if not get:
            return _NOT_GET
        return None

    def slow(self, request: Request) -> Answer:
        """An authenticated GET or HEAD, on a serving thread."""
        path, query, head = request.path, request.query, request.method == "HEAD"
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
_NOT_GET = error(405, "the admin server only answers GET")._replace(
    headers=(("Allow", "GET, HEAD"),))


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
