"""The admin HTTP server: one address for the whole gateway, served from the supervisor.

It runs in the supervisor process on its own OS threads (stdlib `ThreadingHTTPServer`: one
thread per admin connection, at most `MAX_CONNECTIONS` at once), never on a worker's event
loop, so it answers while every worker is saturated. /metrics, /healthz and all of /stats but each worker's `state` read shared memory;
profiles and worker state go over the control channel (`control.py`).

Routes (GET; HEAD for the cheap ones):

* `/healthz`: 200 `{"status": "ok", ...}` while the supervisor runs (with how many workers
  are ready).
* `/metrics`: Prometheus text (`metrics.py`).
* `/stats`: JSON (`snapshot.py`).
* `/debug/pprof/`: an index page linking the rest.
* `/debug/pprof/profile?seconds=N&format=html|speedscope|text|svg&worker=K`: profile the
  workers' loops for N seconds (default 10, at most 60) and return the merged result. One at
  a time (409 otherwise); bad parameters get 400 with a JSON error.
* `/debug/pprof/last?format=...`: the last profile again, in any format, without waiting.

Protection (it can profile the workers and reads every counter):

* VELOX_ADMIN_TOKEN: when set, every path but /healthz needs `Authorization: Bearer <token>`
  (compared in constant time); anything else gets 401. /healthz stays open for probes.
* Without a token only a loopback address may be bound: VELOX_ADMIN_ADDR=0.0.0.0:6060 and no
  token stops start-up with a message saying how to fix it (`bind_problem`).
* A connection that sends nothing for `READ_TIMEOUT_S` is closed, and at most
  `MAX_CONNECTIONS` are served at once; the next one gets 503 and is closed at once (3,000
  idle clients once gave the supervisor 3,004 threads).

The socket is bound when the supervisor starts (before any fork, so a taken address fails
start-up with a message naming VELOX_ADMIN_ADDR); the thread starts after the first workers
are forked.

Imports: admin.control, admin.metrics, admin.profiling, admin.snapshot, config, stats, stdlib,
prometheus_client, orjson.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from velox.admin import profiling, snapshot
from velox.admin.control import ControlError, ControlHub
from velox.admin.metrics import VeloxCollector, make_registry
from velox.config import is_loopback
from velox.stats import F, SharedStats

log = logging.getLogger("velox.admin")

# How long past the profile's own duration to wait for the workers' sessions.
_PROFILE_GRACE_S = 10.0
_JSON = "application/json"
# Connections served at once. Scrapers, a profile and a person with curl use a handful; the
# rest is refused rather than given a thread each.
MAX_CONNECTIONS = 16
# An idle keep-alive connection (or one that never sends its request) holds a thread; 10 s
# outlasts any scrape interval's gap between a client's requests on one connection.
READ_TIMEOUT_S = 10.0
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n")


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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    app: AdminServer
    slots: threading.BoundedSemaphore
    refused: int  # connections answered 503 because MAX_CONNECTIONS were being served

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            _refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _refuse(request: socket.socket) -> None:
    """Answer 503 and close, from the accepting thread: a short write, never a wait."""
    body = orjson.dumps({"error": {"status": 503, "message": (
        f"the admin server is serving {MAX_CONNECTIONS} connections already; "
        "close idle ones or try again")}})
    try:
        request.settimeout(0.5)
        request.sendall(_BUSY % len(body) + body)
        request.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        request.close()


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
        self.token = (b"Bearer " + settings.admin_token.encode()) if settings.admin_token else b""
        host, port = endpoint
        server_class = type("_AdminHTTPServer", (_HTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        try:
            self.httpd: _HTTPServer = server_class((host, port), _Handler)
        except OSError as exc:
            raise SystemExit(
                f"velox: cannot listen on {settings.admin_addr} (VELOX_ADMIN_ADDR): "
                f"{exc.strerror or exc}; set VELOX_ADMIN_ADDR to a free host:port, or off"
            ) from None
        self.httpd.app = self
        self.httpd.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.httpd.refused = 0
        self.collector = VeloxCollector(shared, limiter, settings.ring_depth, self.started_at,
                                        self.profile_state, lambda: self.httpd.refused)
        self.registry = make_registry(self.collector)
        self.thread: threading.Thread | None = None
        self.cluster: Any = None  # velox.cluster.Cluster with VELOX_REDIS_URL (see use_cluster)

    def use_cluster(self, cluster: Any) -> None:
        """Show the Redis refresher's state in /metrics (velox_redis_*) and /stats ("redis")."""
        self.cluster = cluster
        self.collector.cluster = cluster

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def start(self) -> None:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="velox-admin",
                                       daemon=True)
        self.thread.start()
        log.info("admin on http://%s (/metrics, /stats, /healthz, /debug/pprof/)", self.address)

    def stop(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.hub.close()

    def use(self, shared: SharedStats) -> None:
        """After a reload: read the new configuration's shared state (its upstreams)."""
        self.shared = shared
        self.collector.shared = shared

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited admin socket and control channels."""
        self.httpd.socket.close()
        self.hub.close_in_child()

    def authorized(self, path: str, header: str | None) -> bool:
        if not self.token or path == "/healthz":
            return True
        return hmac.compare_digest((header or "").strip().encode("latin-1", "replace"),
                                   self.token)

    def profile_state(self) -> tuple[int, bool]:
        return self.profile_runs, self.profile_lock.locked()

    # --- endpoints (each returns status, content type, body) -------------------------------

    def healthz(self) -> tuple[int, str, bytes]:
        rows = self.shared.counters.snapshot()
        serving = self.shared.active_slots()
        ready = sum(1 for slot in serving if rows[slot][F.READY])
        body = {"status": "ok", "workers": len(serving), "workers_ready": ready,
                "uptime_s": round(time.time() - self.started_at, 3)}
        return 200, _JSON, orjson.dumps(body)

    def metrics(self) -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def stats(self) -> tuple[int, str, bytes]:
        runs, active = self.profile_state()
        doc = snapshot.build(self.shared, self.limiter, self.settings, self.hub,
                             self.started_at, runs, active, self.cluster)
        return 200, _JSON, orjson.dumps(doc, option=orjson.OPT_INDENT_2)

    def profile(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        try:
            params = profiling.parse_params(query, self.shared.slots)
        except profiling.BadParams as exc:
            return _error(400, str(exc))
        serving = self.shared.active_slots()
        if params.worker is not None and params.worker not in serving:
            return _error(400, f"worker={params.worker} is not a serving worker; serving: "
                               f"{', '.join(map(str, serving))}")
        if not self.profile_lock.acquire(blocking=False):
            return _error(409, "a profile is already running; try again when it is done")
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
            return _error(503, f"no worker returned a profile: {failed}")
        session = profiling.merge(docs)
        who = ("worker " + str(params.worker) if params.worker is not None
               else f"{len(docs)} worker(s)")
        title = f"Velox CPU profile: {who}, {params.seconds:g} s"
        self.last_profile, self.last_profile_title = session, title
        return 200, profiling.FORMATS[params.fmt], profiling.render(session, params.fmt, title)

    def last(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        try:
            fmt = profiling.parse_format(query)
        except profiling.BadParams as exc:
            return _error(400, str(exc))
        session = self.last_profile
        if session is None:
            return _error(404, "no profile has been taken yet: GET /debug/pprof/profile first")
        return 200, profiling.FORMATS[fmt], profiling.render(session, fmt,
                                                             self.last_profile_title)

    def index(self) -> tuple[int, str, bytes]:
        return 200, "text/html; charset=utf-8", _index_page(self.shared.workers).encode()


def _error(status: int, message: str) -> tuple[int, str, bytes]:
    return status, _JSON, orjson.dumps({"error": {"status": status, "message": message}})


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "velox-admin"
    # The head and the body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK of the first, 40 ms on Linux, on every keep-alive request.
    disable_nagle_algorithm = True
    timeout = READ_TIMEOUT_S  # socket timeout: an idle connection is closed, its thread ends

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's naming
        self._dispatch(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch(head=True)

    def _dispatch(self, head: bool) -> None:
        app = self.server.app
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        path = url.path
        try:
            if not app.authorized(path, self.headers.get("Authorization")):
                self._send(*_error(401, "the admin server needs Authorization: Bearer "
                                   "<VELOX_ADMIN_TOKEN>"), head=head, auth=True)
                return
            if path == "/healthz":
                result = app.healthz()
            elif path == "/metrics":
                result = app.metrics()
            elif path == "/stats":
                result = app.stats()
            elif path in ("/debug/pprof", "/debug/pprof/"):
                result = app.index()
            elif path == "/debug/pprof/profile" and not head:
                result = app.profile(query)
            elif path == "/debug/pprof/last" and not head:
                result = app.last(query)
            else:
                result = _error(404, f"unknown admin path {path}; see /debug/pprof/")
        except Exception:  # noqa: BLE001 - answer 500 and keep serving
            log.exception("admin request %s failed", self.path)
            result = _error(500, "internal error; see the gateway's log")
        self._send(*result, head=head)

    def _send(self, status: int, content_type: str, body: bytes, head: bool = False,
              auth: bool = False, allow: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if auth:
            self.send_header("WWW-Authenticate", 'Bearer realm="velox-admin"')
        if allow:
            self.send_header("Allow", "GET, HEAD")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        app = self.server.app
        if not app.authorized(urlsplit(self.path).path, self.headers.get("Authorization")):
            self._send(*_error(401, "the admin server needs Authorization: Bearer "
                               "<VELOX_ADMIN_TOKEN>"), auth=True)
            return
        self._send(*_error(405, "the admin server only answers GET"), allow=True)

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        # Admin traffic (scrapes every few seconds) would drown the gateway's own log.
        log.debug("admin %s %s", self.address_string(), format % args)


def _index_page(workers: int) -> str:
    fmt_links = " · ".join(
        f'<a href="profile?seconds=10&amp;format={f}">{f}</a>' for f in profiling.FORMATS)
    per_worker = " · ".join(
        f'<a href="profile?seconds=10&amp;worker={w}">worker {w}</a>' for w in range(workers))
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
<a href="/healthz">/healthz</a></p>
</body></html>
"""
